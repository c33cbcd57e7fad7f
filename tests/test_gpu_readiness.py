"""CPU proxies for the CUDA-only paths, and GPU regression tests for bugs found by reading them.

* The decode-graph forward and pointing the LoRA meta at its uploaded table run no op that syncs with the
  host on CUDA (item / nonzero / boolean masks / unique ...), checked with the profiler's nested aten ops.
* The engine in bfloat16 and float16 on CPU: emulated decode graphs give the eager tokens.
* benchmarks/gpu_check.py never starts an engine it has no time for and still writes its JSON.
* (gpu) The batch builder's pinned buffers are not overwritten while a non_blocking copy of the
  previous step is still queued (a step that samples nothing never syncs).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from adapters import LoRARequest
from lora_runner import LLMEngine, SamplingParams
from lora_runner.worker.batch_builder import BatchBuilder, SeqChunk
from lora_runner.worker.cuda_graphs import RerunGraph
from engine_support import run_to_completion
from test_engine_lora import NAMES

ROOT = Path(__file__).resolve().parent.parent
# aten ops that wait for the device on CUDA (a host read of device data): never inside a graph
SYNC_OPS = ("aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select",
            "aten::unique", "aten::_unique", "aten::_unique2", "aten::unique_consecutive", "aten::is_nonzero",
            "aten::equal", "aten::allclose", "aten::repeat_interleave.Tensor", "aten::bincount")
ENGINE = dict(max_num_seqs=8, max_model_len=64, max_loras=2, max_lora_rank=16, max_cpu_loras=4, block_size=4,
              max_num_batched_tokens=24)


def host_sync_ops(fn) -> list[str]:
    """Names of the sync-prone aten ops (nested ones included) that fn() runs."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sorted({e.name for e in prof.events() if e.name.startswith(SYNC_OPS)})


def graphed_engine(path: str, dtype, **kwargs) -> LLMEngine:
    engine = LLMEngine(path, device="cpu", dtype=dtype, **(kwargs or ENGINE))
    engine.runner.capture_decode_graphs(engine.adapters.manager.loras, 16, make_graph=RerunGraph, progress=False)
    return engine


def stub_lora_kernels(monkeypatch) -> list[bool]:
    """The LoRA kernels (Triton on CUDA, their no-sync tests gpu-marked) stubbed out: add_lora records
    whether its meta covers exactly the batch's tokens (the returned list); embed_tokens LoRA's gather and
    expand (gpu-marked no-sync test in test_vocab_lora.py) do nothing."""
    import punica_kernels

    calls = []

    def lora_stub(y, x, lora_a, lora_b, meta, slice_sizes, **scales):
        calls.append(meta.num_tokens == x.shape[0] == y.shape[0])
        return y

    monkeypatch.setattr(punica_kernels, "add_lora", lora_stub)
    monkeypatch.setattr(punica_kernels, "embedding_shrink", lambda input_ids, lora_a, meta, out: out)
    monkeypatch.setattr(punica_kernels, "lora_expand", lambda y, *args, **kwargs: y)
    return calls


@torch.inference_mode()
def test_decode_graph_forward_and_lora_table_have_no_host_sync(engine_checkpoint, monkeypatch):
    """What a CUDA graph records must not read device data on the host. The LoRA kernels are
    Triton on CUDA (their no-sync test is gpu-marked); here the rest of the forward, on every key."""
    path, _, adapters = engine_checkpoint
    engine = graphed_engine(path, torch.float32)
    calls = stub_lora_kernels(monkeypatch)
    graphs, meta = engine.runner.decode_graphs, engine.runner.lora_meta
    engine.adapters.manager.loras.activate([engine.add_lora(LoRARequest("r4", adapters["r4"][0]))])
    for key, captured in graphs._graphs.items():
        # the table was built on the host and uploaded with the batch: pointing the meta at it is no device op
        assert host_sync_ops(lambda: engine.runner.forward_contexts.prepare_lora(captured.batch)) == []
        assert meta.num_tokens == key.num_seqs or not key.has_lora
        calls.clear()
        assert host_sync_ops(captured.graph.fn) == [], key
        lora_linears = 4 * engine.model_config.num_layers if key.has_lora else 0  # base-only graphs: no LoRA
        assert len(calls) == lora_linears and all(calls)  # every LoRA linear, right T


def half_precision_logprob_tolerance(dtype) -> float:
    """Two units in the last place of a logit in [8, 16) (this model's largest logits).

    Graphed and eager decode are not bit-identical in half precision: a graph attends over its
    context bucket with a mask (eager over the batch's own context length), so the attention's
    reductions are blocked differently and round differently (fp16 SDPA already differs by an ulp
    on a masked, padded context; bf16 on wider ones). That last-bit difference in the hidden
    states reaches the logits as about one ulp of their magnitude: measured up to 0.056 in bf16
    (ulp 0.0625 at 8..16) and 0.006 in fp16 (ulp 0.0078) over three seeds.
    """
    return 16 * torch.finfo(dtype).eps


def assert_same_decoding(want, got, tol: float) -> int:
    """Graphed tokens equal eager ones and every logprob agrees within tol, up to a token where a
    near-tie flips (both engines' top two within 2 * tol; the contexts differ after it, so the
    request is compared no further). Returns the number of requests that flipped."""
    flips = 0
    for request_id, out in want.items():
        completion, expected = got[request_id].outputs[0], out.outputs[0]
        assert completion.finish_reason == "length" and len(completion.token_ids) == 6, request_id
        for step, (token, expected_token) in enumerate(zip(completion.token_ids, expected.token_ids)):
            lp, expected_lp = completion.logprobs[step], expected.logprobs[step]
            assert all(torch.isfinite(torch.tensor(list(lp.values()))))
            if token != expected_token:  # a flip must be a near-tie in both engines
                assert {token, expected_token} <= lp.keys() & expected_lp.keys(), (request_id, step)
                assert abs(lp[token] - lp[expected_token]) <= 2 * tol, (request_id, step, lp)
                assert abs(expected_lp[token] - expected_lp[expected_token]) <= 2 * tol, (request_id, step)
                flips += 1
                break
            for candidate in lp.keys() & expected_lp.keys():
                assert abs(lp[candidate] - expected_lp[candidate]) <= tol, (request_id, step, lp, expected_lp)
    return flips


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_engine_with_emulated_graphs_matches_eager(engine_checkpoint, dtype):
    """The CUDA default dtype (bf16) and fp16 through the whole engine on CPU: prefill, LoRA slots
    in half precision, padded decode graphs; the graphed engine gives the eager engine's tokens,
    and logprobs within two ulps of a logit (see half_precision_logprob_tolerance)."""
    path, _, adapters = engine_checkpoint
    rng = random.Random(5)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    requests = []
    for i in range(10):
        name = rng.choice(NAMES + [None])
        prompt = [rng.randrange(3, 256) for _ in range(rng.randint(2, 30))]  # some chunked (24 per step)
        requests.append((f"h{i}", prompt, params, LoRARequest(name, adapters[name][0]) if name else None))
    # every adapter loaded up front and cached: scheduling (hence batching and rounding) is deterministic
    kwargs = dict(ENGINE, max_cpu_loras=len(NAMES))
    eager = LLMEngine(path, device="cpu", dtype=dtype, **kwargs)
    graphed = graphed_engine(path, dtype, **kwargs)
    for engine in (eager, graphed):
        for name in NAMES:
            engine.add_lora(LoRARequest(name, adapters[name][0]))
    assert graphed.adapters.manager.lora_slots.weights(0, "qkv")[0].dtype == dtype
    want, got = run_to_completion(eager, requests, per_step=3), run_to_completion(graphed, requests, per_step=3)
    assert graphed.runner.decode_graphs.num_replays >= 5
    for request_id, out in want.items():  # prefills run eagerly in both engines: bit-identical
        assert got[request_id].outputs[0].token_ids[0] == out.outputs[0].token_ids[0]
        assert got[request_id].outputs[0].logprobs[0] == out.outputs[0].logprobs[0]
    assert_same_decoding(want, got, half_precision_logprob_tolerance(dtype))


@pytest.mark.slow  # a ~15-20 s gpu_check subprocess
def test_gpu_check_starts_no_engine_without_time_and_still_writes_json(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--cpu-smoke", "--sections", "engine",
                           "--budget-s", "30"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    status = results["sections"]["engine"]["status"]
    assert status.startswith("FAILED") and "no time left to start the eager engine" in status
    assert "engine_setup" not in results


@pytest.mark.gpu
def test_batch_builder_waits_for_queued_copies_before_rewriting_pinned_buffers():
    """Three builds without a sync between them (steps that sample nothing), the device busy: each
    step's one copy, still queued, must read that step's rows. The second build packs the other
    staging buffer (no wait); the third reuses the first's, so it must wait for that copy."""
    builder = BatchBuilder(max_num_tokens=64, max_num_seqs=4, max_blocks_per_seq=4, block_size=16, device="cuda")
    tables = ([0, 1, 2], [3, 2, 1], [2, 0, 3])
    chunks = [SeqChunk(token_ids=list(range(10 + 90 * i, 50 + 90 * i)), start=0, num_new_tokens=40,
                       block_table=table, sample=False) for i, table in enumerate(tables)]
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the device is busy: every build's copy waits in the stream
    seen = []
    for chunk in chunks:
        batch = builder.build([chunk])
        seen.append((batch.input_ids.clone(), batch.slot_mapping.clone()))  # queued after that step's copy
    assert builder.staging.num_uploads == 3
    torch.cuda.synchronize()
    for chunk, table, (input_ids, slot_mapping) in zip(chunks, tables, seen):
        assert input_ids.tolist() == chunk.token_ids
        assert slot_mapping.tolist() == [b * 16 + i for b in table for i in range(16)][:40]
