"""The adapter tier's one lock guards its four parts, whichever module of the tier touches them.

``AdapterTier`` is split into mixins (adapters.tier_state, tier_loads, tier_served, tier_pins,
tier_stats); every method of every mixin must still reach the version table, the CPU cache, the
slot pool and the load queue only with the tier's lock held (the parts have no locks of their
own). Here each part is wrapped in a guard that records any use without the lock, and a run
through every public method of the tier (loads in worker threads included) must record none.
The parts' records also keep the tier's one logger name ("adapters.tier").
"""

import logging

import pytest

from adapters import AdapterManager, LoRARequest, UnknownAdapterError
from adapters.versions import ServedAdapter
from test_adapters_manager import wait
from tests import factories

# what the tier reads of its parts without the lock, by design: fixed bounds and the byte check of a
# load's weights, both pure (adapters.cpu_cache.CPUCache.check_fits, LoadQueue.max_loading)
UNLOCKED_OK = {"check_fits", "max_bytes", "max_loading"}


class Guarded:
    """Forwards to ``part``, recording in ``misses`` every use while ``lock`` is not held by this thread."""

    def __init__(self, part, lock, label: str, misses: list):
        self._part, self._lock, self._label, self._misses = part, lock, label, misses

    def _check(self, what: str) -> None:
        if what not in UNLOCKED_OK and not self._lock._is_owned():  # noqa: SLF001 - RLock's owner check
            self._misses.append(f"{self._label}.{what}")

    def __getattr__(self, name):
        self._check(name)
        return getattr(self._part, name)

    def __iter__(self):
        self._check("__iter__")
        return iter(self._part)

    def __len__(self):
        self._check("__len__")
        return len(self._part)

    def __contains__(self, item):
        self._check("__contains__")
        return item in self._part


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("tier_locking")
    base = factories.build_tiny_model("llama", seed=6)
    for seed, name in enumerate(["a", "b", "c"]):
        factories.save_lora(base, root / name, r=2 + 2 * seed, seed=seed)
    return dict(spec=factories.model_spec(base), root=root)


def guarded_tier(env):
    manager = AdapterManager(env["spec"], max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    tier, misses = manager.loras, []
    for attr in ("_versions", "_cpu", "_slot_pool", "_loads"):
        setattr(tier, attr, Guarded(getattr(tier, attr), tier._lock, attr, misses))  # noqa: SLF001
    return manager, tier, misses


def test_every_public_method_uses_the_parts_under_the_tiers_lock(env, caplog):
    manager, tier, misses = guarded_tier(env)
    request = {name: LoRARequest(name, str(env["root"] / name)) for name in "abc"}
    try:
        with caplog.at_level(logging.DEBUG, logger="adapters.tier"):
            a = tier.add(request["a"])
            b = tier.acquire(request["b"])  # a worker thread loads it
            assert wait(tier, b) == "ready"
            c = tier.prefetch(request["c"])  # one over max_cpu: the least recently used unheld version goes
            assert wait(tier, c) == "ready" and tier.lookup("a") is None and tier.list() == ["b", "c"]
            tier.pin("b")
            assert tier.num_pinned() == 1 and tier.reserved_slots([a]) == 0
            assert tier.activate([b]) == [0] and tier.reserved_slots([]) == 1 and tier.size(b) == 4
            tier.unpin("b")
            tier.release(b)
            staged = tier.stage(request["a"], fresh=True)
            assert tier.publish(ServedAdapter("a", request["a"]), replace=False, ref=staged)
            tier.release(staged)
            assert tier.served("a").request == request["a"] and [s.name for s in tier.served_all()] == ["a"]
            assert tier.withdraw("a").name == "a"
            with pytest.raises(UnknownAdapterError):
                tier.withdraw("a")
            dummy = tier.add_dummy("warm", 4, hold=True)
            tier.remove("warm")
            tier.release(dummy)
            assert tier.memory_stats()["num_resident"] == 1 and tier.load_stats()["queued"] == 0
            assert tier.counts()["cpu_evictions"] >= 1 and tier.cpu_bytes > 0
            tier.release_snapshots()
            tier.close()
    finally:
        manager.close()
    assert misses == [], f"parts used without the tier's lock: {sorted(set(misses))}"
    records = [r for r in caplog.records if r.name.startswith("adapters.tier")]
    assert records and {r.name for r in records} == {"adapters.tier"}, {r.name for r in records}
    assert any("evicted from the CPU cache" in r.getMessage() for r in records)
