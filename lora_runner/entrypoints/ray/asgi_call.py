"""Drive an ASGI app in process: one HTTP request in, its response head and body chunks out.

Used by the Ray Serve engine replicas to run the single-process app on a forwarded request. When
the consumer stops early (its client went away, Serve cancelled the call) the app sees
``http.disconnect``, so its generation is aborted as it is for a direct client.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

SHUTDOWN_WAIT_S = 10.0  # how long an app that was told of a disconnect gets to wind down


def _scope(method: str, path: str, headers: list[tuple[str, str]]) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
            "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
            "server": ("127.0.0.1", 0), "client": ("127.0.0.1", 0)}


async def call_asgi(app, method: str, path: str, headers: list[tuple[str, str]],
                    body: bytes) -> AsyncIterator[dict | bytes]:
    """Yield ``{"status", "headers"}`` (headers as str pairs), then the body's non-empty chunks.
    The app's exception, if it raises before finishing the response, propagates."""
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    task = asyncio.ensure_future(app(_scope(method, path, headers), receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while True:
            message = await messages.get()
            if message is None:
                task.result()  # the app's error, if any
                return
            if message["type"] == "http.response.start":
                yield {"status": message["status"],
                       "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()
        if not task.done():
            done, _ = await asyncio.wait({task}, timeout=SHUTDOWN_WAIT_S)
            if not done:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
