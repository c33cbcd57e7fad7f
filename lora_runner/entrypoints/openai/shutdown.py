"""Graceful shutdown on SIGTERM/SIGINT: stop accepting, let in-flight requests finish for a while,
then abort the rest so their streams end with finish_reason "abort" and ``data: [DONE]``.

uvicorn's own shutdown would instead cut open streams mid-body after its grace period; this runs
first, then uvicorn's (which finds nothing left) and the app's lifespan (which closes the engine).
"""

from __future__ import annotations

import logging

import uvicorn

from lora_runner.entrypoints.openai.state import ServerState

logger = logging.getLogger(__name__)

ABORT_GRACE_S = 2.0  # time aborted streams get to send their last chunk


class GracefulServer(uvicorn.Server):
    """A uvicorn.Server that drains `state`'s engine before shutting down."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    async def shutdown(self, sockets=None) -> None:
        """Stop listening, drain (503 for new requests meanwhile), abort what is left, then uvicorn's."""
        for server in getattr(self, "servers", []):
            server.close()
        self.state.draining = True
        engine, timeout = self.state.engine, self.state.config.shutdown_timeout
        if not await engine.drain(timeout):
            logger.warning("aborting %d requests still in flight after %.1f s", engine.num_in_flight(), timeout)
            engine.abort_all()
            await engine.drain(ABORT_GRACE_S)
        await super().shutdown(sockets)
