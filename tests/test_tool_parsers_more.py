"""vLLM's mistral and qwen3_xml / qwen3_coder tool-call parsers (--tool-call-parser): vLLM's own test cases
(tests/tool_parsers/test_mistral_tool_parser.py, test_qwen3coder_tool_parser.py: their model outputs and
expected calls and content), read whole and in every split, and each parser through the server with the
official openai client (on test_tool_calls_server's canned engine).

Where we differ from vLLM on purpose (malformed or unknown calls stay content, never a partial call) the
case says so."""

import json

import openai
import pytest
from test_tool_calls_parser import parse_in_pieces, splits
from test_tool_calls_server import HERMES_TEMPLATE, TOOLS, USER, CannedEngine, pieces

from lora_runner.entrypoints.openai.app import build_app
from lora_runner.entrypoints.openai.background import BackgroundServer
from lora_runner.entrypoints.openai.state import ServerConfig, ServerState
from lora_runner.entrypoints.openai.tenants import KeyRing
from lora_runner.entrypoints.openai.tool_calls.deltas import join_calls
from lora_runner.entrypoints.openai.tool_calls.mistral_parser import MistralToolParser
from lora_runner.entrypoints.openai.tool_calls.qwen3_xml_parser import Qwen3XmlToolParser, typed_value

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "state": {"type": "string"},
                                            "unit": {"type": "string", "enum": ["fahrenheit", "celsius"]}}}
AREA = {"type": "object", "properties": {"shape": {"type": "string"}, "dimensions": {"type": "object"},
                                         "precision": {"type": "integer"}}}
ANY = {"type": "object"}
SCHEMAS = {"add": ANY, "multiply": ANY, "get_current_weather": WEATHER, "get_age": ANY, "bash": ANY,
           "add_this_and_that": ANY, "calculate_area": AREA}
SF = {"city": "San Francisco", "state": "CA", "unit": "celsius"}
DALLAS = {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}
BASH = {"command": "print(\"hello world!\")\nre.compile(r'{}')"}

MISTRAL = {  # vLLM's case name -> (model output, content, [(name, arguments)])
    "no_tools": ("This is a test", "This is a test", []),
    "pre_v11 single_tool_add": ('[TOOL_CALLS][{"name": "add", "arguments":{"a": 3.5, "b": 4}}]', "",
                                [("add", {"a": 3.5, "b": 4})]),
    "pre_v11 spaced": ('[TOOL_CALLS]  [ {"name":"add" , "arguments" : {"a": 3, "b": 4} } ]', "",
                       [("add", {"a": 3, "b": 4})]),
    "pre_v11 strings": ('[TOOL_CALLS] [{"name": "add", "arguments":{"a": "3", "b": "4"}}]', "",
                        [("add", {"a": "3", "b": "4"})]),
    "pre_v11 single_tool_weather": ('[TOOL_CALLS] [{"name": "get_current_weather", "arguments":{"city": "San '
                                    'Francisco", "state": "CA", "unit": "celsius"}}]', "",
                                    [("get_current_weather", SF)]),
    "pre_v11 argument_before_name": ('[TOOL_CALLS] [{"arguments":{"city": "San Francisco", "state": "CA", "unit": '
                                     '"celsius"}, "name": "get_current_weather"}]', "", [("get_current_weather", SF)]),
    "pre_v11 name_in_argument": ('[TOOL_CALLS] [{"arguments":{"name": "John Doe"}, "name": "get_age"}]', "",
                                 [("get_age", {"name": "John Doe"})]),
    "pre_v11 multiple_tools": ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, {"name": '
                               '"get_current_weather", "arguments":{"city": "San Francisco", "state": "CA", "unit": '
                               '"celsius"}}]', "", [("add", {"a": 3.5, "b": 4}), ("get_current_weather", SF)]),
    "pre_v11 content_before_tool": ('Hello[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1, "b": 2}}]', "Hello",
                                    [("add", {"a": 1, "b": 2})]),
    # vLLM's stream keeps the trailing text (its whole-output reader drops it): we keep it both ways
    "pre_v11 trailing_data": ('[TOOL_CALLS] [{"name": "get_current_weather", "arguments":{"city": "Dallas", "state": '
                              '"TX", "unit": "fahrenheit"}}]\nextra trailing data', "\nextra trailing data",
                              [("get_current_weather", DALLAS)]),
    "v11 single_tool_add": ('[TOOL_CALLS]add_this_and_that{"a": 3.5, "b": 4}', "",
                            [("add_this_and_that", {"a": 3.5, "b": 4})]),
    "v11 single_tool_weather": ('[TOOL_CALLS]get_current_weather{"city": "San Francisco", "state": "CA", "unit": '
                                '"celsius"}', "", [("get_current_weather", SF)]),
    "v11 multiple_tool_calls": ('[TOOL_CALLS]add{"a": 3.5, "b": 4}[TOOL_CALLS]multiply{"a": 3, "b": 6}', "",
                                [("add", {"a": 3.5, "b": 4}), ("multiply", {"a": 3, "b": 6})]),
    "v11 content_before_tool": ('bla[TOOL_CALLS]add_this_and_that{"a": 3.5, "b": 4}', "bla",
                                [("add_this_and_that", {"a": 3.5, "b": 4})]),
    "v11 wrong_json (braces in content and strings)": (
        'hi{hi[TOOL_CALLS]bash{"command": "print(\\"hello world!\\")\\nre.compile(r\'{}\')"}', "hi{hi",
        [("bash", BASH)]),
    "v11 [ARGS] (v13)": ('[TOOL_CALLS]add[ARGS]{"a": 1}', "", [("add", {"a": 1})]),
    # vLLM sends a call with partial arguments ("complex"), or none at all: we show the output
    "v11 complex (cut short)": ('hi{hi[TOOL_CALLS]bash{"command": "print(\\"hello world!\\")',
                                'hi{hi[TOOL_CALLS]bash{"command": "print(\\"hello world!\\")', []),
    "v11 without arguments": ("[TOOL_CALLS]toolname_no_args", "[TOOL_CALLS]toolname_no_args", []),
    "pre_v11 not json": ("[TOOL_CALLS] not json at all", "[TOOL_CALLS] not json at all", []),
    "pre_v11 two tokens": ('[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1}}][TOOL_CALLS] [{"name": "add", '
                           '"arguments":{"b": 2}}]', '[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1}}][TOOL_CALLS] '
                           '[{"name": "add", "arguments":{"b": 2}}]', []),
    "not offered": ('[TOOL_CALLS]rm{"path": "/"}', '[TOOL_CALLS]rm{"path": "/"}', []),
    "repeated key": ('[TOOL_CALLS]add{"a": 1, "a": 2}', '[TOOL_CALLS]add{"a": 1, "a": 2}', []),
}


def _qwen(*calls: str) -> str:
    return "\n".join(f"<tool_call>\n<function={name}>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n"
                                                                    for k, v in params) + "</function>\n</tool_call>"
                     for name, params in calls)


DALLAS_XML = ("get_current_weather", [("city", "Dallas"), ("state", "TX"), ("unit", "fahrenheit")])
QWEN = {  # vLLM's case name -> (model output, content, [(name, arguments)])
    "no_tools": ("This is a test response without any tool calls",
                 "This is a test response without any tool calls", []),
    "single_tool": (_qwen(DALLAS_XML), "", [("get_current_weather", DALLAS)]),
    "single_tool_with_content": ("Sure! Let me check the weather for you." + _qwen(DALLAS_XML),
                                 "Sure! Let me check the weather for you.", [("get_current_weather", DALLAS)]),
    "single_tool_multiline_param": (_qwen(("calculate_area", [("shape", "rectangle"), ("dimensions",
                                                                '{"width": 10, \n "height": 20}'), ("precision", "2")])),
                                    "", [("calculate_area", {"shape": "rectangle", "dimensions": {"width": 10,
                                                             "height": 20}, "precision": 2})]),
    "parallel_tools": (_qwen(DALLAS_XML, ("get_current_weather", [("city", "Orlando"), ("state", "FL"),
                                                                  ("unit", "celsius")])),
                       "", [("get_current_weather", DALLAS),
                            ("get_current_weather", {"city": "Orlando", "state": "FL", "unit": "celsius"})]),
    "tool_with_typed_params": ("Let me calculate that area for you." + _qwen(("calculate_area", [
        ("shape", "circle"), ("dimensions", '{"radius": 15.5}'), ("precision", "3")])),
        "Let me calculate that area for you.",
        [("calculate_area", {"shape": "circle", "dimensions": {"radius": 15.5}, "precision": 3})]),
    "missing_closing_parameter_tag": (
        "Let me check the weather for you:\n<tool_call>\n<function=get_current_weather>\n<parameter=city>\nDallas\n"
        "<parameter=state>\nTX\n</parameter>\n<parameter=unit>\nfahrenheit\n</parameter>\n</function>\n</tool_call>",
        "Let me check the weather for you:", [("get_current_weather", DALLAS)]),
    # vLLM also reads a bare <function=...> block without <tool_call>: we take the template's markup only
    "fallback_no_tags": ("<function=get_current_weather>\n<parameter=city>\nDallas\n</parameter>\n</function>",
                         "<function=get_current_weather>\n<parameter=city>\nDallas\n</parameter>\n</function>", []),
    "not offered": ("<tool_call>\n<function=rm>\n<parameter=path>\n/\n</parameter>\n</function>\n</tool_call>",
                    "<tool_call>\n<function=rm>\n<parameter=path>\n/\n</parameter>\n</function>\n</tool_call>", []),
    "cut short": ("<tool_call>\n<function=get_current_weather>\n<parameter=city>\nDal",
                  "<tool_call>\n<function=get_current_weather>\n<parameter=city>\nDal", []),
}


@pytest.mark.parametrize("case", MISTRAL)
def test_mistral_vllm_cases_whole_and_split(case):
    text, content, calls = MISTRAL[case]
    for chunks in splits(text, case):
        assert parse_in_pieces(MistralToolParser(SCHEMAS), chunks) == (content, calls)


@pytest.mark.parametrize("case", QWEN)
def test_qwen3_xml_vllm_cases_whole_and_split(case):
    text, content, calls = QWEN[case]
    for chunks in splits(text, case):
        assert parse_in_pieces(Qwen3XmlToolParser(SCHEMAS), chunks) == (content, calls)


def test_mistral_content_streams_before_the_token():
    parser = MistralToolParser(SCHEMAS)
    assert parser.feed("Sure. ").content == "Sure."  # the space may precede [TOOL_CALLS]: held
    assert parser.feed("[TOOL").content == ""
    assert parser.feed("_CALLS]add{").content == ""


def test_qwen3_type_conversion():
    """vLLM's test_extract_tool_calls_type_conversion and ..._anyof_type_conversion."""
    properties = {"int_param": {"type": "integer"}, "float_param": {"type": "float"}, "bool_param": {"type": "boolean"},
                  "str_param": {"type": "string"}, "obj_param": {"type": "object"},
                  "anyof_int": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": 5},
                  "anyof_array": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
                  "type_as_array": {"type": ["integer", "null"]},
                  "multi_non_null": {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]}}
    params = [("int_param", "42"), ("float_param", "3.14"), ("bool_param", "true"), ("str_param", "hello world"),
              ("obj_param", '{"key": "value"}'), ("anyof_int", "5"), ("anyof_array", '["a", "b", "c"]'),
              ("type_as_array", "42"), ("multi_non_null", "some text"), ("unknown", "7")]
    parser = Qwen3XmlToolParser({"test_types": {"type": "object", "properties": properties}})
    _, [(_, arguments)] = parse_in_pieces(parser, [_qwen(("test_types", params))])
    assert arguments == {"int_param": 42, "float_param": 3.14, "bool_param": True, "str_param": "hello world",
                         "obj_param": {"key": "value"}, "anyof_int": 5, "anyof_array": ["a", "b", "c"],
                         "type_as_array": 42, "multi_non_null": "some text", "unknown": "7"}
    assert type(arguments["int_param"]) is int and type(arguments["type_as_array"]) is int
    assert typed_value("null", {"type": "integer"}) is None and typed_value("x", {"type": "integer"}) == "x"
    assert typed_value("3.0", {"type": "number"}) == 3 and typed_value("{'a': 1}", {"type": "object"}) == {"a": 1}
    assert typed_value("__import__('os')", {"type": "object"}) == "__import__('os')"  # never run


def test_qwen3_repeated_parameter_is_content():
    text = _qwen(("get_current_weather", [("city", "Dallas"), ("city", "Austin")]))
    assert parse_in_pieces(Qwen3XmlToolParser(SCHEMAS), [text]) == (text, [])


def _server(parser: str):
    from factories import make_byte_level_tokenizer

    tokenizer = make_byte_level_tokenizer()
    tokenizer.chat_template = HERMES_TEMPLATE
    engine = CannedEngine(tokenizer)
    state = ServerState(engine, ServerConfig("base", tool_call_parser=parser), KeyRing.from_options([], None))
    return BackgroundServer(build_app(state)), engine


def _calls_and_content(answer, stream: bool):
    if not stream:
        message = answer.choices[0].message
        return ([(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []],
                message.content or "", answer.choices[0].finish_reason)
    chunks = [chunk for chunk in answer if chunk.choices]
    calls = join_calls([], [_delta(call) for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []])
    content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices[0].finish_reason]
    return [(c.name, json.loads(c.arguments)) for c in calls], content, finish[-1]


def _delta(call):
    from lora_runner.entrypoints.openai.tool_calls.deltas import ToolCallDelta

    return ToolCallDelta(call.index, call.id, call.function.name, call.function.arguments or "")


PARIS = {"city": "Paris", "unit": "celsius"}
SERVED = {  # parser -> what the canned engine writes
    "mistral": 'Let me look.[TOOL_CALLS]get_weather{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time{}',
    "qwen3_xml": "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                 "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
                 "<function=get_time>\n</function>\n</tool_call>",
    "qwen3_coder": "Let me look.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                   "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call><tool_call>\n"
                   "<function=get_time>\n</function>\n</tool_call>",
}


@pytest.mark.parametrize("parser", SERVED)
def test_a_server_with_the_parser_returns_the_calls(parser):
    server, engine = _server(parser)
    with server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)
        engine.reply = pieces(SERVED[parser])
        for stream in (False, True):
            answer = client.chat.completions.create(model="base", messages=USER, tools=TOOLS, stream=stream)
            assert _calls_and_content(answer, stream) == ([("get_weather", PARIS), ("get_time", {})], "Let me look.",
                                                          "tool_calls")
            # Mistral's [TOOL_CALLS] is a special token: decoding must keep it (as vLLM's parser asks)
            assert engine.received[-1][1].skip_special_tokens is (parser != "mistral")
        engine.reply = pieces("No call needed.")
        answer = client.chat.completions.create(model="base", messages=USER, tools=TOOLS, tool_choice="none")
        assert engine.received[-1][1].skip_special_tokens is True  # no parser reads tool_choice "none"
