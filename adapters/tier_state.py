"""What every part of :class:`adapters.tier.AdapterTier` shares: its state and the helpers all parts call.

``AdapterTier`` is one object built from a few mixins, one concern each (``adapters.tier_loads``,
``tier_pins``, ``tier_served``, ``tier_stats``); :class:`TierState` is their common base. It holds no
state of its own: it names the attributes ``AdapterTier.__init__`` sets, so each mixin reads as the
code of the one object it is.

Locking is the tier's, unchanged by the split: one ``RLock`` (``_lock``) guards the version table,
the CPU cache, the slot pool and the load queue (they have no locks of their own). Every public
method of every mixin takes it; every private one (``_name``) is called with it held, except
``_load`` and ``_notify``, which run outside it (disk and Hub IO never run under the lock).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any, Callable

from adapters.cpu_cache import CPUCache
from adapters.errors import UnknownAdapterError
from adapters.load_queue import LoadQueue
from adapters.memory_source import MemorySnapshots
from adapters.slot_pool import SlotPool
from adapters.versions import READY, AdapterRef, AdapterVersion, VersionTable

__all__ = ["TierClosedError", "TierState", "logger"]

# the tier's one logger, for all its parts: records keep the name ("adapters.tier") they had before the split
logger = logging.getLogger("adapters.tier")


class TierClosedError(RuntimeError):
    """The adapter manager was closed: it starts no new loads (lora_runner raises EngineClosedError)."""


class TierState:
    """The attributes and shared helpers of an adapter tier (set by ``AdapterTier.__init__``)."""

    kind: str  # "LoRA" or "prompt adapter", for messages
    slots: Any  # the device slots (num_slots, write, clear, nbytes)
    _request_type: type
    _load_fn: Callable  # request -> validated weights
    _dummy_fn: Callable  # (name, size) -> weights, no file
    _on_settled: Callable[[], None] | None
    _lock: threading.RLock
    _versions: VersionTable
    _cpu: CPUCache
    _slot_pool: SlotPool
    _loads: LoadQueue
    _snapshots: MemorySnapshots | None
    _closed: bool
    _counts: Counter[str]  # cumulative events, see counts()

    def _check_request(self, request) -> None:
        if not isinstance(request, self._request_type):
            raise ValueError(f"expected a {self._request_type.__name__}, got {type(request).__name__}")

    def _check_open(self) -> None:
        if self._closed:
            raise TierClosedError(f"the {self.kind} tier is closed: no new adapters are loaded")

    def _get(self, ref: AdapterRef) -> AdapterVersion:
        with self._lock:
            version = self._versions.get(ref)
        if version is None:
            raise UnknownAdapterError(f"unknown {self.kind} version {ref} (removed, replaced or evicted)")
        return version

    def _serving(self, name: str) -> AdapterVersion | None:
        """The version that serves ``name`` now: the fallback while a replacement loads, else the newest."""
        return self._versions.serving(name)

    def _start_queued(self) -> None:
        """Start queued loads, oldest first, while the CPU bound allows (adapters.tier's docstring)."""
        if not self._closed:
            self._loads.start(len(self._cpu), is_live=lambda v: self._versions.get(v.ref) is v,
                              room=lambda num_running: self._cpu.has_room(num_running, self._loads.max_loading))

    def _notify(self) -> None:
        if self._on_settled is not None:
            self._on_settled()

    def _touch_cpu(self, version: AdapterVersion) -> None:
        if version.state == READY:  # only ready versions are cached; a load's end touches it anyway
            self._cpu.touch(version)

    def _trim_cpu(self) -> None:
        """Evict least recently used, unpinned, unheld versions while the CPU cache is over either bound."""
        for victim in self._cpu.trim():
            logger.debug("%s %r evicted from the CPU cache", self.kind, victim.ref.name)
            self._counts["cpu_evictions"] += 1
            self._versions.drop(victim)
