"""The adapter manager's loader threads: two small pools of daemon threads, chosen by where an adapter lives.

Background loads of both adapter kinds (adapters.tier) run here: adapters in local directories on
one pool, Hub downloads on the other, so a stalled or slow Hub never delays an adapter on disk. The
threads are daemons and ``shutdown()`` does not wait for them, so neither ``AdapterManager.close()``
nor process exit waits for a stalled download. Each pool has a lock of its own, taken inside a tier's
lock when the tier submits a load (never the other way round); a load itself runs with no lock held
(``AdapterTier._load`` takes the tier's lock only to publish its result).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Callable

__all__ = ["DaemonPool", "LoadPools"]

# the manager's logger: a crashed load's record keeps the name ("adapters.manager") it had before the move
logger = logging.getLogger("adapters.manager")


class DaemonPool:
    """A fixed number of daemon worker threads (started on demand) running submitted calls in order.

    Unlike ThreadPoolExecutor, whose workers the interpreter joins at exit, these threads never keep
    the process alive: a download stalled for minutes cannot delay close() or exit."""

    def __init__(self, num_workers: int, name: str):
        self._num_workers, self._name = num_workers, name
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable, arg) -> None:
        """Run ``fn(arg)`` on a worker (ignored after shutdown)."""
        with self._lock:
            if self._closed:
                return
            self._tasks.put((fn, arg))
            if len(self._threads) < self._num_workers:
                thread = threading.Thread(target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()

    def shutdown(self) -> None:
        """Drop queued calls and let idle workers exit; does not wait for a running call."""
        with self._lock:
            self._closed = True
            while not self._tasks.empty():
                self._tasks.get_nowait()
            for _ in self._threads:
                self._tasks.put(None)

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            fn, arg = task
            try:
                fn(arg)
            except BaseException:  # the tier's _load catches adapter errors; anything else is a bug
                logger.exception("background adapter load crashed")


class LoadPools:
    """Runs background loads on two pools, chosen by where the adapter lives: local directories on
    one, Hub repos on the other. A Hub download can stall for minutes; with one shared pool a few
    stalled downloads would hold every worker and delay adapters that are already on disk."""

    def __init__(self, load_workers: int, download_workers: int):
        if load_workers < 1 or download_workers < 1:
            raise ValueError(f"load_workers and download_workers must be >= 1, got {load_workers}, "
                             f"{download_workers}")
        self._local = DaemonPool(load_workers, "adapter-load")
        self._hub = DaemonPool(download_workers, "adapter-download")

    def submit(self, load: Callable, version) -> None:
        """Run ``load(version)`` on the pool matching ``version.request.path`` (local dir or Hub id)."""
        request = version.request
        local = request.root is not None or os.path.isdir(os.path.expanduser(request.path))
        (self._local if local else self._hub).submit(load, version)

    def shutdown(self) -> None:
        """Stop both pools without waiting."""
        for pool in (self._local, self._hub):
            pool.shutdown()
