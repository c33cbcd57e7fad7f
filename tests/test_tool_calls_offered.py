"""Only functions the request offered become tool calls (issue 39 item 10): a generated call of any
other name, or one whose JSON names a function twice, stays content, whole or streamed, under
``auto`` and ``required`` alike. Through the server on the canned engine of test_tool_calls_server."""

import json

import pytest
from test_tool_calls_server import CALL, TOOLS, _ask, _streamed, client, pieces, served  # noqa: F401 - fixtures

from lora_runner.entrypoints.openai.tool_calls.forced_parsers import RequiredCallsParser
from lora_runner.entrypoints.openai.tool_calls.hermes_parser import HermesToolParser

OFFERED = frozenset(tool["function"]["name"] for tool in TOOLS)  # get_weather, get_time
UNOFFERED = {
    "another name": '<tool_call>\n{"name": "delete_files", "arguments": {"path": "/"}}\n</tool_call>',
    "name given twice": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}, '
                        '"name": "delete_files"}\n</tool_call>',
    "name twice, other first": '<tool_call>{"name": "delete_files", "name": "get_weather", '
                               '"arguments": {"city": "Paris"}}</tool_call>',
    "name not a string": '<tool_call>{"name": ["get_time"], "arguments": {}}</tool_call>',
    "arguments twice": '<tool_call>{"name": "get_time", "arguments": {}, "arguments": {"x": 1}}</tool_call>',
}


@pytest.mark.parametrize("case", list(UNOFFERED))
def test_a_call_of_a_function_not_offered_is_content(served, client, case):  # noqa: F811
    text = "Doing it.\n" + UNOFFERED[case]
    response, _, _ = _ask(served, client, pieces(text))
    choice = response.choices[0]
    assert (choice.message.tool_calls, choice.finish_reason) == (None, "stop")
    assert choice.message.content == text


@pytest.mark.parametrize("case", ["another name", "name twice, other first"])
def test_a_streamed_call_of_a_function_not_offered_is_content(served, client, case):  # noqa: F811
    text = "Doing it.\n" + UNOFFERED[case]
    chunks, _, _ = _ask(served, client, pieces(text, size=2), stream=True)
    content, calls, finish = _streamed(chunks)
    assert (content, calls, finish) == (text, {}, "stop")


def test_offered_calls_beside_an_unoffered_one_stay_calls(served, client):  # noqa: F811
    text = CALL + "\n" + UNOFFERED["another name"]
    response, _, _ = _ask(served, client, pieces(text))
    (call,) = response.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert "delete_files" in response.choices[0].message.content


@pytest.mark.parametrize("parser", [lambda: HermesToolParser(OFFERED), lambda: RequiredCallsParser(OFFERED)])
def test_parsers_never_return_a_name_that_was_not_offered(parser):
    texts = {
        "hermes": [UNOFFERED[case] for case in UNOFFERED],
        "list": ['[{"name": "delete_files", "arguments": {}}]',
                 '[{"name": "get_time", "arguments": {}, "name": "delete_files"}]',
                 '[{"name": {"get_time": 1}, "arguments": {}}]'],
    }
    for text in texts["hermes"] + texts["list"]:
        out = parser().feed(text, finished=True)
        assert not out.calls and out.content == text, text
    good = parser().feed('[{"name": "get_time", "arguments": {}}]' if isinstance(parser(), RequiredCallsParser)
                         else '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', finished=True)
    assert [(c.name, json.loads(c.arguments)) for c in good.calls] == [("get_time", {})]
