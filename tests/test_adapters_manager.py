"""The LRU adapter manager: tiers, pinning, replacement, capacity, background loading, memory bounds."""

import gc
import random
import threading
import time
import weakref

import pytest
import torch

from adapters import (
    AdapterCapacityError,
    AdapterError,
    AdapterManager,
    AdapterNotFoundError,
    AdapterTooLargeError,
    LoRARequest,
    PromptAdapterRequest,
    UnknownAdapterError,
    UnsafeAdapterError,
)
from adapters.lora import dummy_lora, load_lora
from adapters.slots import LoRASlots
from tests import factories

RANKS = {"a": 2, "b": 4, "c": 8, "d": 4, "e": 2}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    base = factories.build_tiny_model("llama", seed=6)
    spec = factories.model_spec(base)
    dirs = {}
    for seed, (name, rank) in enumerate(RANKS.items()):
        factories.save_lora(base, root / name, r=rank, seed=seed)
        dirs[name] = str(root / name)
    factories.save_lora(base, root / "partial", r=2, seed=9, target_modules=["q_proj"], layers_to_transform=[0])
    factories.save_lora(base, root / "too_big", r=16, seed=10)
    for n in (4, 2):
        factories.save_prompt_adapter(base, root / f"p{n}", num_virtual_tokens=n, seed=n)
    dirs.update(partial=str(root / "partial"), too_big=str(root / "too_big"), p4=str(root / "p4"), p2=str(root / "p2"))
    nbytes = {name: load_lora(name, dirs[name], spec, max_lora_rank=8).nbytes for name in [*RANKS, "partial"]}
    return dict(spec=spec, dirs=dirs, nbytes=nbytes, root=root)


@pytest.fixture
def make(env):
    managers = []

    def make(**overrides):
        kwargs = dict(max_loras=2, max_lora_rank=8, max_cpu_loras=3, max_prompt_adapters=1, max_prompt_adapter_tokens=4)
        kwargs.update(overrides)
        manager = AdapterManager(env["spec"], **kwargs)
        managers.append(manager)
        return manager

    yield make
    for manager in managers:
        manager.close()


def req(env, name, source=None):
    return LoRARequest(name, env["dirs"][source or name])


def wait(tier, ref, timeout=20.0):
    deadline = time.monotonic() + timeout
    while tier.state(ref) == "loading":
        assert time.monotonic() < deadline, f"{ref} still loading"
        time.sleep(0.005)
    return tier.state(ref)


def assert_slot_holds(manager, slot, env, source):
    """The slot equals a fresh slot written with the adapter read straight from disk (None: empty)."""
    spec = env["spec"]
    expected = LoRASlots(spec, 1, manager.max_lora_rank)
    expected.write(0, load_lora(source, env["dirs"][source], spec, max_lora_rank=8))
    for module in spec.modules:
        for got, want in zip(manager.lora_slots.weights(*module.key), expected.weights(*module.key)):
            assert torch.equal(got[slot], want[0]), (slot, source, module.key)
    assert manager.lora_slots.slot_ranks[slot].item() == expected.slot_ranks[0].item()


def test_cpu_cache_is_lru_and_bounded(env, make):
    m = make()
    for name in "abc":
        m.loras.add(req(env, name))
    m.loras.add(req(env, "a"))  # touch a: b is now least recently used
    m.loras.add(req(env, "d"))
    assert m.loras.list() == ["c", "a", "d"]
    stats = m.loras.memory_stats()
    assert stats["num_cpu"] == 3 and stats["cpu_bytes"] == sum(env["nbytes"][n] for n in "cad")
    assert stats["num_resident"] == 0 and stats["device_bytes_used"] == 0


def test_activate_evicts_only_unneeded_lru_slots(env, make):
    m = make()
    refs = {n: m.loras.add(req(env, n)) for n in "abc"}
    assert m.loras.activate([refs["a"], refs["b"], refs["a"]]) == [0, 1, 0]
    assert_slot_holds(m, 0, env, "a")
    m.loras.activate([refs["b"]])  # b used more recently than a
    assert m.loras.activate([refs["c"], refs["b"]]) == [0, 1]  # a (LRU, not needed) makes room
    assert_slot_holds(m, 0, env, "c")  # rank 8 over rank 2
    assert m.loras.activate([refs["b"], refs["a"]]) == [1, 0]  # c evicted; a (rank 2) zeroes c's rows
    assert_slot_holds(m, 0, env, "a")
    assert m.loras.memory_stats()["device_bytes_used"] == env["nbytes"]["a"] + env["nbytes"]["b"]
    stats = m.stats
    assert (stats.lora_loads, stats.lora_evictions, stats.lora_disk_loads, stats.lora_cpu_evictions) == (4, 2, 3, 0)


def test_too_many_adapters_for_the_slots_is_refused_without_side_effects(env, make):
    m = make()
    refs = [m.loras.add(req(env, n)) for n in "abc"]
    m.loras.activate(refs[:2])
    before = [t.clone() for t in m.lora_slots.weights(1, "qkv")]
    with pytest.raises(AdapterCapacityError, match="3 distinct LoRAs but there are only 2"):
        m.loras.activate(refs)
    assert all(torch.equal(b, t) for b, t in zip(before, m.lora_slots.weights(1, "qkv")))
    assert m.loras.activate(refs[:2]) == [0, 1]


def test_pinned_adapters_stay_in_cpu_cache_and_slot(env, make):
    m = make(max_loras=3, max_cpu_loras=3)
    refs = {n: m.loras.add(req(env, n)) for n in "ab"}
    m.loras.pin("a")
    assert m.loras.activate([refs["a"], refs["b"]]) == [0, 1]
    refs["c"] = m.loras.add(req(env, "c"))
    m.loras.pin("c")
    with pytest.raises(AdapterCapacityError, match="at least one must stay free"):  # 2 of 3 slots pinned
        m.loras.pin("b")
    held = m.loras.acquire(req(env, "d"))  # held by a request: over capacity, b (not a: pinned) is evicted
    assert wait(m.loras, held) == "ready" and m.loras.list() == ["a", "c", "d"]
    assert m.loras.memory_stats()["num_resident"] == 1 and m.loras.num_pinned() == 2
    assert m.loras.activate([refs["c"]]) == [1]  # two slots now hold pinned adapters
    assert m.loras.reserved_slots({held}) == 2 and m.loras.reserved_slots({held, refs["a"]}) == 1
    other = m.loras.acquire(req(env, "e"))
    assert wait(m.loras, other) == "ready"
    with pytest.raises(AdapterCapacityError, match="can be freed"):
        m.loras.activate([held, other])
    m.loras.release(other)
    assert m.loras.activate([held]) == [2]
    m.loras.unpin("c")
    assert m.loras.reserved_slots({held}) == 1
    assert m.loras.activate([held, refs["a"]]) == [2, 0]
    assert_slot_holds(m, 2, env, "d")
    m.loras.release(held)
    assert m.loras.list() == ["c", "d", "a"]  # LRU first: activate touched d, then a
    with pytest.raises(UnknownAdapterError):
        m.loras.pin("nope")
    with pytest.raises(UnknownAdapterError):
        m.loras.unpin("nope")


def test_replacement_keeps_old_version_for_running_requests(env, make):
    m = make()
    old = m.loras.acquire(req(env, "t", "a"))
    assert wait(m.loras, old) == "ready"
    old_slot = m.loras.activate([old])[0]
    new = m.loras.acquire(req(env, "t", "c"))  # same name, other path: a replacement
    assert new != old and new.name == old.name
    assert wait(m.loras, new) == "ready" and m.loras.lookup("t") == new  # it took over once loaded
    slots = m.loras.activate([old, new])
    assert slots[0] == old_slot and slots[1] != old_slot
    assert_slot_holds(m, slots[0], env, "a")
    assert_slot_holds(m, slots[1], env, "c")
    assert m.loras.list() == ["t"] and m.loras.memory_stats()["num_cpu"] == 2
    m.loras.release(old)  # the last holder of the old version: it is dropped with its slot
    stats = m.loras.memory_stats()
    assert stats["num_cpu"] == 1 and stats["num_resident"] == 1 and stats["cpu_bytes"] == env["nbytes"]["c"]
    assert m.lora_slots.slot_ranks[old_slot].item() == 0
    with pytest.raises(UnknownAdapterError):
        m.loras.state(old)
    m.loras.release(new)
    with pytest.raises(ValueError, match="without a matching acquire"):
        m.loras.release(new)


def test_remove_is_deferred_while_in_use(env, make):
    m = make()
    ref = m.loras.acquire(req(env, "a"))
    wait(m.loras, ref)
    m.loras.remove("a")
    assert m.loras.list() == [] and m.loras.lookup("a") is None
    assert m.loras.activate([ref]) == [0]  # the running request keeps its weights
    assert m.loras.memory_stats()["num_cpu"] == 1
    m.loras.release(ref)
    assert m.loras.memory_stats() == dict(cpu_bytes=0, device_bytes_used=0, num_cpu=0, num_resident=0,
                                          device_bytes_allocated=m.lora_slots.nbytes)
    with pytest.raises(UnknownAdapterError, match="unknown LoRA 'a'"):
        m.loras.remove("a")


def test_background_loading_never_blocks_and_failures_are_remembered(env, make):
    gate, calls = threading.Event(), []

    def resolver(path, revision, patterns, local_files_only):
        calls.append(path)
        if path == "flaky":
            if calls.count("flaky") == 1:
                raise AdapterNotFoundError("adapter 'flaky': repo 'flaky' not found")
            return env["dirs"]["a"]
        if path == "slow":
            assert gate.wait(20)
            return env["dirs"]["b"]
        return env["dirs"].get(path, path)

    m = make(resolver=resolver)
    try:
        _check_background_loading(env, m, gate, calls)
    finally:
        gate.set()  # never leave a worker blocked


def _check_background_loading(env, m, gate, calls):
    start = time.monotonic()
    slow = m.loras.acquire(LoRARequest("s", "slow"))
    flaky = m.loras.acquire(LoRARequest("f", "flaky"))
    assert time.monotonic() - start < 1.0 and m.loras.state(slow) == "loading"
    with pytest.raises(ValueError, match="loading"):
        m.loras.activate([slow])
    assert wait(m.loras, flaky) == "failed"
    assert isinstance(m.loras.error(flaky), AdapterNotFoundError)
    assert m.loras.acquire(LoRARequest("f", "flaky")) == flaky  # still held: same failure, no retry
    assert calls.count("flaky") == 1
    m.loras.release(flaky)
    m.loras.release(flaky)
    retry = m.loras.acquire(LoRARequest("f", "flaky"))  # forgotten once released: loads again
    assert retry != flaky and wait(m.loras, retry) == "ready" and m.loras.error(retry) is None
    gate.set()
    assert wait(m.loras, slow) == "ready"
    assert_slot_holds(m, m.loras.activate([slow])[0], env, "b")
    prefetched = m.loras.prefetch(req(env, "c"))
    assert wait(m.loras, prefetched) == "ready" and "c" in m.loras.list()


def test_invalid_adapters_raise_and_leave_the_manager_usable(env, make, tmp_path):
    m = make(max_adapter_bytes=10**6)
    good = m.loras.add(req(env, "a"))
    m.loras.activate([good])
    stats = m.loras.memory_stats()
    factories.save_lora(factories.build_tiny_model("llama", seed=6), tmp_path / "bin", r=2)
    bin_dir = tmp_path / "bin"
    (bin_dir / "adapter_model.safetensors").rename(tmp_path / "moved.safetensors")
    torch.save({}, str(bin_dir / "adapter_model.bin"))
    cases = [(LoRARequest("big", env["dirs"]["too_big"]), AdapterTooLargeError),
             (LoRARequest("missing", str(tmp_path / "nope")), AdapterNotFoundError),
             (LoRARequest("pickle", str(bin_dir)), UnsafeAdapterError)]
    for request, error in cases:
        with pytest.raises(error, match=repr(request.name)):
            m.loras.add(request)
        ref = m.loras.acquire(request)  # in the engine: the request fails alone
        assert wait(m.loras, ref) == "failed" and isinstance(m.loras.error(ref), error)
        m.loras.release(ref)
    small = make(max_adapter_bytes=1000)
    with pytest.raises(AdapterTooLargeError, match="max_adapter_bytes=1000"):
        small.loras.add(req(env, "c"))
    assert m.loras.memory_stats() == stats and m.loras.list() == ["a"]
    assert m.loras.activate([m.loras.add(req(env, "b")), good]) == [1, 0]


def test_dummy_adapters_for_warmup(env, make):
    m = make()
    ref = m.loras.add_dummy("warmup", 8)
    slot = m.loras.activate([ref])[0]
    assert m.lora_slots.slot_ranks[slot].item() == 8
    for module in m.spec.modules:
        lora_a, lora_b = m.lora_slots.weights(*module.key)
        assert lora_a[slot].abs().min() > 0 and lora_b[slot].abs().min() > 0  # every module, full rank
    with pytest.raises(AdapterTooLargeError):
        m.loras.add_dummy("huge", 16)
    with pytest.raises(ValueError):
        m.loras.add_dummy("zero", 0)
    m.loras.remove("warmup")
    assert m.loras.memory_stats()["cpu_bytes"] == 0 and m.lora_slots.slot_ranks.sum().item() == 0
    pref = m.prompts.add_dummy("pw", 4)
    assert m.prompts.num_virtual_tokens(pref) == 4 and m.prompts.activate([pref]) == [0]


def test_prompt_adapters(env, make):
    m = make()
    p4 = m.prompts.add(PromptAdapterRequest("p4", env["dirs"]["p4"]))
    p2 = m.prompts.acquire(PromptAdapterRequest("p2", env["dirs"]["p2"]))
    wait(m.prompts, p2)
    assert m.prompts.num_virtual_tokens(p4) == 4 and m.prompts.num_virtual_tokens(p2) == 2
    assert m.prompts.activate([p4]) == [0]
    with pytest.raises(AdapterCapacityError):
        m.prompts.activate([p4, p2])
    assert m.prompts.activate([p2]) == [0]  # p4 was not needed: evicted; p2 zeroes its rows 2..3
    assert m.prompt_slots.num_virtual_tokens.tolist() == [2]
    assert torch.all(m.prompt_slots.embeddings[0, 2:] == 0)
    with pytest.raises(ValueError, match="PromptAdapterRequest"):
        m.prompts.add(LoRARequest("x", env["dirs"]["a"]))
    disabled = make(max_prompt_adapters=0, max_prompt_adapter_tokens=0)
    with pytest.raises(AdapterCapacityError, match="disabled"):
        disabled.prompts.add(PromptAdapterRequest("p4", env["dirs"]["p4"]))


def test_partial_adapter_leaves_untargeted_modules_zero(env, make):
    m = make()
    refs = [m.loras.add(req(env, "partial")), m.loras.add(req(env, "a"))]
    assert m.loras.activate(refs) == [0, 1]
    assert_slot_holds(m, 0, env, "partial")  # untargeted modules are zero


def test_memory_returns_to_what_cached_adapters_need(env, make):
    """Random sequences of every operation; then all released and removed: nothing left anywhere."""
    rng = random.Random(1234)
    m = make(max_cpu_loras=3)
    dummy_bytes = {rank: dummy_lora("d", env["spec"], rank).nbytes for rank in (1, 8)}
    held, source_of = [], {}  # source_of: name -> bytes of the version the name refers to now
    for _ in range(300):
        op = rng.choice(["acquire", "acquire", "release", "add", "remove", "activate", "pin", "unpin", "dummy"])
        name, source, rank = rng.choice("vwxyz"), rng.choice(list(RANKS)), rng.choice([1, 8])
        try:
            if op == "acquire":  # waits, so no background load races the checks below
                if len(held) >= 8:  # more held versions than the CPU bound would queue this load forever
                    m.loras.release(held.pop(0))
                held.append(m.loras.acquire(req(env, name, source)))
                wait(m.loras, held[-1])
                source_of[name] = env["nbytes"][source]
            elif op == "release" and held:
                m.loras.release(held.pop(rng.randrange(len(held))))
            elif op == "add":
                m.loras.add(req(env, name, source))
                source_of[name] = env["nbytes"][source]
            elif op == "remove":
                m.loras.remove(name)
            elif op == "activate" and held:
                m.loras.activate(rng.sample(held, min(len(held), 2)))
            elif op == "pin":
                m.loras.pin(name)
            elif op == "unpin":
                m.loras.unpin(name)
            elif op == "dummy":
                m.loras.add_dummy(name, rank)
                source_of[name] = dummy_bytes[rank]
        except (UnknownAdapterError, AdapterCapacityError):
            pass
        stats = m.loras.memory_stats()
        assert stats["num_resident"] == int((m.lora_slots.slot_ranks > 0).sum())
        assert stats["num_cpu"] <= 3 + len(set(held)) + 3  # over capacity only by held or pinned adapters
    for ref in held:
        m.loras.release(ref)
    stats, cached = m.loras.memory_stats(), m.loras.list()
    assert stats["num_cpu"] == len(cached) <= 3
    assert stats["cpu_bytes"] == sum(source_of[name] for name in cached)
    for name in cached:
        m.loras.unpin(name)
        m.loras.remove(name)
    assert m.loras.memory_stats() == dict(cpu_bytes=0, device_bytes_used=0, num_cpu=0, num_resident=0,
                                          device_bytes_allocated=m.lora_slots.nbytes)
    assert m.lora_slots.slot_ranks.sum().item() == 0 and m.loras.list() == []


def test_weights_are_freed_when_dropped(env, make):
    m = make(max_cpu_loras=2)
    ref = m.loras.add(req(env, "a"))
    m.loras.activate([ref])
    probe = weakref.ref(m.loras._get(ref).weights)  # noqa: SLF001
    m.loras.add(req(env, "b"))
    m.loras.add(req(env, "c"))  # evicts a from the CPU cache and its slot
    gc.collect()
    assert probe() is None and "a" not in m.loras.list()


def test_concurrent_users_and_step_thread(env, make):
    m = make(max_cpu_loras=3)
    stop, errors = threading.Event(), []

    def user(seed):
        rng = random.Random(seed)
        while not stop.is_set():
            name = rng.choice("vwxy")
            try:
                rng.choice([lambda: m.loras.add(req(env, name, rng.choice(list(RANKS)))),
                            lambda: m.loras.prefetch(req(env, name, rng.choice(list(RANKS)))),
                            lambda: m.loras.remove(name), lambda: m.loras.pin(name),
                            lambda: m.loras.unpin(name)])()
            except AdapterError:
                pass
            except Exception as exc:  # noqa: BLE001 - any other exception is a bug the test reports
                errors.append(exc)

    threads = [threading.Thread(target=user, args=(seed,)) for seed in range(2)]
    for thread in threads:
        thread.start()
    rng, deadline = random.Random(7), time.monotonic() + 1.5
    while time.monotonic() < deadline:  # the engine's step loop
        refs = [m.loras.acquire(req(env, n, rng.choice(list(RANKS)))) for n in rng.sample("vwxyz", 2)]
        ready = [r for r in refs if wait(m.loras, r) == "ready"]
        try:
            m.loras.activate(ready)
        except AdapterCapacityError:  # both slots pinned by the users: a legal refusal
            pass
        for ref in refs:
            m.loras.release(ref)
    stop.set()
    for thread in threads:
        thread.join()
    assert errors == []
    for name in "vwxyz":
        try:
            m.loras.unpin(name)
            m.loras.remove(name)
        except UnknownAdapterError:
            pass
    assert m.loras.memory_stats()["num_cpu"] == 0 and m.lora_slots.slot_ranks.sum().item() == 0
