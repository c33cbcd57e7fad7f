"""CPU proxies for the CUDA-only paths, and GPU regression tests for bugs found by reading them.

* The decode-graph forward and ``LoRAMeta.prepare`` run no op that syncs with the host on CUDA
  (item / nonzero / boolean masks / unique ...), checked with the profiler's nested aten ops.
* The engine in bfloat16 and float16 on CPU: emulated decode graphs give the eager tokens.
* The SGMV kernels, launched exactly as ``triton_ops.add_lora`` launches them, compile for sm_90
  without a GPU and fit an H100/H200's shared memory.
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
from lora_runner.batch import BatchBuilder, SeqChunk
from lora_runner.cuda_graphs import RerunGraph
from test_engine_lora import NAMES, run_all

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
    engine.runner.capture_decode_graphs(engine.adapter_manager.loras, 16, make_graph=RerunGraph, progress=False)
    return engine


@torch.inference_mode()
def test_decode_graph_forward_and_meta_prepare_have_no_host_sync(engine_checkpoint, monkeypatch):
    """What a CUDA graph records must not read device data on the host. The LoRA kernels are
    Triton on CUDA (their no-sync test is gpu-marked); here the rest of the forward, on every key."""
    import lora_runner.model.layers as layers

    path, _, adapters = engine_checkpoint
    engine = graphed_engine(path, torch.float32)
    calls = []

    def lora_stub(y, x, lora_a, lora_b, meta, slice_sizes):
        calls.append(meta.num_tokens == x.shape[0] == y.shape[0])
        return y

    monkeypatch.setattr(layers.punica_kernels, "add_lora", lora_stub)
    graphs, meta = engine.runner.decode_graphs, engine.runner.lora_meta
    slot = engine.adapter_manager.loras.activate([engine.add_lora(LoRARequest("r4", adapters["r4"][0]))])[0]
    for key, captured in graphs._graphs.items():
        captured.batch.token_lora_slots[:] = torch.arange(key.num_seqs) % 2 * (slot + 1) - 1  # -1 / slot
        slot_ranks = engine.adapter_manager.lora_slots.slot_ranks
        assert host_sync_ops(lambda: meta.prepare(captured.batch.token_lora_slots, slot_ranks, check=False)) == []
        assert meta.num_tokens == key.num_seqs
        calls.clear()
        assert host_sync_ops(captured.graph.fn) == [], key
        lora_linears = 4 * engine.model_config.num_layers if key.has_lora else 0  # base-only graphs: no LoRA
        assert len(calls) == lora_linears and all(calls)  # every LoRA linear, right T


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_engine_with_emulated_graphs_matches_eager(engine_checkpoint, dtype):
    """The CUDA default dtype (bf16) and fp16 through the whole engine on CPU: prefill, LoRA slots
    in half precision, padded decode graphs; the graphed engine gives the eager engine's tokens."""
    path, _, adapters = engine_checkpoint
    rng = random.Random(5)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
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
    assert graphed.adapter_manager.lora_slots.weights(0, "qkv")[0].dtype == dtype
    want, got = run_all(eager, requests, per_step=3), run_all(graphed, requests, per_step=3)
    assert graphed.runner.decode_graphs.num_replays >= 5
    identical = 0
    for request_id, out in want.items():
        completion, expected = got[request_id].outputs[0], out.outputs[0]
        assert completion.finish_reason == "length" and len(completion.token_ids) == 6
        assert all(torch.isfinite(torch.tensor(list(lp.values()))).all() for lp in completion.logprobs)
        assert completion.token_ids[0] == expected.token_ids[0]  # prefills run eagerly in both engines
        assert completion.logprobs[0] == expected.logprobs[0]
        identical += completion.token_ids == expected.token_ids
    # padded decode batches round differently in half precision: a near-tie may flip on some CPUs
    assert identical >= len(want) - 2, identical


class _RecordedLaunch:
    """Stands in for a compiled kernel: records grid, arguments and constexprs of one launch."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **constexprs: self.launches.append((self.kernel, grid, args, constexprs))


def _source_for_sm90(kernel, args, constexprs):
    """An ASTSource specialized as Triton's JIT would be for these launch arguments."""
    from triton.compiler import ASTSource

    pointer = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int64: "*i64",
               torch.int32: "*i32"}
    names = [p.name for p in kernel.params]
    signature, constants = {}, dict(constexprs)
    for name, value in zip(names, args):
        if isinstance(value, torch.Tensor):
            signature[name] = pointer[value.dtype]
        elif value == 1 and name not in kernel.do_not_specialize and names.index(name) not in kernel.do_not_specialize:
            signature[name], constants[name] = "constexpr", 1  # Triton specializes ints equal to 1
        else:
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
    signature.update({name: "constexpr" for name in constexprs})
    return ASTSource(kernel, signature, constants)


@pytest.mark.parametrize("dtype,rank", [(torch.bfloat16, 16), (torch.bfloat16, 128), (torch.float32, 64)])
def test_sgmv_kernels_compile_for_sm90_within_shared_memory(dtype, rank, monkeypatch):
    """Compile (no GPU needed) the shrink/expand launches of a 4096-wide qkv/gate_up/down layer at
    decode (K-split) and prefill sizes for Hopper; each must fit 227 KiB of shared memory."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from punica_kernels import LoRAMeta, triton_ops

    if not isinstance(triton_ops._shrink_kernel, triton.runtime.JITFunction):
        pytest.skip("TRITON_INTERPRET=1 at import: no compilable kernels")
    launches = []
    monkeypatch.setattr(triton_ops, "_kernel_for", lambda kernel, device: _RecordedLaunch(kernel, launches))
    hidden, kv, inter = 4096, 1024, 11008
    layouts = {"qkv": (hidden, (hidden, kv, kv)), "gate_up": (hidden, (inter, inter)), "down": (inter, (hidden,))}
    for num_tokens in (1, 256):
        meta = LoRAMeta(1024, 4, "cpu", max_rank=rank, max_slices=3)
        meta.prepare(torch.arange(num_tokens) % 4)
        for num_features, slices in layouts.values():
            x = torch.empty(num_tokens, num_features, dtype=dtype)
            y = torch.empty(num_tokens, sum(slices), dtype=dtype)
            lora_a = torch.empty(4, len(slices), rank, num_features, dtype=dtype)
            lora_b = torch.empty(4, sum(slices), rank, dtype=dtype)
            triton_ops.add_lora(y, x, lora_a, lora_b, meta, slices)  # records, runs nothing
    assert len(launches) == 12
    compiled = {}
    for kernel, _, args, constexprs in launches:
        source = _source_for_sm90(kernel, args, constexprs)
        if source.hash() not in compiled:
            binary = triton.compile(source, target=GPUTarget("cuda", 90, 32))
            compiled[source.hash()] = (kernel.fn.__name__, constexprs, binary.metadata.shared)
    for name, constexprs, shared in compiled.values():
        assert 0 < shared <= 227 * 1024, (name, constexprs, shared)


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
    """Two builds without a sync between them (steps that sample nothing): the first step's
    non_blocking copies, queued behind a long kernel, must still read the first step's rows."""
    builder = BatchBuilder(max_num_tokens=64, max_num_seqs=4, max_blocks_per_seq=4, block_size=16, device="cuda")
    first = SeqChunk(token_ids=list(range(10, 50)), start=0, num_new_tokens=40, block_table=[0, 1, 2], sample=False)
    second = SeqChunk(token_ids=list(range(100, 140)), start=0, num_new_tokens=40, block_table=[3, 2, 1],
                      sample=False)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the device is busy: the first build's copies wait in the stream
    batch = builder.build([first])
    seen = (batch.input_ids.clone(), batch.slot_mapping.clone())  # queued after those copies
    builder.build([second])  # rewrites the pinned CPU rows
    torch.cuda.synchronize()
    assert seen[0].tolist() == first.token_ids
    assert seen[1].tolist() == [b * 16 + i for b in (0, 1, 2) for i in range(16)][:40]
