"""The LoRA CPU cache counts the real bytes it holds and is bounded by max_cpu_lora_bytes as well as by count.

Bytes are checked against a census of every live tensor storage (the memory soak's), so counting the
wrong tensors, or a fused module's shared A once per slice, shows. Under a byte bound smaller than
three adapters the engine evicts least recently used adapters and reloads them, and stays exact
against PEFT; adapters held by a request in flight or pinned are never evicted; an adapter larger
than the whole bound is refused naming the setting while other requests go on; a mixture of
experts' expert LoRA is counted whole; the default bound never binds before the count; /metrics
shows the bytes.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch

from adapters import AdapterCapacityError, AdapterManager, CPUCacheBoundError, LoRARequest, ModelSpec
from adapters.lora import dummy_lora, load_lora
from adapters.request import PromptAdapterRequest
from adapters.slot_memory import lora_slot_bytes
from engine_support import assert_exact, make_engine, run_to_completion
from factories import build_tiny_model, model_spec, save_lora, save_prompt_adapter
from lora_runner import EngineConfig, SamplingParams
from lora_runner.model import load_model
from lora_runner.model.lora_linear import decoder_lora_modules
from test_adapters_memory_soak import host_bytes, tensor_census

RANK = 16


def _manager(spec: ModelSpec, **overrides) -> AdapterManager:
    kwargs = dict(max_loras=2, max_lora_rank=RANK, max_cpu_loras=8, max_prompt_adapters=1,
                  max_prompt_adapter_tokens=8, local_files_only=True)
    return AdapterManager(spec, **{**kwargs, **overrides})


def _fused_spec(hf) -> ModelSpec:
    """Phi-3's spec: fused qkv_proj and gate_up_proj, whose slices share one A."""
    cfg = hf.config
    sizes = dict(num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads,
                 num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.hidden_size // cfg.num_attention_heads,
                 intermediate_size=cfg.intermediate_size)
    return ModelSpec(**sizes, modules=decoder_lora_modules(types.SimpleNamespace(**sizes, fused_projections=True)))


def _wait(tier, ref, timeout=20.0) -> str:
    assert tier._get(ref).done.wait(timeout), f"{ref} still loading"  # noqa: SLF001 - a hang guard
    return tier.state(ref)


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_bytes_counted_are_the_storages_the_cache_keeps_alive(arch, tmp_path):
    hf = build_tiny_model(arch, seed=3)
    spec = model_spec(hf) if arch == "llama" else _fused_spec(hf)
    targets = ("q_proj", "v_proj", "down_proj") if arch == "llama" else ("qkv_proj", "gate_up_proj", "o_proj")
    for seed, r in enumerate((4, 8)):
        save_lora(hf, tmp_path / f"lora{seed}", seed=seed, r=r, target_modules=targets)
    save_prompt_adapter(hf, tmp_path / "prompt", num_virtual_tokens=5)
    manager = _manager(spec)
    before = tensor_census()
    for seed in range(2):
        manager.loras.add(LoRARequest(f"lora{seed}", str(tmp_path / f"lora{seed}")))
    lora_bytes = host_bytes(tensor_census(), before)
    manager.prompts.add(PromptAdapterRequest("prompt", str(tmp_path / "prompt")))
    prompt_bytes = host_bytes(tensor_census(), before) - lora_bytes
    assert manager.loras.cpu_bytes == manager.loras.memory_stats()["cpu_bytes"] == lora_bytes > 0
    assert manager.stats.lora_cpu_cache_bytes == lora_bytes
    assert manager.prompts.memory_stats()["cpu_bytes"] == prompt_bytes == 5 * spec.hidden_size * 4
    if arch == "phi3":  # q, k and v share one A: counted once, not once per slice
        weights = load_lora("x", str(tmp_path / "lora0"), spec, max_lora_rank=RANK)
        per_pair = sum(t.numel() * t.element_size() for pair in weights.pairs() for t in (pair.a, pair.b))
        assert weights.nbytes < per_pair
        del weights  # the census below must see the cache's tensors only
    manager.loras.remove("lora0")
    manager.loras.remove("lora1")
    assert manager.loras.cpu_bytes == 0 == host_bytes(tensor_census(), before) - prompt_bytes
    manager.close()


@pytest.fixture(scope="module")
def adapter_bytes(engine_checkpoint):
    """{name: bytes its weights hold in the engine's CPU cache} of conftest's ENGINE_ADAPTERS."""
    path, _, adapters = engine_checkpoint
    spec = load_model(path)[1].spec()
    return {name: load_lora(name, adapters[name][0], spec, max_lora_rank=RANK).nbytes for name in adapters}


def test_a_byte_bound_below_three_adapters_evicts_lru_and_stays_exact(engine_checkpoint, adapter_bytes,
                                                                       greedy_oracle):
    path, hf, adapters = engine_checkpoint
    names = ["r4", "r8-rslora", "r16-patterns", "r16-mlp"]
    sizes = sorted(adapter_bytes[name] for name in names)
    bound = sum(sizes[:3]) - 1  # no three fit, the largest does
    assert bound >= sizes[-1]
    engine = make_engine(path, max_cpu_loras=16, max_cpu_lora_bytes=bound, max_model_len=48)
    tier = engine.adapters.manager.loras
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)
    order = names + [None] + names[::-1] + names[1::2]
    requests = [(f"q{i}", [3 + (7 * i) % 200, 5 + i, 9], params, LoRARequest(name, adapters[name][0]) if name else None)
                for i, name in enumerate(order)]
    done = {}
    for phase in (requests[:len(names) + 1], requests[len(names) + 1:]):  # the second finds evicted ones gone
        run_to_completion(engine, phase, per_step=2, done=done)
    for (request_id, prompt, _, _), name in zip(requests, order):
        assert_exact(done[request_id], adapters[name][1] if name else hf, prompt, greedy_oracle, 4)
    stats = engine.adapters.manager.stats
    assert stats.lora_cpu_evictions > 0 and stats.lora_disk_loads > len(names)  # evicted by bytes, reloaded
    assert tier.memory_stats()["num_cpu"] <= 2 and tier.cpu_bytes <= bound  # nothing held: back under the bound
    assert stats.lora_cpu_cache_bytes == tier.cpu_bytes == sum(adapter_bytes[name] for name in tier.list())


def test_held_and_pinned_adapters_are_never_evicted(engine_checkpoint, adapter_bytes):
    path, _, adapters = engine_checkpoint
    spec = load_model(path)[1].spec()
    manager = _manager(spec, max_cpu_lora_bytes=adapter_bytes["r4"] + adapter_bytes["r16-mlp"])
    tier = manager.loras
    request = {name: LoRARequest(name, adapters[name][0]) for name in adapters}
    held = tier.acquire(request["r4"])  # a request in flight
    assert _wait(tier, held) == "ready"
    tier.add(request["r16-mlp"])
    assert tier.list() == ["r4", "r16-mlp"]
    tier.add(request["r8-qv"])  # over the bound: r4 is the least recently used, but held
    assert tier.list() == ["r4", "r8-qv"] and tier.state(held) == "ready"
    tier.release(held)
    tier.pin("r4")
    for name in ("r16-mlp", "r8-rslora"):
        tier.add(request[name])  # each time over the bound: the pinned r4 stays
        assert tier.list() == ["r4", name]
    assert manager.stats.lora_cpu_evictions == 3
    manager.close()
    full = _manager(spec, max_cpu_lora_bytes=adapter_bytes["r8-qv"])  # one adapter fills the bound exactly
    full.loras.add(request["r8-qv"])
    with pytest.raises(AdapterCapacityError, match="max_cpu_lora_bytes"):  # pinned, no other could ever load
        full.loras.pin("r8-qv")
    full.close()


def test_a_load_waits_while_held_adapters_fill_the_bound(engine_checkpoint, adapter_bytes):
    """Two CPU entries and two loads at once: a load waits once the cache holds twice the bound (the
    count rule's slack of max_loading entries, in bytes), and starts when a holder releases."""
    path, _, adapters = engine_checkpoint
    spec = load_model(path)[1].spec()
    bound = adapter_bytes["r16-patterns"]
    manager = _manager(spec, max_cpu_loras=2, max_cpu_lora_bytes=bound, load_workers=1, download_workers=1)
    tier = manager.loras
    assert tier.max_loading == 2
    held = {}
    for name in ("r16-patterns", "r16-mlp", "r8-rslora"):  # each starts: the cache holds less than 2 x bound
        held[name] = tier.acquire(LoRARequest(name, adapters[name][0]))
        assert _wait(tier, held[name]) == "ready"
    assert tier.cpu_bytes >= 2 * bound  # all held: over the bound, nothing evictable
    waiting = tier.acquire(LoRARequest("r4", adapters["r4"][0]))
    assert tier.load_stats() == dict(ready=3, loading=0, queued=1) and tier.state(waiting) == "loading"
    tier.release(held["r16-patterns"])  # evicted at once (over the bound), and the load starts
    assert _wait(tier, waiting) == "ready" and "r16-patterns" not in tier.list()
    manager.close()


def test_a_request_in_flight_keeps_its_adapter_while_others_page(engine_checkpoint, adapter_bytes, greedy_oracle):
    """A bound of the largest adapter: the long request's adapter stays cached (the same version, never
    reloaded) while short requests of other adapters come and go; every request exact."""
    path, hf, adapters = engine_checkpoint
    engine = make_engine(path, max_cpu_loras=16, max_cpu_lora_bytes=adapter_bytes["r16-patterns"])
    tier = engine.adapters.manager.loras
    long = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    engine.add_request("long", [5, 6, 7], long, lora_request=LoRARequest("r16-mlp", adapters["r16-mlp"][0]))
    ref = tier.lookup("r16-mlp")
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=1)
    others = [(f"s{i}", [9, 10 + i], short, LoRARequest(name, adapters[name][0]))
              for i, name in enumerate(["r4", "r8-rslora", "r8-qv", "r4"])]
    states, finished = [], []

    def on_step(step, outputs):  # the version's state while "long" runs (dropped, it would raise)
        finished.extend(o.request_id for o in outputs if o.finished)
        if "long" not in finished:
            states.append(tier.state(ref))

    done = run_to_completion(engine, others, per_step=1, on_step=on_step)
    assert states and states[states.index("ready"):] == ["ready"] * (len(states) - states.index("ready"))
    assert_exact(done["long"], adapters["r16-mlp"][1], [5, 6, 7], greedy_oracle, 12)
    for request_id, prompt, _, lora in others:
        assert_exact(done[request_id], adapters[lora.name][1], prompt, greedy_oracle, 2)
    assert engine.adapters.manager.stats.lora_cpu_evictions > 0  # the others paged around it


def test_an_adapter_larger_than_the_bound_is_refused_and_others_go_on(engine_checkpoint, adapter_bytes,
                                                                       greedy_oracle):
    path, hf, adapters = engine_checkpoint
    bound = adapter_bytes["r8-qv"]
    assert adapter_bytes["r16-mlp"] > bound
    engine = make_engine(path, max_cpu_lora_bytes=bound)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)
    requests = [("big", [5, 6, 7], params, LoRARequest("r16-mlp", adapters["r16-mlp"][0])),
                ("fits", [5, 6, 7], params, LoRARequest("r8-qv", adapters["r8-qv"][0])),
                ("base", [8, 9], params, None)]
    done = run_to_completion(engine, requests, per_step=3)
    assert done["big"].outputs[0].finish_reason == "error" and isinstance(done["big"].error, CPUCacheBoundError)
    assert f"max_cpu_lora_bytes={bound}" in str(done["big"].error) and "r16-mlp" in str(done["big"].error)
    assert_exact(done["fits"], adapters["r8-qv"][1], [5, 6, 7], greedy_oracle, 4)
    assert_exact(done["base"], hf, [8, 9], greedy_oracle, 4)
    tier = engine.adapters.manager.loras
    with pytest.raises(CPUCacheBoundError, match="max_cpu_lora_bytes"):
        tier.add(LoRARequest("r16-mlp", adapters["r16-mlp"][0]))
    with pytest.raises(CPUCacheBoundError, match="max_cpu_lora_bytes"):
        tier.add_dummy("warmup", RANK)
    assert tier.list() == ["r8-qv"] and tier.cpu_bytes == bound


def test_an_expert_adapter_is_counted_whole(tmp_path):
    from test_moe import save_moe
    from test_moe_lora import write_adapter

    save_moe(tmp_path / "model", "qwen3_moe", seed=5)
    spec = load_model(str(tmp_path / "model"))[1].spec()
    factors = write_adapter(tmp_path / "experts", spec, ["q_proj", "gate_proj", "up_proj", "down_proj"], 4, 8, 1)
    expected = sum(t.numel() * 4 for a, b in factors.values() for t in (a, b))  # float32, one A per PEFT module
    experts = sum(t.numel() * 4 for path, (a, b) in factors.items() if ".experts." in path for t in (a, b))
    assert experts > expected / 2  # the experts' LoRA is most of it
    manager = _manager(spec, max_lora_rank=8)
    before = tensor_census()
    manager.loras.add(LoRARequest("experts", str(tmp_path / "experts")))
    assert manager.loras.cpu_bytes == expected == host_bytes(tensor_census(), before)
    manager.close()
    with pytest.raises(CPUCacheBoundError, match="max_cpu_lora_bytes"):  # over a bound the attention alone fits
        _manager(spec, max_lora_rank=8, max_cpu_lora_bytes=expected - experts).loras.add(
            LoRARequest("experts", str(tmp_path / "experts")))


def test_the_default_bound_is_max_cpu_loras_whole_slots_and_logged(caplog):
    hf = build_tiny_model("llama", seed=0)
    spec = model_spec(hf)
    with caplog.at_level(logging.INFO, logger="adapters.manager"):
        manager = _manager(spec, max_cpu_loras=3)
    per_slot = lora_slot_bytes(spec, RANK, torch.float32).per_slot
    assert manager.loras.max_cpu_bytes == 3 * per_slot
    assert f"max_cpu_loras=3, max_cpu_lora_bytes={3 * per_slot}" in caplog.text and "default" in caplog.text
    for name in ("a", "b", "c"):  # three adapters of the largest size fit: the count binds first
        manager.loras.add_dummy(name, RANK)
    assert dummy_lora("x", spec, RANK).nbytes < per_slot and manager.loras.list() == ["a", "b", "c"]
    manager.loras.add_dummy("d", RANK)
    assert manager.loras.list() == ["b", "c", "d"] and manager.stats.lora_cpu_evictions == 1
    manager.close()
    with pytest.raises(ValueError, match="max_cpu_lora_bytes"):
        EngineConfig("m", max_cpu_lora_bytes=0)


def test_metrics_show_the_cache_bytes_as_a_gauge():
    import dataclasses

    from adapters.manager import AdapterStats
    from lora_runner.entrypoints.openai.metrics import ServerMetrics
    from test_serve_engine_client import STATS, StandInEngine

    stats = dataclasses.replace(STATS, adapters=dataclasses.replace(STATS.adapters, lora_cpu_cache_bytes=12345))
    engine = StandInEngine()
    engine.get_stats = lambda: stats
    text = ServerMetrics(engine).render().decode()
    assert "lora_runner_cpu_lora_cache_bytes 12345.0" in text.splitlines()
    assert 'event="lora_cpu_cache_bytes"' not in text  # a gauge, not an event counter
    assert AdapterStats(0, 0, 0, 0, 0, 0).lora_cpu_cache_bytes == 0


def test_the_lru_counts_bytes_and_trims_to_either_bound():
    from adapters.lru import LRUCache

    removed = []
    cache = LRUCache(3, on_remove=lambda key, value: removed.append(key), max_bytes=100)
    cache.put("a", None, 40)
    cache.put("b", None, 50)
    cache.put("a", None, 30)  # a put of a known key replaces its size
    assert cache.nbytes == 80 and list(cache) == ["b", "a"] and not cache.over()
    cache.put("c", None, 60)  # b, a, c: 140 bytes
    assert cache.over() and cache.trim(keep=lambda key: True) == [] and cache.over()  # all kept: stays over
    assert cache.trim(keep=lambda key: key == "b") == ["a", "c"] and cache.nbytes == 50 and not cache.over()
    cache.put("d", None, 10)
    cache.put("e", None, 10)
    cache.put("f", None, 10)  # over the count: the least recently used goes
    assert cache.trim(keep=lambda key: False) == ["b"] and cache.nbytes == 30 and removed == ["a", "c", "b"]
    cache.pop("d")
    assert cache.nbytes == 20 and cache.size("e") == 10
    with pytest.raises(ValueError, match="max_bytes"):
        LRUCache(1, max_bytes=0)


def test_cpu_worker_ranks_take_the_cache_bound_off_the_ram_the_kv_cache_is_sized_from(monkeypatch):
    """Worker ranks are sized before they start: a larger bound leaves fewer KV blocks when the RAM
    decides the KV cache."""
    from lora_runner.executor import startup
    from test_moe_slot_memory import _engine_config, tiny_configs

    monkeypatch.setattr(startup, "available_host_memory", lambda: 48 << 20)
    moe, _ = tiny_configs()
    workers = {bound: startup.worker_limits(_engine_config(2, max_cpu_lora_bytes=bound), moe).num_kv_blocks
               for bound in (1 << 20, 16 << 20)}
    assert workers[16 << 20] < workers[1 << 20]


def test_the_warmup_dummies_are_held_whatever_the_bound():
    """The memory profile and the CUDA graphs warm up with max_loras dummies at max_lora_rank resident at
    once: a bound meant for tenants' smaller adapters neither refuses nor evicts them."""
    from lora_runner.worker.cuda_graphs import resident_dummy_loras

    spec = model_spec(build_tiny_model("llama", seed=0))
    dummy = dummy_lora("x", spec, RANK).nbytes
    manager = _manager(spec, max_loras=3, max_cpu_lora_bytes=dummy // 2)
    tier = manager.loras
    with resident_dummy_loras(tier, 3, RANK) as slots:
        assert sorted(slots) == [0, 1, 2] and tier.cpu_bytes == 3 * dummy and len(tier.list()) == 3
    assert tier.list() == [] and tier.cpu_bytes == 0 and manager.lora_slots.slot_ranks.sum().item() == 0
    manager.close()
