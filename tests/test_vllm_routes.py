"""vLLM's service routes on a real server (the tiny model through the serve command line): /tokenize
(a prompt or a chat, as the chat route renders it), /detokenize, /version, /ping, and model cards with
max_model_len. They follow /v1/models' key rules: 401 without a key, and a tenant that may not use a
model cannot tokenize for it either."""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest
from serve_support import model_with_chat_template, serve_args, start_server

from lora_runner.engine.chat import chat_token_ids

OPERATOR, TENANT = "sk-operator", "sk-tenant-a"
MESSAGES = [{"role": "user", "content": "the cat sat"}]


@pytest.fixture(scope="module")
def served(engine_checkpoint, tmp_path_factory):
    """(base url, ServerState): LoRA "a" served, an operator key and a tenant key limited to "a"."""
    work = tmp_path_factory.mktemp("vllm-routes")
    model = model_with_chat_template(engine_checkpoint[0], work / "model")
    _add_bos(model)
    (work / "keys.json").write_text(json.dumps({TENANT: {"adapters": ["a"], "base": False}}))
    loras = {"a": engine_checkpoint[2]["r4"][0]}
    server, state = start_server(serve_args(model, loras, extra=["--api-key", OPERATOR,
                                                                 "--tenant-keys", str(work / "keys.json")]))
    yield server.base_url, state
    server.stop()


def _add_bos(model: str) -> None:
    """Make the model's tokenizer put <s> before a prompt (add_special_tokens then changes the ids)."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)])
    tokenizer.save_pretrained(model)


def _post(served, path, body, key=OPERATOR) -> httpx.Response:
    return httpx.post(served[0] + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_tokenize_a_prompt_with_and_without_special_tokens(served):
    tokenizer = served[1].tokenizer
    answer = _post(served, "/tokenize", {"model": "base", "prompt": "the cat sat", "return_token_strs": True})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    expected = tokenizer.encode("the cat sat")
    assert body == {"count": len(expected), "max_model_len": 512, "tokens": expected,
                    "token_strs": tokenizer.convert_ids_to_tokens(expected)}
    plain = _post(served, "/tokenize", {"prompt": "the cat sat", "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode("the cat sat", add_special_tokens=False) == expected[1:]
    assert expected[0] == tokenizer.bos_token_id


def test_tokenize_a_chat_gives_the_ids_the_chat_route_generates_from(served):
    body = _post(served, "/tokenize", {"model": "a", "messages": MESSAGES}).json()
    assert body["tokens"] == chat_token_ids(served[1].tokenizer, [MESSAGES], chat_template=None)[0]
    client = openai.OpenAI(base_url=served[0] + "/v1", api_key=OPERATOR, max_retries=0)
    response = client.chat.completions.create(model="base", messages=MESSAGES, max_tokens=1,
                                              extra_body={"return_token_ids": True})
    assert response.model_extra["prompt_token_ids"] == body["tokens"] and body["count"] == len(body["tokens"])
    open_reply = _post(served, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert open_reply["tokens"] != body["tokens"]  # the template's field reaches it


@pytest.mark.parametrize("body", [{}, {"prompt": "x", "messages": MESSAGES}, {"prompt": 3}])
def test_tokenize_refuses_bodies_that_are_not_one_prompt(served, body):
    assert _post(served, "/tokenize", body).status_code == 400


def test_detokenize_is_the_text_of_the_ids(served):
    tokenizer = served[1].tokenizer
    ids = tokenizer.encode("the cat sat")
    answer = _post(served, "/detokenize", {"model": "base", "tokens": ids})
    assert answer.status_code == 200 and answer.json() == {"prompt": tokenizer.decode(ids)}
    assert _post(served, "/detokenize", {"tokens": [len(tokenizer)]}).status_code == 400
    assert _post(served, "/detokenize", {"tokens": [-1]}).status_code == 400


def test_version_and_ping(served):
    version = httpx.get(served[0] + "/version", headers={"Authorization": f"Bearer {OPERATOR}"})
    assert version.status_code == 200 and isinstance(version.json()["version"], str)
    for method in ("GET", "POST"):
        assert httpx.request(method, served[0] + "/ping",
                             headers={"Authorization": f"Bearer {OPERATOR}"}).status_code == 200


@pytest.mark.parametrize("method, path, body", [
    ("POST", "/tokenize", {"prompt": "x"}), ("POST", "/detokenize", {"tokens": [1]}),
    ("GET", "/version", None), ("GET", "/ping", None), ("GET", "/tokenizer_info", None)])
def test_the_routes_need_a_key_as_models_does(served, method, path, body):
    assert httpx.request(method, served[0] + path, json=body).status_code == 401
    assert httpx.request(method, served[0] + "/v1/models").status_code == 401


def test_a_tenant_tokenizes_only_for_its_models(served):
    assert _post(served, "/tokenize", {"model": "a", "prompt": "x"}, key=TENANT).status_code == 200
    assert _post(served, "/tokenize", {"model": "base", "prompt": "x"}, key=TENANT).status_code == 404
    assert _post(served, "/detokenize", {"model": "nope", "tokens": [1]}, key=TENANT).status_code == 404


def test_model_cards_carry_max_model_len(served):
    client = openai.OpenAI(base_url=served[0] + "/v1", api_key=OPERATOR, max_retries=0)
    cards = {card.id: card.model_extra for card in client.models.list().data}
    assert set(cards) == {"base", "a"} and all(card["max_model_len"] == 512 for card in cards.values())


def test_without_served_model_name_the_base_card_shows_no_server_path(engine_checkpoint):
    """The card names the model folder (not its absolute path); a request may name either, as vLLM's may
    name the path it was started with."""
    model = engine_checkpoint[0]
    args = serve_args(model, {"a": engine_checkpoint[2]["r4"][0]})
    args.served_model_name = None  # as `lora-runner serve MODEL_DIR` without --served-model-name
    server, _ = start_server(args)
    try:
        listing = httpx.get(server.base_url + "/v1/models").text
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        cards = {card.id: card for card in client.models.list().data}
        name = os.path.basename(model)
        assert set(cards) == {name, "a"} and cards["a"].model_extra["parent"] == name
        assert cards[name].model_extra["root"] == name and model not in listing
        for requested in (name, model):
            response = client.completions.create(model=requested, prompt="the cat", max_tokens=1)
            assert response.choices[0].finish_reason == "length"
    finally:
        server.stop()
