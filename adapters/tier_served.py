"""Served names of an adapter tier: stage, publish, withdraw (a part of ``adapters.tier``).

The served names (the server's model list) live in the tier's version table, one
:class:`ServedAdapter` per name. ``stage`` loads a version that serves no name yet; ``publish``
makes it the name's version (taking over the old one's pin) and records the served name;
``withdraw`` stops serving a name and retires its versions. In-memory adapters
(adapters.memory_source) run only while their name is served from their snapshot:
``_check_not_superseded`` refuses a request naming an older update, and ``release_snapshots``
frees the snapshots nothing uses any more.

Locking: the public methods take the tier's lock; ``_hold_staged`` and ``_check_not_superseded``
are called with it held (adapters.tier_state). ``stage`` loads outside it, as ``add`` does.
"""

from __future__ import annotations

import copy
from typing import Callable

from adapters.errors import AdapterError, UnknownAdapterError
from adapters.memory_source import MemoryLoRARequest
from adapters.tier_state import TierState
from adapters.versions import FAILED, AdapterRef, AdapterVersion, ServedAdapter

__all__ = ["SupersededAdapterError", "TierServedNames"]


class SupersededAdapterError(AdapterError):
    """A request named an in-memory adapter version that a later update replaced (adapters.memory_source)."""


class TierServedNames(TierState):
    """The served-name registry and the stage/publish path of an :class:`adapters.tier.AdapterTier`."""

    def stage(self, request, fresh: bool = False) -> AdapterRef:
        """Load and validate ``request`` now, like add(), into a version that serves no name yet and
        that the caller holds: ``publish`` it, then ``release`` it; released unpublished, it is dropped
        and nothing changed. Without ``fresh``, the version its name serves is reused when it has the
        same source; with ``fresh`` (load_inplace: the files may have changed under the same path) it
        never is: a new version is read from what the source holds now, so neither the old weights nor
        the prefix-cache blocks keyed by the old version serve it."""
        return self._load_held(request, staged=True, fresh=fresh)

    def publish(self, served: ServedAdapter | None, replace: bool, ref: AdapterRef | None = None,
                claim: Callable[[], bool] | None = None) -> bool:
        """Serve ``served`` under its name (None: leave the name's served record as it is); with ``ref``
        (a staged version, see ``stage``) that version serves its name from now on, taking over the
        replaced version's pin. ``claim`` is asked last, under the lock: False (its caller gave up
        waiting) changes nothing. Returns whether it was published.

        Raises:
            ValueError: the name is served already and ``replace`` is False.
            AdapterCapacityError: the version would inherit a pin that its bytes put past the CPU cache's
                bound (adapters.cpu_cache.CPUCache.check_inherited_pin); nothing changed.
        """
        with self._lock:
            if served is not None and self._versions.served(served.name) is not None and not replace:
                raise ValueError(f"an adapter named {served.name!r} is already loaded")
            if claim is not None and not claim():
                return False
            if ref is not None:
                version = self._get(ref)
                if version.state == FAILED:  # a slot write failed since it was staged
                    raise copy.copy(version.error) from version.error
                serving = self._serving(ref.name)
                if serving is not None and serving is not version and serving.pinned:
                    self._cpu.check_inherited_pin(ref.name, self._cpu.size(version), serving, version)
                self._versions.publish(version)
            if served is not None:
                self._versions.serve(served, replace)
            self.release_snapshots()
            return True

    def withdraw(self, name: str) -> ServedAdapter:
        """Stop serving ``name`` and retire its versions (requests running on them finish first).

        Raises:
            UnknownAdapterError: ``name`` is not served.
        """
        with self._lock:
            served = self._versions.unserve(name)
            if served is None:
                raise UnknownAdapterError(f"{self.kind} {name!r} is not served")
            self._versions.retire_name(name)
            self.release_snapshots()
            self._start_queued()
            return served

    def served(self, name: str) -> ServedAdapter | None:
        """The served adapter ``name`` with the version serving it now, or None."""
        with self._lock:
            return self._versions.served(name)

    def served_all(self) -> list[ServedAdapter]:
        """Every served adapter, in the order its name was first served."""
        with self._lock:
            return self._versions.served_all()

    def release_snapshots(self) -> None:
        """Release the in-memory snapshots no longer in use: neither the served record of their name nor
        a live version (held by requests, staged or cached) was made from them (adapters.memory_source)."""
        if not self._snapshots:
            return
        with self._lock:
            live = {version.ref.path for version in self._versions}

            def in_use(request) -> bool:
                served = self._versions.served(request.name)
                return request.path in live or served is not None and served.request.path == request.path

            self._snapshots.release_unused(in_use)

    def _hold_staged(self, request, fresh: bool) -> AdapterVersion:
        self._check_open()
        serving = self._serving(request.name)
        if not fresh and serving is not None and serving.source == request.source and serving.state != FAILED:
            version = serving  # publishing it changes only the served record
        else:
            version = self._versions.stage(request)
        version.holders += 1
        self._touch_cpu(version)
        return version

    def _check_not_superseded(self, request) -> None:
        """An adapter handed over in memory runs only while its name is served from it: a request holding
        an older update would otherwise load those tensors as the name's newest version, silently
        undoing the update (a folder's request reloads what the folder holds; a snapshot never changes)."""
        if isinstance(request, MemoryLoRARequest):
            served = self._versions.served(request.name)
            if served is None or served.request.source != request.source:
                raise SupersededAdapterError(
                    f"{self.kind} {request.name!r}: this in-memory version ({request.path}) is no longer the one "
                    "served under its name; use the request of the served adapter (served_adapter(name).request)")
