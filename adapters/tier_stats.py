"""What an adapter tier reports: memory, load state and cumulative events (a part of ``adapters.tier``).

Read-only: each report takes the tier's lock (adapters.tier_state) for a consistent snapshot and
changes nothing; the two bounds (``max_loading``, ``max_cpu_bytes``) are fixed at construction and
read without it, as they always were. The counters themselves are bumped where the events happen (loads, slot writes,
evictions); this part only reads them.
"""

from __future__ import annotations

from adapters.tier_state import TierState
from adapters.versions import LOADING

__all__ = ["TierStats"]


class TierStats(TierState):
    """Memory, load and event reports of an :class:`adapters.tier.AdapterTier`."""

    @property
    def max_loading(self) -> int:
        """Background loads in flight at most (beyond the CPU cache, see adapters.tier's docstring)."""
        return self._loads.max_loading

    def memory_stats(self) -> dict:
        """CPU bytes of cached adapters, device bytes of resident adapters' weights, counts."""
        with self._lock:
            cached, resident = list(self._cpu), self._slot_pool.resident()
            return dict(cpu_bytes=self._cpu.nbytes,
                        device_bytes_used=sum(v.weights.nbytes for v in resident),
                        device_bytes_allocated=self.slots.nbytes, num_cpu=len(cached), num_resident=len(resident))

    @property
    def cpu_bytes(self) -> int:
        """Bytes the CPU cache's adapters hold now (each storage once, adapters.cache_memory)."""
        with self._lock:
            return self._cpu.nbytes

    @property
    def max_cpu_bytes(self) -> int | None:
        """The CPU cache's byte bound (None: count only)."""
        return self._cpu.max_bytes

    def load_stats(self) -> dict[str, int]:
        """Versions now ``ready`` (cached), ``loading`` (load started) and ``queued`` (waiting for room)."""
        with self._lock:
            queued = sum(1 for v in self._versions if v.state == LOADING and not v.started)
            return dict(ready=len(self._cpu), loading=self._loads.num_running, queued=queued)

    def counts(self) -> dict[str, int]:
        """Cumulative events: slot_loads (writes into a device slot), slot_evictions (resident adapters
        evicted to make room), disk_loads / load_failures (background or add() loads), cpu_evictions."""
        with self._lock:
            return {key: self._counts[key] for key in
                    ("slot_loads", "slot_evictions", "disk_loads", "load_failures", "cpu_evictions")}
