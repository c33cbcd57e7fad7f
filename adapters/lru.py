"""One small LRU cache, used twice by an adapter tier: for the CPU cache and for the device slots.

As vLLM's ``LoRALRUCache``: entries in least-recently-used order, a capacity, and an ``on_remove``
hook called for every entry that leaves (evicted or removed), so the owner frees what the entry
held (CPU tensors, a device slot) in one place. Unlike a plain LRU it never evicts by itself:
eviction asks the caller which entries to keep (pinned, held by a request, needed this step), as
SGLang's pluggable eviction policy does.

Not thread-safe on purpose: the owning ``AdapterTier`` holds its lock around every call.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Generic, Iterator, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LRUCache(Generic[K, V]):
    """Entries ``key -> value`` in least-recently-used order (no lock: the owner's lock guards it).

    Args:
        capacity: how many entries ``trim`` keeps (entries that ``keep`` protects may exceed it).
        on_remove: called as ``on_remove(key, value)`` after an entry left, whether by ``pop``,
            ``discard`` or ``trim``.
    """

    def __init__(self, capacity: int, on_remove: Callable[[K, V], None] | None = None):
        if capacity < 0:
            raise ValueError(f"LRU capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[K, V] = OrderedDict()  # least recently used first
        self._on_remove = on_remove

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[K]:
        """Keys, least recently used first (a snapshot: the caller may pop while iterating)."""
        return iter(list(self._entries))

    def values(self) -> list[V]:
        """Values, least recently used first."""
        return list(self._entries.values())

    def put(self, key: K, value: V) -> None:
        """Insert (or replace the value of) ``key`` as the most recently used entry."""
        self._entries[key] = value
        self._entries.move_to_end(key)

    def touch(self, key: K) -> None:
        """Mark ``key`` the most recently used entry (KeyError if absent: touch only what is cached)."""
        self._entries.move_to_end(key)

    def pop(self, key: K) -> V:
        """Remove ``key`` (KeyError if absent), call the on-remove hook, return its value."""
        value = self._entries.pop(key)
        if self._on_remove is not None:
            self._on_remove(key, value)
        return value

    def discard(self, key: K) -> None:
        """Remove ``key`` if present (through the hook, as ``pop``)."""
        if key in self._entries:
            self.pop(key)

    def victims(self, count: int, keep: Callable[[K], bool]) -> list[K]:
        """Up to ``count`` keys, least recently used first, that ``keep`` does not protect; removes none."""
        if count <= 0:
            return []
        found = []
        for key in self._entries:
            if not keep(key):
                found.append(key)
                if len(found) == count:
                    break
        return found

    def trim(self, keep: Callable[[K], bool]) -> list[K]:
        """Evict unprotected entries, least recently used first, while over capacity; returns them in order.

        Stops short of the capacity when every remaining entry is protected by ``keep``."""
        evicted = self.victims(len(self._entries) - self.capacity, keep)
        for key in evicted:
            self.pop(key)
        return evicted
