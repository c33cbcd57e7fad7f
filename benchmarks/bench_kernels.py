"""Kernel benchmark: punica_kernels.add_lora vs a plain torch gather+bmm vs the base layer's matmul.

One single-slice layer with K = N = hidden (4096 on GPU, 1024 on CPU) and 32 adapter slots, for
a grid of T (tokens), rank and number of distinct adapters in the batch (tokens round-robin over
them). For each point, measured in the same run:
  add_lora        the library op (backend "auto": Triton on GPU, torch on CPU); on GPU also the
                  time of a CUDA-graph replay, which removes the Python launch overhead
  gather+bmm      lora_a[slots] / lora_b[slots] gathered per token, then two torch.bmm
  base matmul     x @ W.T of the layer itself, the cost the LoRA delta is added to
GB/s uses the byte count of design.md section 4 at the run's element size e (e = 2 for bf16):
  e*T*K + e*n*r*K + 8*T*r + e*n*r*N + 2*e*T*N   (n = distinct adapters actually in the batch)

    python benchmarks/bench_kernels.py            # full grid (CPU: about 2-3 minutes)
    python benchmarks/bench_kernels.py --quick    # T in (1, 64, 1024), ranks (8, 64)

Writes results/bench_kernels-<device>-<time>.json (``--out`` to change) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from common import machine_description, markdown_table  # benchmarks/common.py
from punica_kernels import LoRAMeta, add_lora, load_table

logger = logging.getLogger("bench_kernels")

MAX_LORAS = 32
TOKENS = (1, 16, 64, 256, 1024)
RANKS = (8, 16, 64)
DISTINCT = (1, 8, 32)
COLUMNS = [("num_tokens", "T", "d"), ("rank", "rank", "d"), ("distinct", "adapters", "d"),
           ("present", "in batch", "d"),
           ("lora_us", "add_lora us", ".1f"), ("graph_us", "graph us", ".1f"),
           ("lora_gbps", "GB/s", ".2f"), ("gather_us", "gather+bmm us", ".1f"),
           ("speedup_vs_gather", "x faster than gather", ".2f"), ("base_us", "base matmul us", ".1f"),
           ("lora_over_base", "add_lora / base", ".2f")]


def time_us(fn, device: torch.device, min_seconds: float, max_repeats: int = 200) -> float:
    """Median microseconds of fn() over repeats (after a warm-up), synchronizing on GPU."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    samples, start = [], time.perf_counter()
    while len(samples) < max_repeats and (len(samples) < 3 or time.perf_counter() - start < min_seconds):
        begin = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - begin) * 1e6)
    return statistics.median(samples)


def lora_bytes(num_tokens: int, rank: int, distinct: int, hidden: int, element: int) -> int:
    """design.md section 4: activations, n adapters' A and B, fp32 intermediate, output r+w."""
    k = n = hidden
    return (element * num_tokens * k + element * distinct * rank * k + 8 * num_tokens * rank
            + element * distinct * rank * n + 2 * element * num_tokens * n)


def gather_bmm(y, x, lora_a, lora_b, slots):
    """The plain torch baseline: per-token weight gather, then two batched matmuls."""
    a = lora_a[slots, 0]  # [T, r, K]
    b = lora_b[slots]  # [T, N, r]
    inter = torch.bmm(a, x.unsqueeze(2))  # [T, r, 1]
    y += torch.bmm(b, inter).squeeze(2)  # [T, N]
    return y


def graph_time_us(y, x, lora_a, lora_b, meta, min_seconds: float) -> float:
    """Replay time of add_lora captured in a CUDA graph (kernel time without launch overhead)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        add_lora(y, x, lora_a, lora_b, meta, (y.shape[1],))
    return time_us(graph.replay, y.device, min_seconds)


def bench_point(num_tokens: int, rank: int, distinct: int, hidden: int, dtype: torch.dtype,
                device: torch.device, base_us: float, min_seconds: float, gen: torch.Generator) -> dict:
    rand = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen) * scale).to(device, dtype)  # noqa: E731
    x = rand(num_tokens, hidden)  # [T, K]
    y = rand(num_tokens, hidden)  # [T, N]
    lora_a = rand(MAX_LORAS, 1, rank, hidden, scale=hidden ** -0.5)  # [L, 1, r, K]
    lora_b = rand(MAX_LORAS, hidden, rank, scale=0.02)  # [L, N, r]
    slots = (torch.arange(num_tokens) % distinct).to(device)  # [T] round-robin
    # sized like an engine's (room for K-split partials at small T), not just for this T
    meta = LoRAMeta(max(TOKENS), MAX_LORAS, device, max_rank=rank, max_slices=1)
    load_table(meta, slots, torch.full((MAX_LORAS,), rank, dtype=torch.int32, device=device))

    expected = gather_bmm(y.float().clone(), x.float(), lora_a.float(), lora_b.float(), slots)
    got = add_lora(y.clone(), x, lora_a, lora_b, meta, (hidden,)).float()
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)  # time the right thing

    lora_us = time_us(lambda: add_lora(y, x, lora_a, lora_b, meta, (hidden,)), device, min_seconds)
    gather_us = time_us(lambda: gather_bmm(y, x, lora_a, lora_b, slots), device, min_seconds)
    graph_us = (graph_time_us(y, x, lora_a, lora_b, meta, min_seconds)
                if device.type == "cuda" else None)
    present = min(distinct, num_tokens)
    nbytes = lora_bytes(num_tokens, rank, present, hidden, x.element_size())
    kernel_us = graph_us if graph_us is not None else lora_us
    return dict(num_tokens=num_tokens, rank=rank, distinct=distinct, present=present, bytes=nbytes,
                lora_us=lora_us, graph_us=graph_us, lora_gbps=nbytes / kernel_us / 1e3,
                gather_us=gather_us, speedup_vs_gather=gather_us / lora_us,
                base_us=base_us, lora_over_base=lora_us / base_us)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                        help="default: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--hidden", type=int, default=None, help="default: 4096 GPU, 1024 CPU")
    parser.add_argument("--quick", action="store_true", help="reduced grid")
    parser.add_argument("--min-seconds", type=float, default=None,
                        help="time per measurement (default 0.2 CPU, 0.05 GPU)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's); 1 is steadier on a busy machine")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default results/...)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_gpu else "float32"))
    hidden = args.hidden or (4096 if on_gpu else 1024)
    min_seconds = args.min_seconds or (0.05 if on_gpu else 0.2)
    tokens, ranks = ((1, 64, 1024), (8, 64)) if args.quick else (TOKENS, RANKS)
    gen = torch.Generator().manual_seed(0)

    rows = []
    for num_tokens in tokens:
        x = torch.randn(num_tokens, hidden, generator=gen).to(device, dtype)  # [T, K]
        weight = (torch.randn(hidden, hidden, generator=gen) * hidden ** -0.5).to(device, dtype)
        base_us = time_us(lambda: x @ weight.T, device, min_seconds)
        for rank in ranks:
            for distinct in DISTINCT:
                row = bench_point(num_tokens, rank, distinct, hidden, dtype, device, base_us,
                                  min_seconds, gen)
                logger.info("T=%d r=%d n=%d: add_lora %.1f us, gather+bmm %.1f us, base %.1f us",
                            num_tokens, rank, distinct, row["lora_us"], row["gather_us"], base_us)
                rows.append(row)

    columns = COLUMNS if on_gpu else [c for c in COLUMNS if c[0] != "graph_us"]
    print(f"\nadd_lora on {device} ({'triton' if on_gpu else 'torch'} backend), {dtype}, "
          f"hidden {hidden}, {MAX_LORAS} slots; GB/s by design.md section 4's byte count"
          + ("" if not on_gpu else " over the graph replay time"))
    print(markdown_table(rows, columns))
    out = args.out or Path("results") / f"bench_kernels-{device.type}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(machine=machine_description(str(device)), dtype=str(dtype),
                                   hidden=hidden, max_loras=MAX_LORAS, quick=args.quick,
                                   rows=rows), indent=2))
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
