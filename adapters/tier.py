"""The generic LRU adapter tier: a CPU cache and device slots, for LoRAs and prompt adapters alike.

One class, :class:`AdapterTier`, serves both kinds (``adapters.manager.AdapterManager`` builds
them); each kind brings its own loader (resolve + read + validate) and slot writer. Life of an
adapter version:

    acquire/prefetch/add -> "loading" (a worker thread resolves, reads, validates; no lock held)
                         -> "ready"   (in the CPU cache: LRU, max_cpu entries; pinned entries and
                                       entries held by live requests are never evicted, so the
                                       cache exceeds max_cpu only while more than that are in use)
                         -> resident  (activate() wrote it into a device slot; LRU among slots)
                         or "failed"  (the AdapterError is remembered while a request holds the ref)

A version is identified by an :class:`AdapterRef` (name, path, revision, version number). A request
with a known name but another (path, revision) creates a new version that the name then refers
to; requests holding the old ref keep its weights and slot until they release it, then the old
version is dropped. ``remove`` is deferred the same way. Memory held always equals what the
cached versions need: dropping a version frees its CPU tensors and its slot.

Thread-safety: user threads (acquire/add/prefetch/remove/pin) and the engine's step thread
(activate/release) share one lock; disk and Hub IO always run outside it.
"""

from __future__ import annotations

import copy
import itertools
from collections import Counter
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from adapters.errors import AdapterCapacityError, AdapterError, InvalidAdapterError, UnknownAdapterError

logger = logging.getLogger(__name__)

LOADING, READY, FAILED = "loading", "ready", "failed"


@dataclass(frozen=True)
class AdapterRef:
    """One version of a named adapter: what a request holds between acquire and release."""

    name: str
    path: str
    revision: str | None
    version: int  # unique per manager tier: re-adding the same source after removal is a new version


class _Version:
    """Internal state of one adapter version (guarded by the tier's lock)."""

    def __init__(self, ref: AdapterRef, request: Any):
        self.ref, self.request = ref, request
        self.state, self.error, self.weights = LOADING, None, None
        self.done = threading.Event()  # set once state leaves LOADING
        self.holders = 0  # live requests (acquire minus release)
        self.slot: int | None = None
        self.cpu_tick = self.slot_tick = 0  # last use, for LRU in each tier
        self.retired = False  # removed or replaced: dropped when holders reaches 0


class AdapterTier:
    """Two-tier LRU cache of one adapter kind (CPU cache of ``max_cpu`` entries, device slots).

    Args:
        kind: "LoRA" or "prompt adapter", for messages.
        request_type: the request class this tier accepts.
        load: request -> validated weights (resolve + read + validate; raises AdapterError).
        make_dummy: (name, size) -> weights with the right shapes, no file.
        slots: the device slots (``num_slots``, ``write(slot, weights)``, ``clear(slot)``, ``nbytes``).
        max_cpu: CPU cache capacity (adapters); pinned and held adapters are never evicted.
        executor: runs background loads: ``executor.submit(fn, version)`` with ``version.request`` the
            request being loaded (a ThreadPoolExecutor, or the manager's pools that route by source).
    """

    def __init__(self, kind: str, request_type: type, load: Callable, make_dummy: Callable, slots, max_cpu: int,
                 executor: ThreadPoolExecutor | Any):
        if max_cpu < slots.num_slots:
            raise ValueError(f"the {kind} CPU cache ({max_cpu}) must hold at least as many adapters as there are "
                             f"device slots ({slots.num_slots})")
        self.kind, self._request_type, self._load_fn, self._dummy_fn = kind, request_type, load, make_dummy
        self.slots, self._max_cpu, self._executor = slots, max_cpu, executor
        self._lock = threading.RLock()
        self._current: dict[str, _Version] = {}  # name -> the version the name refers to
        self._versions: dict[AdapterRef, _Version] = {}  # every live version (current or retired but held)
        self._slot_owner: list[_Version | None] = [None] * slots.num_slots
        self._pinned: set[str] = set()
        self._ids, self._ticks = itertools.count(), itertools.count(1)
        self._counts: Counter[str] = Counter()  # cumulative events, see counts()

    # ---- requests' side: acquire / release -------------------------------------------------------
    def acquire(self, request) -> AdapterRef:
        """A request starts using this adapter; starts a background load if it is not cached."""
        return self._acquire(request, background=True).ref

    def release(self, ref: AdapterRef) -> None:
        """A request using ``ref`` finished or was aborted; completes deferred removals/replacements."""
        with self._lock:
            version = self._versions.get(ref)
            if version is None or version.holders == 0:
                raise ValueError(f"release of {ref} without a matching acquire")
            version.holders -= 1
            if version.holders == 0:
                if version.retired or version.state == FAILED:
                    self._drop(version)
                else:
                    self._trim_cpu()

    def state(self, ref: AdapterRef) -> str:
        """The version's load state: "loading", "ready" or "failed"."""
        return self._get(ref).state

    def error(self, ref: AdapterRef) -> AdapterError | None:
        """The AdapterError a failed version raised while loading (None unless failed)."""
        return self._get(ref).error

    def size(self, ref: AdapterRef) -> int:
        """Rank (LoRA) or number of virtual tokens (prompt adapter) of a ready version."""
        version = self._get(ref)
        if version.state != READY:
            raise ValueError(f"{self.kind} {ref.name!r} is {version.state}, not ready")
        return version.weights.size()

    def lookup(self, name: str) -> AdapterRef | None:
        """The version ``name`` refers to now (None if unknown)."""
        with self._lock:
            version = self._current.get(name)
            return None if version is None else version.ref

    # ---- user side: add / prefetch / remove / pin ------------------------------------------------
    def add(self, request) -> AdapterRef:
        """Resolve, load and validate ``request`` into the CPU cache now (in the calling thread).

        Raises the adapter's AdapterError (not found, invalid, too large, unsupported, unsafe).
        """
        version = self._acquire(request, background=False)
        try:
            version.done.wait()
            with self._lock:
                if version.state == FAILED:  # a fresh exception per caller, chained to the loader's
                    raise copy.copy(version.error) from version.error
            return version.ref
        finally:
            self.release(version.ref)

    def prefetch(self, request) -> AdapterRef:
        """Start loading ``request`` in the background and return at once."""
        self._check_request(request)
        with self._lock:
            version, created = self._version_for(request)
            self._touch_cpu(version)
        if created:
            self._executor.submit(self._load, version)
        return version.ref

    def add_dummy(self, name: str, size: int) -> AdapterRef:
        """A ready adapter of the right shapes (rank or virtual tokens ``size``), no file; removable."""
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"dummy {self.kind} size must be a positive int, got {size!r}")
        weights = self._dummy_fn(name, size)
        with self._lock:
            if name in self._current:
                self._retire(self._current[name])
            version = _Version(AdapterRef(name, "<dummy>", None, next(self._ids)), None)
            version.state, version.weights = READY, weights
            version.done.set()
            self._register(version)
            self._touch_cpu(version)
            self._trim_cpu()
            return version.ref

    def remove(self, name: str) -> None:
        """Forget ``name``; deferred while requests hold it (they keep the weights they started with)."""
        with self._lock:
            version = self._current.get(name)
            if version is None:
                raise UnknownAdapterError(f"unknown {self.kind} {name!r}; known: {sorted(self._current)}")
            self._pinned.discard(name)
            if version.holders:
                logger.info("%s %r: removal deferred until %d request(s) release it", self.kind, name,
                            version.holders)
            self._retire(version)

    def pin(self, name: str) -> None:
        """Never evict ``name`` from the CPU cache, nor from its device slot once resident."""
        with self._lock:
            if name not in self._current:
                raise UnknownAdapterError(f"cannot pin unknown {self.kind} {name!r}")
            if name not in self._pinned and len(self._pinned) >= self._max_cpu:
                raise AdapterCapacityError(f"cannot pin {self.kind} {name!r}: {len(self._pinned)} adapters are "
                                           f"pinned already and the CPU cache holds {self._max_cpu}")
            self._pinned.add(name)
            if len(self._pinned) >= self.slots.num_slots > 0:
                logger.warning("%d %ss pinned with %d device slots: unpinned adapters may not fit in a step",
                               len(self._pinned), self.kind, self.slots.num_slots)

    def unpin(self, name: str) -> None:
        """Make ``name`` evictable again."""
        with self._lock:
            if name not in self._current and name not in self._pinned:
                raise UnknownAdapterError(f"cannot unpin unknown {self.kind} {name!r}")
            self._pinned.discard(name)
            self._trim_cpu()

    def list(self) -> list[str]:
        """Names of the CPU-cached adapters, least recently used first."""
        with self._lock:
            ready = [v for v in self._current.values() if v.state == READY]
            return [v.ref.name for v in sorted(ready, key=lambda v: v.cpu_tick)]

    # ---- engine side: activate -------------------------------------------------------------------
    def activate(self, refs: list[AdapterRef]) -> list[int]:
        """Make every ref resident in a device slot; returns the slot of each ref (same order).

        Only slots not needed by ``refs`` and not pinned are evicted (least recently used first),
        and nothing is evicted unless all of ``refs`` fit.

        Raises:
            AdapterCapacityError: more distinct refs than slots, or too many slots pinned.
            ValueError: a ref that is unknown or not ready (the scheduler must check ``state``).
        """
        with self._lock:
            versions = [self._get(ref) for ref in refs]
            for version in versions:
                if version.state != READY:
                    raise ValueError(f"cannot activate {self.kind} {version.ref.name!r}: it is {version.state}")
            needed = list(dict.fromkeys(versions))  # distinct, in order
            if len(needed) > self.slots.num_slots:
                raise AdapterCapacityError(f"a step needs {len(needed)} distinct {self.kind}s but there are only "
                                           f"{self.slots.num_slots} device slots")
            new = [v for v in needed if v.slot is None]
            free = [s for s, owner in enumerate(self._slot_owner) if owner is None]
            if len(new) > len(free):
                victims = sorted((v for v in self._slot_owner if v is not None and v not in needed
                                  and not self._is_pinned(v)), key=lambda v: v.slot_tick)
                if len(new) - len(free) > len(victims):
                    raise AdapterCapacityError(
                        f"a step needs {len(needed)} {self.kind}s but only {len(free) + len(victims)} of "
                        f"{self.slots.num_slots} device slots can be freed ({len(self._pinned)} pinned)")
                for victim in victims[:len(new) - len(free)]:
                    free.append(self._evict_slot(victim))
                    self._counts["slot_evictions"] += 1
            for version, slot in zip(new, free):
                self.slots.write(slot, version.weights)
                self._counts["slot_loads"] += 1
                version.slot, self._slot_owner[slot] = slot, version
            for version in needed:
                version.slot_tick = next(self._ticks)
                self._touch_cpu(version)
            return [v.slot for v in versions]

    def memory_stats(self) -> dict:
        """CPU bytes of cached adapters, device bytes of resident adapters' weights, counts."""
        with self._lock:
            cached = [v for v in self._versions.values() if v.state == READY]
            resident = [v for v in self._slot_owner if v is not None]
            return dict(cpu_bytes=sum(v.weights.nbytes for v in cached),
                        device_bytes_used=sum(v.weights.nbytes for v in resident),
                        device_bytes_allocated=self.slots.nbytes, num_cpu=len(cached), num_resident=len(resident))

    def counts(self) -> dict[str, int]:
        """Cumulative events: slot_loads (writes into a device slot), slot_evictions (resident adapters
        evicted to make room), disk_loads / load_failures (background or add() loads), cpu_evictions."""
        with self._lock:
            return {key: self._counts[key] for key in
                    ("slot_loads", "slot_evictions", "disk_loads", "load_failures", "cpu_evictions")}

    # ---- internals (call with the lock held, except _load) ---------------------------------------
    def _check_request(self, request) -> None:
        if not isinstance(request, self._request_type):
            raise ValueError(f"expected a {self._request_type.__name__}, got {type(request).__name__}")

    def _get(self, ref: AdapterRef) -> _Version:
        with self._lock:
            version = self._versions.get(ref)
        if version is None:
            raise UnknownAdapterError(f"unknown {self.kind} version {ref} (removed, replaced or evicted)")
        return version

    def _acquire(self, request, background: bool) -> _Version:
        self._check_request(request)
        with self._lock:
            version, created = self._version_for(request)
            version.holders += 1
            self._touch_cpu(version)
        if created:
            if background:
                self._executor.submit(self._load, version)
            else:
                self._load(version)
        return version

    def _version_for(self, request) -> tuple[_Version, bool]:
        """The current version of request.name if it has the same source, else a new one (replacement)."""
        current = self._current.get(request.name)
        if current is not None and (current.ref.path, current.ref.revision) == request.source:
            return current, False
        if current is not None:
            logger.info("%s %r: replacing %s with %s", self.kind, request.name,
                        (current.ref.path, current.ref.revision), request.source)
            self._retire(current)
        version = _Version(AdapterRef(request.name, request.path, request.revision, next(self._ids)), request)
        self._register(version)
        return version, True

    def _load(self, version: _Version) -> None:
        """Load outside the lock, then publish the result (or discard it if the version was dropped)."""
        name, weights, error = version.ref.name, None, None
        try:
            weights = self._load_fn(version.request)
        except AdapterError as exc:
            error = exc
        except Exception as exc:  # a library or loader bug must fail this adapter, not the engine thread
            logger.exception("%s %r: unexpected error while loading", self.kind, name)
            error = InvalidAdapterError(f"{self.kind} {name!r}: unexpected error while loading: {exc!r}")
            error.__cause__ = exc
        with self._lock:
            if self._versions.get(version.ref) is not version:
                logger.debug("%s %r: dropped while loading; result discarded", self.kind, name)
            elif error is None:
                version.state, version.weights = READY, weights
                self._counts["disk_loads"] += 1
                self._touch_cpu(version)
                self._trim_cpu()
            else:
                logger.warning("%s %r failed to load: %s", self.kind, name, error)
                version.state, version.error = FAILED, error
                self._counts["load_failures"] += 1
                if version.holders == 0:
                    self._drop(version)
            version.done.set()

    def _register(self, version: _Version) -> None:
        self._current[version.ref.name] = version
        self._versions[version.ref] = version

    def _touch_cpu(self, version: _Version) -> None:
        version.cpu_tick = next(self._ticks)

    def _is_pinned(self, version: _Version) -> bool:
        return version.ref.name in self._pinned and self._current.get(version.ref.name) is version

    def _retire(self, version: _Version) -> None:
        version.retired = True
        if self._current.get(version.ref.name) is version:
            del self._current[version.ref.name]
        if version.holders == 0:
            self._drop(version)

    def _drop(self, version: _Version) -> None:
        """Forget a version: free its CPU tensors and its slot."""
        self._versions.pop(version.ref, None)
        if self._current.get(version.ref.name) is version:
            del self._current[version.ref.name]
        if version.slot is not None:
            self._evict_slot(version)
        version.weights = None

    def _evict_slot(self, version: _Version) -> int:
        slot = version.slot
        self.slots.clear(slot)
        version.slot, self._slot_owner[slot] = None, None
        return slot

    def _trim_cpu(self) -> None:
        """Evict least recently used, unpinned, unheld versions while the CPU cache is over capacity."""
        cached = [v for v in self._versions.values() if v.state == READY]
        excess = len(cached) - self._max_cpu
        if excess > 0:
            victims = sorted((v for v in cached if v.holders == 0 and not self._is_pinned(v)),
                             key=lambda v: v.cpu_tick)
            for victim in victims[:excess]:
                logger.debug("%s %r evicted from the CPU cache", self.kind, victim.ref.name)
                self._counts["cpu_evictions"] += 1
                self._drop(victim)


class PromptAdapterTier(AdapterTier):
    """The prompt-adapter tier: adds the per-ref number of virtual tokens the engine inserts."""

    def num_virtual_tokens(self, ref: AdapterRef) -> int:
        """Number of placeholder tokens the soft prompt of ``ref`` occupies."""
        return self.size(ref)
