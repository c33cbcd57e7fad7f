"""Property-based test (hypothesis) of the LRU adapter tier against a simple model of its state.

The model is the tier's contract written plainly: an LRU list of CPU-cached versions (most recent
last), an LRU list of resident versions with their slot, pins by name (carried by the version the
name serves; a failed load holds none; at most MAX_LORAS - 1), holders per version, a replacement
that takes over only once it loaded (a failed one leaves the old version serving), and what each
operation does to them (see adapters/tier.py's docstring). After every operation the
real tier must agree on everything a user can observe: list(), lookup(), memory_stats(), which
operations raise, which slot activate() picks, and the rank written into every slot.
"""

import time
from collections import OrderedDict
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from adapters import AdapterCapacityError, AdapterManager, InvalidAdapterError, LoRARequest, UnknownAdapterError
from adapters.lora import dummy_lora, load_lora
from tests import factories

MAX_LORAS, MAX_CPU, MAX_RANK = 2, 3, 8
NAMES = st.sampled_from("abcde")
SOURCES = st.sampled_from(["s1", "s2", "s4", "s1", "s2", "s4", "broken"])  # one load in 7 fails
DUMMY_RANKS = st.sampled_from([1, 3])


@pytest.fixture(scope="module")
def lru_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("lru")
    base = factories.build_tiny_model("llama", seed=12, **factories.MICRO_LLAMA)
    spec = factories.model_spec(base)
    dirs, sizes = {}, {}
    for source, rank in (("s1", 1), ("s2", 2), ("s4", 4)):
        factories.save_lora(base, root / source, r=rank, seed=rank, target_modules=["q_proj", "down_proj"])
        dirs[source] = str(root / source)
        sizes[source] = (rank, load_lora(source, dirs[source], spec, max_lora_rank=MAX_RANK).nbytes)
    for rank in (1, 3):
        sizes[f"dummy{rank}"] = (rank, dummy_lora("d", spec, rank).nbytes)
    factories.save_lora(base, root / "broken", r=2, target_modules=["q_proj"])
    factories.edit_adapter_tensors(root / "broken", lambda t: {k: v * float("nan") for k, v in t.items()})
    dirs["broken"] = str(root / "broken")
    return dict(spec=spec, dirs=dirs, sizes=sizes)


@dataclass(eq=False)
class ModelVersion:
    """The model's view of one adapter version."""

    name: str
    source: str
    ready: bool = False  # False: failed (the state machine always waits for loads)
    holders: int = 0
    retired: bool = False
    slot: int | None = None
    previous: "ModelVersion | None" = None  # the ready version it replaces once it loaded


class LRUModel:
    """What the tier should hold, stated without its bookkeeping: LRU orders are OrderedDicts."""

    def __init__(self):
        self.current: dict[str, ModelVersion] = {}
        self.cpu_lru: OrderedDict[ModelVersion, None] = OrderedDict()  # every live version, LRU first
        self.slot_lru: OrderedDict[ModelVersion, None] = OrderedDict()  # resident versions, LRU first
        self.pinned: set[str] = set()

    def cached(self):
        return [v for v in self.cpu_lru if v.ready]

    def is_pinned(self, version):
        return version.name in self.pinned and self.current.get(version.name) is version

    def touch(self, version):
        self.cpu_lru[version] = None
        self.cpu_lru.move_to_end(version)

    def version_for(self, name, source):
        """The version a request for (name, source) uses; a new source replaces the current one."""
        version = self.current.get(name)
        if version is not None and version.source == source:
            return version, False
        new = ModelVersion(name, source)
        if version is not None and version.ready:
            new.previous = version  # serves on until the new one loaded
        elif version is not None:
            self.retire(version)
        self.current[name] = new
        return new, True

    def loaded(self, version, ok):
        version.ready, previous, version.previous = ok, version.previous, None
        if ok:
            if previous is not None:
                self.retire(previous)
            self.touch(version)
            self.trim()
            return
        if previous is not None:  # a failed replacement: the name falls back to the old version
            self.current[version.name] = previous
        else:
            self.pinned.discard(version.name)  # a failed version holds no pin
        if version.holders == 0:
            self.drop(version)

    def retire(self, version):
        version.retired = True
        if self.current.get(version.name) is version:
            del self.current[version.name]
        if version.holders == 0:
            self.drop(version)

    def release(self, version):
        version.holders -= 1
        if version.holders == 0:
            if version.retired or not version.ready:
                self.drop(version)
            else:
                self.trim()

    def drop(self, version):
        self.cpu_lru.pop(version, None)
        self.slot_lru.pop(version, None)
        version.slot = None
        if self.current.get(version.name) is version:
            del self.current[version.name]

    def trim(self):
        excess = len(self.cached()) - MAX_CPU
        victims = [v for v in self.cached() if v.holders == 0 and not self.is_pinned(v)]
        for victim in victims[:max(0, excess)]:
            self.drop(victim)

    def activate(self, versions):
        """Slots of `versions`, or AdapterCapacityError (then nothing changed)."""
        needed = list(dict.fromkeys(versions))
        if len(needed) > MAX_LORAS:
            raise AdapterCapacityError("more than slots")
        new = [v for v in needed if v.slot is None]
        used = {v.slot for v in self.slot_lru}
        free = [s for s in range(MAX_LORAS) if s not in used]
        victims = [v for v in self.slot_lru if v not in needed and not self.is_pinned(v)]
        if len(new) - len(free) > len(victims):
            raise AdapterCapacityError("pinned")
        for victim in victims[:max(0, len(new) - len(free))]:
            free.append(victim.slot)
            self.slot_lru.pop(victim)
            victim.slot = None
        for version, slot in zip(new, free):
            version.slot = slot
        for version in needed:
            self.slot_lru[version] = None
            self.slot_lru.move_to_end(version)
            self.touch(version)
        return [v.slot for v in versions]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lru_manager_matches_model(lru_env):
    env = lru_env

    class LRUMachine(RuleBasedStateMachine):
        @initialize()
        def start(self):
            self.manager = AdapterManager(env["spec"], max_loras=MAX_LORAS, max_lora_rank=MAX_RANK,
                                          max_cpu_loras=MAX_CPU, load_workers=1)
            self.tier, self.model = self.manager.loras, LRUModel()
            self.ref_of: dict[ModelVersion, object] = {}  # model version -> the tier's AdapterRef
            self.held: list[ModelVersion] = []

        def teardown(self):
            if hasattr(self, "manager"):
                self.manager.close()

        def _request(self, name, source):
            return LoRARequest(name, env["dirs"][source])

        def _wait(self, ref):
            """Wait for a load (the model is deterministic only with loads awaited); None if dropped."""
            try:
                while (state := self.tier.state(ref)) == "loading":
                    time.sleep(0.0002)
                return state
            except UnknownAdapterError:  # a failed load nobody holds, or evicted as soon as it was cached
                return None

        def _check_new_ref(self, version, ref, created):
            if created:
                assert ref not in self.ref_of.values(), "a new version must get a new ref"
                self.ref_of[version] = ref
            else:
                assert ref == self.ref_of[version], "the same (name, source) must reuse the current version"

        @precondition(lambda self: len(self.held) < 8)  # held versions beyond the CPU bound queue loads
        @rule(name=NAMES, source=SOURCES)
        def acquire(self, name, source):
            version, created = self.model.version_for(name, source)
            version.holders += 1
            self.model.touch(version)
            ref = self.tier.acquire(self._request(name, source))
            self._check_new_ref(version, ref, created)
            state = self._wait(ref)  # held: never dropped
            if created:
                self.model.loaded(version, source != "broken")
            assert state == ("ready" if version.ready else "failed")
            self.held.append(version)

        @precondition(lambda self: self.held)
        @rule(index=st.integers(0, 20))
        def release(self, index):
            version = self.held.pop(index % len(self.held))
            self.tier.release(self.ref_of[version])
            self.model.release(version)

        @rule(name=NAMES, source=SOURCES)
        def add(self, name, source):
            version, created = self.model.version_for(name, source)
            version.holders += 1
            self.model.touch(version)
            if created:
                self.model.loaded(version, source != "broken")
            if version.ready:
                self._check_new_ref(version, self.tier.add(self._request(name, source)), created)
            else:  # a broken file, or the name's current version failed and is still held
                with pytest.raises(InvalidAdapterError, match="NaN"):
                    self.tier.add(self._request(name, source))
            self.model.release(version)

        @rule(name=NAMES, source=SOURCES)
        def prefetch(self, name, source):
            version, created = self.model.version_for(name, source)
            self.model.touch(version)
            ref = self.tier.prefetch(self._request(name, source))
            self._check_new_ref(version, ref, created)
            if created:
                self._wait(ref)
                self.model.loaded(version, source != "broken")

        @rule(name=NAMES, rank=DUMMY_RANKS)
        def add_dummy(self, name, rank):
            if name in self.model.current:
                self.model.retire(self.model.current[name])
            version = ModelVersion(name, f"dummy{rank}", ready=True)
            self.model.current[name] = version
            self.model.touch(version)
            self.model.trim()
            self._check_new_ref(version, self.tier.add_dummy(name, rank), True)

        @rule(name=NAMES)
        def remove(self, name):
            expected = self.model.current.get(name)
            if expected is None:
                with pytest.raises(UnknownAdapterError):
                    self.tier.remove(name)
                return
            self.tier.remove(name)
            self.model.pinned.discard(name)
            self.model.retire(expected)

        @rule(name=NAMES)
        def pin(self, name):
            model = self.model
            if name not in model.current or not model.current[name].ready:
                with pytest.raises(UnknownAdapterError):
                    self.tier.pin(name)
            elif name not in model.pinned and len(model.pinned) >= MAX_LORAS - 1:
                with pytest.raises(AdapterCapacityError):
                    self.tier.pin(name)
            else:
                self.tier.pin(name)
                model.pinned.add(name)

        @rule(name=NAMES)
        def unpin(self, name):
            model = self.model
            if name not in model.current:
                with pytest.raises(UnknownAdapterError):
                    self.tier.unpin(name)
                return
            self.tier.unpin(name)
            model.pinned.discard(name)
            model.trim()

        @rule(picks=st.lists(st.integers(0, 20), max_size=3), names=st.lists(NAMES, max_size=2))
        def activate(self, picks, names):
            """Activate a mix of held versions and current (cached) ones."""
            versions = [self.held[i % len(self.held)] for i in picks if self.held]
            versions += [self.model.current[n] for n in names if n in self.model.current]
            versions = [v for v in versions if v.ready]
            refs = [self.ref_of[v] for v in versions]
            try:
                expected = self.model.activate(versions)
            except AdapterCapacityError:
                with pytest.raises(AdapterCapacityError):
                    self.tier.activate(refs)
                return
            assert self.tier.activate(refs) == expected

        @invariant()
        def agrees_with_model(self):
            if not hasattr(self, "model"):
                return
            model, tier = self.model, self.tier
            cached = model.cached()
            assert tier.list() == [v.name for v in cached if model.current.get(v.name) is v]
            for name in "abcde":
                version = model.current.get(name)
                assert tier.lookup(name) == (None if version is None else self.ref_of[version])
            stats = tier.memory_stats()
            assert stats["num_cpu"] == len(cached)
            assert stats["cpu_bytes"] == sum(env["sizes"][v.source][1] for v in cached)
            assert stats["num_resident"] == len(model.slot_lru)
            assert stats["device_bytes_used"] == sum(env["sizes"][v.source][1] for v in model.slot_lru)
            ranks = [0] * MAX_LORAS
            for version in model.slot_lru:
                ranks[version.slot] = env["sizes"][version.source][0]
            assert self.manager.lora_slots.slot_ranks.tolist() == ranks

    run_state_machine_as_test(LRUMachine, settings=settings(
        max_examples=100, stateful_step_count=40, deadline=None, database=None,
        suppress_health_check=[HealthCheck.too_slow]))
