"""A streamed response that gives up on a client that stopped reading.

While a client does not read, the server's socket buffers fill and each ASGI ``send`` waits (uvicorn's
flow control). A send that does not complete within the timeout ends the response: the body
iterator is closed (so what produces it is aborted) and the connection is dropped. Used by the
OpenAI routes' streams (generation.py) and by the Ray ingress, which relays a replica's stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from fastapi.responses import StreamingResponse

logger = logging.getLogger(__name__)


class SendTimeoutError(TimeoutError):
    """A streamed response's client did not take a chunk within the send timeout (it stopped reading)."""


def send_with_timeout(send: Callable, timeout: float) -> Callable:
    """`send` (an ASGI send), raising SendTimeoutError when one message is not taken within `timeout` s."""
    async def timed_send(message: dict) -> None:
        try:
            await asyncio.wait_for(send(message), timeout)
        except asyncio.TimeoutError:
            raise SendTimeoutError(f"the client took no data for {timeout} s") from None

    return timed_send


class TimedStreamingResponse(StreamingResponse):
    """A StreamingResponse whose sends wait at most `send_timeout` s; its body iterator is closed
    however the response ends (finished, client gone, send timed out)."""

    def __init__(self, content, send_timeout: float, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._send_timeout = send_timeout

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send_with_timeout(send, self._send_timeout))
        except SendTimeoutError as exc:  # the response started: all that is left is to drop the connection
            logger.warning("gave up a streamed response: %s", exc)
        finally:
            await self.body_iterator.aclose()
