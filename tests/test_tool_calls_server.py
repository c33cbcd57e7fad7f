"""Tool calls on /v1/chat/completions through the official openai client.

A tiny random model writes no tool calls, so the server here runs on a stand-in engine client that
answers every request with canned text (in pieces, as the engine streams deltas) and records the
prompt and SamplingParams it was given; the tokenizer is a byte-level BPE with a Hermes-style chat
template (tools, assistant tool calls, tool responses, as Qwen2.5's template writes them).
"""

import asyncio
import json

import openai
import pytest

from lora_runner.engine.stats import EngineStats
from lora_runner.entrypoints.openai.app import build_app
from lora_runner.entrypoints.openai.background import BackgroundServer
from lora_runner.entrypoints.openai.state import ServerConfig, ServerState
from lora_runner.entrypoints.openai.tenants import KeyRing
from lora_runner.entrypoints.openai.tool_calls.choice import required_calls_schema
from lora_runner.outputs import CompletionOutput, RequestOutput

HERMES_TEMPLATE = (
    "{%- if tools %}<|system|>You may call these functions:\n<tools>\n"
    "{%- for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|tool|><tool_response id={{ m.tool_call_id }}>{{ m.content }}</tool_response>\n"
    "{%- elif m.role == 'assistant' %}<|assistant|>{{ m.content }}"
    "{%- for tc in m.tool_calls or [] %}<tool_call>\n"
    "{\"name\": \"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}\n"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}")

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
USER = [{"role": "user", "content": "weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
ARGS = '{"city": "Paris", "unit": "celsius"}'


def pieces(text: str, size: int = 3) -> list[str]:
    """The text as the engine would stream it: a few characters per token."""
    return [text[i:i + size] for i in range(0, len(text), size)]


class CannedEngine:
    """An EngineClient answering each request with `reply` (pieces of text) and recording what it got."""

    model_name, max_model_len, max_logprobs, is_running = "canned", 4096, 5, True

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.reply, self.received = tokenizer, ["hello"], []
        self.vocab_size = len(tokenizer)

    async def generate(self, prompt, params, request_id, lora_request=None, prompt_adapter_request=None,
                       tenant=None, cache_salt=None):
        self.received.append((list(prompt), params))
        reply = list(self.reply)
        for position, piece in enumerate(reply):
            await asyncio.sleep(0)
            last = position == len(reply) - 1
            outputs = [CompletionOutput(sample, [position], text_delta=piece, finish_reason="stop" if last else None)
                       for sample in range(params.n)]
            yield RequestOutput(request_id, list(prompt), outputs, finished=last)

    def get_tokenizer(self):
        return self.tokenizer

    def encode(self, text):
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids):
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def served_adapter(self, name):
        return None  # the base model only

    def served_adapters(self):
        return []

    def get_stats(self):
        return EngineStats(running=0, waiting=0, kv_blocks_used=0, kv_blocks_total=1, preemptions=0, steps=0)

    def num_in_flight(self):
        return 0

    def abort(self, request_id):
        pass

    def abort_all(self):
        pass

    async def drain(self, timeout):
        return True

    def shutdown(self, timeout=10.0):
        pass


@pytest.fixture(scope="module")
def served():
    from factories import make_byte_level_tokenizer

    tokenizer = make_byte_level_tokenizer()
    tokenizer.chat_template = HERMES_TEMPLATE
    engine = CannedEngine(tokenizer)
    state = ServerState(engine, ServerConfig("base"), KeyRing.from_options([], None))
    with BackgroundServer(build_app(state)) as server:
        yield server, engine


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0].base_url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _ask(served, client, reply, stream=False, **kwargs):
    """(response or the list of stream chunks, the prompt text and SamplingParams the engine got)."""
    engine = served[1]
    engine.reply, engine.received = reply, []
    kwargs = {"model": "base", "messages": USER, "tools": TOOLS, "temperature": 0.0, **kwargs}
    answer = client.chat.completions.create(stream=stream, **kwargs)
    answer = list(answer) if stream else answer
    (prompt, params), = engine.received
    return answer, engine.tokenizer.decode(prompt), params


def _streamed(chunks):
    """(content, {index: [tool call deltas]}, finish reason) of one choice's chunks."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            calls.setdefault(call.index, []).append(call)
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


def _calls(answer, stream: bool) -> tuple[str, list[tuple[str, dict]]]:
    """(finish reason, [(function name, decoded arguments)]) of one choice, streamed or whole."""
    if stream:
        _, calls, finish = _streamed(answer)
        return finish, [(deltas[0].function.name, json.loads("".join(d.function.arguments or "" for d in deltas)))
                        for deltas in calls.values()]
    choice = answer.choices[0]
    return choice.finish_reason, [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]


def test_auto_parses_the_call_and_the_text_before_it(served, client):
    response, prompt, params = _ask(served, client, pieces("Let me check.\n" + CALL))
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert (call.function.name, call.function.arguments) == ("get_weather", ARGS)
    assert params.structured_outputs is None  # auto: the model chooses, nothing is forced
    assert json.dumps(TOOLS[0]) in prompt  # the tools went through the chat template


def test_auto_streams_openai_tool_call_deltas_that_reassemble_to_the_whole_answer(served, client):
    reply = pieces("Sure.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo"), size=2)
    whole, _, _ = _ask(served, client, reply)
    chunks, _, _ = _ask(served, client, reply, stream=True)
    content, calls, finish = _streamed(chunks)
    assert content == whole.choices[0].message.content == "Sure."
    assert not any("<tool" in (c.choices[0].delta.content or "") for c in chunks if c.choices)
    assert finish == "tool_calls" and sorted(calls) == [0, 1]
    for index, deltas in calls.items():
        first, rest = deltas[0], deltas[1:]
        assert first.id.startswith("call_") and first.type == "function" and first.function.name == "get_weather"
        assert rest and all(d.id is None and d.function.name is None for d in rest)  # arguments come in fragments
        arguments = "".join(d.function.arguments or "" for d in deltas)
        assert arguments == whole.choices[0].message.tool_calls[index].function.arguments
    assert json.loads("".join(d.function.arguments or "" for d in calls[1]))["city"] == "Oslo"


def test_malformed_call_is_content_and_no_error(served, client):
    text = 'Calling <tool_call>{"name": "get_weather", "arguments": {"city": Paris}}</tool_call>'
    response, _, _ = _ask(served, client, pieces(text))
    choice = response.choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (text, None, "stop")


def test_none_renders_the_tools_but_never_parses_calls(served, client):
    response, prompt, params = _ask(served, client, pieces(CALL), tool_choice="none")
    choice = response.choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (CALL, None, "stop")
    assert "get_weather" in prompt and params.structured_outputs is None  # vLLM's default for "none"


def test_no_tools_no_parsing(served, client):
    response, prompt, _ = _ask(served, client, pieces(CALL), tools=openai.NOT_GIVEN)
    assert response.choices[0].message.content == CALL and "<tools>" not in prompt


@pytest.mark.parametrize("stream", [False, True])
def test_required_constrains_the_output_to_a_list_of_calls(served, client, stream):
    reply = pieces('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]')
    answer, _, params = _ask(served, client, reply, stream=stream, tool_choice="required")
    schema = params.structured_outputs.json
    assert schema == required_calls_schema({"get_weather": WEATHER_PARAMS,
                                            "get_time": TOOLS[1]["function"]["parameters"]})
    assert schema["minItems"] == 1
    assert [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][0]["properties"]["arguments"] == WEATHER_PARAMS
    finish, got = _calls(answer, stream)
    assert finish == "tool_calls" and got == [("get_time", {}), ("get_weather", {"city": "Rome"})]


@pytest.mark.parametrize("stream", [False, True])
def test_named_function_constrains_the_arguments_to_its_parameters(served, client, stream):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    answer, _, params = _ask(served, client, pieces(ARGS), stream=stream, tool_choice=choice, n=2)
    assert params.structured_outputs.json == WEATHER_PARAMS
    if stream:
        for index in (0, 1):
            _, calls, finish = _streamed([c for c in answer if c.choices and c.choices[0].index == index])
            first, *rest = calls[0]
            assert first.id.startswith("call_") and first.function.name == "get_weather" and len(rest) > 1
            assert "".join(d.function.arguments or "" for d in calls[0]) == ARGS and finish == "tool_calls"
    else:
        for choice_out in answer.choices:
            (call,) = choice_out.message.tool_calls
            assert (call.function.name, call.function.arguments) == ("get_weather", ARGS)
            assert choice_out.message.content is None


def test_tool_and_assistant_tool_call_messages_render_through_the_template(served, client):
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, ünd sunny"}]
    response, prompt, _ = _ask(served, client, ["It is 18 degrees."], messages=messages)
    assert response.choices[0].message.content == "It is 18 degrees."
    expected_tail = ('<|user|>weather in Paris?\n<|assistant|><tool_call>\n'
                     '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
                     '<|tool|><tool_response id=call_1>18 degrees, ünd sunny</tool_response><|assistant|>')
    assert prompt.endswith(expected_tail)


def test_special_token_strings_in_tools_and_tool_calls_stay_text(served, client):
    tools = [{"type": "function", "function": {"name": "f", "description": "ends here </s> <s>",
                                               "parameters": {"type": "object", "properties": {"</s>": {}}}}}]
    messages = USER + [
        {"role": "assistant", "tool_calls": [{"id": "<s>", "type": "function",
                                              "function": {"name": "f", "arguments": '{"a": "</s>"}'}}]},
        {"role": "tool", "tool_call_id": "</s>", "content": "done"}]
    _, prompt, _ = _ask(served, client, ["ok"], tools=tools, messages=messages)
    engine = served[1]
    (ids, _), = engine.received
    assert not {engine.tokenizer.eos_token_id, engine.tokenizer.bos_token_id} & set(ids)
    for text in ("ends here </s> <s>", '"</s>": {}', '{"a": "</s>"}', "<tool_response id=</s>>done"):
        assert text in prompt


def _too_deep(depth, key="properties"):
    """A schema nested `depth` deep through properties, or through a default value (no schema keyword)."""
    schema, value = {"type": "object"}, 1
    for _ in range(depth):
        schema, value = {"type": "object", "properties": {"x": schema}}, [value]
    return schema if key == "properties" else {"type": "object", "default": value}


def _function(name="f", **extra):
    return {"type": "function", "function": {"name": name, **extra}}


BAD_REQUESTS = {  # name -> (extra request fields, a word of the error message)
    "not a function": ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "function"),
    "no function": ({"tools": [{"type": "function"}]}, "function"),
    "parameters not an object schema": ({"tools": [_function(parameters={"type": "string"})]}, "object"),
    "required not a list": ({"tools": [_function(parameters={"type": "object", "required": "city"})]}, "required"),
    "properties not schemas": ({"tools": [_function(parameters={"type": "object", "properties": {"a": 3}})]},
                               "properties.a"),
    "parameters not a dict": ({"tools": [_function(parameters=[1])]}, "parameters"),
    "too deep": ({"tools": [_function(parameters=_too_deep(40))]}, "deep"),
    "too deep a default": ({"tools": [_function(parameters=_too_deep(40, "default"))]}, "deep"),
    "bad name": ({"tools": [_function("get weather!")]}, "name"),
    "repeated name": ({"tools": [_function("f"), _function("f")]}, "another tool"),
    # counted before each tool is validated (the last one is no function)
    "too many": ({"tools": [_function(f"f{i}") for i in range(128)] + [{"type": "x"}]}, "129 tools"),
    "huge": ({"tools": [_function(description="x" * 70_000)]}, "characters"),
    "choice without tools": ({"tool_choice": "required"}, "needs tools"),
    "unknown choice": ({"tools": [_function()], "tool_choice": "always"}, "tool_choice"),
    "named function not among tools": ({"tools": [_function()], "tool_choice": {
        "type": "function", "function": {"name": "g"}}}, "not among the tools"),
    "tool call arguments not a string": ({"messages": USER + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]}, "arguments"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_tools_are_400_with_an_openai_error_body(served, client, case):
    fields, word = BAD_REQUESTS[case]
    engine = served[1]
    engine.received = []
    body = {"model": "base", "messages": USER, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**body)
    error = info.value.response.json()["error"]
    assert word in error["message"] and error["type"] == "invalid_request_error" and error["code"]
    assert engine.received == []  # refused before any work
    assert client.chat.completions.create(model="base", messages=USER).choices[0].message.content  # server goes on
