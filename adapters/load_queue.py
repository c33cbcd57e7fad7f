"""The bounded queue of adapter loads: which waiting load starts when, so CPU memory stays bounded.

A queued load starts only while fewer than ``max_loading`` loads run and ``ready + running <
max_cpu + max_loading`` versions, so at most ``max_cpu + max_loading`` versions of one tier hold (or
are reading) weights; under a byte bound, the same rule holds in bytes too (adapters.cpu_cache). The
loads themselves run on the executor's worker threads (the manager's daemon pools, shared by both
tiers, routed by source); an ``add()`` caller runs its own load and counts as running through ``begin``.

Not thread-safe on purpose: the owning ``AdapterTier`` holds its lock around every call.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from adapters.versions import AdapterVersion


class LoadQueue:
    """Loads waiting for room, oldest first, and the count of loads running (the tier's lock guards it).

    Args:
        max_cpu: the tier's CPU cache capacity (adapters).
        max_loading: loads running at once, and how far beyond ``max_cpu`` they may reach.
        submit: hands a started version to a worker thread (which loads it and calls ``finish``).
    """

    def __init__(self, max_cpu: int, max_loading: int, submit: Callable[[AdapterVersion], None]):
        assert max_loading >= 1, f"max_loading must be >= 1, got {max_loading}"
        self.max_cpu, self.max_loading, self._submit = max_cpu, max_loading, submit
        self._waiting: deque[AdapterVersion] = deque()  # oldest first; may hold started or dropped versions
        self.num_running = 0  # loads started and not finished

    def push(self, version: AdapterVersion) -> None:
        """Queue the load of a new version."""
        self._waiting.append(version)

    def begin(self, version: AdapterVersion) -> None:
        """Count the load of ``version`` as running (a worker or an add() caller runs it now)."""
        assert not version.started, f"the load of {version.ref} started twice"
        version.started = True
        self.num_running += 1

    def finish(self) -> None:
        """A running load finished (ready, failed or discarded)."""
        assert self.num_running > 0, "finish() without a running load"
        self.num_running -= 1

    def start(self, num_ready: int, is_live: Callable[[AdapterVersion], bool],
              room: Callable[[int], bool] = lambda num_running: True) -> None:
        """Submit queued loads, oldest first, while the bound allows (module docstring); ``num_ready``
        versions hold weights now; ``room(num_running)``: whether the CPU cache's byte bound lets one
        more load start (adapters.cpu_cache.CPUCache.has_room). Skips versions that an add() caller
        took over or that were dropped."""
        while room(self.num_running) and self._waiting and self.num_running < self.max_loading and \
                num_ready + self.num_running < self.max_cpu + self.max_loading:
            version = self._waiting.popleft()
            if version.started or not is_live(version):
                continue
            self.begin(version)
            self._submit(version)

    def clear(self) -> None:
        """Forget every waiting load (close: they fail, and nothing starts them again)."""
        self._waiting.clear()
