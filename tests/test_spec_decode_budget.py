"""A draft model's weights and KV cache inside the memory budget (lora_runner.executor.draft_budget), on
every path that sizes the target's KV cache: kv_cache_memory_bytes in this process and per worker rank
(tp = 2), the CPU's RAM-based bound (the draft's weights and adapter slots taken off the RAM first, and its
adapters' CPU cache bound where the model's is: worker ranks, or max_cpu_lora_bytes set), the CUDA memory
profile's budget and kv_cache_memory_bytes against the free device memory (the device branches of the
sizing, driven on CPU). Bytes are counted from the allocated KV tensors (the engine's own, or the ones
allocate_kv_cache makes for a worker rank's spec) and from the draft model's parameters. Engines on the
shared budget stay greedy-exact, and a budget that cannot hold the draft is refused with a ValueError
naming the setting."""

from __future__ import annotations

import dataclasses
import logging
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from adapters.slot_memory import cpu_cache_bytes
from engine_support import run_to_completion
from factories import build_tiny_model, save_tiny_tokenizer
from lora_runner import EngineConfig, LLMEngine, SamplingParams
from lora_runner.distributed import TensorParallel
from lora_runner.executor import startup
from lora_runner.executor.draft_budget import draft_memory, limits_with_draft, model_bytes
from lora_runner.model import ModelConfig
from lora_runner.worker import draft_runner
from lora_runner.worker.kv_cache import allocate_kv_cache, kv_block_bytes

K = 3
ENGINE = dict(device="cpu", dtype="float32", max_num_seqs=4, max_model_len=64, block_size=4,
              max_num_batched_tokens=16, cpu_threads=1)
TARGET_BLOCK = 2048  # the tiny llama: 2 layers x K,V x 2 KV heads x head_dim 16 x 4 tokens x fp32
DRAFT_BLOCK = 1024  # its one-layer draft


@pytest.fixture(scope="module")
def target_and_draft(engine_checkpoint, tmp_path_factory):
    """(model dir, draft dir): the draft is the model's first layer with its embeddings and head."""
    path, hf, _ = engine_checkpoint
    draft_dir = tmp_path_factory.mktemp("budget") / "draft"
    draft = build_tiny_model("llama", seed=0, num_hidden_layers=1)
    missing, _ = draft.load_state_dict(hf.state_dict(), strict=False)
    assert not missing
    draft.save_pretrained(str(draft_dir))
    save_tiny_tokenizer(draft_dir, 256)
    assert kv_block_bytes(ModelConfig.from_dir(path), 4, torch.float32) == TARGET_BLOCK
    assert kv_block_bytes(ModelConfig.from_dir(str(draft_dir)), 4, torch.float32) == DRAFT_BLOCK
    return path, str(draft_dir)


@pytest.fixture(scope="module")
def requests():
    rng = random.Random(3)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    return [(f"r{i}", ([rng.randrange(3, 256) for _ in range(3)] * 6)[:rng.randint(8, 14)], params) for i in range(4)]


@pytest.fixture(scope="module")
def reference(target_and_draft, requests):
    """The tokens of the run without speculation."""
    engine = LLMEngine(target_and_draft[0], **ENGINE)
    done = run_to_completion(engine, requests)
    engine.close()
    return {request_id: out.outputs[0].token_ids for request_id, out in done.items()}


def speculative(draft_dir: str) -> dict:
    return {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": K, "min_acceptance_rate": 0}


def draft_of(engine: LLMEngine):
    """The draft model's runner (its KV cache and model) behind the engine's speculation policy."""
    return engine.scheduler.speculator.proposer.forward


def checkpoint_bytes(model_dir: str) -> int:
    """The bytes of a checkpoint's tensors: what the loaded model holds (fp32, as saved)."""
    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        return sum(f.get_tensor(name).nbytes for name in f.keys())


def assert_greedy_exact(engine: LLMEngine, requests, reference) -> None:
    done = run_to_completion(engine, requests)
    assert {request_id: out.outputs[0].token_ids for request_id, out in done.items()} == reference
    assert engine.stats.spec_decode.num_accepted_tokens > 0


def assert_fills(budget: int, used: int) -> None:
    """`used` fits `budget` and leaves less than one more block of each cache."""
    assert budget - (TARGET_BLOCK + DRAFT_BLOCK) < used <= budget, (used, budget)


# ------------------------------------------------------------------ engines on CPU
def test_kv_cache_memory_bytes_holds_both_caches(target_and_draft, requests, reference, caplog):
    """kv_cache_memory_bytes is the target's and the draft's caches together (vLLM's draft layers share
    it), not the target's alone with the draft's on top; one INFO line says the draft's share."""
    path, draft_dir = target_and_draft
    budget = 150_000
    with caplog.at_level(logging.INFO, "lora_runner.executor.draft_budget"):
        engine = LLMEngine(path, kv_cache_memory_bytes=budget, speculative_config=speculative(draft_dir), **ENGINE)
    target, draft = engine.runner.kv_cache, draft_of(engine).kv_cache
    assert target.shape[2] == engine.limits.num_kv_blocks and draft.shape[2] > target.shape[2]
    assert_fills(budget, target.nbytes + draft.nbytes)
    [line] = [r.getMessage() for r in caplog.records if r.name == "lora_runner.executor.draft_budget"]
    weights = model_bytes(draft_of(engine).model)
    assert 0 <= weights - checkpoint_bytes(draft_dir) < 1024  # the CPU GEMM's packed weights counted (+ rotary buffers)
    assert f"weights {weights} bytes" in line, line
    assert f"{draft.shape[2]} blocks, {draft.nbytes} bytes" in line and f"model's {target.shape[2]} blocks" in line
    assert_greedy_exact(engine, requests, reference)
    engine.close()


def test_the_ram_bound_holds_both_caches_after_the_draft_weights(target_and_draft, monkeypatch):
    """On CPU the default KV bound is drawn from the RAM available less the draft's weights and adapter slots
    (allocated after it), and holds both caches."""
    path, draft_dir = target_and_draft
    available = 1_200_000  # RAM available after the model and its slots (the draft not loaded yet)
    monkeypatch.setattr(startup, "available_host_memory", lambda: available)
    engine = LLMEngine(path, speculative_config=speculative(draft_dir), **dict(ENGINE, max_num_seqs=8))
    runner = draft_of(engine)
    slots = engine.scheduler.speculator.proposer.adapters.tier.slots.nbytes
    bound = (available - checkpoint_bytes(draft_dir) - slots) // 4  # kv_budget.CPU_KV_MEMORY_FRACTION
    assert 8 * 16 * (TARGET_BLOCK + DRAFT_BLOCK) > bound, "the workload would use more: the bound decides"
    assert_fills(bound, engine.runner.kv_cache.nbytes + runner.kv_cache.nbytes)
    engine.close()


def test_an_explicit_cpu_cache_bound_takes_the_draft_adapters_cache_off_the_ram_too(target_and_draft, monkeypatch,
                                                                                      caplog):
    """In the engine's own process an explicit max_cpu_lora_bytes comes off the RAM (startup.in_process_host_ram),
    and so does the draft adapters' CPU cache bound (unset, neither does: the test above); the bound counted is
    the one the draft's AdapterManager draws, and the draft's INFO line gives it."""
    path, draft_dir = target_and_draft
    # 16 (max_cpu_loras) draft adapters at rank 16, each a whole slot of the one-layer draft: about 1.6 MB
    draft_cache = cpu_cache_bytes(ModelConfig.from_dir(draft_dir).spec(), 16, 16, torch.float32)
    explicit = 200_000
    available = 1_200_000 + explicit + draft_cache
    monkeypatch.setattr(startup, "available_host_memory", lambda: available)
    with caplog.at_level(logging.INFO, "lora_runner.executor.draft_budget"):
        engine = LLMEngine(path, speculative_config=speculative(draft_dir), max_cpu_lora_bytes=explicit,
                           **dict(ENGINE, max_num_seqs=8))
    tier = engine.scheduler.speculator.proposer.adapters.tier
    loaded = draft_runner.LoadedDraft(draft_of(engine).model, ModelConfig.from_dir(draft_dir), Path(draft_dir))
    memory = draft_memory(loaded, engine.config)
    assert memory.cpu_cache_bytes == tier.max_cpu_bytes > 2 * (TARGET_BLOCK + DRAFT_BLOCK) * 4, "would not show"
    bound = (available - explicit - checkpoint_bytes(draft_dir) - tier.slots.nbytes - tier.max_cpu_bytes) // 4
    assert 8 * 16 * (TARGET_BLOCK + DRAFT_BLOCK) > bound, "the workload would use more: the bound decides"
    assert_fills(bound, engine.runner.kv_cache.nbytes + draft_of(engine).kv_cache.nbytes)
    [line] = [r.getMessage() for r in caplog.records if r.name == "lora_runner.executor.draft_budget"]
    assert f"CPU cache bound {tier.max_cpu_bytes} bytes" in line and "taken off the RAM" in line, line
    engine.close()


def test_worker_ranks_share_kv_cache_memory_bytes_with_the_draft(target_and_draft, requests, reference,
                                                                 monkeypatch):
    """tp = 2: the draft is loaded once, in the engine's process, before the ranks' sizes are decided; the
    ranks' caches (the host holds both on CPU) and the draft's fit kv_cache_memory_bytes; greedy-exact."""
    loads = []
    load_model = draft_runner.load_model
    monkeypatch.setattr(draft_runner, "load_model", lambda *args, **kwargs: loads.append(args) or load_model(
        *args, **kwargs))
    path, draft_dir = target_and_draft
    budget = 150_000
    engine = LLMEngine(path, kv_cache_memory_bytes=budget, speculative_config=speculative(draft_dir),
                       tensor_parallel_size=2, **ENGINE)
    assert len(loads) == 1 and engine.runner is None
    spec = engine.executor.spec
    ranks = [allocate_kv_cache(engine.model_config, spec.num_kv_blocks, spec.block_size, spec.dtype, "cpu",
                               TensorParallel(rank, 2)) for rank in range(2)]
    assert_fills(budget, sum(cache.nbytes for cache in ranks) + draft_of(engine).kv_cache.nbytes)
    assert_greedy_exact(engine, requests, reference)
    engine.close()


def test_worker_ranks_ram_bound_counts_the_draft(target_and_draft):
    """tp = 2 on CPU without kv_cache_memory_bytes: the RAM left after the ranks' LoRA slots and the draft's
    weights bounds every rank's cache and the draft's."""
    path, draft_dir = target_and_draft
    cfg = EngineConfig(model=path, tensor_parallel_size=2, speculative_config=speculative(draft_dir),
                       **dict(ENGINE, max_num_seqs=8))
    loaded = draft_runner.load_draft(cfg.speculative(), dtype=torch.float32, device=torch.device("cpu"))
    model_config = ModelConfig.from_dir(path)
    # the LoRA CPU cache's bound comes off the RAM too (adapters.slot_memory.cpu_cache_bytes)
    cache = cpu_cache_bytes(model_config.spec(), cfg.cpu_loras, cfg.max_lora_rank, torch.float32)
    memory = draft_memory(loaded, cfg)  # the draft adapters' slots and their CPU cache bound come off too
    available = 2_200_000 + cache + memory.cpu_cache_bytes
    limits = startup.worker_limits(cfg, model_config, memory, available)
    ranks = [allocate_kv_cache(model_config, limits.num_kv_blocks, 4, torch.float32, "cpu", TensorParallel(rank, 2))
             for rank in range(2)]
    draft = allocate_kv_cache(loaded.config, draft_runner.draft_kv_blocks(limits.num_kv_blocks, max_num_seqs=8, k=K,
                                                                          block_size=4), 4, torch.float32, "cpu")
    bound = (available - cache - startup.lora_slot_memory(cfg, model_config) - checkpoint_bytes(draft_dir)
             - memory.lora_slot_bytes - memory.cpu_cache_bytes) // 4
    assert 8 * 16 * (TARGET_BLOCK + DRAFT_BLOCK) > bound, "the workload would use more: the bound decides"
    assert_fills(bound, sum(cache.nbytes for cache in ranks) + draft.nbytes)


# ------------------------------------------------------------------ the CUDA budgets (their sizing, on CPU)
@pytest.fixture(scope="module")
def loaded_draft(target_and_draft):
    cfg = EngineConfig(model=target_and_draft[0], speculative_config=speculative(target_and_draft[1]), **ENGINE)
    return cfg, draft_runner.load_draft(cfg.speculative(), dtype=torch.float32, device=torch.device("cpu"))


def allocated_bytes(cfg: EngineConfig, loaded, num_kv_blocks: int) -> int:
    """The bytes of the target's cache of num_kv_blocks and of the draft's cache beside it, allocated."""
    target = allocate_kv_cache(ModelConfig.from_dir(cfg.model), num_kv_blocks, 4, torch.float32, "cpu")
    draft = allocate_kv_cache(loaded.config, draft_runner.draft_kv_blocks(num_kv_blocks, max_num_seqs=4, k=K,
                                                                          block_size=4), 4, torch.float32, "cpu")
    return target.nbytes + draft.nbytes


def test_the_profiled_budget_holds_both_caches(loaded_draft):
    cfg, loaded = loaded_draft
    slots = draft_memory(loaded, cfg).lora_slot_bytes  # the draft adapters' slots: allocated after the profile
    profiled = 120_000 + slots  # what the memory profile left for KV caches (the draft's weights resident in it)
    limits = limits_with_draft(cfg, 512, TARGET_BLOCK // 4, draft_memory(loaded, cfg), free_device_bytes=10**9,
                               device_kv_budget_bytes=profiled)
    assert_fills(profiled - slots, allocated_bytes(cfg, loaded, limits.num_kv_blocks))
    with pytest.raises(ValueError, match="raise gpu_memory_utilization"):
        limits_with_draft(cfg, 512, TARGET_BLOCK // 4, draft_memory(loaded, cfg), free_device_bytes=10**9,
                          device_kv_budget_bytes=slots + 4 * DRAFT_BLOCK + TARGET_BLOCK)  # spare blocks, room for none


def test_device_kv_cache_memory_bytes_holds_both_caches_and_must_be_free(loaded_draft):
    cfg, loaded = loaded_draft
    cfg = dataclasses.replace(cfg, kv_cache_memory_bytes=130_000)
    slots = draft_memory(loaded, cfg).lora_slot_bytes  # free after the weights, taken by the draft adapters' slots
    limits = limits_with_draft(cfg, 512, TARGET_BLOCK // 4, draft_memory(loaded, cfg),
                               free_device_bytes=200_000 + slots)
    assert_fills(130_000, allocated_bytes(cfg, loaded, limits.num_kv_blocks))
    with pytest.raises(ValueError, match="lower kv_cache_memory_bytes"):  # the draft's weights took the memory
        limits_with_draft(cfg, 512, TARGET_BLOCK // 4, draft_memory(loaded, cfg), free_device_bytes=100_000 + slots)


# ------------------------------------------------------------------ refused: the setting named
@pytest.mark.parametrize("tp", [1, 2])
def test_kv_cache_memory_bytes_too_small_for_the_draft_is_refused(target_and_draft, tp):
    """Room for the model's cache of one request, none for the draft's: refused at start, before any
    worker process."""
    path, draft_dir = target_and_draft
    one_request = 16 * TARGET_BLOCK  # max_model_len 64 in blocks of 4
    with pytest.raises(ValueError, match="raise kv_cache_memory_bytes"):
        LLMEngine(path, kv_cache_memory_bytes=one_request, speculative_config=speculative(draft_dir),
                  tensor_parallel_size=tp, **ENGINE)


def test_a_ram_bound_too_small_for_the_draft_is_refused(target_and_draft, monkeypatch):
    path, draft_dir = target_and_draft
    monkeypatch.setattr(startup, "available_host_memory", lambda: 400_000)  # the draft's weights (0.25 MB) come off
    with pytest.raises(ValueError, match="the CPU bound.*raise kv_cache_memory_bytes"):
        LLMEngine(path, speculative_config=speculative(draft_dir), **dict(ENGINE, max_num_seqs=64))
