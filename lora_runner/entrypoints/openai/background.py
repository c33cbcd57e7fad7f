"""Run the app with uvicorn in a background thread on 127.0.0.1 and a free port (tests, benchmarks)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from lora_runner.entrypoints.openai.connections import ConnectionLimits


class BackgroundServer:
    """``with BackgroundServer(app) as server: server.base_url`` -> "http://127.0.0.1:PORT".

    Leaving the block stops uvicorn (its lifespan shutdown runs, which shuts the engine down).
    Connections are served with `limits` (default: those of the app's ServerConfig, as ``serve`` does).
    """

    def __init__(self, app, startup_timeout: float = 60.0, shutdown_timeout: float = 10.0,
                 limits: ConnectionLimits | None = None) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        if limits is None:
            server_state = getattr(getattr(app, "state", None), "server", None)
            limits = server_state.config.connection_limits if server_state is not None else ConnectionLimits()
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=int(max(1, shutdown_timeout)),
                                **limits.uvicorn_settings())
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="uvicorn", daemon=True)
        self._startup_timeout, self._shutdown_timeout = startup_timeout, shutdown_timeout

    def start(self) -> BackgroundServer:
        """Start serving; RuntimeError when uvicorn does not come up in time."""
        self._thread.start()
        deadline = time.monotonic() + self._startup_timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Ask uvicorn to exit and wait for it."""
        self.server.should_exit = True
        self._thread.join(self._shutdown_timeout + 10)
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
