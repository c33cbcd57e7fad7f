"""Completions echo (+ logprobs, max_tokens=0), chat echo and return_token_ids over HTTP through the
official openai client, the prompt's logprobs checked against PEFT's forward."""

from __future__ import annotations

import httpx
import openai
import pytest
from serve_support import PROMPTS, model_with_chat_template, serve_args, start_server, token_ids
from test_prompt_logprobs import TOLERANCE, assert_prompt_logprobs, peft_prompt_logprobs

MAX_TOKENS = 3


@pytest.fixture(scope="module")
def served(engine_checkpoint, tmp_path_factory):
    """(server, state, the r4 PeftModel)."""
    model_dir, _, adapters = engine_checkpoint
    model = model_with_chat_template(model_dir, tmp_path_factory.mktemp("echo") / "model")
    server, state = start_server(serve_args(model, {"r4": adapters["r4"][0]}))
    yield server, state, adapters["r4"][1]
    server.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].base_url + "/v1", api_key="unused", max_retries=0)


def test_echo_with_logprobs_puts_the_prompt_first(served, client):
    _, state, peft_model = served
    prompt = PROMPTS[2]
    ids = state.tokenizer.encode(prompt)
    plain = client.completions.create(model="r4", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=2)
    echoed = client.completions.create(model="r4", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=2,
                                       echo=True)
    choice, generated = echoed.choices[0], plain.choices[0]
    assert choice.text == prompt + generated.text
    logprobs = choice.logprobs
    assert token_ids(state.tokenizer, logprobs.tokens) == ids + token_ids(state.tokenizer, generated.logprobs.tokens)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing predicts it
    want = peft_prompt_logprobs(peft_model, ids)
    for j in range(1, len(ids)):
        assert abs(logprobs.token_logprobs[j] - float(want[j - 1, ids[j]])) <= TOLERANCE, j
        assert len(logprobs.top_logprobs[j]) in (2, 3)  # the top 2 and the prompt token
    assert logprobs.token_logprobs[len(ids):] == pytest.approx(generated.logprobs.token_logprobs, abs=TOLERANCE)
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    assert echoed.usage.completion_tokens == MAX_TOKENS and echoed.usage.prompt_tokens == len(ids)


def test_echo_with_max_tokens_0_scores_the_prompt_only(served, client):
    _, state, peft_model = served
    ids = state.tokenizer.encode(PROMPTS[0])
    response = client.completions.create(model="r4", prompt=[ids], max_tokens=0, temperature=0, logprobs=1,
                                         echo=True)
    choice = response.choices[0]
    assert choice.text == state.tokenizer.decode(ids)
    assert token_ids(state.tokenizer, choice.logprobs.tokens) == ids
    want = peft_prompt_logprobs(peft_model, ids)
    assert sum(choice.logprobs.token_logprobs[1:]) == pytest.approx(
        sum(float(want[j - 1, ids[j]]) for j in range(1, len(ids))), abs=TOLERANCE * len(ids))
    assert response.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="max_tokens=0 needs echo"):
        client.completions.create(model="r4", prompt=PROMPTS[0], max_tokens=0)


def test_streamed_echo_opens_with_the_prompt(client):
    prompt = PROMPTS[1]
    whole = client.completions.create(model="base", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      logprobs=1, echo=True).choices[0]
    chunks = list(client.completions.create(model="base", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            logprobs=1, echo=True, stream=True))
    assert chunks[0].choices[0].text.startswith(prompt)
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    streamed = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None  # the prompt's first token
    assert streamed[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=TOLERANCE)


def test_return_token_ids_on_completions_and_chat(served, client):
    _, state, _ = served
    ids = state.tokenizer.encode(PROMPTS[3])
    choice = client.completions.create(model="r4", prompt=PROMPTS[3], max_tokens=MAX_TOKENS, temperature=0,
                                       logprobs=0, extra_body={"return_token_ids": True}).choices[0]
    assert choice.model_extra["prompt_token_ids"] == ids
    assert choice.model_extra["token_ids"] == token_ids(state.tokenizer, choice.logprobs.tokens)
    plain = client.completions.create(model="r4", prompt=PROMPTS[3], max_tokens=MAX_TOKENS, temperature=0).choices[0]
    assert "token_ids" not in plain.model_extra and "prompt_token_ids" not in plain.model_extra
    messages = [{"role": "user", "content": "hello world"}]
    chat = client.chat.completions.create(model="r4", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                          logprobs=True, extra_body={"return_token_ids": True})
    reply = chat.choices[0]
    assert chat.model_extra["prompt_token_ids"] == state.tokenizer.encode("you hello world i")
    assert reply.model_extra["token_ids"] == token_ids(state.tokenizer, [e.token for e in reply.logprobs.content])


def test_chat_echo_repeats_the_assistants_last_message(client):
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the cat"}]
    plain = client.chat.completions.create(model="base", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    echoed = client.chat.completions.create(model="base", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            extra_body={"echo": True})
    assert echoed.choices[0].message.content == "the cat" + plain.choices[0].message.content
    user_last = client.chat.completions.create(model="base", messages=messages[:1], max_tokens=MAX_TOKENS,
                                               temperature=0, extra_body={"echo": True})
    assert not user_last.choices[0].message.content.startswith("hello")


def test_special_token_fields_reach_the_engine(served):
    server, _, _ = served
    body = {"model": "base", "prompt": PROMPTS[0], "max_tokens": 2, "skip_special_tokens": False,
            "spaces_between_special_tokens": False}
    assert httpx.post(server.base_url + "/v1/completions", json=body).status_code == 200
    bad = httpx.post(server.base_url + "/v1/completions", json={**body, "skip_special_tokens": "no"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"


def _as_engine_entries(field: list) -> list:
    """vLLM's prompt_logprobs field back to RequestOutput.prompt_logprobs' shape."""
    return [None if entry is None else {int(t): e["logprob"] for t, e in entry.items()} for entry in field]


def test_prompt_logprobs_field_on_completions_and_chat_matches_peft(served, client):
    """vLLM's request-level prompt_logprobs: per choice on completions (each of n), on the chat response;
    values PEFT's, ranks 1..k for the top k, the prompt token's own entry always there."""
    _, state, peft_model = served
    ids = state.tokenizer.encode(PROMPTS[4])
    response = client.completions.create(model="r4", prompt=PROMPTS[4], max_tokens=MAX_TOKENS, temperature=0, n=2,
                                         extra_body={"prompt_logprobs": 2})
    want = peft_prompt_logprobs(peft_model, ids)
    for choice in response.choices:
        field = choice.model_extra["prompt_logprobs"]
        assert_prompt_logprobs(_as_engine_entries(field), ids, want, 2)
        for j in range(1, len(ids)):
            ranked = sorted((e["rank"], t) for t, e in field[j].items() if e["rank"] is not None)
            assert [rank for rank, _ in ranked] == [1, 2]
            assert field[j][str(ids[j])]["decoded_token"] == state.token_text(ids[j])
    plain = client.completions.create(model="r4", prompt=PROMPTS[4], max_tokens=MAX_TOKENS, temperature=0)
    assert "prompt_logprobs" not in plain.choices[0].model_extra
    messages = [{"role": "user", "content": "hello world"}]
    chat = client.chat.completions.create(model="base", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"prompt_logprobs": 0})
    chat_ids = state.tokenizer.encode("you hello world i")
    entries = _as_engine_entries(chat.model_extra["prompt_logprobs"])
    assert len(entries) == len(chat_ids) and entries[0] is None
    assert all(set(entry) == {chat_ids[j]} for j, entry in enumerate(entries) if j)  # k=0: the prompt token alone


@pytest.mark.parametrize("extra, message", [
    # the engine's max_logprobs (default 20)
    ({"prompt_logprobs": 21}, r"prompt_logprobs=21 is more than this server.s --max-logprobs \(20"),
    ({"prompt_logprobs": 1, "stream": True}, "not available with stream"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
])
def test_prompt_logprobs_over_the_cap_or_streamed_are_400(client, extra, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.completions.create(model="base", prompt=PROMPTS[0], max_tokens=2, extra_body=extra)
    assert client.completions.create(model="base", prompt=PROMPTS[0], max_tokens=2).choices[0].text is not None
