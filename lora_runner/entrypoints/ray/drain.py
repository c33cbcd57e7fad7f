"""Graceful shutdown of ``serve --num-replicas N``: every replica drains like the single process does.

On SIGINT/SIGTERM the driver (ray.app.serve_on_ray) sets a named :class:`DrainSignal` actor before it
tears Serve down. Each engine replica waits on it from a thread (:func:`watch_for_drain`); once set, it
answers new generations with 503, lets in-flight requests finish for ``--shutdown-timeout`` seconds,
aborts the rest (their streams end with ``finish_reason: "abort"`` and ``data: [DONE]``, through the
ingress as ever), then acknowledges. The driver waits for every replica's acknowledgement (bounded)
and only then shuts Serve down, which would otherwise cut open streams mid-body.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import ray

from lora_runner.entrypoints.openai.shutdown import ABORT_GRACE_S
from lora_runner.entrypoints.openai.state import ServerState

logger = logging.getLogger(__name__)

SIGNAL_NAME = "lora-runner-drain"
SIGNAL_NAMESPACE = "lora-runner"


@ray.remote(num_cpus=0)
class DrainSignal:
    """Set once by the driver; replicas wait on it and acknowledge when drained."""

    def __init__(self) -> None:
        self._set = asyncio.Event()
        self._drained = 0

    async def wait(self) -> None:
        """Return once the driver asked for the drain."""
        await self._set.wait()

    def set(self) -> None:
        """Ask every replica to drain."""
        self._set.set()

    def ack(self) -> None:
        """One replica has drained."""
        self._drained += 1

    def drained(self) -> int:
        """How many replicas have drained."""
        return self._drained


def create_drain_signal():
    """The driver's signal actor (named, so replicas started after it find it)."""
    return DrainSignal.options(name=SIGNAL_NAME, namespace=SIGNAL_NAMESPACE).remote()


def drain_replicas(signal, num_replicas: int, timeout: float) -> int:
    """Set `signal` and wait up to `timeout` s for `num_replicas` acknowledgements; how many came."""
    ray.get(signal.set.remote())
    deadline = time.monotonic() + timeout
    drained = ray.get(signal.drained.remote())
    while drained < num_replicas and time.monotonic() < deadline:
        time.sleep(0.1)
        drained = ray.get(signal.drained.remote())
    if drained < num_replicas:
        logger.warning("%d of %d replicas drained before the deadline", drained, num_replicas)
    return drained


def watch_for_drain(state: ServerState) -> threading.Thread | None:
    """Start the replica's watcher thread (None when no driver signal exists: the application was
    started some other way, as tests do, and Serve's own shutdown applies)."""
    try:
        signal = ray.get_actor(SIGNAL_NAME, namespace=SIGNAL_NAMESPACE)
    except ValueError:
        return None
    thread = threading.Thread(target=_drain_when_told, args=(state, signal), name="lora-runner-drain",
                              daemon=True)
    thread.start()
    return thread


def _drain_when_told(state: ServerState, signal) -> None:
    try:
        ray.get(signal.wait.remote())
    except ray.exceptions.RayError:  # the driver went away without a drain: nothing to do
        return
    drain_state(state)
    signal.ack.remote()


def drain_state(state: ServerState) -> None:
    """As GracefulServer.shutdown: 503 for new requests, wait for in-flight ones, abort the rest and
    give their streams time to send their last event (thread-safe engine calls only)."""
    state.draining = True
    engine, timeout = state.engine, state.config.shutdown_timeout
    if not _wait_idle(engine, timeout):
        logger.warning("aborting %d requests still in flight after %.1f s", engine.num_in_flight(), timeout)
        engine.abort_all()
        _wait_idle(engine, ABORT_GRACE_S)


def _wait_idle(engine, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while engine.num_in_flight() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not engine.num_in_flight()
