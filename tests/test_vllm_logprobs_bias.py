"""vLLM's whole-vocabulary logprobs (-1, capped by --max-logprobs) and OpenAI's / vLLM's logit_bias:
the sampler against a float reference, SamplingParams' checks, then LLM and the HTTP server with the
official openai client (greedy choices checked against raw logprobs + bias)."""

from __future__ import annotations

import math

import numpy as np
import openai
import pytest
import torch
from serve_support import PROMPTS, model_with_chat_template, serve_args, start_server
from test_prompt_logprobs import TOLERANCE, peft_prompt_logprobs

from lora_runner.engine.input_processor import InputProcessor
from lora_runner.sample.sampler import Sampler
from lora_runner.sampling_params import SamplingParams

VOCAB = 256  # the engine test model's
ENTRIES_LIMIT = 2000  # --max-logprob-entries of the served model: 8 whole-vocabulary tokens fit, not 10


# ---------------------------------------------------------------- the sampler, no model

def test_logit_bias_is_added_before_penalties_and_sampling():
    """vLLM's order: logits + bias, then the repetition penalty, then temperature; greedy rows take the
    argmax of the biased logits; rows without a bias are untouched and the logprobs stay raw."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 40, generator=gen) * 3  # [S, V]
    biases = [{3: 7.5, 11: -100.0, 0: 2.25}, None, {int(logits[2].argmax()): -100.0}, {5: 1.5, 6: -0.5}]
    params = [SamplingParams(temperature=0.7, logit_bias=biases[0], logprobs=2),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logit_bias=biases[2]),
              SamplingParams(temperature=1.3, logit_bias=biases[3], repetition_penalty=1.7)]
    history = ([5, 9], [6])  # row 3's prompt and generated tokens: 5, 6 and 9 are penalised
    sampler = Sampler(40, "cpu")
    batch = sampler.make_batch(params, [None] * 4, histories=[None, None, None, history])
    want = logits.double().clone()
    for row, bias in enumerate(biases):
        for token, value in (bias or {}).items():
            want[row, token] += value
    for token in (5, 6, 9):
        want[3, token] = want[3, token] / 1.7 if want[3, token] > 0 else want[3, token] * 1.7
    prepared = sampler.prepare(logits.clone(), batch)
    torch.testing.assert_close(prepared.penalized.double(), want, rtol=0, atol=1e-5)
    assert torch.equal(prepared.raw, logits)
    probs = sampler.probs(prepared.penalized, prepared.settings)  # [S, V]
    for row, temperature in ((0, 0.7), (3, 1.3)):
        torch.testing.assert_close(probs[row].double(), torch.softmax(want[row] / temperature, -1),
                                   rtol=0, atol=1e-6)
    out = sampler(logits.clone(), batch)
    assert out.token_ids[1:3] == [int(logits[1].argmax()), int(want[2].argmax())]
    assert out.logprobs[0][out.token_ids[0]] == pytest.approx(float(torch.log_softmax(logits[0], -1)[out.token_ids[0]]))


def test_a_biased_row_keeps_its_bias_when_rows_are_picked_or_repeated():
    """SamplingBatch.row (the one-at-a-time fallback) and select (speculative verification repeats rows)."""
    sampler = Sampler(10, "cpu")
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logit_bias={4: 100.0})]
    batch = sampler.make_batch(params, [None, None])
    logits = torch.zeros(3, 10)
    assert sampler(logits[:1], batch.row(1)).token_ids == [4]
    assert sampler(logits[:1], batch.row(0)).token_ids == [0]
    assert sampler(logits, batch.select(np.array([1, 0, 1]))).token_ids == [4, 0, 4]


def test_a_biased_random_row_samples_the_biased_distribution():
    """Frequencies of a temperature-1 row follow softmax(logits + bias) (chi-square, fresh draws)."""
    scipy_stats = pytest.importorskip("scipy.stats")
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0])
    bias = {4: -3.0, 2: 1.25}
    n = 6000
    params = [SamplingParams(temperature=1.0, logit_bias=bias)] * n
    sampler = Sampler(6, "cpu", seed=int(torch.randint(0, 2**31, (1,))))
    tokens = torch.tensor(sampler(logits.expand(n, 6).clone(), sampler.make_batch(params, [None] * n)).token_ids)
    want = torch.softmax(logits.double() + torch.tensor([0, 0, 1.25, 0, -3.0, 0], dtype=torch.float64), -1)
    counts = torch.bincount(tokens, minlength=6).double()
    assert scipy_stats.chisquare(counts.numpy(), (want * n).numpy()).pvalue > 1e-4


@pytest.mark.parametrize("bias,match", [
    ({1: 100.5}, r"logit_bias\[1\]"), ({1: -101}, r"logit_bias\[1\]"), ({1: math.nan}, r"logit_bias\[1\]"),
    ({1: math.inf}, r"logit_bias\[1\]"), ({1: True}, r"logit_bias\[1\]"), ({1: "1"}, r"logit_bias\[1\]"),
    ({-1: 1.0}, "logit_bias keys"), ({"1": 1.0}, "logit_bias keys"), ({True: 1.0}, "logit_bias keys"),
    ({2**31: 1.0}, "logit_bias keys"), ([[1, 1.0]], "logit_bias must be"),
])
def test_bad_logit_bias_is_a_value_error(bias, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(logit_bias=bias)


def test_whole_vocabulary_counts_against_max_logprobs():
    """-1 counts as the vocabulary: over a cap (vLLM's default 20) a ValueError naming max_logprobs; with
    the cap lifted (-1) the engine's copy asks for every token; the caller's params keep -1."""
    inputs = InputProcessor(vocab_size=VOCAB, max_model_len=64, max_logprobs=20, encode=None, prompts_enabled=False)
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"{field}=-1 \(the whole vocabulary, {VOCAB}\) is over the engine's "
                                             r"max_logprobs \(20\)"):
            inputs.checked_params(SamplingParams(**{field: -1}))
    inputs.max_logprobs = -1
    mine = SamplingParams(logprobs=-1, prompt_logprobs=-1)
    checked = inputs.checked_params(mine)
    assert (checked.logprobs, checked.prompt_logprobs, mine.logprobs) == (VOCAB, VOCAB, -1)
    with pytest.raises(ValueError, match="logit_bias keys must be token ids in \\[0, 255\\]"):
        inputs.checked_params(SamplingParams(logit_bias={VOCAB: 1.0}))
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-2)


# ---------------------------------------------------------------- LLM on the test model

@pytest.fixture(scope="module")
def llm(engine_checkpoint):
    from lora_runner import LLM

    engine = LLM(engine_checkpoint[0], device="cpu", dtype="float32", max_model_len=512, max_logprobs=-1)
    yield engine
    engine.close()


def test_llm_whole_vocabulary_logprobs_and_prompt_logprobs(llm, engine_checkpoint):
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=3, logprobs=-1, prompt_logprobs=-1),
                       use_tqdm=False)[0]
    want = peft_prompt_logprobs(engine_checkpoint[1], ids)  # [L - 1, V]
    assert out.prompt_logprobs[0] is None
    for j, entry in enumerate(out.prompt_logprobs[1:]):
        assert sorted(entry) == list(range(VOCAB))
        assert max(abs(entry[t] - float(want[j, t])) for t in range(VOCAB)) <= TOLERANCE
    for entry in out.outputs[0].logprobs:
        assert sorted(entry) == list(range(VOCAB))
        assert math.fsum(math.exp(v) for v in entry.values()) == pytest.approx(1.0, abs=1e-4)


def test_llm_logit_bias_picks_the_argmax_of_raw_logprobs_plus_bias(llm):
    prompt = PROMPTS[2]
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0].outputs[0]
    bias = {plain.token_ids[0]: -100.0, plain.token_ids[1]: -4.0, 7: 3.5, 20: 2.0}
    biased = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, logprobs=-1, logit_bias=bias),
                          use_tqdm=False)[0].outputs[0]
    assert biased.token_ids != plain.token_ids
    for token, entry in zip(biased.token_ids, biased.logprobs):
        scores = {t: lp + bias.get(t, 0.0) for t, lp in entry.items()}  # raw logprobs: the bias is not in them
        assert token == max(scores, key=scores.get)


# ---------------------------------------------------------------- the HTTP server, official openai client

@pytest.fixture(scope="module")
def served(engine_checkpoint, tmp_path_factory):
    """(server, state, transformers model) on --max-logprobs -1 and a small --max-logprob-entries."""
    model = model_with_chat_template(engine_checkpoint[0], tmp_path_factory.mktemp("vocab") / "model")
    server, state = start_server(serve_args(model, {}, extra=["--max-logprobs", "-1", "--max-logprob-entries",
                                                              str(ENTRIES_LIMIT)]))
    yield server, state, engine_checkpoint[1]
    server.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].base_url + "/v1", api_key="unused", max_retries=0)


def test_http_top_logprobs_minus_one_is_the_whole_vocabulary(client):
    messages = [{"role": "user", "content": "hello world"}]
    chat = client.chat.completions.create(model="base", messages=messages, max_tokens=2, temperature=0,
                                          logprobs=True, top_logprobs=-1).choices[0]
    for entry in chat.logprobs.content:
        assert len(entry.top_logprobs) == VOCAB
        assert math.fsum(math.exp(t.logprob) for t in entry.top_logprobs) == pytest.approx(1.0, abs=1e-4)
    completion = client.completions.create(model="base", prompt=PROMPTS[1], max_tokens=2, temperature=0,
                                           logprobs=-1, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    assert [len(top) for top in completion.logprobs.top_logprobs] == [VOCAB, VOCAB]


def test_http_prompt_logprobs_minus_one_match_transformers(served, client):
    _, state, model = served
    ids = state.tokenizer.encode(PROMPTS[3])
    choice = client.completions.create(model="base", prompt=[ids], max_tokens=1, temperature=0,
                                       extra_body={"prompt_logprobs": -1}).choices[0]
    field = choice.model_extra["prompt_logprobs"]
    want = peft_prompt_logprobs(model, ids)
    assert field[0] is None and len(field) == len(ids)
    for j, entry in enumerate(field[1:]):
        assert len(entry) == VOCAB
        assert max(abs(e["logprob"] - float(want[j, int(t)])) for t, e in entry.items()) <= TOLERANCE


def test_http_whole_vocabulary_over_a_bound_is_a_400_naming_it(served, client):
    with pytest.raises(openai.BadRequestError, match="--max-logprob-entries"):  # 10 x 257 entries > 2000
        client.completions.create(model="base", prompt=PROMPTS[0], max_tokens=10, logprobs=-1)
    state = served[1]
    state.max_logprobs = 20  # as a server on vLLM's default --max-logprobs 20 checks before the engine does
    try:
        for route in ("completions", "chat"):
            with pytest.raises(openai.BadRequestError, match=r"logprobs=-1 \(the whole vocabulary, 256 tokens\) "
                                                             r"is more than this server's --max-logprobs \(20"):
                if route == "completions":
                    client.completions.create(model="base", prompt=PROMPTS[0], max_tokens=1,
                                              extra_body={"prompt_logprobs": -1})
                else:
                    client.chat.completions.create(model="base", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=1, logprobs=True, top_logprobs=-1)
        client.completions.create(model="base", prompt=PROMPTS[0], max_tokens=1, logprobs=20)
    finally:
        state.max_logprobs = -1


def test_http_logit_bias_on_completions_and_chat(served, client):
    """A +100 bias makes a token every greedy choice; moderate biases pick argmax(raw logprobs + bias)."""
    tokenizer = served[1].tokenizer
    forced = tokenizer.get_vocab()["dog"]
    text = client.completions.create(model="base", prompt=PROMPTS[0], max_tokens=3, temperature=0,
                                     logit_bias={str(forced): 100}).choices[0].text
    assert tokenizer.encode(text, add_special_tokens=False) == [forced] * 3
    messages = [{"role": "user", "content": "the cat"}]
    plain = client.chat.completions.create(model="base", messages=messages, max_tokens=4, temperature=0,
                                           logprobs=True, extra_body={"return_token_ids": True}).choices[0]
    first = plain.model_extra["token_ids"][0]
    bias = {str(first): -100.0, "30": 2.5, "41": -1.5}
    chat = client.chat.completions.create(model="base", messages=messages, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=-1, logit_bias=bias,
                                          extra_body={"return_tokens_as_token_ids": True}).choices[0]
    assert chat.message.content != plain.message.content
    for entry in chat.logprobs.content:
        scores = {int(t.token.split(":")[1]): t.logprob + bias.get(t.token.split(":")[1], 0.0)
                  for t in entry.top_logprobs}
        assert int(entry.token.split(":")[1]) == max(scores, key=scores.get)


@pytest.mark.parametrize("bias,match", [({"x": 1}, "logit_bias keys must be token ids"),
                                        ({"5": 101}, r"logit_bias\[5\] must be a number in \[-100, 100\]"),
                                        ({"5": 1, "05": 2}, "names token 5 twice"),
                                        ({"256": 1}, r"logit_bias keys must be token ids in \[0, 255\]")])
def test_http_bad_logit_bias_is_a_400(client, bias, match):
    for call in (lambda: client.completions.create(model="base", prompt="hello", max_tokens=1, logit_bias=bias),
                 lambda: client.chat.completions.create(model="base", messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=1, logit_bias=bias)):
        with pytest.raises(openai.BadRequestError, match=match):
            call()
