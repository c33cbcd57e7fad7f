"""SlotPool (adapters/slot_pool.py): which version holds each device slot, and which a step evicts."""

import pytest

from adapters.errors import AdapterCapacityError
from adapters.slot_pool import SlotPool
from adapters.versions import READY, AdapterRef, AdapterVersion


class RecordingSlots:
    """Device slots that record what was written and cleared (the pool's only view of the device)."""

    def __init__(self, num_slots):
        self.num_slots, self.held, self.events = num_slots, [None] * num_slots, []

    def write(self, slot, weights):
        self.held[slot] = weights
        self.events.append(("write", slot, weights))

    def clear(self, slot):
        self.held[slot] = None
        self.events.append(("clear", slot))


def _version(name, pinned=False):
    version = AdapterVersion(AdapterRef(name, f"/{name}", None, 0), None)
    version.state, version.weights, version.pinned = READY, f"weights-{name}", pinned
    return version


def _pool(num_slots):
    slots = RecordingSlots(num_slots)
    return SlotPool("LoRA", slots), slots


def _no_pins():
    return 0


def test_free_slots_fill_lowest_index_first_and_resident_versions_stay():
    pool, slots = _pool(3)
    a, b = _version("a"), _version("b")
    pool.activate([b, a], _no_pins)
    assert (b.slot, a.slot) == (0, 1) and slots.held == ["weights-b", "weights-a", None]
    slots.events.clear()
    plan = pool.activate([a, b], _no_pins)  # both resident: nothing written
    assert plan.victims == [] and plan.writes == [] and slots.events == []


def test_the_least_recently_used_unneeded_version_is_evicted():
    pool, slots = _pool(2)
    a, b, c = _version("a"), _version("b"), _version("c")
    pool.activate([a], _no_pins)
    pool.activate([b], _no_pins)
    pool.activate([a], _no_pins)  # b is now the least recently used
    plan = pool.activate([c], _no_pins)
    assert plan.victims == [b] and b.slot is None and c.slot == 1 and a.slot == 0
    assert slots.events[-2:] == [("clear", 1), ("write", 1, "weights-c")]
    assert pool.resident() == [a, c]


def test_pinned_and_needed_versions_are_never_evicted():
    pool, _ = _pool(3)
    pinned, a, b, c = _version("p", pinned=True), _version("a"), _version("b"), _version("c")
    pool.activate([pinned], _no_pins)  # the least recently used, but pinned
    pool.activate([a], _no_pins)
    pool.activate([b], _no_pins)
    plan = pool.activate([a, c], _no_pins)  # a is needed: b goes, though a was used before it
    assert plan.victims == [b] and {v.ref.name for v in pool.resident()} == {"p", "a", "c"}


def test_nothing_is_evicted_unless_the_whole_step_fits():
    pool, slots = _pool(3)
    p1, p2, a = _version("p1", pinned=True), _version("p2", pinned=True), _version("a")
    pool.activate([p1, p2, a], _no_pins)
    slots.events.clear()
    b, c = _version("b"), _version("c")
    with pytest.raises(AdapterCapacityError, match=r"only 1 of 3 device slots can be freed \(2 pinned\)"):
        pool.activate([b, c], lambda: 2)
    assert slots.events == [] and a.slot == 2 and b.slot is None  # a kept its slot
    with pytest.raises(AdapterCapacityError, match="needs 4 distinct LoRAs but there are only 3"):
        pool.activate([a, b, c, _version("d")], _no_pins)


def test_reserved_counts_pinned_residents_outside_the_step():
    pool, _ = _pool(3)
    p1, p2, a = _version("p1", pinned=True), _version("p2", pinned=True), _version("a")
    pool.activate([p1, a], _no_pins)
    assert pool.reserved(set()) == 1 and pool.reserved({p1.ref}) == 0  # p2 is pinned but not resident
    pool.activate([p2], _no_pins)
    assert pool.reserved({a.ref}) == 2


def test_evict_clears_the_device_slot_once():
    pool, slots = _pool(2)
    a = _version("a")
    pool.activate([a], _no_pins)
    pool.evict(a)
    pool.evict(a)  # no longer resident: nothing to clear
    assert slots.events[-1:] == [("clear", 0)] and slots.events.count(("clear", 0)) == 1
    assert a.slot is None and pool.resident() == []
    b = _version("b")
    pool.activate([b], _no_pins)
    assert b.slot == 0  # the freed slot is reused first
