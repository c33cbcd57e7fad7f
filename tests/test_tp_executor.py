"""The tensor-parallel executor (issue 22, part B): worker processes, one message per step, failure.

Until the sharded model lands every rank holds the whole model (lora_runner.executor.rank_model), so a
tp=2 engine must give exactly the tokens and logprobs of tp=1; the executor checks on every step that
every rank sampled the same tokens (a rank whose slots missed a write would disagree and kill the
engine). Each tp=2 engine start spawns two processes (seconds each on a shared CPU): one engine
serves the equality, hot-load and counting tests; the failure tests build their own.
"""

from __future__ import annotations

import os
import random
import signal
import time

import psutil
import pytest
import torch

from adapters import LoRARequest, PromptAdapterRequest
from factories import save_lora, save_prompt_adapter
from engine_support import assert_exact, run_to_completion, start_decoding
from lora_runner import LLMEngine, SamplingParams
from lora_runner.engine.async_llm_engine import AsyncLLMEngine
from lora_runner.model import ModelConfig
from lora_runner.worker.kv_cache import kv_block_bytes

KV_BLOCKS = 14  # blocks of 4 tokens: too few for 4 requests of ~40 tokens, so the scheduler preempts
MAX_TOKENS = 8


def engine_kwargs(model_dir: str, **overrides) -> dict:
    """Chunked prefill (16 tokens a step), preemption (KV_BLOCKS), 2 LoRA slots for 5 LoRAs, 1 soft-prompt slot."""
    kv = KV_BLOCKS * kv_block_bytes(ModelConfig.from_dir(model_dir), 4, torch.float32)
    return dict(device="cpu", dtype="float32", max_num_seqs=4, max_model_len=48, block_size=4,
                max_num_batched_tokens=16, max_loras=2, max_lora_rank=16, max_cpu_loras=8, max_prompt_adapters=1,
                max_prompt_adapter_tokens=8, kv_cache_memory_bytes=kv, **overrides)


@pytest.fixture(scope="module")
def adapters_tp(engine_checkpoint, tmp_path_factory):
    """engine_checkpoint's LoRAs plus a DoRA, a soft prompt and one that fails validation (rank 32 > 16)."""
    model_dir, hf, loras = engine_checkpoint
    root = tmp_path_factory.mktemp("tp")
    dirs = {name: path for name, (path, _) in loras.items()}
    save_lora(hf, root / "dora", seed=21, r=8, lora_alpha=16, scale=0.15, use_dora=True)
    save_prompt_adapter(hf, root / "soft", num_virtual_tokens=4, seed=7)
    save_lora(hf, root / "too-large", seed=22, r=32, lora_alpha=32)
    dirs.update(dora=str(root / "dora"), soft=str(root / "soft"), bad=str(root / "too-large"))
    return model_dir, dirs


@pytest.fixture(scope="module")
def tp2(adapters_tp):
    """The module's one tp=2 engine; closed (and its workers checked gone) at the end."""
    model_dir, _ = adapters_tp
    engine = LLMEngine(model_dir, **engine_kwargs(model_dir, tensor_parallel_size=2))
    yield engine
    pids = [p.pid for p in engine.executor.processes]
    engine.close()
    assert not _alive(pids)


def _alive(pids) -> list[int]:
    """Those of `pids` still running children of this process (zombies count: nobody reaped them)."""
    children = {child.pid for child in psutil.Process().children(recursive=True)}
    return [pid for pid in pids if pid in children]


def mixed_requests(dirs: dict) -> list[tuple]:
    """Base, LoRAs of three ranks, DoRA, a soft prompt alone and with a LoRA, and n=2 seeded sampling."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(5, 30))] for _ in range(8)]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    sampled = SamplingParams(temperature=0.9, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1, n=2, seed=11)
    lora = {name: LoRARequest(name, dirs[name]) for name in ("r4", "r8-rslora", "r16-mlp", "r8-qv", "dora")}
    soft = PromptAdapterRequest("soft", dirs["soft"])
    adapters = [(None, None), (lora["r4"], None), (lora["r8-rslora"], None), (lora["r16-mlp"], None),
                (lora["dora"], None), (None, soft), (lora["r4"], soft), (lora["r8-qv"], None)]
    return [(f"m{i}", prompt, sampled if i == 7 else greedy, *adapters[i]) for i, prompt in enumerate(prompts)]


def _preload(engine: LLMEngine, requests: list[tuple]) -> None:
    """Load every adapter the requests name into the engine's CPU cache now."""
    for _, _, _, lora, prompt_adapter in requests:
        if lora is not None:
            engine.add_lora(lora)
        if prompt_adapter is not None:
            engine.add_prompt_adapter(prompt_adapter)


def _completions(done: dict) -> dict:
    return {rid: [(c.token_ids, c.logprobs, c.finish_reason) for c in out.outputs] for rid, out in done.items()}


@pytest.mark.slow
def test_tp2_equals_tp1_for_a_mixed_batch(adapters_tp, tp2):
    model_dir, dirs = adapters_tp
    tp1 = LLMEngine(model_dir, **engine_kwargs(model_dir))
    for engine in (tp1, tp2):  # loaded before the run: no background load timing in either schedule
        _preload(engine, mixed_requests(dirs))
    want = _completions(run_to_completion(tp1, mixed_requests(dirs), per_step=3))
    got = _completions(run_to_completion(tp2, mixed_requests(dirs), per_step=3))
    assert tp2.scheduler.num_preemptions == tp1.scheduler.num_preemptions > 0
    assert tp2.adapters.manager.stats.lora_evictions > 0  # 5 LoRAs over 2 slots: every rank re-wrote slots
    assert set(got) == set(want)
    for rid, completions in want.items():
        assert len(got[rid]) == len(completions)
        for (tokens, logprobs, reason), (got_tokens, got_logprobs, got_reason) in zip(completions, got[rid]):
            assert (got_tokens, got_reason) == (tokens, reason), rid
            for step, token in enumerate(tokens):
                assert abs(got_logprobs[step][token] - logprobs[step][token]) <= 1e-4, (rid, step)
    assert len(set(map(tuple, (c[0] for c in got["m7"])))) == 2  # n=2 sampled: two different samples


@pytest.mark.slow
def test_hot_load_replace_remove_and_a_bad_adapter_at_tp2(adapters_tp, engine_checkpoint, tp2, greedy_oracle):
    _, dirs = adapters_tp
    _, hf, loras = engine_checkpoint
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)
    tp2.add_lora(LoRARequest("tenant", dirs["r4"]))
    tp2.add_request("old", [5, 6, 7, 8], params, lora_request=LoRARequest("tenant", dirs["r4"]))
    tp2.add_request("bad", [5, 6, 7], params, lora_request=LoRARequest("bad", dirs["bad"]))
    done = {}
    for _ in range(2):
        done.update({o.request_id: o for o in tp2.step() if o.finished})
    tp2.add_lora(LoRARequest("tenant", dirs["r16-patterns"]))  # replace while "old" runs on the old version
    tp2.add_request("new", [5, 6, 7, 8], params, lora_request=LoRARequest("tenant", dirs["r16-patterns"]))
    tp2.add_request("base", [9, 10, 11], params)
    run_to_completion(tp2, done=done)
    assert done["bad"].outputs[0].finish_reason == "error"
    assert_exact(done["old"], loras["r4"][1], [5, 6, 7, 8], greedy_oracle)
    assert_exact(done["new"], loras["r16-patterns"][1], [5, 6, 7, 8], greedy_oracle)
    assert_exact(done["base"], hf, [9, 10, 11], greedy_oracle)
    tp2.remove_lora("tenant")
    assert "tenant" not in tp2.list_loras()
    tp2.add_request("again", [5, 6, 7, 8], params, lora_request=LoRARequest("tenant", dirs["r4"]))
    assert_exact(run_to_completion(tp2)["again"], loras["r4"][1], [5, 6, 7, 8], greedy_oracle)
    assert tp2.is_alive


@pytest.mark.slow
def test_one_message_per_step_and_one_shared_file_per_adapter_version(adapters_tp, tp2):
    _, dirs = adapters_tp
    executor = tp2.executor
    executor.flush()  # ops queued by earlier tests are delivered now, outside the counted steps
    counts, files = executor.counts.copy(), executor.shared.files_created
    rank_messages = list(executor.rank_messages)
    loads = tp2.adapters.manager.stats.lora_loads
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    names = ["r8-qv", "r16-mlp", "r8-qv"]  # cached versions: the third is made resident again from its file
    steps = 0
    for i, name in enumerate(names):
        tp2.add_lora(LoRARequest(name, dirs[name]))  # in the CPU cache before it runs, so its weights stay
        tp2.add_request(f"c{i}", [3, 4, 5], params, lora_request=LoRARequest(name, dirs[name]))
        tp2.add_request(f"d{i}", [6, 7], params, lora_request=LoRARequest("r4", dirs["r4"]))
        before = executor.counts["messages"]
        run_to_completion(tp2)
        steps += executor.counts["messages"] - before
    assert executor.counts["messages"] - counts["messages"] == steps > 0
    assert executor.counts["pickles"] - counts["pickles"] == steps  # one pickle per step, not one per rank
    assert executor.counts["sends"] - counts["sends"] == 2 * steps  # the same bytes down each rank's pipe
    assert [n - m for n, m in zip(executor.rank_messages, rank_messages)] == [steps, steps]
    slot_writes = tp2.adapters.manager.stats.lora_loads - loads
    assert slot_writes >= 4  # 2 slots for r4 beside r8-qv, r16-mlp, r8-qv: r8-qv is written twice
    # files: at most one per version (r4, r8-qv, r16-mlp; none if earlier tests shared them already)
    assert executor.shared.files_created - files <= 3 < slot_writes


@pytest.mark.slow
def test_a_killed_worker_fails_every_request_and_leaves_no_process(adapters_tp):
    model_dir, dirs = adapters_tp
    engine = LLMEngine(model_dir, **engine_kwargs(model_dir, tensor_parallel_size=2))
    pids = [p.pid for p in engine.executor.processes]
    assert engine.is_alive and len(_alive(pids)) == 2
    done = start_decoding(engine, 5, dirs["r4"])
    os.kill(pids[1], signal.SIGKILL)
    started = time.monotonic()
    run_to_completion(engine, done=done, timeout=10)
    assert time.monotonic() - started < 10
    assert {rid: out.outputs[0].finish_reason for rid, out in done.items()} == {f"k{i}": "error" for i in range(5)}
    assert not engine.has_unfinished_requests() and not engine.is_alive
    assert not _alive(pids)  # the surviving rank was stopped too, and both were reaped
    with pytest.raises(RuntimeError, match="no more requests"):
        engine.add_request("late", [3, 4], SamplingParams(max_tokens=2))
    server_engine = AsyncLLMEngine(engine)  # what /health asks: 503 while is_running is False
    try:
        assert not server_engine.is_running
    finally:
        server_engine.shutdown()


@pytest.mark.slow
def test_a_hung_worker_times_out_and_close_leaves_no_process(adapters_tp):
    model_dir, _ = adapters_tp
    engine = LLMEngine(model_dir, **engine_kwargs(model_dir, tensor_parallel_size=2, worker_step_timeout_s=2.0))
    pids = [p.pid for p in engine.executor.processes]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request("h", [3, 4, 5], params)
    engine.step()
    os.kill(pids[0], signal.SIGSTOP)  # alive but silent: only the timeout can tell
    started = time.monotonic()
    done = run_to_completion(engine, timeout=15)
    assert time.monotonic() - started < 10
    assert done["h"].outputs[0].finish_reason == "error"
    assert "within 2.0 s" in str(done["h"].error)
    engine.close()
    assert not _alive(pids)


def test_config_refuses_unknown_backends_and_bad_sizes():
    from lora_runner import EngineConfig

    with pytest.raises(ValueError, match='"mp" or "ray"'):
        EngineConfig(model="m", tensor_parallel_size=2, distributed_executor_backend="mpi")
    assert EngineConfig(model="m", tensor_parallel_size=2, distributed_executor_backend="ray").executor_backend == "ray"
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            EngineConfig(model="m", tensor_parallel_size=bad)
    with pytest.raises(ValueError, match="needs tensor_parallel_size=1"):
        EngineConfig(model="m", tensor_parallel_size=2, distributed_executor_backend="uni")
    assert EngineConfig(model="m").executor_backend == "uni"
    assert EngineConfig(model="m", tensor_parallel_size=2).executor_backend == "mp"
    with pytest.raises(ValueError, match="worker_step_timeout_s"):
        EngineConfig(model="m", worker_step_timeout_s=0)
