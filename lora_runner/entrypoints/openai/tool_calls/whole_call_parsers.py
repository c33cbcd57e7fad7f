"""vLLM's ``llama3_json`` and ``pythonic`` tool-call parsers (``--tool-call-parser``): calls that make up
the whole output, read once it has ended.

- llama3_json (Llama 3.1/3.2 JSON tool calling): the output is ``{"name": ..., "parameters": {...}}``
  (or ``"arguments"``), optionally after ``<|python_tag|>``, several separated by ``;``.
- pythonic (Llama 3.2 / 4 pythonic style): the output is a Python list of calls with keyword
  arguments of literal values, ``[get_weather(city="Paris"), get_time()]``.

An output that does not start like a call streams as content at once; one that does is held until it
ends (a half-written call cannot be told from content before), then becomes its calls, each sent
whole, or, when it is not a list of well-formed calls of offered functions, the content it was. As
the Hermes parser: only offered names become calls, malformed output is shown, never an error.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Collection

from lora_runner.entrypoints.openai.tool_calls.deltas import Extracted, ToolCallDelta, new_call_id
from lora_runner.entrypoints.openai.tool_calls.hermes_parser import loads_unique

PYTHON_TAG = "<|python_tag|>"


class _WholeCallParser:
    """Feeds of one choice's text -> Extracted; subclasses say how a call starts and parse the whole output."""

    openers: tuple[str, ...] = ()

    def __init__(self, offered: Collection[str]) -> None:
        self.offered = frozenset(offered)
        self.num_calls = 0
        self._buffer = ""
        self._holding: bool | None = None  # None: undecided (only whitespace, or part of an opener, so far)

    @property
    def called(self) -> bool:
        """Whether any tool call was found."""
        return self.num_calls > 0

    def feed(self, text: str, finished: bool = False) -> Extracted:
        """What `text` (the next piece of the output) adds; `finished`: the output ends here."""
        self._buffer += text
        if self._holding is None:
            start = self._buffer.lstrip()
            if any(start.startswith(opener) for opener in self.openers):
                self._holding = True
            elif start and not any(opener.startswith(start) for opener in self.openers):
                self._holding = False
        if self._holding is False or (self._holding is None and finished):
            content, self._buffer = self._buffer, ""
            return Extracted(content)
        if not finished:
            return Extracted()
        calls = self._calls(self._buffer.strip())
        if calls is None:
            return Extracted(self._buffer)
        deltas = [ToolCallDelta(self.num_calls + i, new_call_id(), name, arguments)
                  for i, (name, arguments) in enumerate(calls)]
        self.num_calls += len(deltas)
        return Extracted("", deltas)

    def _calls(self, text: str) -> list[tuple[str, str]] | None:
        """(name, arguments JSON) of each call the whole output holds; None: it is content."""
        raise NotImplementedError


class Llama3JsonToolParser(_WholeCallParser):
    """``--tool-call-parser llama3_json`` (module docstring)."""

    openers = (PYTHON_TAG, "{")

    def _calls(self, text: str) -> list[tuple[str, str]] | None:
        text = text.removeprefix(PYTHON_TAG).lstrip()
        decoder, calls, position = json.JSONDecoder(), [], 0
        while position < len(text):
            try:
                _, end = decoder.raw_decode(text, position)
            except ValueError:
                return None
            call = self._call(text[position:end])
            if call is None:
                return None
            calls.append(call)
            position = end
            while position < len(text) and (text[position].isspace() or text[position] == ";"):
                position += 1
        return calls or None

    def _call(self, body: str) -> tuple[str, str] | None:
        try:
            call = loads_unique(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or call.get("name") not in self.offered:
            return None
        arguments = call.get("parameters", call.get("arguments", {}))
        if not isinstance(arguments, dict):
            return None
        return call["name"], json.dumps(arguments, ensure_ascii=False)


class PythonicToolParser(_WholeCallParser):
    """``--tool-call-parser pythonic`` (module docstring)."""

    openers = ("[",)

    def _calls(self, text: str) -> list[tuple[str, str]] | None:
        try:
            tree = ast.parse(text, mode="eval").body
        except (SyntaxError, ValueError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = [self._call(element) for element in tree.elts]
        return None if any(call is None for call in calls) else calls

    def _call(self, node: ast.expr) -> tuple[str, str] | None:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                and node.func.id in self.offered and all(k.arg is not None for k in node.keywords)):
            return None
        try:  # literals only: nothing of the model's text is ever run
            arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
            return node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
