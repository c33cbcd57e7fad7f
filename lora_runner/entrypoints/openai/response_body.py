"""A whole (non-streamed) response's JSON, built and serialised off the event loop, sent in chunks.

A scoring request (prompt_logprobs, echo with logprobs, n samples) can answer tens of MiB of JSON:
serialised on the event loop it stalls every other tenant's stream for a second, and held as one
string it doubles what the response's objects take. Here the body is written by ``json_pieces`` in
the prompt pool (ServerState.off_loop), CHUNK_BYTES at a time, each sent before the next is built; a
body of one chunk goes out whole (with its Content-Length), a longer one as a chunked response whose
sends give up after the stream send timeout, like a stream's.

What the n samples of a prompt share (its vLLM ``prompt_logprobs``) is a ``SharedJSON``: one object,
serialised once, spliced into each choice that carries it. The bytes a response may hold are charged
before it runs (ServerState.reserve_response, from ``response_bytes``) and refunded when its body ends.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from fastapi.responses import Response

from lora_runner.entrypoints.openai.send_timeout import TimedStreamingResponse

CHUNK_BYTES = 64 << 10  # about what one off-loop call serialises, and one send holds
# about the JSON of one logprob entry (a vLLM prompt_logprobs entry is ~60 bytes, a completions top entry ~25,
# a chat one with its bytes ~70): what reserve_response charges per entry
ENTRY_JSON_BYTES = 64


def _dumps(value: Any) -> str:
    """As Starlette's JSONResponse writes it."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


class SharedJSON:
    """A value several choices carry (a prompt's prompt_logprobs, one for its n samples): made by `make()` and
    serialised once, both on first use (in the thread that writes the body, not on the event loop)."""

    __slots__ = ("_make", "_value", "_text")

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._value: Any = None
        self._text: str | None = None

    @property
    def value(self) -> Any:
        """The value (made now if it was not yet)."""
        if self._make is not None:
            self._value, self._make = self._make(), None
        return self._value

    def text(self) -> str:
        """The value's JSON."""
        if self._text is None:
            self._text = _dumps(self.value)
        return self._text

    def __eq__(self, other: object) -> bool:
        return self.value == (other.value if isinstance(other, SharedJSON) else other)

    __hash__ = None


class LazyArray:
    """A JSON array whose items are made one at a time as the body is written (a response's choices: each
    choice's logprobs objects exist only while it is serialised)."""

    def __init__(self, make: Callable[[Any], Any], sources: Iterable) -> None:
        self.make, self.sources = make, sources

    def __iter__(self) -> Iterator:
        return map(self.make, self.sources)


def json_pieces(value: Any, dumps: Callable[[Any], str] = _dumps) -> Iterator[str]:
    """`value`'s JSON text in pieces: dicts and LazyArrays are walked (a response, its choices, their logprobs
    objects: a handful of levels), a SharedJSON is spliced as its one text, anything else is one `dumps`."""
    if isinstance(value, SharedJSON):
        yield value.text()
    elif isinstance(value, dict):
        yield "{"
        for position, (key, item) in enumerate(value.items()):
            yield ("," if position else "") + dumps(key) + ":"
            yield from json_pieces(item, dumps)
        yield "}"
    elif isinstance(value, LazyArray):
        yield "["
        for position, item in enumerate(value):
            if position:
                yield ","
            yield from json_pieces(item, dumps)
        yield "]"
    else:
        yield dumps(value)


def dumps(value: Any) -> str:
    """`value`'s whole JSON (SharedJSON and LazyArray included)."""
    return "".join(json_pieces(value))


def body_chunks(build: Callable[[], Any]) -> Iterator[bytes]:
    """The JSON of `build()` (called on the first next()) as UTF-8 chunks of about CHUNK_BYTES."""
    pending: list[str] = []
    size = 0
    for piece in json_pieces(build()):
        pending.append(piece)
        size += len(piece)
        if size >= CHUNK_BYTES:
            yield "".join(pending).encode()
            pending, size = [], 0
    if pending:
        yield "".join(pending).encode()


async def whole_response(off_loop: Callable, build: Callable[[], Any], headers: dict, send_timeout: float,
                         on_end: Callable[[], None]) -> Response:
    """The response whose body is build()'s JSON, every piece of it made by `off_loop` (ServerState.off_loop).
    on_end: called once the body was sent or given up (the reserved bytes' refund)."""
    chunks = body_chunks(build)
    try:
        first = await off_loop(next, chunks, None)
        second = None if first is None else await off_loop(next, chunks, None)
    except BaseException:
        on_end()
        raise
    if second is None:  # one chunk: sent whole, with its length
        on_end()
        return Response(first or b"", media_type="application/json", headers=headers)

    async def rest():
        try:
            yield first
            yield second
            while (chunk := await off_loop(next, chunks, None)) is not None:
                yield chunk
        finally:
            on_end()

    return _EndingResponse(rest(), on_end, send_timeout, media_type="application/json", headers=headers)


class _EndingResponse(TimedStreamingResponse):
    """Calls `on_end` however the response ends, also when the client was gone before the body started."""

    def __init__(self, content, on_end: Callable[[], None], send_timeout: float, **kwargs) -> None:
        super().__init__(content, send_timeout, **kwargs)
        self._on_end = on_end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_end()
