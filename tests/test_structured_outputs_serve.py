"""Structured outputs over HTTP through the official openai client: response_format json_schema on
chat and completions, vLLM's structured_outputs field, hostile constraints and bad token filters as
400s while other requests go on."""

import json

import jsonschema
import openai
import pytest

from serve_support import serve_args, start_server
from structured_support import MODEL_VOCAB, save_byte_checkpoint

SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["colour", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    model_dir, _ = save_byte_checkpoint(tmp_path_factory.mktemp("structured-serve"))
    server, _ = start_server(serve_args(model_dir, {}))
    yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    server.stop()


def _json_schema_format(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_json_schema_on_chat_and_completions(client):
    chat = client.chat.completions.create(model="base", messages=[{"role": "user", "content": "answer"}],
                                          max_tokens=200, temperature=0.0, response_format=_json_schema_format())
    completion = client.completions.create(model="base", prompt="answer:", max_tokens=200, temperature=1.0,
                                           seed=2, extra_body={"response_format": _json_schema_format()})
    for choice, text in ((chat.choices[0], chat.choices[0].message.content), (completion.choices[0],
                                                                              completion.choices[0].text)):
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("body, check", [
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, lambda t: len(t) == 3 and t.isdigit()),
    ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
    ({"response_format": {"type": "text"}}, lambda t: True),
])
def test_vllm_fields(client, body, check):
    completion = client.completions.create(model="base", prompt="pick", max_tokens=20, temperature=0.0,
                                           extra_body=body)
    assert check(completion.choices[0].text), completion.choices[0].text


@pytest.mark.parametrize("body, message", [
    ({"response_format": _json_schema_format({"type": "nope"})}, "cannot be compiled"),
    ({"response_format": _json_schema_format(json.loads("{" + '"items": {' * 70 + "}" * 70 + "}"))}, "deeper"),
    ({"structured_outputs": {"regex": "(a", "choice": ["x"]}}, "exactly one"),
    ({"structured_outputs": {"grammar": "root ::= nothing_here"}}, "cannot be compiled"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "at most one"),
    ({"allowed_token_ids": [MODEL_VOCAB]}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
])
def test_hostile_constraints_and_bad_filters_are_400_and_others_go_on(client, body, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.completions.create(model="base", prompt="x", max_tokens=8, extra_body=body)
    ok = client.completions.create(model="base", prompt="x", max_tokens=4, temperature=0.0)
    assert ok.choices[0].finish_reason == "length"


def test_allowed_token_ids_over_http(client):
    completion = client.completions.create(model="base", prompt="x", max_tokens=10, temperature=1.0, seed=3,
                                           logprobs=0, extra_body={"allowed_token_ids": [70, 71], "ignore_eos": True})
    assert set(completion.choices[0].logprobs.tokens) <= {"e", "f"}  # ids 70, 71: the bytes e, f
