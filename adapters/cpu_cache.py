"""The CPU cache of one adapter tier: its ready versions, bounded by count and by the bytes they hold.

A version is put with the real bytes of its weights (``weights.nbytes``: each storage once,
adapters.cache_memory), so ``max_bytes`` bounds what the cached adapters hold, whatever their sizes:
a mixture of experts' expert LoRA holds every expert's A and B (1.6 GiB for Qwen3-30B-A3B at rank 16
in bf16), where a dense model's holds a few MiB. Entries held by a request or pinned are never
evicted; the least recently used of the others go first, while the cache is over either bound.

Three rules keep the byte bound an operator's bound that no tenant can push memory past, and keep
the tier from stalling under it:

- an adapter that alone holds more than ``max_bytes`` is refused (:class:`CPUCacheBoundError`,
  naming the setting) when its load ends; the requests for it fail, the others go on;
- a queued load starts only while the cached bytes plus the loads running, each counted at one
  entry's share of the bound (``max_bytes / max_entries``), stay under ``max_bytes`` plus
  ``max_loading`` shares (``has_room``): adapters.load_queue's count rule, in bytes. The cache
  trims evictable entries down to ``max_bytes`` first, so only adapters held by requests (which
  release them) ever hold a load back. Under the default bound (``max_entries`` adapters of the
  largest size, adapters.slot_memory.cpu_cache_bytes) no adapter is larger than a share, so this
  never holds back a load the count rule lets start: a vLLM setup runs as before;
- pins may hold less than ``max_bytes`` together (``check_pin``), so there is always room to load;
  a replacement that would inherit a pin (adapters.tier: ``publish``, a load that takes over its
  name, ``add_dummy``) is checked again with its own bytes in place of the version it replaces
  (``check_inherited_pin``), and refused when the pins would reach the bound: the old version keeps
  serving, pinned.

Counted elsewhere: an in-memory adapter's request (adapters.memory_source) keeps its snapshot of the
trainer's tensors while its name is served from it or a live version was made from it, whether its
weights are cached or not; those snapshots are bounded together by ``max_memory_adapter_bytes``
(adapters.memory_source.MemorySnapshots). A cached version's weights may be its snapshot's very
tensors (same dtype): then the same storage is counted in both bounds, and held once.

Not thread-safe on purpose: the owning ``AdapterTier`` holds its lock around every call.
"""

from __future__ import annotations

from typing import Callable, Iterator

from adapters.errors import AdapterCapacityError, CPUCacheBoundError
from adapters.lru import LRUCache
from adapters.versions import AdapterVersion


class CPUCache:
    """Ready versions of one tier in LRU order, with the bytes their weights hold (the tier's lock guards it).

    Args:
        kind: "LoRA" or "prompt adapter", for messages.
        max_entries: how many versions it keeps (protected ones may exceed it).
        max_bytes: how many bytes of weights it keeps (None: bounded by count only).
        on_remove: called with each version that leaves the cache (the tier frees its slot and weights).
        setting: the name of the setting ``max_bytes`` comes from, for messages.
    """

    def __init__(self, kind: str, max_entries: int, max_bytes: int | None, on_remove: Callable[[AdapterVersion], None],
                 setting: str = "max_cpu_lora_bytes"):
        self.kind, self.setting = kind, setting
        self._lru: LRUCache[AdapterVersion, None] = LRUCache(max_entries, lambda version, _: on_remove(version),
                                                             max_bytes=max_bytes)

    @property
    def max_bytes(self) -> int | None:
        """The byte bound (None: count only)."""
        return self._lru.max_bytes

    @property
    def nbytes(self) -> int:
        """Bytes the cached versions' weights hold now."""
        return self._lru.nbytes

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, version) -> bool:
        return version in self._lru

    def __iter__(self) -> Iterator[AdapterVersion]:
        """Cached versions, least recently used first (a snapshot)."""
        return iter(self._lru)

    def size(self, version: AdapterVersion) -> int:
        """Bytes a cached ``version``'s weights hold (0 when it is not cached)."""
        return self._lru.size(version) if version in self._lru else 0

    def check_fits(self, name: str, nbytes: int) -> None:
        """CPUCacheBoundError when an adapter of ``nbytes`` could never be cached under ``max_bytes``."""
        if self.max_bytes is not None and nbytes > self.max_bytes:
            raise CPUCacheBoundError(
                f"{self.kind} {name!r}: its weights hold {nbytes} bytes, more than the whole CPU cache may hold "
                f"({self.setting}={self.max_bytes}); raise {self.setting} or serve a smaller adapter")

    def put(self, version: AdapterVersion, nbytes: int) -> None:
        """Cache ``version`` (ready; its weights hold ``nbytes``) as the most recently used."""
        self._lru.put(version, None, nbytes)

    def touch(self, version: AdapterVersion) -> None:
        """Mark a cached ``version`` the most recently used."""
        self._lru.touch(version)

    def discard(self, version: AdapterVersion) -> None:
        """Remove ``version`` if cached (through the on-remove hook)."""
        self._lru.discard(version)

    def trim(self) -> list[AdapterVersion]:
        """Evict least recently used versions neither held nor pinned while over either bound; returns them."""
        return self._lru.trim(keep=_protected)

    def has_room(self, num_running: int, max_loading: int) -> bool:
        """Whether another load may start beside ``num_running`` loads, of at most ``max_loading``
        (the byte rule in the module docstring)."""
        if self.max_bytes is None:
            return True
        share = self.max_bytes / max(self._lru.capacity, 1)
        return self.nbytes + num_running * share < self.max_bytes + max_loading * share

    def check_pin(self, version: AdapterVersion) -> None:
        """AdapterCapacityError when pinning ``version`` too would leave the pins ``max_bytes`` or more,
        so that no other adapter could ever load (a version not cached yet counts 0 bytes)."""
        if self.max_bytes is None or version.pinned:
            return
        pinned = sum(self._lru.size(v) for v in self._lru if v.pinned or v is version)
        if pinned >= self.max_bytes:
            raise AdapterCapacityError(
                f"cannot pin {self.kind} {version.ref.name!r}: the pinned {self.kind}s would hold {pinned} bytes, "
                f"leaving no room in the CPU cache ({self.setting}={self.max_bytes}) for any other")

    def check_inherited_pin(self, name: str, nbytes: int, replaced: AdapterVersion | None,
                            new: AdapterVersion | None = None) -> None:
        """AdapterCapacityError when a new version of ``name`` (``new``, if it is already cached; its weights
        hold ``nbytes``) taking over the pin of ``replaced`` would leave the pins ``max_bytes`` or more, as
        ``check_pin`` refuses a pin: the replacement is refused, so that a larger update cannot slip past the
        bound that a pin of the same weights would have met."""
        if self.max_bytes is None:
            return
        others = sum(self._lru.size(v) for v in self._lru if v.pinned and v is not replaced and v is not new)
        if others + nbytes >= self.max_bytes:
            raise AdapterCapacityError(
                f"cannot replace pinned {self.kind} {name!r}: the new version holds {nbytes} bytes, so the pinned "
                f"{self.kind}s would hold {others + nbytes}, leaving no room in the CPU cache "
                f"({self.setting}={self.max_bytes}) for any other; unpin it first or raise {self.setting}")


def _protected(version: AdapterVersion) -> bool:
    """Held by a live request or pinned: never evicted."""
    return version.holders > 0 or version.pinned
