"""What a tool-call extractor hands the response formatter: content text and tool-call deltas."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field


def new_call_id() -> str:
    """A fresh tool-call id in OpenAI's shape ("call_" + 24 hex digits)."""
    return f"call_{secrets.token_hex(12)}"


@dataclass
class ToolCallDelta:
    """A piece of one tool call of a choice, in OpenAI's streaming shape: the call's first delta carries
    its ``id`` and ``name`` (``arguments`` may be ""), later ones only ``arguments`` fragments."""

    index: int  # the call's position among the choice's calls
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def as_chunk(self) -> dict:
        """The delta as an element of a stream chunk's ``delta.tool_calls``."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Extracted:
    """What one piece of model text became: text for ``content`` and tool-call deltas."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


def join_calls(calls: list[ToolCallDelta], more: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """`calls` (one entry per call) with the deltas `more` folded in: arguments fragments appended."""
    by_index = {call.index: ToolCallDelta(call.index, call.id, call.name, call.arguments) for call in calls}
    for delta in more:
        call = by_index.get(delta.index)
        if call is None:
            by_index[delta.index] = ToolCallDelta(delta.index, delta.id, delta.name, delta.arguments)
        else:
            call.arguments += delta.arguments
    return [by_index[index] for index in sorted(by_index)]


def message_tool_calls(calls: list[ToolCallDelta]) -> list[dict]:
    """Whole calls (join_calls' result) as a message's ``tool_calls``."""
    return [{"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in calls]
