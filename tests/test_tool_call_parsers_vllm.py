"""vLLM's llama3_json and pythonic tool-call parsers (--tool-call-parser): whole and in every split, and
through the server with the official openai client (on test_tool_calls_server's canned engine)."""

import json

import openai
import pytest
from test_tool_calls_parser import parse_in_pieces, splits
from test_tool_calls_server import HERMES_TEMPLATE, TOOLS, USER, CannedEngine, pieces

from lora_runner.entrypoints.openai.app import build_app
from lora_runner.entrypoints.openai.background import BackgroundServer
from lora_runner.entrypoints.openai.state import ServerConfig, ServerState
from lora_runner.entrypoints.openai.tenants import KeyRing
from lora_runner.entrypoints.openai.tool_calls.whole_call_parsers import Llama3JsonToolParser, PythonicToolParser

OFFERED = ("get_weather", "get_time")
PARIS = {"city": "Paris", "unit": "celsius"}

CASES = {  # (parser, model text) -> (content, [(name, arguments)])
    "llama3 one": (Llama3JsonToolParser, '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
                   "", [("get_weather", PARIS)]),
    "llama3 tag, two": (Llama3JsonToolParser, '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris", '
                        '"unit": "celsius"}}; {"name": "get_time", "parameters": {}}',
                        "", [("get_weather", PARIS), ("get_time", {})]),
    "llama3 text": (Llama3JsonToolParser, "It is sunny {maybe}.", "It is sunny {maybe}.", []),
    "llama3 not offered": (Llama3JsonToolParser, '{"name": "rm", "parameters": {}}', '{"name": "rm", "parameters": {}}',
                           []),
    "llama3 trailing text": (Llama3JsonToolParser, '{"name": "get_time", "parameters": {}} done',
                             '{"name": "get_time", "parameters": {}} done', []),
    "pythonic two": (PythonicToolParser, '[get_weather(city="Paris", unit="celsius"), get_time()]', "",
                     [("get_weather", PARIS), ("get_time", {})]),
    "pythonic text": (PythonicToolParser, "Sunny, 20 degrees.", "Sunny, 20 degrees.", []),
    "pythonic code is not run": (PythonicToolParser, '[get_weather(city=__import__("os").getcwd())]',
                                 '[get_weather(city=__import__("os").getcwd())]', []),
    "pythonic positional": (PythonicToolParser, '[get_weather("Paris")]', '[get_weather("Paris")]', []),
    "pythonic unclosed": (PythonicToolParser, '[get_weather(city="Par', '[get_weather(city="Par', []),
}


@pytest.mark.parametrize("case", CASES)
def test_whole_and_every_random_split_agree(case):
    parser_type, text, content, calls = CASES[case]
    for chunks in splits(text, case):
        assert parse_in_pieces(parser_type(OFFERED), chunks) == (content, calls)


def test_plain_content_streams_at_once():
    assert PythonicToolParser(OFFERED).feed("Sunny").content == "Sunny"
    assert Llama3JsonToolParser(OFFERED).feed("  It").content == "  It"
    assert Llama3JsonToolParser(OFFERED).feed("<|pyth").content == ""  # may be the tag: held


@pytest.fixture(scope="module")
def pythonic_server():
    from factories import make_byte_level_tokenizer

    tokenizer = make_byte_level_tokenizer()
    tokenizer.chat_template = HERMES_TEMPLATE
    engine = CannedEngine(tokenizer)
    state = ServerState(engine, ServerConfig("base", tool_call_parser="pythonic"), KeyRing.from_options([], None))
    with BackgroundServer(build_app(state)) as server:
        yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=30), engine


@pytest.mark.parametrize("stream", [False, True])
def test_a_pythonic_server_returns_the_calls(pythonic_server, stream):
    client, engine = pythonic_server
    engine.reply = pieces('[get_weather(city="Paris", unit="celsius")]')
    answer = client.chat.completions.create(model="base", messages=USER, tools=TOOLS, stream=stream)
    if stream:
        chunks = list(answer)
        calls = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []] if chunks else []
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", PARIS)]
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    else:
        message = answer.choices[0].message
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
            ("get_weather", PARIS)]
        assert answer.choices[0].finish_reason == "tool_calls" and not message.content


def test_an_unknown_parser_is_refused_naming_the_available_ones():
    with pytest.raises(ValueError, match="--tool-call-parser kimi_k2 .*hermes, llama3_json, pythonic, mistral, "
                       "qwen3_xml, qwen3_coder"):
        ServerConfig("base", tool_call_parser="kimi_k2")
