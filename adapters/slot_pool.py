"""Which adapter version holds each device slot, and which resident version a step evicts.

The device tensors themselves are ``adapters.slots`` (``LoRASlots``, ``PromptSlots``); this pool
only decides. Resident versions sit in an :class:`~adapters.lru.LRUCache` (version -> slot) whose
on-remove hook clears the device slot, so every way out of a slot (evicted for a step, or its
version dropped) clears it alike. A step's slots are chosen before anything is written: free slots
first (lowest index first), then the least recently used resident versions that the step does not
need and that are not pinned; nothing is evicted unless the whole step fits.

Not thread-safe on purpose: the owning ``AdapterTier`` holds its lock around every call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from adapters.errors import AdapterCapacityError
from adapters.lru import LRUCache
from adapters.versions import AdapterVersion


@dataclass
class SlotPlan:
    """What ``SlotPool.activate`` did: evicted ``victims``, then wrote each new version into its slot;
    ``failed``: the versions whose write raised (their slot is empty again), with the exception."""

    victims: list[AdapterVersion]
    writes: list[tuple[AdapterVersion, int]]  # (version, slot)
    failed: list[tuple[AdapterVersion, Exception]] = field(default_factory=list)


class SlotPool:
    """Device-slot choice and eviction for one adapter kind (no lock: the tier's lock guards it).

    Args:
        kind: "LoRA" or "prompt adapter", for messages.
        slots: the device slots (``num_slots``, ``write(slot, weights)``, ``clear(slot)``).
    """

    def __init__(self, kind: str, slots):
        self.kind, self.slots = kind, slots
        self._resident: LRUCache[AdapterVersion, int] = LRUCache(slots.num_slots, on_remove=self._clear)

    @property
    def num_slots(self) -> int:
        """How many device slots there are."""
        return self.slots.num_slots

    def resident(self) -> list[AdapterVersion]:
        """Versions in a device slot, least recently used first."""
        return list(self._resident)

    def reserved(self, refs) -> int:
        """Slots that pinned resident versions other than ``refs`` keep from a step."""
        return sum(1 for v in self._resident if v.pinned and v.ref not in refs)

    def activate(self, needed: list[AdapterVersion], num_pinned: Callable[[], int]) -> SlotPlan:
        """Make every version of ``needed`` (distinct, ready) resident and the most recently used.

        ``num_pinned`` gives the tier's pin count for the error message. A write that raises (whatever
        the adapter holds) leaves its slot empty and that version not resident, in ``plan.failed``;
        the other versions are written all the same, so one adapter's fault stays its own.

        Raises:
            AdapterCapacityError: more versions than slots, or too few slots that can be freed.
        """
        plan = self._plan(needed, num_pinned)
        for victim in plan.victims:
            self.evict(victim)
        for version, slot in plan.writes:
            try:
                self.slots.write(slot, version.weights)
            except Exception as exc:  # noqa: BLE001 - this adapter's write failed; the others go on
                self.slots.clear(slot)  # half written: no token may read it
                plan.failed.append((version, exc))
                continue
            version.slot = slot
            self._resident.put(version, slot)
        failed = {version for version, _ in plan.failed}
        for version in needed:
            if version not in failed:
                self._resident.touch(version)
        return plan

    def evict(self, version: AdapterVersion) -> None:
        """Clear the slot of ``version`` if it is resident."""
        self._resident.discard(version)

    def _plan(self, needed: list[AdapterVersion], num_pinned: Callable[[], int]) -> SlotPlan:
        """Choose (without writing) a slot for each needed version that is not resident."""
        if len(needed) > self.num_slots:
            raise AdapterCapacityError(f"a step needs {len(needed)} distinct {self.kind}s but there are only "
                                       f"{self.num_slots} device slots")
        new = [v for v in needed if v not in self._resident]
        taken = set(self._resident.values())
        free = [slot for slot in range(self.num_slots) if slot not in taken]
        victims: list[AdapterVersion] = []
        if len(new) > len(free):
            keep = set(needed)
            victims = self._resident.victims(len(new) - len(free), keep=lambda v: v in keep or v.pinned)
            if len(victims) < len(new) - len(free):
                evictable = sum(1 for v in self._resident if v not in keep and not v.pinned)
                raise AdapterCapacityError(
                    f"a step needs {len(needed)} {self.kind}s but only {len(free) + evictable} of "
                    f"{self.num_slots} device slots can be freed ({num_pinned()} pinned)")
            free += [v.slot for v in victims]
        return SlotPlan(victims, list(zip(new, free)))

    def _clear(self, version: AdapterVersion, slot: int) -> None:
        """The LRU's on-remove hook: the slot is empty again."""
        assert version.slot == slot, f"{self.kind} {version.ref.name!r} is in slot {version.slot}, not {slot}"
        self.slots.clear(slot)
        version.slot = None
