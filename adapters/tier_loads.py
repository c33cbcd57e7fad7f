"""Loads of an adapter tier: holding a request's version, reading it, settling it (a part of ``adapters.tier``).

A request's version is held (``_hold``; ``_hold_staged`` for a staged one, adapters.tier_served),
queued in the load queue (adapters.load_queue) and read by a worker thread (``_load``), or by the
calling thread for ``add`` / ``stage`` (``_load_held``). ``_settle`` publishes the result: ready (the
version takes over its name and enters the CPU cache) or failed (the name falls back to its previous
version). A load that would make its version inherit a pin past the CPU cache's byte bound fails
too (adapters.tier_pins). ``close`` fails every queued and running load at once.

Locking: ``close`` takes the tier's lock; ``_hold``, ``_version_for`` and ``_settle`` are called with
it held. ``_load`` and ``_load_held`` read weights outside it (disk and Hub IO never run under the
lock) and take it only to publish the result (adapters.tier_state).
"""

from __future__ import annotations

import copy

from adapters.errors import AdapterError, InvalidAdapterError
from adapters.tier_state import TierState, logger
from adapters.versions import FAILED, LOADING, READY, AdapterRef, AdapterVersion

__all__ = ["TierLoads"]


class TierLoads(TierState):
    """The load path of an :class:`adapters.tier.AdapterTier`: hold, read, settle, cancel on close."""

    def close(self) -> None:
        """Start no more loads: queued and running loads fail now with an AdapterError ("cancelled");
        acquire/add/prefetch raise TierClosedError from now on. Returns at once; a worker still
        reading discards its result. Idempotent."""
        with self._lock:
            self._closed = True
            self._loads.clear()
            for version in [v for v in self._versions if v.state == LOADING]:
                error = AdapterError(f"{self.kind} {version.ref.name!r}: load cancelled: the engine was closed")
                self._settle(version, None, error)
        self._notify()

    def _load_held(self, request, staged: bool, fresh: bool = False) -> AdapterRef:
        """add() and stage(): the request's version loaded in this thread (unless a worker has it) and
        held; raises its AdapterError, releasing it."""
        self._check_request(request)
        with self._lock:
            version = self._hold_staged(request, fresh) if staged else self._hold(request)
            run_here = not version.started  # queued: load it now rather than wait for room
            if run_here:
                self._loads.begin(version)
        try:
            if run_here:
                self._load(version)
            version.done.wait()
            with self._lock:
                if version.state == FAILED:  # a fresh exception per caller, chained to the loader's
                    raise copy.copy(version.error) from version.error
            return version.ref
        except BaseException:
            self.release(version.ref)
            raise

    def _hold(self, request) -> AdapterVersion:
        self._check_open()
        self._check_not_superseded(request)
        version = self._version_for(request)
        version.holders += 1
        self._touch_cpu(version)
        return version

    def _version_for(self, request) -> AdapterVersion:
        """The version of the request's name and source; a new one is queued for loading."""
        version, created = self._versions.version_for(request)
        if created:
            self._loads.push(version)
        return version

    def _load(self, version: AdapterVersion) -> None:
        """Load outside the lock, then publish the result (or discard it if the version was dropped)."""
        name, weights, error, nbytes = version.ref.name, None, None, 0
        try:
            weights = self._load_fn(version.request)
            nbytes = weights.nbytes  # counted here, outside the lock: a MoE adapter has tens of thousands of tensors
            self._cpu.check_fits(name, nbytes)
        except AdapterError as exc:
            weights = None
            error = exc
        except Exception as exc:  # a library or loader bug must fail this adapter, not the engine thread
            logger.exception("%s %r: unexpected error while loading", self.kind, name)
            error = InvalidAdapterError(f"{self.kind} {name!r}: unexpected error while loading: {exc!r}")
            error.__cause__ = exc
        with self._lock:
            self._loads.finish()
            if self._versions.get(version.ref) is not version or version.state != LOADING:
                logger.debug("%s %r: dropped or cancelled while loading; result discarded", self.kind, name)
            else:
                self._settle(version, weights, error, nbytes)
            self._start_queued()
        self._notify()

    def _settle(self, version: AdapterVersion, weights, error: AdapterError | None, nbytes: int = 0) -> None:
        """Publish a finished load: ready (and take over its name; its weights hold ``nbytes``) or failed
        (the name falls back; so does a version whose inherited pin its bytes put past the byte bound)."""
        if error is None:
            error = self._inherited_pin_error(version, nbytes)
        if error is None:
            version.state, version.weights = READY, weights
            self._counts["disk_loads"] += 1
            self._versions.take_over(version)
            self._cpu.put(version, nbytes)
            self._trim_cpu()
        else:
            logger.warning("%s %r failed to load: %s", self.kind, version.ref.name, error)
            version.state, version.error = FAILED, error
            self._counts["load_failures"] += 1
            self._versions.fall_back(version)
        version.done.set()
