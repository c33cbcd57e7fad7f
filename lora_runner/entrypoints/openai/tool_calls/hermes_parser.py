"""Hermes-style tool calls out of model text, incrementally: ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`` (one or several), as the Qwen2.5 and SmolLM2 chat templates ask models to write them.

Text outside the markup is content; whitespace right before a call (and trailing whitespace, once a
call was made) is dropped, so content never ends in the newline that separated it from the markup. A
call whose JSON is not a {"name": str, "arguments": object or str} stays in the content as the model
wrote it, markup included: malformed output is shown, never an error. So does a call of a function
the request did not offer, and one whose JSON repeats a key (``"name"`` twice: JSON readers disagree on
which one counts): an agent runs what it gets as ``tool_calls``, so only offered names go there.

The parser sees the text in whatever pieces the engine hands over (one token, or many merged when a
client reads slowly) and answers the same calls and content for every split of a well-formed output.
Once a call's ``{"name": "...", "arguments": `` prefix has arrived its first delta (id, name) goes out,
and its arguments follow as they arrive, held back only by the call's closing brace. A call that turns
out malformed after that point cannot be taken back from a stream: what was sent stays sent (logged);
the non-streamed response feeds the whole output at once (choice.WholeOutput), so there it is content.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Collection

from lora_runner.entrypoints.openai.tool_calls.deltas import Extracted, ToolCallDelta, new_call_id

logger = logging.getLogger(__name__)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# the start of a call in the order the Hermes templates write it: name first, then the arguments object
_PREFIX = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (held back: it may be the tag)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def loads_unique(text: str):
    """json.loads, but ValueError for an object that repeats a key (JSON readers disagree on which wins)."""
    return json.loads(text, object_pairs_hook=_unique_keys)


def unique_keys_decoder() -> json.JSONDecoder:
    """A JSONDecoder (for raw_decode: a value followed by more text) that refuses repeated keys, as loads_unique."""
    return json.JSONDecoder(object_pairs_hook=_unique_keys)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    found = dict(pairs)
    if len(found) != len(pairs):
        raise ValueError("an object repeats a key")
    return found


def call_arguments(body: str, offered: Collection[str]) -> tuple[str, str] | None:
    """(name, arguments as a JSON string) of one call's JSON text; None when it is no valid call of
    an `offered` function (or its JSON repeats a key).

    The arguments are the model's own text of the object when the call starts with the name (as
    streamed), else (another key order, extra keys) the object re-serialized."""
    try:
        call = loads_unique(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or call["name"] not in offered:
        return None
    arguments = call.get("arguments", call.get("parameters"))
    if isinstance(arguments, str):
        return call["name"], arguments
    if not isinstance(arguments, dict):
        return None
    raw = _raw_arguments(body)
    if raw is not None and _loads(raw) == arguments:
        return call["name"], raw
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def _raw_arguments(body: str) -> str | None:
    match = _PREFIX.match(body)
    if match is None:
        return None
    raw = body[match.end():].rstrip()
    return raw[:-1].rstrip() if raw.endswith("}") else None


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


class StreamingToolParser:
    """What the parsers that stream content up to a call's markup share (hermes, qwen3_xml, mistral):
    the offered names, the calls found, the text not handled yet, and content's trailing whitespace,
    held back until more content follows, so content never ends in the whitespace before a call.
    offered: the names of the functions the request offered (only these become calls)."""

    def __init__(self, offered: Collection[str]) -> None:
        self.offered = frozenset(offered)
        self.num_calls = 0
        self._buffer = ""  # text not handled yet: a possible start of the markup, or a call
        self._held_space = ""  # trailing content whitespace, sent once more content follows
        self._space_before = ""  # the whitespace right before the call's markup (content if the call is malformed)

    @property
    def called(self) -> bool:
        """Whether any tool call was found."""
        return self.num_calls > 0

    def _content_until(self, out: Extracted, tag: str, finished: bool) -> int | None:
        """The buffer's content up to `tag` into `out`: the tag's index in the buffer (the whitespace
        before it set aside in _space_before), or None when it is absent (the buffer then keeps only
        an end that may start the tag, nothing once `finished`)."""
        start = self._buffer.find(tag)
        if start < 0:
            keep = 0 if finished else partial_tag(self._buffer, tag)
            self._content(out, self._buffer[:len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return None
        self._content(out, self._buffer[:start])
        self._space_before, self._held_space = self._held_space, ""  # dropped, unless the call is malformed
        return start

    def _content(self, out: Extracted, text: str) -> None:
        text = self._held_space + text
        kept = text.rstrip()
        self._held_space = text[len(kept):]
        out.content += kept


class HermesToolParser(StreamingToolParser):
    """Feeds of one choice's text -> Extracted (content, tool-call deltas); see the module docstring.
    offered: the names of the functions the request offered (only these become calls)."""

    def __init__(self, offered: Collection[str]) -> None:
        super().__init__(offered)
        self._inside = False  # the buffer holds the open call's body
        self._streamed: ToolCallDelta | None = None  # the open call's first delta, once sent
        self._sent_arguments = ""  # what was sent of the open call's arguments

    def feed(self, text: str, finished: bool = False) -> Extracted:
        """What `text` (the next piece of the output) adds; `finished`: the output ends here."""
        out = Extracted()
        self._buffer += text
        while self._close_call(out, finished) if self._inside else self._open_call(out, finished):
            pass
        if finished:
            if not self.called:
                out.content += self._held_space
            self._held_space = ""
        return out

    def _open_call(self, out: Extracted, finished: bool) -> bool:
        """Content up to the next ``<tool_call>``; True when one opened (the buffer then holds its body)."""
        start = self._content_until(out, OPEN, finished)
        if start is None:
            return False
        self._buffer = self._buffer[start + len(OPEN):]
        self._inside, self._streamed, self._sent_arguments = True, None, ""
        return True

    def _close_call(self, out: Extracted, finished: bool) -> bool:
        """The open call up to its ``</tool_call>`` (or the end); True when it closed."""
        end = self._buffer.find(CLOSE)
        if end < 0 and not finished:
            keep = partial_tag(self._buffer, CLOSE)
            self._stream_arguments(out, self._buffer[:len(self._buffer) - keep])
            return False
        body = self._buffer if end < 0 else self._buffer[:end]
        self._buffer = "" if end < 0 else self._buffer[end + len(CLOSE):]
        self._inside = False
        parsed = self._parsed(body)
        if parsed is None:
            if self._streamed is not None:
                logger.warning("tool call %s turned out malformed after its start was streamed", self._streamed.id)
                return True
            self._content(out, self._space_before + OPEN + body + ("" if end < 0 else CLOSE))
            return True
        name, arguments = parsed
        if self._streamed is None:
            out.calls.append(ToolCallDelta(self.num_calls, new_call_id(), name, arguments))
            self.num_calls += 1
        elif not arguments.startswith(self._sent_arguments):
            logger.warning("tool call %s: its arguments were re-serialized after part of them was streamed",
                           self._streamed.id)
        elif len(arguments) > len(self._sent_arguments):
            out.calls.append(ToolCallDelta(self._streamed.index, arguments=arguments[len(self._sent_arguments):]))
        return True

    def _parsed(self, body: str) -> tuple[str, str] | None:
        """(name, arguments JSON) of one closed call's body; None: it is content."""
        return call_arguments(body, self.offered)

    def _stream_arguments(self, out: Extracted, body: str) -> None:
        """The open call's first delta once its name is known, then its arguments as they arrive."""
        match = _PREFIX.match(body)
        if match is None:
            return
        if self._streamed is None:
            name = _loads(f'"{match.group(1)}"')
            if name not in self.offered:  # stays in the buffer: content once the call closes
                return
            self._streamed = ToolCallDelta(self.num_calls, new_call_id(), name, "")
            self.num_calls += 1
            out.calls.append(self._streamed)
        raw = body[match.end():].rstrip()
        ready = raw[:-1].rstrip() if raw.endswith("}") else raw  # that brace may close the call, not the arguments
        if len(ready) > len(self._sent_arguments):
            out.calls.append(ToolCallDelta(self._streamed.index, arguments=ready[len(self._sent_arguments):]))
            self._sent_arguments = ready
