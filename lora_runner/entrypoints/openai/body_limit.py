"""ASGI middleware: refuse request bodies over a byte limit (413) before the app reads them.

A Content-Length over the limit is refused at once; a body without one (chunked) is read up to the
limit and refused as soon as it exceeds it. Accepted bodies are buffered and replayed to the app.
A route may have a limit of its own (``limit_for``: an adapter upload is bounded by the largest
adapter accepted, not by the bound of a JSON body).
"""

from __future__ import annotations

from collections.abc import Callable

from lora_runner.entrypoints.openai.errors import APIError


class BodyLimitMiddleware:
    """Wrap an ASGI app so that HTTP request bodies over `max_bytes` get a 413; `limit_for(path)` gives
    a route its own limit (None: `max_bytes`)."""

    def __init__(self, app, max_bytes: int, limit_for: Callable[[str], int | None] | None = None) -> None:
        self.app, self.max_bytes, self._limit_for = app, max_bytes, limit_for

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route_limit = None if self._limit_for is None else self._limit_for(scope.get("path", ""))
        max_bytes = self.max_bytes if route_limit is None else route_limit
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > max_bytes):
            return await self._refuse(scope, receive, send, max_bytes)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: let the app see it
                return await self.app(scope, _replay([message]), send)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > max_bytes:
                return await self._refuse(scope, receive, send, max_bytes)
            more = message.get("more_body", False)
        await self.app(scope, _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}],
                                      receive), send)

    async def _refuse(self, scope, receive, send, max_bytes: int) -> None:
        response = APIError(413, f"request body is larger than {max_bytes} bytes", "request_too_large").response()
        await response(scope, receive, send)


def _replay(messages: list[dict], then=None):
    """A receive() that returns `messages` first, then defers to `then` (disconnect notices)."""
    pending = list(messages)

    async def receive() -> dict:
        if pending:
            return pending.pop(0)
        if then is not None:
            return await then()
        return {"type": "http.disconnect"}

    return receive
