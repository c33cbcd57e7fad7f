"""Runtime adapter loads on their own threads: bounded in number, per tenant, and in time.

A load reads a tenant's files; run in the server's shared threadpool (where sync dependencies such
as authentication also run), loads that hang would stop every route of every tenant. Here each load
runs on a daemon thread of its own, at most ``max_loads`` at once and ``max_loads_per_tenant`` for one
tenant (more is a 503 / 429 answered at once, nothing queued), and the caller waits at most
``timeout`` seconds (then 504). A thread cannot be killed: a load past its deadline keeps counting
against its tenant and the total until it really ends, so a tenant cannot pile up stuck threads.
A load is handed ``claim``, which it calls right before its result becomes visible (under the lock
that publishes it): True once and for all when its caller still waits (the caller then waits for the
result past the deadline, which only the publishing itself can delay), False when the caller was
already answered 504 (the load must then change nothing: nothing to undo).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from lora_runner.entrypoints.openai.errors import APIError

logger = logging.getLogger(__name__)


class _Load:
    """One load's outcome, handed from its thread to the waiting route; claimed or abandoned, never both."""

    def __init__(self) -> None:
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.claimed = self.abandoned = False


class LoadExecutor:
    """Runs runtime adapter loads (see module docstring). Thread-safe; ``run`` is awaited on the event loop."""

    def __init__(self, max_loads: int, max_loads_per_tenant: int, timeout: float) -> None:
        if max_loads < 1 or max_loads_per_tenant < 1 or not timeout > 0:
            raise ValueError(f"max_loads and max_loads_per_tenant must be >= 1 and timeout > 0, got {max_loads}, "
                             f"{max_loads_per_tenant}, {timeout}")
        self.max_loads, self.max_loads_per_tenant, self.timeout = max_loads, max_loads_per_tenant, timeout
        self._lock = threading.Lock()
        self._running = 0
        self._per_tenant: Counter[str] = Counter()

    @property
    def running(self) -> int:
        """Loads whose threads have not ended (those past their deadline included)."""
        with self._lock:
            return self._running

    async def run(self, tenant: str, load: Callable[[Callable[[], bool]], Any], capped: bool = True) -> Any:
        """``load(claim)`` on a thread of its own (see the module docstring); its result, or what it raised.
        capped: the per-tenant cap applies (False for the operator, whose loads only the total bounds: a
        single-tenant server loading several adapters at once, as vLLM's tests do, is not throttled).

        Raises:
            APIError: 429 when ``tenant`` already runs ``max_loads_per_tenant`` loads (capped), 503 when
                ``max_loads`` run in all, 504 when the load did not end within ``timeout`` seconds.
        """
        with self._lock:
            if capped and self._per_tenant[tenant] >= self.max_loads_per_tenant:
                raise APIError(429, f"this key already runs {self.max_loads_per_tenant} adapter load(s); wait for "
                               "them to finish", "rate_limit_exceeded")
            if self._running >= self.max_loads:
                raise APIError(503, "the server runs its most adapter loads at once; retry later", "server_busy")
            self._running += 1
            self._per_tenant[tenant] += 1
        job = _Load()
        threading.Thread(target=self._work, args=(tenant, load, job), name=f"runtime-load-{tenant}",
                         daemon=True).start()
        result = asyncio.wrap_future(job.future)
        try:  # shield: a timeout or a client that went away must not cancel the thread's future
            return await asyncio.wait_for(asyncio.shield(result), self.timeout)
        except asyncio.TimeoutError:
            with self._lock:
                job.abandoned = not job.claimed and not job.future.done()
            if not job.abandoned:  # it ended, or publishes its result, just now
                return await result
            logger.warning("a runtime adapter load of tenant %r passed its %g s deadline; abandoned", tenant,
                           self.timeout)
            raise APIError(504, f"the adapter load did not finish within {self.timeout:g} s", "load_timeout") from None

    def _work(self, tenant: str, load: Callable[[Callable[[], bool]], Any], job: _Load) -> None:
        def claim() -> bool:
            with self._lock:
                job.claimed = job.claimed or not job.abandoned
                return job.claimed

        try:
            result = load(claim)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting route, which maps it
            outcome = (False, exc)
        else:
            outcome = (True, result)
        with self._lock:
            self._running -= 1
            self._per_tenant[tenant] -= 1
            abandoned = job.abandoned
            if not abandoned:
                (job.future.set_result if outcome[0] else job.future.set_exception)(outcome[1])
        if abandoned:
            logger.info("an abandoned runtime adapter load of tenant %r ended (%s); nothing was published", tenant,
                        "loaded" if outcome[0] else f"failed: {outcome[1]!r}")
