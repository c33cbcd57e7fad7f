"""vLLM's chat fields over HTTP (chat_template_kwargs, chat_template, add_generation_prompt,
continue_final_message), rendered exactly as LLM.chat renders them; the serve flags that shape a
request (--chat-template, --trust-request-chat-template, --generation-config, --enable-log-requests).
Driven by the official openai client against real servers on the tiny model."""

from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest
from serve_support import CHAT_TEMPLATE, PROMPTS, model_with_chat_template, offline_greedy, serve_args, start_server

from lora_runner.engine.chat import chat_token_ids

# the server's --chat-template: the test template plus a variable a request's chat_template_kwargs sets
SERVER_TEMPLATE = (CHAT_TEMPLATE + "{% if enable_thinking is defined and not enable_thinking %} no{% else %} yes{% endif %}"
                   "{{ note | default('') }}")
# a request's own template (only a server started with --trust-request-chat-template renders it)
REQUEST_TEMPLATE = "{% for m in messages %}we {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}i{% endif %}"
CONVERSATION = [{"role": "user", "content": PROMPTS[0]}]
CONTINUED = CONVERSATION + [{"role": "assistant", "content": "the dog"}]


@pytest.fixture(scope="module")
def model(engine_checkpoint, tmp_path_factory):
    return model_with_chat_template(engine_checkpoint[0], tmp_path_factory.mktemp("chat-fields") / "model")


@pytest.fixture(scope="module")
def served(model, tmp_path_factory):
    """(server, state) started with --chat-template FILE, --generation-config DIR and --enable-log-requests."""
    work = tmp_path_factory.mktemp("chat-fields-flags")
    (work / "template.jinja").write_text(SERVER_TEMPLATE)
    (work / "gen").mkdir()
    (work / "gen" / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3}))
    server, state = start_server(serve_args(model, {}, extra=[
        "--chat-template", str(work / "template.jinja"), "--generation-config", str(work / "gen"),
        "--enable-log-requests"]))
    yield server, state
    server.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].base_url + "/v1", api_key="unused", max_retries=0)


def _prompt_ids(client, messages, **extra) -> list[int]:
    response = client.chat.completions.create(model="base", messages=messages, max_tokens=1,
                                              extra_body={"return_token_ids": True, **extra})
    return response.model_extra["prompt_token_ids"]


def _oracle(served, messages, **options) -> list[int]:
    """The ids LLM.chat renders (lora_runner.engine.chat), with the server's template unless one is given."""
    options.setdefault("chat_template", SERVER_TEMPLATE)
    return chat_token_ids(served[1].tokenizer, [messages], **options)[0]


def test_chat_template_kwargs_reach_the_template(served, client):
    thinking_off = _prompt_ids(client, CONVERSATION, chat_template_kwargs={"enable_thinking": False})
    assert thinking_off == _oracle(served, CONVERSATION, chat_template_kwargs={"enable_thinking": False})
    assert thinking_off == _oracle(served, CONVERSATION, tenant_template_kwargs={"enable_thinking": False})
    assert thinking_off != _prompt_ids(client, CONVERSATION)  # the variable changed the rendering


def test_a_special_token_in_a_template_variable_stays_text(served, client):
    tokenizer = served[1].tokenizer
    ids = _prompt_ids(client, CONVERSATION, chat_template_kwargs={"note": tokenizer.eos_token})
    assert tokenizer.eos_token_id not in ids
    assert ids == _oracle(served, CONVERSATION, tenant_template_kwargs={"note": tokenizer.eos_token})


def test_the_server_template_replaces_the_tokenizers(served, client):
    assert _prompt_ids(client, CONVERSATION) == _oracle(served, CONVERSATION)
    assert _prompt_ids(client, CONVERSATION) != _oracle(served, CONVERSATION, chat_template=CHAT_TEMPLATE)


def test_add_generation_prompt_and_continue_final_message_render_as_llm_chat(served, client):
    no_opening = _prompt_ids(client, CONVERSATION, add_generation_prompt=False)
    assert no_opening == _oracle(served, CONVERSATION, add_generation_prompt=False)
    assert no_opening != _prompt_ids(client, CONVERSATION)
    continued = _prompt_ids(client, CONTINUED, add_generation_prompt=False, continue_final_message=True)
    assert continued == _oracle(served, CONTINUED, add_generation_prompt=False, continue_final_message=True)


@pytest.mark.parametrize("extra, code", [
    ({"chat_template": REQUEST_TEMPLATE}, "chat_template_not_allowed"),
    ({"chat_template_kwargs": {"chat_template": REQUEST_TEMPLATE}}, "chat_template_not_allowed"),
    ({"chat_template_kwargs": {"tokenize": False}}, "invalid_value"),
    ({"continue_final_message": True}, "invalid_value"),  # with add_generation_prompt (default true)
    ({"continue_final_message": True, "add_generation_prompt": False}, "invalid_value"),  # last message: user
])
def test_what_cannot_be_honoured_is_a_400(client, extra, code):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="base", messages=CONVERSATION, max_tokens=1, extra_body=extra)
    assert err.value.body["code"] == code


def test_the_fields_are_not_reported_as_ignored(served):
    response = httpx.post(served[0].base_url + "/v1/chat/completions", timeout=60, json={
        "model": "base", "messages": CONVERSATION, "max_tokens": 1, "add_generation_prompt": True,
        "continue_final_message": False, "chat_template_kwargs": {"enable_thinking": True}})
    assert response.status_code == 200 and "x-ignored-fields" not in response.headers


def test_generation_config_defaults_apply_where_the_request_is_silent(served, model, client):
    response = client.completions.create(model="base", prompt=PROMPTS[1])  # greedy, 3 tokens (the folder's file)
    assert response.usage.completion_tokens == 3
    greedy = offline_greedy(model, [(PROMPTS[1], None, None)], 3, {})[0]
    assert response.choices[0].text == served[1].tokenizer.decode(greedy, skip_special_tokens=True)
    assert client.completions.create(model="base", prompt=PROMPTS[1], max_tokens=5).usage.completion_tokens == 5


def test_log_requests_names_lengths_and_parameters_never_the_prompt(client, caplog):
    with caplog.at_level(logging.INFO, logger="lora_runner.entrypoints.openai.completions"):
        client.completions.create(model="base", prompt="the green tenant says no", max_tokens=2)
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request cmpl-")]
    assert len(logged) == 1 and "prompt_tokens=[5]" in logged[0] and "max_tokens=2" in logged[0]
    assert "green tenant" not in logged[0]


def test_a_trusting_server_renders_the_requests_template(model):
    server, state = start_server(serve_args(model, {}, extra=["--trust-request-chat-template"]))
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        ids = _prompt_ids(client, CONVERSATION, chat_template=REQUEST_TEMPLATE)
        assert ids == chat_token_ids(state.tokenizer, [CONVERSATION], chat_template=REQUEST_TEMPLATE)[0]
        assert ids != _prompt_ids(client, CONVERSATION)
    finally:
        server.stop()
