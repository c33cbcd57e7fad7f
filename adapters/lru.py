"""One small LRU cache, used twice by an adapter tier: for the CPU cache and for the device slots.

As vLLM's ``LoRALRUCache``: entries in least-recently-used order, a capacity (entries, and optionally
bytes: each entry is put with its size, as the CPU cache puts an adapter's real bytes), and an ``on_remove``
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
        max_bytes: how many bytes (the sizes entries were put with) ``trim`` keeps, as ``capacity``;
            None: entries are bounded by count only.
    """

    def __init__(self, capacity: int, on_remove: Callable[[K, V], None] | None = None, max_bytes: int | None = None):
        if capacity < 0:
            raise ValueError(f"LRU capacity must be >= 0, got {capacity}")
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"LRU max_bytes must be positive or None, got {max_bytes}")
        self.capacity, self.max_bytes = capacity, max_bytes
        self._entries: OrderedDict[K, V] = OrderedDict()  # least recently used first
        self._sizes: dict[K, int] = {}  # key -> the bytes it was put with
        self.nbytes = 0  # the sum of _sizes
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

    def put(self, key: K, value: V, nbytes: int = 0) -> None:
        """Insert (or replace the value and size of) ``key`` as the most recently used entry of ``nbytes``."""
        self._entries[key] = value
        self._entries.move_to_end(key)
        self.nbytes += nbytes - self._sizes.get(key, 0)
        self._sizes[key] = nbytes

    def size(self, key: K) -> int:
        """The bytes ``key`` was put with (KeyError if absent)."""
        return self._sizes[key]

    def touch(self, key: K) -> None:
        """Mark ``key`` the most recently used entry (KeyError if absent: touch only what is cached)."""
        self._entries.move_to_end(key)

    def pop(self, key: K) -> V:
        """Remove ``key`` (KeyError if absent), call the on-remove hook, return its value."""
        value = self._entries.pop(key)
        self.nbytes -= self._sizes.pop(key)
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

    def over(self) -> bool:
        """Whether the entries are over the capacity or over ``max_bytes``."""
        return len(self._entries) > self.capacity or self.max_bytes is not None and self.nbytes > self.max_bytes

    def trim(self, keep: Callable[[K], bool]) -> list[K]:
        """Evict unprotected entries, least recently used first, while over capacity or ``max_bytes``;
        returns them in order.

        Stops short of the bounds when every remaining entry is protected by ``keep``."""
        evicted = []
        for key in list(self._entries):
            if not self.over():
                break
            if not keep(key):
                self.pop(key)
                evicted.append(key)
        return evicted
