"""The generic LRU adapter tier: a CPU cache and device slots, for LoRAs and prompt adapters alike.

One class, :class:`AdapterTier`, serves both kinds (``adapters.manager.AdapterManager`` builds
them); each kind brings its own loader (resolve + read + validate) and slot writer. Life of an
adapter version:

    acquire/prefetch/add -> "loading" (queued until there is room, then a worker thread resolves,
                                       reads and validates; no lock held)
                         -> "ready"   (in the CPU cache: LRU, max_cpu entries and max_bytes of
                                       weights; pinned entries and entries held by live requests
                                       are never evicted; adapters.cpu_cache)
                         -> resident  (activate() wrote it into a device slot; LRU among slots)
                         or "failed"  (the AdapterError is remembered while a request holds the ref)

CPU memory is bounded: a queued load starts only while ``ready + loading < max_cpu + max_loading``
versions, so at most ``max_cpu + max_loading`` versions hold (or are reading) weights, plus one per
concurrent ``add()`` caller; requests beyond that wait with their version queued (state "loading").
With ``max_bytes`` the same rule holds in bytes, and an adapter larger than ``max_bytes`` alone is
refused (adapters.cpu_cache).

A version is identified by an :class:`AdapterRef` (name, path, revision, version number). A request
with a known name but another (path, revision) creates a new version for that source; the old
version keeps serving the name (``lookup``, ``list``, pins) until the new one is ready (then the old
one is retired) or fails (then the name stays with the old one), so a bad replacement never takes a
working adapter away. A failed version with nothing to fall back to stays the name's version while
requests hold it (they all fail alike; no reload storm), then is dropped. A retired version is
dropped once no request holds it; ``remove`` is deferred the same way. Dropping a version frees its
CPU tensors and its slot.

Served names (the server's model list) live in the same version table, as one
:class:`ServedAdapter` per name: ``publish`` serves a name, ``withdraw`` stops serving it, ``served``
reads it. A served name outlives the CPU cache's eviction of its weights (the next request reloads
them from its request). ``stage`` loads a version that serves no name until ``publish`` makes it the
name's version (taking over the old one's pin); released unpublished, it is dropped and nothing
changed, so a load whose caller gave up needs no undo. ``stage(fresh=True)`` (load_inplace) never
reuses a version: the same path may hold retrained files, so the new version is read from what is
there now, and its number (hence its prefix-cache keys) is new. Adapters handed over in memory
(``adapters.memory_source``) are a new source per update; a request naming an update that a later
one replaced is refused (``SupersededAdapterError``) rather than loaded back over it.

Pins live on the version record only, on the version a name serves (``AdapterVersion.pinned``): a
replacement inherits the pin once it takes over, unless its bytes would put the pins past the CPU
cache's byte bound (then it is refused with AdapterCapacityError, and the old version keeps serving,
pinned: adapters.cpu_cache); a failed, removed or retired version holds none.
At most ``num_slots - 1`` versions are pinned, so unpinned adapters always keep a slot;
``reserved_slots`` tells the scheduler how many slots pinned residents keep from a step.

The tier orchestrates four small parts, one idea each: the version table (``adapters.versions``:
refs, records, which version serves a name), the load queue (``adapters.load_queue``: the CPU bound
above), and one LRU class (``adapters.lru``) used twice, for the CPU cache here and for the device
slots in the slot pool (``adapters.slot_pool``: slot choice, eviction, reserved slots).

Its own code is split the same way, into mixins of the one class, each a module: the load path
(``adapters.tier_loads``: hold, read, settle, close), the served names (``adapters.tier_served``:
stage, publish, withdraw, in-memory snapshots), the pins (``adapters.tier_pins``) and the reports
(``adapters.tier_stats``), over a common base naming the shared state and helpers
(``adapters.tier_state``). This module keeps construction, acquire/release, add/prefetch/remove,
dummies and activate.

Thread-safety: user threads (acquire/add/prefetch/remove/pin) and the engine's step thread
(activate/release) share the tier's one lock, which guards all four parts (they have no locks of
their own) and is the lock of every mixin above; disk and Hub IO always run outside it.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Callable

from adapters.cpu_cache import CPUCache
from adapters.errors import AdapterError, InvalidAdapterError, UnknownAdapterError
from adapters.load_queue import LoadQueue
from adapters.memory_source import MemorySnapshots
from adapters.slot_pool import SlotPool
from adapters.tier_loads import TierLoads
from adapters.tier_pins import TierPins
from adapters.tier_served import SupersededAdapterError, TierServedNames
from adapters.tier_state import TierClosedError, logger
from adapters.tier_stats import TierStats
from adapters.versions import FAILED, LOADING, READY, AdapterRef, AdapterVersion, ServedAdapter, VersionTable

__all__ = ["FAILED", "LOADING", "READY", "AdapterRef", "AdapterTier", "PromptAdapterTier", "ServedAdapter",
           "SupersededAdapterError", "TierClosedError"]


class AdapterTier(TierLoads, TierServedNames, TierPins, TierStats):
    """Two-tier LRU cache of one adapter kind (CPU cache of ``max_cpu`` entries, device slots).

    Args:
        kind: "LoRA" or "prompt adapter", for messages.
        request_type: the request class this tier accepts.
        load: request -> validated weights (resolve + read + validate; raises AdapterError).
        make_dummy: (name, size) -> weights with the right shapes, no file.
        slots: the device slots (``num_slots``, ``write(slot, weights)``, ``clear(slot)``, ``nbytes``).
        max_cpu: CPU cache capacity (adapters); pinned and held adapters are never evicted.
        max_bytes: CPU cache capacity in bytes of weights (None: count only; adapters.cpu_cache).
        bytes_setting: the setting ``max_bytes`` comes from, named in messages.
        executor: runs background loads: ``executor.submit(fn, version)`` with ``version.request`` the
            request being loaded (the manager's pools route by source).
        max_loading: background loads in flight beyond the cache (see the module docstring).
        on_settled: called (outside the lock) whenever a load finishes, fails or is cancelled, so an
            engine waiting for work can wake up.
        snapshots: the live snapshots of in-memory adapters (adapters.memory_source); the tier releases
            each once neither its served record nor a live version was made from it.
    """

    def __init__(self, kind: str, request_type: type, load: Callable, make_dummy: Callable, slots, max_cpu: int,
                 executor: Any, max_loading: int = 2, on_settled: Callable[[], None] | None = None,
                 max_bytes: int | None = None, bytes_setting: str = "max_cpu_lora_bytes",
                 snapshots: MemorySnapshots | None = None):
        if max_cpu < slots.num_slots:
            raise ValueError(f"the {kind} CPU cache ({max_cpu}) must hold at least as many adapters as there are "
                             f"device slots ({slots.num_slots})")
        if max_loading < 1:
            raise ValueError(f"max_loading must be >= 1, got {max_loading}")
        self.kind, self._request_type, self._load_fn, self._dummy_fn = kind, request_type, load, make_dummy
        self.slots, self._on_settled = slots, on_settled
        self._lock = threading.RLock()  # guards every part below; they have no locks of their own
        self._versions = VersionTable(kind, on_drop=self._free)
        self._cpu = CPUCache(kind, max_cpu, max_bytes, on_remove=self._free_weights, setting=bytes_setting)  # ready
        self._slot_pool = SlotPool(kind, slots)
        self._loads = LoadQueue(max_cpu, max_loading, submit=lambda version: executor.submit(self._load, version))
        self._snapshots = snapshots
        self._closed = False
        self._counts: Counter[str] = Counter()  # cumulative events, see counts()

    # ---- requests' side: acquire / release -------------------------------------------------------
    def acquire(self, request) -> AdapterRef:
        """A request starts using this adapter; queues a background load if it is not cached.

        Raises TierClosedError after close().
        """
        self._check_request(request)
        with self._lock:
            version = self._hold(request)
            self._start_queued()
            return version.ref

    def release(self, ref: AdapterRef) -> None:
        """A request using ``ref`` finished or was aborted; completes deferred removals/replacements."""
        with self._lock:
            version = self._versions.release(ref)  # drops it if it was retired or failed
            if version.holders == 0:
                self._trim_cpu()
                self.release_snapshots()
            self._start_queued()

    def state(self, ref: AdapterRef) -> str:
        """The version's load state: "loading" (queued or reading), "ready" or "failed"."""
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
        """The version ``name`` serves now (None if unknown): the old one while a replacement loads."""
        with self._lock:
            version = self._serving(name)
            return None if version is None else version.ref

    # ---- user side: add / prefetch / remove (pins: adapters.tier_pins; names: tier_served) ---------
    def add(self, request) -> AdapterRef:
        """Resolve, load and validate ``request`` into the CPU cache now (in the calling thread).

        A new source under a known name replaces the old version only once it loaded: if it fails,
        the old version keeps serving. Raises the adapter's AdapterError (not found, invalid, too
        large, unsupported, unsafe), or TierClosedError after close().
        """
        ref = self._load_held(request, staged=False)
        self.release(ref)
        return ref

    def prefetch(self, request) -> AdapterRef:
        """Queue a background load of ``request`` and return at once."""
        self._check_request(request)
        with self._lock:
            self._check_open()
            self._check_not_superseded(request)
            version = self._version_for(request)
            self._touch_cpu(version)
            self._start_queued()
            return version.ref

    def add_dummy(self, name: str, size: int, hold: bool = False) -> AdapterRef:
        """A ready adapter of the right shapes (rank or virtual tokens ``size``), no file; removable.

        It replaces ``name`` at once and inherits its pin. ``hold``: the caller holds it as a request
        would (``remove`` it, then ``release`` it): never evicted, and not refused by the byte bound,
        which is the tenants' adapters' (the start-up warm-up makes ``max_loras`` dummies at
        ``max_lora_rank`` resident at once, whatever the bound)."""
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"dummy {self.kind} size must be a positive int, got {size!r}")
        weights = self._dummy_fn(name, size)
        nbytes = weights.nbytes
        if not hold:
            self._cpu.check_fits(name, nbytes)
        with self._lock:
            self._check_open()
            serving = self._serving(name)
            if not hold and serving is not None and serving.pinned:  # it inherits the pin: checked as a pin is
                self._cpu.check_inherited_pin(name, nbytes, serving)
            version = AdapterVersion(self._versions.new_ref(name, "<dummy>", None), None)
            version.state, version.weights, version.started = READY, weights, True
            version.done.set()
            version.holders = int(hold)
            version.pinned = self._versions.retire_name(name)
            self._versions.register(version)
            self._cpu.put(version, nbytes)
            self._trim_cpu()
            return version.ref

    def remove(self, name: str) -> None:
        """Forget ``name`` (and its pin); deferred while requests hold it (they keep their weights)."""
        with self._lock:
            if self._serving(name) is None:
                raise UnknownAdapterError(f"unknown {self.kind} {name!r}; known: {sorted(self._versions.names())}")
            self._versions.retire_name(name)
            self._start_queued()

    def list(self) -> list[str]:
        """Names whose serving version is in the CPU cache, least recently used first."""
        with self._lock:
            serving = self._versions.serving_versions()
            return [v.ref.name for v in self._cpu if v in serving]

    # ---- engine side: reserved slots / activate --------------------------------------------------
    def reserved_slots(self, refs) -> int:
        """Device slots that pinned resident versions other than ``refs`` keep from a step.

        Exact, not an upper bound: activate() can make any set of refs resident whose size plus this
        number is at most ``num_slots``. The scheduler asks this (under the engine's step lock)."""
        with self._lock:
            return self._slot_pool.reserved(refs)

    def activate(self, refs: list[AdapterRef]) -> list[int]:
        """Make every ref resident in a device slot; returns the slot of each ref (same order).

        Only slots not needed by ``refs`` and not pinned are evicted (least recently used first),
        and nothing is evicted unless all of ``refs`` fit. A version whose slot write raises fails as
        a load failure does (state "failed", an InvalidAdapterError naming the slot write in
        ``error``; its name falls back to a previous version, if any): its slot is None here, and the
        engine fails its requests alone.

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
            plan = self._slot_pool.activate(needed, self.num_pinned)
            self._counts["slot_evictions"] += len(plan.victims)
            self._counts["slot_loads"] += len(plan.writes) - len(plan.failed)
            for version, exc in plan.failed:
                self._fail_ready(version, exc)
            for version in needed:
                self._touch_cpu(version)
            return [v.slot for v in versions]

    def _fail_ready(self, version: AdapterVersion, exc: Exception) -> None:
        """A ready version could not be written into its slot: it fails as a load failure does."""
        logger.error("%s %r could not be written into a device slot: %r", self.kind, version.ref.name, exc)
        error = InvalidAdapterError(f"{self.kind} {version.ref.name!r} could not be written into its device slot: "
                                    f"{exc}")
        error.__cause__ = exc
        self._cpu.discard(version)  # frees its CPU tensors (and its slot, already empty)
        version.weights = None
        version.state, version.error = FAILED, error
        self._counts["load_failures"] += 1
        self._versions.fall_back(version)

    # ---- internals: the parts' on-remove hooks (called with the lock held) ----------------------
    def _free(self, version: AdapterVersion) -> None:
        """The version table's on-drop hook: the version leaves the CPU cache (if cached)."""
        self._cpu.discard(version)
        assert version.slot is None and version.weights is None, f"{version.ref} still holds a slot or weights"

    def _free_weights(self, version: AdapterVersion) -> None:
        """The CPU cache's on-remove hook: free the version's slot, then its CPU tensors."""
        self._slot_pool.evict(version)
        version.weights = None


class PromptAdapterTier(AdapterTier):
    """The prompt-adapter tier: adds the per-ref number of virtual tokens the engine inserts."""

    def num_virtual_tokens(self, ref: AdapterRef) -> int:
        """Number of placeholder tokens the soft prompt of ``ref`` occupies."""
        return self.size(ref)
