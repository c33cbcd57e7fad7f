"""Connection limits below the app: a header deadline, a header size bound and a connection cap.

uvicorn (0.54) has no header read timeout: ``timeout_keep_alive`` only starts after a response, and
``limit_concurrency`` answers 503 once a request's headers are complete, so connections that never
finish their headers hold a file descriptor each until the process runs out (the slowloris attack).
``protocol_class`` wraps uvicorn's own HTTP protocol (httptools or h11, whichever uvicorn picks) with:

- a header deadline: a connection whose request headers are not complete ``header_timeout`` seconds
  after it opened, or after the first byte of its next request, is closed;
- a header size bound: more than ``max_header_bytes`` received before the headers end closes it;
- a connection cap: past ``max_connections`` open connections, the oldest one with no request in
  progress (still sending headers, or idle between keep-alive requests) is closed to make room, so
  clients that never finish cannot keep a new client out. When every connection has a request in
  progress, uvicorn's ``limit_concurrency`` (set to ``max_connections + 1``) answers 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from uvicorn.protocols.http.auto import AutoHTTPProtocol

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectionLimits:
    """Per-server connection limits (validated on construction, ValueError). The defaults keep the
    open connections well under the usual open-file limit of 1024 (``ulimit -n``)."""

    max_connections: int = 512
    header_timeout: float = 10.0  # seconds to send a request's headers
    max_header_bytes: int = 64 << 10

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if not self.header_timeout > 0:
            raise ValueError(f"header_timeout must be > 0 seconds, got {self.header_timeout}")
        if self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes must be >= 1024, got {self.max_header_bytes}")

    def uvicorn_settings(self) -> dict:
        """The keyword arguments of uvicorn.Config that apply these limits."""
        return {"http": protocol_class(self), "limit_concurrency": self.max_connections + 1,
                "h11_max_incomplete_event_size": self.max_header_bytes}


def protocol_class(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class with `limits` applied (uvicorn instantiates it per connection)."""
    return type("LimitedHTTPProtocol", (_HeaderDeadline, AutoHTTPProtocol), {"limits": limits})


class _HeaderDeadline:
    """Mixin over uvicorn's HTTP protocol. "Waiting for headers" is read from uvicorn's own state: no
    request cycle yet, or the last one's response is complete, and no new cycle since the deadline
    was armed (uvicorn makes a cycle exactly when a request's headers are complete)."""

    limits: ConnectionLimits

    def connection_made(self, transport) -> None:
        self._opened_at = time.monotonic()
        self._deadline = None
        self._header_bytes = 0
        super().connection_made(transport)
        self._arm()
        if len(self.connections) > self.limits.max_connections:
            self._make_room()

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self._idle():
            self._arm()
        if self._deadline is not None:
            self._header_bytes += len(data)
        super().data_received(data)
        if self._deadline is not None and self._waiting_for_headers():
            if self._header_bytes > self.limits.max_header_bytes:
                logger.warning("closing a connection that sent over %d header bytes", self.limits.max_header_bytes)
                self._close()
        else:
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _idle(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _waiting_for_headers(self) -> bool:
        return self._deadline is not None and self.cycle is self._armed_cycle

    def _arm(self) -> None:
        self._armed_cycle, self._header_bytes = self.cycle, 0
        self._deadline = self.loop.call_later(self.limits.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        if self._waiting_for_headers():
            logger.info("closing a connection that sent no complete headers in %.1f s", self.limits.header_timeout)
            self._close()
        self._deadline = None

    def _close(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self.transport.close()

    def _make_room(self) -> None:
        """Close the oldest other connection with no request in progress, if there is one."""
        idle = [c for c in self.connections if c is not self and isinstance(c, _HeaderDeadline) and c._idle()
                and not c.transport.is_closing()]
        if idle:
            oldest = min(idle, key=lambda c: c._opened_at)
            logger.warning("%d connections open: closing the oldest one without a request in progress",
                           len(self.connections))
            oldest._close()
            # uvicorn forgets a connection in connection_lost, a loop iteration later; forget it now, or the
            # newcomer's request could still find the server over limit_concurrency and get a 503
            self.connections.discard(oldest)
