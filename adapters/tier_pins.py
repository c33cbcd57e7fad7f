"""Pins of an adapter tier: which versions are never evicted (a part of ``adapters.tier``).

A pin lives on the version record only (``AdapterVersion.pinned``), on the version a name serves.
At most ``num_slots - 1`` versions are pinned, so unpinned adapters always keep a device slot, and
the pinned versions' bytes stay within the CPU cache's byte bound (adapters.cpu_cache). A
replacement inherits its name's pin once it takes over, unless its bytes would put the pins past
that bound: ``_inherited_pin_error`` is the check a finished load makes (``publish`` and
``add_dummy`` make the same check, through ``CPUCache.check_inherited_pin``, on their own paths).

Locking: ``pin``, ``unpin`` and ``num_pinned`` take the tier's lock; ``_inherited_pin_error`` is
called with it held (adapters.tier_state).
"""

from __future__ import annotations

from adapters.errors import AdapterCapacityError, UnknownAdapterError
from adapters.tier_state import TierState
from adapters.versions import FAILED, AdapterVersion

__all__ = ["TierPins"]


class TierPins(TierState):
    """Pin, unpin and the inherited-pin check of an :class:`adapters.tier.AdapterTier`."""

    def pin(self, name: str) -> None:
        """Never evict the version ``name`` serves from the CPU cache, nor from its slot once resident.

        Raises:
            UnknownAdapterError: ``name`` is unknown, or its version failed to load.
            AdapterCapacityError: the pin would leave no device slot for unpinned adapters
                (at most ``num_slots - 1`` pins), or no room in the CPU cache's ``max_bytes``.
        """
        with self._lock:
            version = self._serving(name)
            if version is None or version.state == FAILED:
                raise UnknownAdapterError(f"cannot pin {self.kind} {name!r}: it is unknown or failed to load")
            if not version.pinned and self.num_pinned() + 1 > self.slots.num_slots - 1:
                raise AdapterCapacityError(
                    f"cannot pin {self.kind} {name!r}: {self.num_pinned()} of {self.slots.num_slots} device slots "
                    f"are pinned already and at least one must stay free for unpinned adapters")
            self._cpu.check_pin(version)
            version.pinned = True

    def unpin(self, name: str) -> None:
        """Make ``name`` evictable again."""
        with self._lock:
            version = self._serving(name)
            if version is None:
                raise UnknownAdapterError(f"cannot unpin unknown {self.kind} {name!r}")
            version.pinned = False
            self._trim_cpu()
            self._start_queued()

    def num_pinned(self) -> int:
        """How many versions are pinned (at most ``num_slots - 1``)."""
        with self._lock:
            return self._versions.num_pinned()

    def _inherited_pin_error(self, version: AdapterVersion, nbytes: int) -> AdapterCapacityError | None:
        """The error refusing a loaded ``version`` (``nbytes``) that is, or would become by taking over its
        name, pinned past the CPU cache's byte bound (CPUCache.check_inherited_pin); None when it may."""
        serving = self._serving(version.ref.name)
        takes_over = not version.retired and serving is not None and serving is not version and serving.pinned
        if not (version.pinned or takes_over):
            return None
        try:
            self._cpu.check_inherited_pin(version.ref.name, nbytes, serving if takes_over else None)
        except AdapterCapacityError as exc:
            return exc
        return None
