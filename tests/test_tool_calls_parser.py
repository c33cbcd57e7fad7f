"""Hermes-style tool calls out of model text, whole and in every split (lora_runner.entrypoints.openai.tool_calls)."""

import json
import random

import pytest

from lora_runner.entrypoints.openai.tool_calls.deltas import join_calls
from lora_runner.entrypoints.openai.tool_calls.forced_parsers import NamedFunctionParser, RequiredCallsParser
from lora_runner.entrypoints.openai.tool_calls.hermes_parser import HermesToolParser

OFFERED = ("get_weather", "search", "f", "g")  # the functions the tests' requests offer
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
NESTED_ARGS = {"query": {"filters": [{"field": "città", "op": "=", "value": "東京 🙂"},
                                     {"nested": {"deep": [1, [2, {}]]}}],
                         "text": "a \"quoted\" } brace and </tool_call> in a string? no: {}"}, "limit": 3}
NESTED = f'<tool_call>{{"name": "search", "arguments": {json.dumps(NESTED_ARGS, ensure_ascii=False)}}}</tool_call>'

CASES = {  # name -> (model text, expected content, expected [(name, arguments dict)])
    "one call": (WEATHER, "", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    "two calls": (WEATHER + "\n" + WEATHER.replace("Paris", "Oslo"), "",
                  [("get_weather", {"city": "Paris", "unit": "celsius"}),
                   ("get_weather", {"city": "Oslo", "unit": "celsius"})]),
    "text then call": ("Let me look that up.\n\n" + WEATHER, "Let me look that up.",
                       [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    # a close tag inside an argument string would end the call (as in vLLM): models escape it
    "nested unicode": ("Searching: " + NESTED.replace("</tool_call> in", "</tool_call\\u003e in"), "Searching:",
                       [("search", NESTED_ARGS)]),
    "keys in another order": ('<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>', "", [("f", {"x": 1})]),
    "unclosed at the end": ('<tool_call>{"name": "f", "arguments": {"x": [1, 2]}}', "", [("f", {"x": [1, 2]})]),
    "malformed json": ('I will call <tool_call>{"name": "f" "arguments": {"x": 1}}</tool_call>',
                       'I will call <tool_call>{"name": "f" "arguments": {"x": 1}}</tool_call>', []),
    "malformed arguments": ('I will call\n<tool_call>{"name": "f", "arguments": {"x": }}</tool_call>',
                            'I will call\n<tool_call>{"name": "f", "arguments": {"x": }}</tool_call>', []),
    "no name": ('<tool_call>{"arguments": {}}</tool_call> ok', '<tool_call>{"arguments": {}}</tool_call> ok', []),
    "call then whitespace": (WEATHER + "\n\n", "", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    "plain text": ("the cat sat on the mat \n", "the cat sat on the mat \n", []),
    "almost a tag": ("a < b and <tool_ca", "a < b and <tool_ca", []),
}


def _run(parser, pieces):
    content, calls, deltas = "", [], []
    for i, piece in enumerate(pieces):
        out = parser.feed(piece, finished=i == len(pieces) - 1)
        content += out.content
        deltas += out.calls
        calls = join_calls(calls, out.calls)
    return content, calls, deltas


def random_split(text: str, rng: random.Random, max_cuts: int = 40) -> list[str]:
    """`text` cut at 1 to `max_cuts` places drawn from `rng`."""
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, max_cuts)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def splits(text: str, seed: str, times: int = 20, max_cuts: int = 6):
    """The pieces a parser may get `text` in: whole, one character a piece (every tag split everywhere),
    then `times` random splits seeded by `seed`."""
    rng = random.Random(seed)
    yield [text]
    yield list(text)
    for _ in range(times):
        yield random_split(text, rng, max_cuts)


def parse_in_pieces(parser, chunks: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    """(content, [(name, arguments dict)]) the parser makes of `chunks` fed in order, the last one
    finishing the output; `called` must agree with the calls found."""
    content, calls = "", []
    for position, chunk in enumerate(chunks):
        out = parser.feed(chunk, position == len(chunks) - 1)
        content += out.content
        calls = join_calls(calls, out.calls)
    assert parser.called == bool(calls)
    return content, [(call.name, json.loads(call.arguments)) for call in calls]


@pytest.mark.parametrize("case", list(CASES))
def test_whole_text_parses_to_the_expected_calls_and_content(case):
    text, content, expected = CASES[case]
    got_content, calls, _ = _run(HermesToolParser(OFFERED), [text])
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls)
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("case", [case for case in CASES if case != "malformed arguments"])
def test_every_split_streams_the_same_calls_in_openai_shape(case):
    text, content, expected = CASES[case]
    whole_content, whole_calls, _ = _run(HermesToolParser(OFFERED), [text])
    rng = random.Random(case)
    pieces_list = [list(text), *(random_split(text, rng) for _ in range(20))]  # one character at a time, then random
    for pieces in pieces_list:
        got_content, calls, deltas = _run(HermesToolParser(OFFERED), pieces + [""])
        assert got_content == whole_content
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]
        if expected:
            assert "<tool_call>" not in got_content and "</tool_call>" not in got_content
        for index in range(len(calls)):  # first delta: index, id, name; then only arguments fragments
            mine = [d for d in deltas if d.index == index]
            assert mine[0].id is not None and mine[0].name == calls[index].name
            assert all(d.id is None and d.name is None for d in mine[1:])


def test_arguments_stream_as_they_arrive_not_at_the_end():
    parser = HermesToolParser(OFFERED)
    head = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    first = parser.feed(head)
    assert [(d.name, d.arguments) for d in first.calls] == [("get_weather", ""), (None, '{"city": "Par')]
    rest = parser.feed('is"}}\n</tool_call>', finished=True)
    assert "".join(d.arguments for d in first.calls + rest.calls) == '{"city": "Paris"}'


def test_arguments_malformed_after_the_call_started_streaming_end_the_call_without_markup_in_content():
    # a stream cannot take back the call's first delta (module docstring): what was sent stays a call
    text = CASES["malformed arguments"][0]
    content, calls, _ = _run(HermesToolParser(OFFERED), list(text))
    assert content == "I will call"
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"x": }')]  # sent as it came


def test_named_function_output_is_the_arguments():
    parser = NamedFunctionParser("get_weather")
    content, calls, deltas = _run(parser, ['{"city": ', '"Paris"}'])
    assert content == "" and parser.called
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    assert deltas[0].id.startswith("call_") and deltas[0].arguments == ""


def test_required_output_is_a_list_of_calls():
    text = '[{"name": "f", "arguments": {"a": "ü"}}, {"name": "g", "arguments": {}}]'
    content, calls, _ = _run(RequiredCallsParser(OFFERED), [text[:10], text[10:]])
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": "ü"}), ("g", {})]
    for bad in ("not json", '{"name": "f", "arguments": {}}', '[{"name": "f"}]', "[]"):
        parser = RequiredCallsParser(OFFERED)
        assert _run(parser, [bad]) == (bad, [], []) and not parser.called
