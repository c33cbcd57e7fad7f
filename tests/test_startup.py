"""The CPU KV cache sized from the workload and available RAM, committed
lazily; the intra-op thread count chosen, validated, applied and logged."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import psutil
import pytest
import torch

from lora_runner import EngineConfig, LLMEngine, SamplingParams
from lora_runner import device as device_mod
from lora_runner.worker.kv_budget import CPU_KV_CAP_BYTES, host_kv_budget

MiB, GiB = 2**20, 2**30
KV_PER_TOKEN = 512  # the tiny llama: 2 layers x K,V x 2 KV heads x head_dim 16 x fp32


@pytest.fixture
def available_ram(monkeypatch):
    """set(bytes): what psutil reports as available RAM from now on."""
    def set_available(num_bytes: int) -> None:
        monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=num_bytes))
    return set_available


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def long_context_llama(tmp_path_factory):
    """A tiny llama whose context (2**18 tokens) is far more than a CPU cache should hold for it."""
    from factories import save_tiny_model

    path = tmp_path_factory.mktemp("long") / "model"
    save_tiny_model(path, "llama", seed=0, max_position_embeddings=2**18)
    return str(path)


# ---------------------------------------------------------------- the sizing policy (no model)
def budget(**kwargs):
    args = dict(max_num_seqs=64, max_model_len=None, context=4096, block_size=16, kv_bytes_per_token=KV_PER_TOKEN,
                available_bytes=16 * GiB, explicit_bytes=None)
    return host_kv_budget(**{**args, **kwargs})


def test_budget_is_what_the_workload_can_use_when_that_is_small():
    chosen = budget(max_num_seqs=4, context=512)
    assert (chosen.bytes, chosen.max_model_len) == (4 * 512 * KV_PER_TOKEN, 512)


def test_budget_is_a_quarter_of_available_ram_capped():
    hostile = budget(max_model_len=2**20, context=2**20, available_bytes=8 * GiB)  # 64 x 512 MiB wanted
    assert hostile.bytes == 2 * GiB and hostile.max_model_len == 2**20
    assert budget(max_model_len=2**20, context=2**20, available_bytes=64 * GiB).bytes == CPU_KV_CAP_BYTES


def test_default_max_model_len_is_lowered_to_fit_one_request():
    chosen = budget(context=2**22, available_bytes=1 * GiB)  # one request of the context: 2 GiB
    assert chosen.bytes == 256 * MiB and chosen.max_model_len == 256 * MiB // KV_PER_TOKEN
    assert "lowered" in chosen.reason


def test_default_max_model_len_is_lowered_to_fit_an_explicit_budget():
    chosen = budget(context=8192, explicit_bytes=100 * 16 * KV_PER_TOKEN)  # 100 blocks; one request needs 512
    assert (chosen.bytes, chosen.max_model_len) == (100 * 16 * KV_PER_TOKEN, 1600)
    assert budget(max_model_len=8192, context=8192, explicit_bytes=100).max_model_len == 8192  # explicit: kept


def test_explicit_settings_that_force_a_large_cache_warn(caplog):
    with caplog.at_level(logging.WARNING, "lora_runner.worker.kv_budget"):
        one_request = budget(max_model_len=2**20, context=2**20, available_bytes=1 * GiB)
        assert one_request.bytes == 2**20 * KV_PER_TOKEN  # 512 MiB: over the 256 MiB bound, one request
        assert budget(explicit_bytes=3 * GiB, available_bytes=8 * GiB).bytes == 3 * GiB
    warned = [r.getMessage().split(" ")[0] for r in caplog.records]
    assert warned == ["max_model_len=1048576", "kv_cache_memory_bytes=3221225472"]
    with pytest.raises(ValueError, match="lower max_model_len"):
        budget(max_model_len=2**20, context=2**20, available_bytes=256 * MiB)


# ---------------------------------------------------------------- the engine on CPU
def test_long_context_defaults_size_the_cache_to_available_ram(long_context_llama, available_ram, caplog):
    available_ram(64 * MiB)  # bound: 16 MiB; the model's context needs 128 MiB for one request
    with caplog.at_level(logging.INFO, "lora_runner"):
        engine = LLMEngine(long_context_llama, device="cpu")
    bound_tokens = 16 * MiB // KV_PER_TOKEN
    assert engine.limits.max_model_len == bound_tokens < 2**18
    assert engine.runner.kv_cache.nbytes == 16 * MiB  # not 64 requests x 2**18 tokens (8 GiB)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert f"max_model_len lowered from the model's context {2**18} to {bound_tokens}" in logged
    assert f"KV cache: {bound_tokens // 16} blocks of 16 tokens" in logged


def test_hostile_max_model_len_does_not_allocate_the_full_product(long_context_llama, available_ram, caplog):
    available_ram(64 * MiB)
    with caplog.at_level(logging.WARNING, "lora_runner"):
        engine = LLMEngine(long_context_llama, device="cpu", max_model_len=2**16)  # 32 MiB per request
    assert engine.limits.max_model_len == 2**16 and engine.runner.kv_cache.nbytes == 2**16 * KV_PER_TOKEN
    assert any("max_model_len=65536 needs 0.03 GiB" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="lower max_model_len"):
        LLMEngine(long_context_llama, device="cpu", max_model_len=2**18)  # 128 MiB > 64 MiB available


def test_cpu_cache_pages_are_committed_only_when_used(engine_checkpoint):
    path, _, _ = engine_checkpoint
    process = psutil.Process()
    before = process.memory_info().rss
    engine = LLMEngine(path, device="cpu", kv_cache_memory_bytes=512 * MiB)
    assert engine.runner.kv_cache.nbytes >= 511 * MiB
    assert process.memory_info().rss - before < 128 * MiB


def test_short_memory_serves_max_num_seqs_by_preemption_exactly(engine_checkpoint, greedy_oracle, available_ram):
    """A cache holding 40 blocks (bound: a quarter of the 'available' RAM) for 8 requests of 6 blocks
    (84-91 tokens) each: all 8 are admitted, some are preempted and recomputed; never-written slots hold NaN."""
    path, hf, _ = engine_checkpoint
    available_ram(4 * 40 * 16 * KV_PER_TOKEN)
    engine = LLMEngine(path, device="cpu", max_num_seqs=8)
    assert engine.block_manager.num_blocks == 40
    engine.runner.kv_cache.fill_(float("nan"))
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(4, 256, (int(torch.randint(24, 32, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, logprobs=1)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    outputs, most_running = {}, 0
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)
        most_running = max(most_running, len(engine.scheduler.running))
    assert most_running == 8 and engine.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        tokens, logprobs = greedy_oracle(hf, prompt, 60)
        assert outputs[f"r{i}"].token_ids == tokens
        chosen = [step[t] for step, t in zip(outputs[f"r{i}"].logprobs, tokens)]
        assert chosen == pytest.approx(logprobs, abs=1e-4)


# ---------------------------------------------------------------- intra-op threads
@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_cpu_threads_is_validated(value):
    with pytest.raises(ValueError, match="cpu_threads"):
        EngineConfig("some/model", cpu_threads=value)


def test_available_cores_count_physical_cores_of_the_affinity_mask_and_quota(monkeypatch):
    monkeypatch.setattr(device_mod.os, "sched_getaffinity", lambda pid: set(range(6)), raising=False)
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 16 if logical else 8)  # 2 threads per core
    quota = {"/sys/fs/cgroup/cpu.max": "max 100000"}
    monkeypatch.setattr(device_mod, "_read", lambda path: quota.get(path))
    assert device_mod.available_cpu_cores() == 3
    quota["/sys/fs/cgroup/cpu.max"] = "150000 100000"  # 1.5 CPUs
    assert device_mod.available_cpu_cores() == 2
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # OMP_NUM_THREADS=1, say
    assert device_mod.choose_cpu_threads(None)[0] == 1
    assert device_mod.choose_cpu_threads(4)[0] == 4


def test_engine_applies_and_logs_its_threads(engine_checkpoint, restore_threads, caplog):
    path, _, _ = engine_checkpoint
    torch.set_num_threads(2)
    with caplog.at_level(logging.INFO, "lora_runner"):
        LLMEngine(path, device="cpu", cpu_threads=1)
    assert torch.get_num_threads() == 1
    assert any(r.getMessage().startswith("CPU intra-op threads: 1 (cpu_threads=1") for r in caplog.records)
    cores = device_mod.available_cpu_cores()
    with caplog.at_level(logging.WARNING, "lora_runner"):
        LLMEngine(path, device="cpu", cpu_threads=cores + 1)
    assert torch.get_num_threads() == cores + 1
    assert any(f"cpu_threads={cores + 1} is more than" in r.getMessage() for r in caplog.records)
    LLMEngine(path, device="cpu")  # default: the available cores, at most torch's current setting
    assert torch.get_num_threads() == cores


def test_busy_machine_hint_names_cpu_threads(monkeypatch, restore_threads, caplog):
    monkeypatch.setattr(device_mod, "available_cpu_cores", lambda: 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(device_mod.os, "getloadavg", lambda: (6.0, 6.0, 6.0))
    with caplog.at_level(logging.INFO, "lora_runner.device"):
        assert device_mod.set_cpu_threads(None) == 4
        assert device_mod.set_cpu_threads(2) == 2  # an explicit choice gets no hint
    hints = [r.getMessage() for r in caplog.records if "cpu_threads=1 can be" in r.getMessage()]
    assert len(hints) == 1 and "load average 6.0 for 4 core(s)" in hints[0]


def test_serve_cli_passes_cpu_threads_to_the_engine():
    """`lora-runner serve --cpu-threads N` reaches EngineConfig (default: the engine's own choice)."""
    from lora_runner.entrypoints.cli import engine_config
    from serve_support import serve_args

    assert engine_config(serve_args("unused-model-dir", {}, extra=["--cpu-threads", "1"])).cpu_threads == 1
    assert engine_config(serve_args("unused-model-dir", {})).cpu_threads is None
