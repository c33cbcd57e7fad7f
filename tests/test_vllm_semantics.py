"""vLLM / OpenAI semantics of tool calls, found by running vLLM's own cases against us, through the
official openai client on the canned-engine server of test_tool_calls_server (the engine records the
constraint it was given; xgrammar and jsonschema then judge that constraint).

tool_choice "required" with pydantic-made parameters ($defs / $ref) compiles and validates; a streamed
named-function call sends one tool_calls entry per call per chunk; a function without parameters takes
no arguments ({}), as OpenAI means.
"""

import json

import jsonschema
import openai
import pydantic
import pytest
from test_tool_calls_server import ARGS, TOOLS, _ask, _calls, client, pieces, served  # noqa: F401 (fixtures)

xgrammar = pytest.importorskip("xgrammar")
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402


class Address(pydantic.BaseModel):
    city: str
    zip: int


class Person(pydantic.BaseModel):
    name: str
    home: Address
    friends: list["Person"] = []  # a recursive $ref


class Item(pydantic.BaseModel):  # a second tool whose $defs reuse a name ("Address") with another schema
    where: "Address2"


class Address2(pydantic.BaseModel):
    street: str


PERSON, ITEM = Person.model_json_schema(), Item.model_json_schema()
DEFS_TOOLS = [{"type": "function", "function": {"name": "add_person", "parameters": PERSON}},
              {"type": "function", "function": {"name": "add_item", "parameters": ITEM}}]
GOOD = [{"name": "add_person", "arguments": {"name": "Ann", "home": {"city": "Oslo", "zip": 1},
                                             "friends": [{"name": "Bo", "home": {"city": "Rome", "zip": 2}}]}},
        {"name": "add_item", "arguments": {"where": {"street": "Main"}}}]
BAD = [{"name": "add_person", "arguments": {"name": "Ann", "home": {"city": "Oslo", "zip": "one"}}}]
BAD_NESTED = [{"name": "add_person", "arguments": {"name": "Ann", "home": {"city": "Oslo", "zip": 1},
                                                   "friends": [{"name": "Bo", "home": {"street": "x"}}]}}]


def _accepts(schema: dict, document) -> bool:
    """Whether xgrammar's grammar of `schema` accepts `document` (its compact separators are json.dumps' own)."""
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    return _is_grammar_accept_string(grammar, json.dumps(document))


@pytest.mark.parametrize("stream", [False, True])
def test_required_with_pydantic_defs_and_refs_compiles_and_validates(served, client, stream):
    assert "$defs" in PERSON and "$defs" in ITEM  # the case: root-relative pointers inside each tool
    answer, _, params = _ask(served, client, pieces(json.dumps(GOOD)), stream=stream, tools=DEFS_TOOLS,
                             tool_choice="required")
    schema = params.structured_outputs.json
    jsonschema.validate(GOOD, schema)  # every $ref resolves, to its own tool's definitions
    for bad in (BAD, BAD_NESTED):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert _accepts(schema, GOOD) and not _accepts(schema, BAD) and not _accepts(schema, BAD_NESTED)
    finish, got = _calls(answer, stream)
    assert finish == "tool_calls" and got == [(call["name"], call["arguments"]) for call in GOOD]


def test_named_function_with_defs_keeps_its_schema_as_the_root(served, client):
    choice = {"type": "function", "function": {"name": "add_person"}}
    arguments = json.dumps(GOOD[0]["arguments"])
    answer, _, params = _ask(served, client, pieces(arguments), tools=DEFS_TOOLS, tool_choice=choice)
    assert params.structured_outputs.json == PERSON
    assert answer.choices[0].message.tool_calls[0].function.arguments == arguments


def test_streamed_named_call_sends_one_entry_per_call_per_chunk(served, client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    chunks, _, _ = _ask(served, client, pieces(ARGS, size=5), stream=True, tool_choice=choice)
    entries = [chunk.choices[0].delta.tool_calls for chunk in chunks
               if chunk.choices and chunk.choices[0].delta.tool_calls]
    assert entries and all(len({call.index for call in calls}) == len(calls) for calls in entries)
    first = entries[0][0]  # a client reading entry 0 of each chunk sees the whole arguments
    assert first.id.startswith("call_") and first.function.name == "get_weather"
    assert first.function.arguments == ARGS[:5]
    assert "".join(calls[0].function.arguments for calls in entries) == ARGS


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "ping"}}])
def test_a_function_without_parameters_takes_no_arguments(served, client, tool_choice):
    tools = TOOLS + [{"type": "function", "function": {"name": "ping"}}]
    reply = '[{"name": "ping", "arguments": {}}]' if tool_choice == "required" else "{}"
    answer, prompt, params = _ask(served, client, pieces(reply), tools=tools, tool_choice=tool_choice)
    schema = params.structured_outputs.json
    call = {} if tool_choice != "required" else None
    documents = ({}, {"x": 1}) if call is not None else ([{"name": "ping", "arguments": {}}],
                                                          [{"name": "ping", "arguments": {"x": 1}}])
    jsonschema.validate(documents[0], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(documents[1], schema)
    assert _accepts(schema, documents[0]) and not _accepts(schema, documents[1])
    (made,) = answer.choices[0].message.tool_calls
    assert (made.function.name, json.loads(made.function.arguments)) == ("ping", {})
    assert '"parameters"' not in prompt.split('"ping"')[1].split("\n")[0]  # the template sees none declared


@pytest.fixture(scope="module")
def real_client(engine_checkpoint, tmp_path_factory):
    """An openai client of a real server on the tiny model (logprobs come from the engine)."""
    from serve_support import model_with_chat_template, serve_args, start_server

    model = model_with_chat_template(engine_checkpoint[0], tmp_path_factory.mktemp("token-ids") / "model")
    server, _ = start_server(serve_args(model, {}))
    yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    server.stop()


def test_return_tokens_as_token_ids_names_every_logprob_token_by_its_id(real_client):
    """vLLM's field: a token that is a piece of a character has no text (decoded: U+FFFD); its id does."""
    chat = real_client.chat.completions.create(
        model="base", messages=[{"role": "user", "content": "the cat"}], max_tokens=4, logprobs=True, top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    choice = chat.choices[0]
    entries = choice.logprobs.content
    assert [entry.token for entry in entries] == [f"token_id:{i}" for i in choice.model_extra["token_ids"]]
    assert all(top.token.startswith("token_id:") for entry in entries for top in entry.top_logprobs)
    legacy = real_client.completions.create(model="base", prompt="the cat sat", max_tokens=2, logprobs=1, echo=True,
                                            extra_body={"return_tokens_as_token_ids": True})
    tokens = legacy.choices[0].logprobs.tokens  # the echoed prompt's tokens too
    assert len(tokens) > 2 and all(token.startswith("token_id:") for token in tokens)
    plain = real_client.completions.create(model="base", prompt="the cat sat", max_tokens=2, logprobs=1)
    assert not any(token.startswith("token_id:") for token in plain.choices[0].logprobs.tokens)
