"""Soak: thousands of add / acquire / activate / evict / replace / remove cycles over hundreds of
adapters with 2 device slots and a CPU cache of 4. Memory held (CPU bytes, device bytes, pinned
buffers) must always equal what the cached and resident adapters need, counted two ways: the
manager's memory_stats() and a census of every live tensor storage in the process. Nothing leaks:
once everything is removed the census is back to its baseline.

The figures (cycles, peak and final memory) are printed; see them with ``pytest -s``.
"""

import gc
import logging
import random
import threading

import pytest
import torch

from adapters import AdapterCapacityError, AdapterManager, LoRARequest, UnknownAdapterError
from adapters.lora import dummy_lora, load_lora
from tests import factories

NUM_NAMES = 300  # distinct adapter names; each (name, source) pair is a separate adapter version
CYCLES = 4000
CHECKPOINTS = 4  # storage censuses (each walks every Python object: 0.3-2 s)
MAX_LORAS, MAX_CPU, MAX_RANK, MAX_HELD = 2, 4, 8, 3
SOURCES = {  # tiny real PEFT checkpoints: name -> save_lora kwargs
    "s1": dict(r=1, seed=1),
    "s2": dict(r=2, seed=2, target_modules=["q_proj", "v_proj"]),
    "s4": dict(r=4, seed=3, lora_alpha=4, use_rslora=True),
    "s6": dict(r=6, seed=4, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "s8": dict(r=8, seed=5, rank_pattern={"o_proj": 3}),
}
DUMMY_RANKS = (1, 3, 8)


@pytest.fixture(scope="module")
def soak_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("soak")
    base = factories.build_tiny_model("llama", seed=11, **factories.MICRO_LLAMA)
    spec = factories.model_spec(base)
    dirs, nbytes, ranks = {}, {}, {}
    for name, kwargs in SOURCES.items():
        factories.save_lora(base, root / name, **kwargs)
        dirs[name] = str(root / name)
        weights = load_lora(name, dirs[name], spec, max_lora_rank=MAX_RANK)
        nbytes[name], ranks[name] = weights.nbytes, weights.rank
    for rank in DUMMY_RANKS:
        nbytes[f"dummy{rank}"], ranks[f"dummy{rank}"] = dummy_lora("d", spec, rank).nbytes, rank
    broken = root / "broken"
    factories.save_lora(base, broken, r=2, seed=9)
    (broken / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    dirs["broken"] = str(broken)
    return dict(spec=spec, dirs=dirs, nbytes=nbytes, ranks=ranks)


def tensor_census() -> dict[str, int]:
    """Bytes of every live tensor storage in the process, each storage counted once, by kind."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.layout == torch.strided and obj.device.type != "meta":
            storage = obj.untyped_storage()
            kind = obj.device.type if obj.device.type != "cpu" else "pinned" if obj.is_pinned() else "cpu"
            storages[(kind, storage.data_ptr())] = storage.nbytes()
    totals = {"cpu": 0, "pinned": 0, "cuda": 0}
    for (kind, _), size in storages.items():
        totals[kind] = totals.get(kind, 0) + size
    return totals


def host_bytes(census: dict[str, int], since: dict[str, int]) -> int:
    """Host bytes (pageable + pinned) allocated between two censuses. On a GPU machine the CPU cache
    pins loaded adapters (so slot writes are asynchronous); dummy adapters stay pageable."""
    return census["cpu"] + census["pinned"] - since["cpu"] - since["pinned"]


def rss_bytes() -> int:
    """Resident set size of this process (Linux), 0 where unavailable."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


class Soak:
    """Drives random operations on a manager and keeps the expected state the checks need."""

    def __init__(self, env, manager, seed):
        self.env, self.m, self.rng = env, manager, random.Random(seed)
        self.held = []  # refs acquired and not yet released (a live request each)
        self.source_of = {}  # name -> source of the version the name refers to (the last one asked for)
        self.source_of_ref = {}  # ref -> source
        self.prefetched = []
        self.events = dict(unknown=0, capacity=0, failed=0)

    def request(self, name, source):
        return LoRARequest(name, self.env["dirs"][source])

    def step(self):
        rng, m = self.rng, self.m
        name, source = f"t{rng.randrange(NUM_NAMES)}", rng.choice(list(SOURCES))
        op = rng.choices(["add", "acquire", "release", "activate", "dummy", "remove", "pin", "unpin", "prefetch",
                          "fail"], weights=[6, 6, 5, 8, 3, 3, 1, 1, 2, 1])[0]
        try:
            if op == "add":
                self._note(m.loras.add(self.request(name, source)), source)
            elif op == "acquire":
                if len(self.held) >= MAX_HELD:
                    m.loras.release(self.held.pop(0))
                ref = m.loras.acquire(self.request(name, source))
                self.held.append(ref)
                self._note(ref, source)
                self._wait(ref)
            elif op == "release" and self.held:
                m.loras.release(self.held.pop(rng.randrange(len(self.held))))
            elif op == "activate":
                self._activate()
            elif op == "dummy":
                rank = rng.choice(DUMMY_RANKS)
                self._note(m.loras.add_dummy(name, rank), f"dummy{rank}")
            elif op == "remove":
                m.loras.remove(rng.choice(m.loras.list() or [name]))
            elif op == "pin":
                m.loras.pin(rng.choice(m.loras.list() or [name]))
            elif op == "unpin":
                m.loras.unpin(rng.choice(m.loras.list() or [name]))
            elif op == "prefetch":
                self.prefetched.append(m.loras.prefetch(self.request(name, source)))
                self._note(self.prefetched[-1], source)
            elif op == "fail":  # a broken file: the request's version fails, the name is forgotten on release
                ref = m.loras.acquire(self.request(name, "broken"))
                assert self._wait(ref) == "failed"
                m.loras.release(ref)
                self.events["failed"] += 1
        except UnknownAdapterError:
            self.events["unknown"] += 1
        except AdapterCapacityError:  # pin of a full cache, or both slots pinned
            self.events["capacity"] += 1

    def _note(self, ref, source):
        self.source_of[ref.name] = source
        self.source_of_ref[ref] = source

    def _wait(self, ref, timeout=20.0):
        """The version's state once its load is over: waits on the load's done event (set by the
        loading thread), no polling; the timeout is a hang guard only."""
        assert self.m.loras._get(ref).done.wait(timeout), f"{ref} still loading"
        return self.m.loras.state(ref)

    def _activate(self):
        """Activate a random mix of held refs and cached names, then check each slot holds its adapter."""
        m, rng = self.m, self.rng
        cached = m.loras.list()
        refs = list(dict.fromkeys(rng.sample(self.held, min(len(self.held), rng.randint(0, MAX_LORAS)))))
        for name in rng.sample(cached, min(len(cached), MAX_LORAS - len(refs))):
            ref = m.loras.lookup(name)
            if ref not in refs:
                refs.append(ref)
        quiescent = not self.loading()
        slots = m.loras.activate(refs)
        assert len(set(slots)) == len(refs)
        for ref, slot in zip(refs, slots):
            if quiescent or ref in self.held:  # else a finishing prefetch may evict an unheld one at once
                assert m.lora_slots.slot_ranks[slot].item() == self.env["ranks"][self.source_of_ref[ref]]

    def settle(self):
        """Wait for background loads, so a census sees a quiescent manager."""
        for ref in self.prefetched:
            try:
                self._wait(ref)
            except UnknownAdapterError:  # dropped (replaced, removed or evicted) meanwhile
                pass
        self.prefetched.clear()

    def loading(self) -> bool:
        """True while a prefetch still loads (it may then publish and evict at any moment)."""
        still = []
        for ref in self.prefetched:
            try:
                if self.m.loras.state(ref) == "loading":
                    still.append(ref)
            except UnknownAdapterError:
                pass
        self.prefetched = still
        return bool(still)

    def check_bounds(self):
        quiescent = not self.loading()
        stats = self.m.loras.memory_stats()
        assert stats["num_cpu"] <= MAX_CPU + len(set(self.held)), stats
        assert stats["num_resident"] <= MAX_LORAS
        if quiescent:  # nothing can change behind our back between these two reads
            assert stats["num_resident"] == int((self.m.lora_slots.slot_ranks > 0).sum())
        assert stats["device_bytes_allocated"] == self.m.lora_slots.nbytes
        assert stats["device_bytes_used"] <= stats["cpu_bytes"]  # every resident adapter is also cached
        return stats

    def expected_cpu_bytes(self):
        """What the cached adapters need when no request holds a retired version."""
        return sum(self.env["nbytes"][self.source_of[name]] for name in self.m.loras.list())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_soak_memory_returns_to_what_resident_adapters_need(soak_env, device):
    threads_before = set(threading.enumerate())
    baseline = tensor_census()
    m = AdapterManager(soak_env["spec"], max_loras=MAX_LORAS, max_lora_rank=MAX_RANK, max_cpu_loras=MAX_CPU,
                       device=device, load_workers=2)
    try:
        soak = Soak(soak_env, m, seed=2024)
        slots_census = tensor_census()
        slot_bytes = m.lora_slots.nbytes
        # per-slot ranks, and which slots hold expert LoRA; prompt adapters are off: their slots are empty
        ranks_bytes = m.lora_slots.slot_ranks.nbytes + m.lora_slots.expert_ranks.nbytes
        assert slots_census[device] - baseline[device] == slot_bytes + ranks_bytes  # allocated once, up front
        rss_start, peak_stats_bytes, peak_census, peak_pinned, peak_rss = rss_bytes(), 0, 0, 0, 0
        for cycle in range(1, CYCLES + 1):
            soak.step()
            peak_stats_bytes = max(peak_stats_bytes, soak.check_bounds()["cpu_bytes"])
            if cycle % (CYCLES // CHECKPOINTS) == 0:
                soak.settle()
                census, stats = tensor_census(), m.loras.memory_stats()
                # every byte of adapter weights alive in the process is one the manager accounts for
                assert host_bytes(census, slots_census) == stats["cpu_bytes"], (cycle, census, stats)
                assert census["cuda"] == slots_census["cuda"]  # no device memory beyond the slots
                peak_census = max(peak_census, host_bytes(census, slots_census))
                peak_pinned = max(peak_pinned, census["pinned"] - slots_census["pinned"])
                peak_rss = max(peak_rss, rss_bytes())
        assert peak_stats_bytes <= (MAX_CPU + MAX_HELD) * max(soak_env["nbytes"].values())
        for ref in soak.held:
            m.loras.release(ref)
        soak.held.clear()
        soak.settle()
        stats = m.loras.memory_stats()
        assert stats["cpu_bytes"] == soak.expected_cpu_bytes() and stats["num_cpu"] <= MAX_CPU
        resident = host_bytes(tensor_census(), slots_census)
        assert resident == stats["cpu_bytes"]
        counts = m.loras.counts()
        assert counts["disk_loads"] > CYCLES // 10 and counts["slot_evictions"] > CYCLES // 20
        assert counts["cpu_evictions"] > CYCLES // 20 and soak.events["failed"] > 0
        for name in m.loras.list():
            m.loras.unpin(name)
            m.loras.remove(name)
        final = m.loras.memory_stats()
        assert final == dict(cpu_bytes=0, device_bytes_used=0, device_bytes_allocated=slot_bytes, num_cpu=0,
                             num_resident=0)
        assert m.lora_slots.slot_ranks.sum().item() == 0
        final_census = tensor_census()
        assert final_census == slots_census  # nothing leaked: CPU, pinned and device bytes all back
        logging.getLogger(__name__).info(
              f"soak[{device}]: {CYCLES} cycles over {NUM_NAMES} names x {len(SOURCES)} sources; "
              f"{counts['disk_loads']} disk loads, {counts['slot_loads']} slot writes, {counts['slot_evictions']} "
              f"slot evictions, {counts['cpu_evictions']} CPU evictions, {counts['load_failures']} failed loads; "
              f"adapter CPU bytes peak {peak_stats_bytes} (census peak {peak_census}), after release "
              f"{resident}, final {host_bytes(final_census, slots_census)} (pinned peak {peak_pinned}); device slots "
              f"{slot_bytes} bytes allocated once, used at end {final['device_bytes_used']}; "
              f"RSS start {rss_start >> 20} MiB, peak {peak_rss >> 20} MiB, end {rss_bytes() >> 20} MiB; "
              f"events {soak.events}")
    finally:
        m.close()
    for thread in set(threading.enumerate()) - threads_before:  # the load pool's workers end on close()
        thread.join(20)
        assert not thread.is_alive(), f"{thread.name} still runs after AdapterManager.close()"
