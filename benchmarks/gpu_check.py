"""GPU check sections: gpu-marked tests, kernel benchmark, attention, quant GEMMs, engine eager vs graphs.

benchmarks/device/run.py is the one device command (it reuses this module's model, engine and kernel
pieces); this script still runs its own sections alone:

    python benchmarks/gpu_check.py               # one GPU, no network, < 8 minutes
    python benchmarks/gpu_check.py --cpu-smoke   # the same code paths at tiny sizes on CPU (torch backend)

Sections (each in its own try/except: a failure is recorded and the next section runs):
  tests   ``pytest -m gpu`` over tests/ in a subprocess (CUDA-graph replay == eager, compiled kernels)
  kernels benchmarks/bench_kernels.py's bench_point at hidden 4096 in bf16: add_lora time, its CUDA-graph
          replay time, GB/s by design.md section 4's byte count, ratio to the gather+bmm baseline
  attention  Triton paged attention (lora_runner/model/paged_attention.py) vs the torch gather path: decode
          at batch 32/128 x context 1k/4k (GQA 32/8, head_dim 128, bf16), eager and replaying one CUDA graph
          captured once per batch size (contexts change in place), GB/s of K/V + q + out against the
          device's own copy rate (copy_gbps, measured first);
          one chunked-prefill point. With --cpu-smoke only when named in --sections (the interpreter).
  quant   W4A16 (punica_kernels.w4a16_matmul, symmetric group 128) and FP8 (fp8_linear: _scaled_mm, per-token
          activation scales) GEMMs vs bf16 F.linear at T = 1/32/128 for 4096x4096 and 14336x4096 (N x K) layers.
  engine  decode tokens/s of LLMEngine for 32 and 128 requests: base only vs 8 and 32 distinct rank-16
          adapters, eager (enforce_eager=True) vs decode CUDA graphs, on a random Llama-shaped model
          (hidden 4096, 8 layers, MLP 11008, GQA 32/8 heads, vocab 32000: 1.7B parameters, bf16) that the
          script writes itself. Adapters: AdapterManager.add_dummy (random weights, every module, rank 16;
          no files). Decode tokens/s = tokens generated after every request's prefill / their wall time.
The table is printed whatever happened; JSON goes to $OUT/gpu_check.json if OUT is set, else results/,
rewritten after every section (a run killed from outside keeps what finished). Time: the tests get at most
240 s, the kernel section stops at 70% of --budget-s, the engine section starts no engine within
ENGINE_SETUP_MARGIN_S of the budget and stops between runs once it is spent; a hang dumps every thread's
stack and exits at --budget-s + HANG_GRACE_S.
Needs only torch, triton, safetensors, huggingface_hub, peft, transformers and numpy.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import logging
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / "device")]  # a script folder

from gpu_tests import run_gpu_tests  # noqa: E402  (benchmarks/device, after the path setup)

logger = logging.getLogger("gpu_check")

ENGINE_SETUP_MARGIN_S = 60.0  # no new engine (model load, memory profile, graph capture) with less time left
# the H200's HBM3e bandwidth (NVIDIA: 4.8 TB/s), the reference of the README's 2026-12-01 attention table only:
# runs now divide by the device's measured copy rate (copy_gbps), which an H100 or an H200 gives alike
HBM_GBPS = 4800.0
LM_HEAD_STD = 0.2  # logits ~ N(0, 0.2 * sqrt(hidden)): top-2 margins far above bf16 rounding
HANG_GRACE_S = 90.0  # past the budget by this much: dump stacks and exit (a hung capture or kernel)


@dataclass(frozen=True)
class Sizes:
    """Everything that differs between the GPU run and the CPU smoke run."""

    device: str
    dtype: torch.dtype
    test_paths: tuple[str, ...]
    test_timeout_s: int
    hidden: int  # kernels
    kernel_tokens: tuple[int, ...]
    kernel_ranks: tuple[int, ...]
    kernel_distinct: tuple[int, ...]
    model: dict  # LlamaConfig kwargs
    num_requests: tuple[int, ...]
    adapter_counts: tuple[int, ...]
    prompt_len: tuple[int, int]
    output_len: int
    max_model_len: int
    attention: dict  # batches, contexts, heads, kv_heads, head_dim, block_size, prefill (chunks, chunk_len)
    quant_shapes: tuple[tuple[int, int], ...] = ((4096, 4096), (14336, 4096))  # (N, K) of the quant GEMMs
    quant_tokens: tuple[int, ...] = (1, 32, 128)


GPU = Sizes("cuda", torch.bfloat16, ("tests",), 240, 4096, (1, 16, 64, 256, 1024), (16, 64), (1, 8, 32),
            dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=8, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=32000),
            (32, 128), (0, 8, 32), (16, 48), 64, 512,
            dict(batches=(32, 128), contexts=(1024, 4096), heads=32, kv_heads=8, head_dim=128, block_size=16,
                 prefill=(8, 512)))
CPU_SMOKE = Sizes("cpu", torch.float32, ("tests/test_cuda_graphs_replay.py",), 120, 128, (1, 16), (16,), (1, 8),
                  dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512),
                  (4, 8), (0, 2, 4), (4, 12), 4, 64,
                  dict(batches=(2,), contexts=(16, 64), heads=4, kv_heads=2, head_dim=64, block_size=16,
                       prefill=(2, 16)), quant_shapes=((128, 256),), quant_tokens=(1, 4))


def run_tests(sizes: Sizes, results: dict) -> None:
    """pytest -m gpu over the gpu test files (benchmarks/device/gpu_tests.py); records the counts."""
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "results"
    run = run_gpu_tests(workers=0, per_test_timeout_s=sizes.test_timeout_s, timeout_s=sizes.test_timeout_s,
                        log_path=out_dir / "gpu_check-tests.log", paths=sizes.test_paths)
    results["tests"] = run
    if run["returncode"] not in (0, 5):  # 5: nothing collected (no gpu tests selected)
        raise RuntimeError(f"gpu tests failed (exit {run['returncode']}): {run['tail'][-1] if run['tail'] else ''}")


def copy_gbps(device: torch.device, nbytes: int | None = None, repeats: int = 10) -> float:
    """The device's device-to-device copy rate in GB/s, counting bytes read and written (the device tool's
    KINDS.md: about 3000 on an H100, 4300 on an H200): the bandwidth kernels are measured against."""
    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dst.copy_(src)
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync()
    return 2 * nbytes * repeats / (time.perf_counter() - start) / 1e9


def measured_gbps(results: dict, device: torch.device) -> float:
    """results["copy_gbps"], measured now if no section measured it yet."""
    if "copy_gbps" not in results:
        results["copy_gbps"] = copy_gbps(device)
    return results["copy_gbps"]


def run_kernels(sizes: Sizes, results: dict, deadline: float) -> None:
    """bench_kernels.bench_point over the grid; each row has GB/s and speedup over gather+bmm."""
    import bench_kernels

    device, gen = torch.device(sizes.device), torch.Generator().manual_seed(0)
    rows = results.setdefault("kernels", [])
    min_seconds = 0.05 if device.type == "cuda" else 0.01
    bandwidth = measured_gbps(results, device)
    for num_tokens in sizes.kernel_tokens:
        x = torch.randn(num_tokens, sizes.hidden, generator=gen).to(device, sizes.dtype)  # [T, K]
        weight = (torch.randn(sizes.hidden, sizes.hidden, generator=gen) * sizes.hidden ** -0.5).to(device, sizes.dtype)
        base_us = bench_kernels.time_us(lambda: x @ weight.T, device, min_seconds)
        for rank in sizes.kernel_ranks:
            for distinct in sizes.kernel_distinct:
                if time.time() > deadline:
                    raise TimeoutError(f"kernel benchmark stopped at T={num_tokens}: out of time")
                try:
                    row = bench_kernels.bench_point(num_tokens, rank, distinct, sizes.hidden, sizes.dtype, device,
                                                    base_us, min_seconds, gen)
                    rows.append(dict(row, bandwidth_fraction=row["lora_gbps"] / bandwidth))
                except Exception as exc:  # noqa: BLE001 -- one bad point must not hide the others
                    logger.exception("kernel point T=%d r=%d n=%d failed", num_tokens, rank, distinct)
                    rows.append(dict(num_tokens=num_tokens, rank=rank, distinct=distinct, error=repr(exc)[:200]))
    if any("error" in row for row in rows):
        raise RuntimeError(f"{sum('error' in row for row in rows)} kernel point(s) failed (see the table)")


def run_attention(sizes: Sizes, results: dict, deadline: float) -> None:
    """Paged decode (eager, one graph replayed for every context, torch path) and one prefill point."""
    cfg, device = sizes.attention, torch.device(sizes.device)
    rows = results.setdefault("attention", [])
    bandwidth = measured_gbps(results, device)
    for batch in cfg["batches"]:
        if time.time() > deadline:
            raise TimeoutError(f"attention benchmark stopped at batch {batch}: out of time")
        rows.extend(_attention_decode_rows(cfg, batch, sizes.dtype, device, bandwidth))
    rows.append(_attention_prefill_row(cfg, sizes.dtype, device))


def _attention_inputs(cfg: dict, num_seqs: int, num_tokens: int, dtype: torch.dtype, device: torch.device):
    """(query [T, H, D], kv_layer over shuffled blocks, metadata at the largest context) of random data."""
    from lora_runner.model.forward_context import AttentionMetadata

    bs, context = cfg["block_size"], max(cfg["contexts"])
    blocks = context // bs
    gen = torch.Generator(device=device).manual_seed(num_seqs)
    kv_layer = torch.randn(2, num_seqs * blocks, bs, cfg["kv_heads"], cfg["head_dim"], generator=gen,
                           device=device).to(dtype)
    tables = torch.randperm(num_seqs * blocks, generator=gen, device=device).view(num_seqs, blocks).int()
    query = torch.randn(num_tokens, cfg["heads"], cfg["head_dim"], generator=gen, device=device).to(dtype)
    starts = torch.arange(num_seqs + 1, device=device, dtype=torch.int32) * (num_tokens // num_seqs)
    attn = AttentionMetadata(slot_mapping=torch.full((num_tokens,), -1, device=device), query_start_loc=starts,
                             seq_lens=torch.full((num_seqs,), context, dtype=torch.int32, device=device),
                             block_tables=tables, max_query_len=num_tokens // num_seqs, max_seq_len=context)
    return query, kv_layer, attn


def _attention_decode_rows(cfg: dict, batch: int, dtype: torch.dtype, device: torch.device,
                           bandwidth: float) -> list[dict]:
    import dataclasses

    import bench_kernels
    from lora_runner.model.attention import paged_attention

    query, kv_layer, attn = _attention_inputs(cfg, batch, batch, dtype, device)
    scale, min_seconds = cfg["head_dim"] ** -0.5, (0.05 if device.type == "cuda" else 0.0)
    triton_fn = lambda: paged_attention(query, kv_layer, attn, scale, backend="triton")  # noqa: E731
    graph = out = None
    if device.type == "cuda":  # one graph, captured at the largest context, replayed for every context
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            triton_fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = triton_fn()
    rows = []
    for context in cfg["contexts"]:
        attn.seq_lens.fill_(context)  # in place: the graph reads it at replay
        torch_attn = dataclasses.replace(attn, max_seq_len=context)
        torch_fn = lambda: paged_attention(query, kv_layer, torch_attn, scale, backend="torch")  # noqa: E731
        triton_us = bench_kernels.time_us(triton_fn, device, min_seconds, max_repeats=50)
        graph_us = bench_kernels.time_us(graph.replay, device, min_seconds, max_repeats=50) if graph else None
        torch_us = bench_kernels.time_us(torch_fn, device, min_seconds, max_repeats=20)
        expected = torch_fn().float()
        if graph is not None:
            graph.replay()
        got = (out if graph is not None else triton_fn()).float()
        element = query.element_size()
        nbytes = 2 * batch * context * cfg["kv_heads"] * cfg["head_dim"] * element + 2 * query.numel() * element
        best_us = min(triton_us, graph_us or triton_us)
        rows.append(dict(kind="decode", batch=batch, context=context, triton_us=triton_us, graph_us=graph_us,
                         torch_us=torch_us, gbps=nbytes / best_us / 1e3,
                         bandwidth_fraction=nbytes / best_us / 1e3 / bandwidth,
                         speedup_vs_torch=torch_us / best_us, max_abs_diff=float((got - expected).abs().max())))
        logger.info("attention decode B=%d ctx=%d: %s", batch, context, rows[-1])
    return rows


def _attention_prefill_row(cfg: dict, dtype: torch.dtype, device: torch.device) -> dict:
    import bench_kernels
    from lora_runner.model.attention import paged_attention

    chunks, chunk_len = cfg["prefill"]
    query, kv_layer, attn = _attention_inputs(cfg, chunks, chunks * chunk_len, dtype, device)
    scale, min_seconds = cfg["head_dim"] ** -0.5, (0.05 if device.type == "cuda" else 0.0)
    triton_us = bench_kernels.time_us(lambda: paged_attention(query, kv_layer, attn, scale, backend="triton"),
                                      device, min_seconds, max_repeats=20)
    torch_us = bench_kernels.time_us(lambda: paged_attention(query, kv_layer, attn, scale, backend="torch"),
                                     device, min_seconds, max_repeats=10)
    diff = (paged_attention(query, kv_layer, attn, scale, backend="triton").float()
            - paged_attention(query, kv_layer, attn, scale, backend="torch").float()).abs().max()
    flops = 4 * chunks * chunk_len * attn.max_seq_len * cfg["heads"] * cfg["head_dim"]  # q.k and p.v, prefix-dominated
    return dict(kind="prefill", batch=chunks, context=attn.max_seq_len, triton_us=triton_us, graph_us=None,
                torch_us=torch_us, tflops=flops / triton_us / 1e6, speedup_vs_torch=torch_us / triton_us,
                max_abs_diff=float(diff))


def attention_table(results: dict) -> list[str]:
    bandwidth = results.get("copy_gbps", 0.0)
    lines = [f"| kind | batch | context | triton us | graph us | torch us | GB/s (of {bandwidth:.0f}) | x torch | max "
             "diff |", "|---|---|---|---|---|---|---|---|---|"]
    for row in results.get("attention", []):
        graph = "n/a" if row["graph_us"] is None else f"{row['graph_us']:.1f}"
        rate = (f"{row['gbps']:.0f} ({row['bandwidth_fraction']:.0%})" if "gbps" in row
                else f"{row['tflops']:.1f} TFLOP/s")
        lines.append(f"| {row['kind']} | {row['batch']} | {row['context']} | {row['triton_us']:.1f} | {graph} | "
                     f"{row['torch_us']:.1f} | {rate} | {row['speedup_vs_torch']:.2f} | {row['max_abs_diff']:.2g} |")
    return lines


def run_quant_gemm(sizes: Sizes, results: dict, deadline: float) -> None:
    """W4A16 (symmetric, group 128) and FP8 (per-channel weight, per-token activations) GEMMs vs F.linear in
    sizes.dtype for each (N, K) layer and T: microseconds and speedup over the dense layer."""
    import bench_kernels
    import torch.nn.functional as F

    from punica_kernels import fp8, fp8_linear, w4a16_matmul

    device, gen = torch.device(sizes.device), torch.Generator().manual_seed(0)
    rows = results.setdefault("quant_gemm", [])
    min_seconds = 0.05 if device.type == "cuda" else 0.0
    for out_features, in_features in sizes.quant_shapes:
        dense = torch.randn(out_features, in_features, generator=gen) * in_features ** -0.5  # [N, K]
        words = torch.randint(-2 ** 31, 2 ** 31, (out_features, in_features // 8), generator=gen, dtype=torch.int64)
        qweight = words.to(torch.int32).to(device)  # [N, K/8] random nibbles
        scales = torch.full((out_features, in_features // 128), 0.01, dtype=sizes.dtype, device=device)
        channel_scale = dense.abs().amax(1) / fp8.FP8_MAX  # [N]
        weight_fp8 = (dense / channel_scale[:, None]).to(fp8.FP8_DTYPE).to(device)
        channel_scale, dense = channel_scale.to(device), dense.to(device, sizes.dtype)
        for num_tokens in sizes.quant_tokens:
            if time.time() > deadline:
                raise TimeoutError(f"quant GEMM benchmark stopped at {out_features}x{in_features}: out of time")
            x = torch.randn(num_tokens, in_features, generator=gen).to(device, sizes.dtype)  # [T, K]
            out = torch.empty(num_tokens, out_features, dtype=sizes.dtype, device=device)
            dense_us = bench_kernels.time_us(lambda: F.linear(x, dense), device, min_seconds)
            w4_us = bench_kernels.time_us(lambda: w4a16_matmul(x, qweight, scales, None, None, 128, out=out),
                                          device, min_seconds)
            fp8_us = bench_kernels.time_us(lambda: fp8_linear(x, weight_fp8, channel_scale), device, min_seconds)
            rows.append(dict(n=out_features, k=in_features, num_tokens=num_tokens, dense_us=dense_us, w4a16_us=w4_us,
                             fp8_us=fp8_us, w4a16_speedup=dense_us / w4_us, fp8_speedup=dense_us / fp8_us,
                             fp8_scaled_mm=fp8.uses_scaled_mm(x, weight_fp8)))
            logger.info("quant GEMM: %s", rows[-1])


def quant_table(results: dict) -> list[str]:
    lines = ["| N x K | T | dense us | W4A16 us | x dense | FP8 us | x dense | FP8 via _scaled_mm |",
             "|---|---|---|---|---|---|---|---|"]
    for row in results.get("quant_gemm", []):
        lines.append(f"| {row['n']}x{row['k']} | {row['num_tokens']} | {row['dense_us']:.1f} | "
                     f"{row['w4a16_us']:.1f} | {row['w4a16_speedup']:.2f} | {row['fp8_us']:.1f} | "
                     f"{row['fp8_speedup']:.2f} | "
                     f"{row['fp8_scaled_mm']} |")
    return lines


def write_random_model(path: Path, sizes: Sizes) -> None:
    """config.json + model.safetensors of a random Llama (weights drawn on the device, std 0.02; lm_head
    std LM_HEAD_STD so greedy tokens have clear margins and eager vs graphs compares kernels, not ties)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    cfg = LlamaConfig(max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      **sizes.model)
    cfg.save_pretrained(str(path))
    hidden, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    kv = cfg.num_key_value_heads * hidden // cfg.num_attention_heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
              "model.norm.weight": (hidden,)}
    layer_shapes = {"input_layernorm": (hidden,), "post_attention_layernorm": (hidden,),
                    "self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv, hidden),
                    "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, hidden),
                    "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
                    "mlp.down_proj": (hidden, inter)}
    for i in range(cfg.num_hidden_layers):
        shapes.update({f"model.layers.{i}.{module}.weight": shape for module, shape in layer_shapes.items()})
    gen = torch.Generator(device=sizes.device).manual_seed(0)
    tensors = {name: (torch.ones(shape, dtype=sizes.dtype) if name.endswith("norm.weight") else
                      (torch.randn(shape, generator=gen, device=sizes.device)
                       * (LM_HEAD_STD if name == "lm_head.weight" else 0.02)).to(sizes.dtype).cpu())
               for name, shape in shapes.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    logger.info("random model: %.2fB parameters", sum(t.numel() for t in tensors.values()) / 1e9)


def make_engine(model_dir: Path, sizes: Sizes, graphs: bool, *, max_num_batched_tokens: int = 8192,
                max_loras: int | None = None, max_num_seqs: int | None = None, quantization: str | None = None,
                batch_invariant: bool = False):
    """An LLMEngine for the benchmarks serving max_loras (default max(sizes.adapter_counts)) dummy rank-16
    adapters "bench-<i>"; on CPU "graphs" are emulated (RerunGraph) through the same hook."""
    from lora_runner import LLMEngine
    from lora_runner.worker.cuda_graphs import RerunGraph

    max_loras = max(sizes.adapter_counts) if max_loras is None else max_loras
    engine = LLMEngine(str(model_dir), device=sizes.device, dtype=sizes.dtype, max_loras=max(1, max_loras),
                       max_lora_rank=16, max_cpu_loras=2 * max(1, max_loras),
                       max_num_seqs=max_num_seqs or max(sizes.num_requests), max_model_len=sizes.max_model_len,
                       max_num_batched_tokens=max_num_batched_tokens, enforce_eager=not graphs,
                       gpu_memory_utilization=0.8, quantization=quantization, batch_invariant=batch_invariant)
    if graphs and sizes.device == "cpu":
        engine.runner.capture_decode_graphs(engine.adapters.manager.loras, 16, make_graph=RerunGraph, progress=False)
    for i in range(max_loras):
        engine.adapters.manager.loras.add_dummy(f"bench-{i}", 16)
    return engine


def free_device_memory() -> None:
    """Give the memory of engines no longer referenced back to the device (the next engine profiles it)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def decode_run(engine, sizes: Sizes, num_requests: int, num_adapters: int, tag: str) -> dict:
    """Serve num_requests prompts (adapters round-robin over num_adapters) to sizes.output_len tokens."""
    from adapters import LoRARequest
    from lora_runner import SamplingParams

    gen = torch.Generator().manual_seed(num_requests)
    params = SamplingParams(temperature=0.0, max_tokens=sizes.output_len, ignore_eos=True)
    for i in range(num_requests):
        length = int(torch.randint(sizes.prompt_len[0], sizes.prompt_len[1] + 1, (), generator=gen))
        prompt = torch.randint(4, sizes.model["vocab_size"], (length,), generator=gen).tolist()
        lora = LoRARequest(f"bench-{i % num_adapters}", "<dummy>") if num_adapters else None
        engine.add_request(f"{tag}-{i}", prompt, params, lora_request=lora)
    progress, tokens, decode_start, decode_tokens = {}, {}, None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            completion = out.outputs[0]
            if completion.finish_reason == "error":
                raise RuntimeError(f"request {out.request_id} failed") from completion.error
            new = len(completion.token_ids) - progress.get(out.request_id, 0)
            progress[out.request_id] = len(completion.token_ids)
            if decode_start is not None:
                decode_tokens += new
            tokens[out.request_id] = completion.token_ids
        if decode_start is None and len(progress) == num_requests:  # every prompt prefilled
            decode_start = time.perf_counter()
    seconds = time.perf_counter() - decode_start
    return dict(tokens_per_s=decode_tokens / seconds, decode_tokens=decode_tokens, seconds=seconds,
                token_ids=[tokens[f"{tag}-{i}"] for i in range(num_requests)])


def run_engine(sizes: Sizes, results: dict, deadline: float) -> None:
    """Eager engine, then graph engine; each serves every (requests, adapters) point."""
    rows = results.setdefault("engine", {})
    with tempfile.TemporaryDirectory() as tmp:
        write_random_model(Path(tmp), sizes)
        for mode in ("eager", "graphs"):
            if time.time() > deadline - ENGINE_SETUP_MARGIN_S:
                raise TimeoutError(f"engine benchmark: no time left to start the {mode} engine")
            start = time.perf_counter()
            engine = make_engine(Path(tmp), sizes, graphs=mode == "graphs")
            graphs = engine.runner.decode_graphs
            results.setdefault("engine_setup", {})[mode] = dict(
                seconds=time.perf_counter() - start, num_kv_blocks=engine.limits.num_kv_blocks,
                num_graphs=len(graphs) if graphs is not None else 0)
            decode_run(engine, sizes, 4, 1, f"{mode}-warmup")  # compile kernels outside the timing
            for num_requests in sizes.num_requests:
                for num_adapters in sizes.adapter_counts:
                    if time.time() > deadline:
                        raise TimeoutError(f"engine benchmark stopped at {mode} n={num_requests}: out of time")
                    replays = graphs.num_replays if graphs is not None else 0
                    run = decode_run(engine, sizes, num_requests, num_adapters, f"{mode}-{num_requests}-{num_adapters}")
                    run["graph_replays"] = (graphs.num_replays if graphs is not None else 0) - replays
                    rows.setdefault(f"{num_requests}/{num_adapters}", {})[mode] = run
                    logger.info("%s: %d requests, %d adapters: %.0f decode tok/s", mode, num_requests,
                                num_adapters, run["tokens_per_s"])
            engine.adapters.manager.close()
            del engine, graphs
            free_device_memory()


def engine_table(results: dict) -> list[str]:
    lines = ["| requests | adapters | eager tok/s | graphs tok/s | graphs/eager | vs base (graphs) | replays "
             "| same tokens |", "|---|---|---|---|---|---|---|---|"]
    for key, modes in results.get("engine", {}).items():
        num_requests, num_adapters = key.split("/")
        eager, graphs = modes.get("eager", {}), modes.get("graphs", {})
        base = results["engine"].get(f"{num_requests}/0", {}).get("graphs", {}).get("tokens_per_s")
        fmt = lambda v, spec=".0f": "n/a" if v is None else format(v, spec)  # noqa: E731
        ratio = graphs["tokens_per_s"] / eager["tokens_per_s"] if eager and graphs else None
        vs_base = graphs["tokens_per_s"] / base if graphs and base else None
        same = (sum(a == b for a, b in zip(eager["token_ids"], graphs["token_ids"])) / len(eager["token_ids"])
                if eager and graphs else None)
        lines.append(f"| {num_requests} | {num_adapters} | {fmt(eager.get('tokens_per_s'))} | "
                     f"{fmt(graphs.get('tokens_per_s'))} | {fmt(ratio, '.2f')} | {fmt(vs_base, '.2f')} | "
                     f"{graphs.get('graph_replays', 'n/a')} | {fmt(same, '.0%')} |")
    return lines


def kernel_table(results: dict) -> list[str]:
    lines = [f"| T | rank | adapters | add_lora us | graph us | GB/s (of {results.get('copy_gbps', 0):.0f}) "
             "| x faster than gather+bmm |",
             "|---|---|---|---|---|---|---|"]
    for row in results.get("kernels", []):
        if "error" in row:
            lines.append(f"| {row['num_tokens']} | {row['rank']} | {row['distinct']} | {row['error']} | | | |")
            continue
        graph = "n/a" if row["graph_us"] is None else f"{row['graph_us']:.1f}"
        lines.append(f"| {row['num_tokens']} | {row['rank']} | {row['distinct']} | {row['lora_us']:.1f} | {graph} | "
                     f"{row['lora_gbps']:.1f} ({row['bandwidth_fraction']:.0%}) | {row['speedup_vs_gather']:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU (torch backend)")
    parser.add_argument("--sections", default=None,
                        help="comma-separated subset (default tests,kernels,attention,engine; with --cpu-smoke "
                             "tests,kernels,engine)")
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="seconds: the kernel section stops at 70%% of it, the engine section at 100%%")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    sizes = CPU_SMOKE if args.cpu_smoke else GPU
    if args.cpu_smoke:
        torch.set_num_threads(1)  # tiny ops: more threads only add contention
    start = time.time()
    faulthandler.dump_traceback_later(args.budget_s + HANG_GRACE_S, exit=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results = {"mode": "cpu-smoke" if args.cpu_smoke else "gpu", "sections": {},
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__}
    sections = {"tests": lambda: run_tests(sizes, results),
                "kernels": lambda: run_kernels(sizes, results, start + 0.7 * args.budget_s),
                "attention": lambda: run_attention(sizes, results, start + 0.8 * args.budget_s),
                "quant": lambda: run_quant_gemm(sizes, results, start + 0.8 * args.budget_s),
                "engine": lambda: run_engine(sizes, results, start + args.budget_s)}
    default_sections = "tests,kernels,engine" if args.cpu_smoke else "tests,kernels,attention,quant,engine"
    for name in (args.sections or default_sections).split(","):
        begin = time.time()
        try:
            if sizes.device == "cuda" and not torch.cuda.is_available():
                raise RuntimeError("no CUDA device: run with --cpu-smoke")
            sections[name]()
            status = "ok"
        except Exception as exc:  # noqa: BLE001 -- record any failure and go on to the next section
            status = f"FAILED: {exc!r}"[:300]
            results.setdefault("errors", {})[name] = traceback.format_exc()
            logger.error("section %s failed:\n%s", name, traceback.format_exc())
        results["sections"][name] = dict(status=status, seconds=round(time.time() - begin, 1))
        write_json(results, stamp)
    faulthandler.cancel_dump_traceback_later()
    report(results)
    write_json(results, stamp, final=True)
    return results


def write_json(results: dict, stamp: str, final: bool = False) -> None:
    """Write the results so far (without the compared token ids) to $OUT/gpu_check.json or results/."""
    data = json.loads(json.dumps(results, default=str))
    for modes in data.get("engine", {}).values():  # the table compared them; keep the JSON small
        for run in modes.values():
            run.pop("token_ids", None)
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "results"
    name = "gpu_check.json" if os.environ.get("OUT") else f"gpu_check-{results['mode']}-{stamp}.json"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / name).write_text(json.dumps(data, indent=1))
    if final:
        print(f"wrote {out_dir / name}")


def report(results: dict) -> None:
    """Print the final table."""
    lines = [f"\n## gpu_check ({results['mode']}, {results['device']}, torch {results['torch']})", "",
             "| section | status | seconds |", "|---|---|---|"]
    lines += [f"| {name} | {s['status']} | {s['seconds']} |" for name, s in results["sections"].items()]
    if "tests" in results:
        lines += ["", f"gpu tests: {results['tests']['counts']}"]
    lines += ["", *kernel_table(results), "", *attention_table(results), "", *quant_table(results), "",
              *engine_table(results)]
    for mode, setup in results.get("engine_setup", {}).items():
        lines.append(f"{mode} engine start-up: {setup['seconds']:.1f} s, {setup['num_kv_blocks']} KV blocks, "
                     f"{setup['num_graphs']} decode graphs")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
