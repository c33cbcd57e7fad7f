"""Reading the output of a forced tool choice, which the structured-output path constrains (choice).

A named function: the whole output is the call's arguments (a JSON object of the function's
parameters schema), streamed as they come after a first delta with the call's id and name.
``required``: the output is a JSON array of {"name": ..., "arguments": {...}} (at least one), read
when it is complete, each call then sent as one delta. Output that is not such an array (possible
only where the constraint is not enforced) stays content, never an error; so does an array naming a
function that was not offered, or repeating a key.
"""

from __future__ import annotations

import json
from collections.abc import Collection

from lora_runner.entrypoints.openai.tool_calls.deltas import Extracted, ToolCallDelta, new_call_id
from lora_runner.entrypoints.openai.tool_calls.hermes_parser import loads_unique


class NamedFunctionParser:
    """The output is the arguments of a call to `name`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.num_calls = 0

    @property
    def called(self) -> bool:
        """Whether the call's first delta went out."""
        return self.num_calls > 0

    def feed(self, text: str, finished: bool = False) -> Extracted:
        """The call's first delta (on the first piece of output), then `text` as arguments."""
        out = Extracted()
        if not self.called and (text or finished):
            out.calls.append(ToolCallDelta(0, new_call_id(), self.name, ""))
            self.num_calls = 1
        if text:
            out.calls.append(ToolCallDelta(0, arguments=text))
        return out


class RequiredCallsParser:
    """The output is a JSON array of calls of the `offered` functions; read once it ends."""

    def __init__(self, offered: Collection[str]) -> None:
        self.offered = frozenset(offered)
        self.num_calls = 0
        self._text = ""

    @property
    def called(self) -> bool:
        """Whether the finished output held calls."""
        return self.num_calls > 0

    def feed(self, text: str, finished: bool = False) -> Extracted:
        """Nothing until the output ends; then its calls (or the text as content when it holds none)."""
        self._text += text
        if not finished:
            return Extracted()
        calls = parse_call_list(self._text, self.offered)
        if not calls:
            return Extracted(content=self._text)
        self.num_calls = len(calls)
        return Extracted(calls=[ToolCallDelta(index, new_call_id(), name, arguments)
                                for index, (name, arguments) in enumerate(calls)])


def parse_call_list(text: str, offered: Collection[str]) -> list[tuple[str, str]]:
    """(name, arguments JSON) of each call in a JSON array of {"name": one of `offered`, "arguments"};
    [] for anything else."""
    try:
        items = loads_unique(text)
    except ValueError:
        return []
    if not isinstance(items, list):
        return []
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or item["name"] not in offered \
                or not isinstance(item.get("arguments"), dict):
            return []
        calls.append((item["name"], json.dumps(item["arguments"], ensure_ascii=False)))
    return calls
