"""Fused MoE kernel benchmark (GPU): punica_kernels.moe_triton.fused_moe vs a per-expert torch loop, without
and with expert LoRA, on one Qwen3-30B-A3B-shaped layer (hidden 2048, 128 experts of 768, top-8, bf16).

For each T (tokens) and number of adapters in the batch (0: base only; tokens round-robin over them,
one in eight tokens without an adapter), measured in the same run:
  fused us       fused_moe: alignment, two grouped GEMMs, (LoRA: shrink + expand per projection)
  graph us       the same captured in a CUDA graph and replayed (no launch overhead; it has no host sync)
  loop us        the torch path lora_runner.model.moe runs on the CPU: per expert hit, one GEMM per
                 projection over its tokens, and per (expert, adapter) the LoRA delta
  GB/s           expert weight bytes read (experts hit x 3 x H x I x e) over the graph time
and the base again with FP8 experts (weights "fp8": quantization="fp8"'s float8_e4m3fn weights with a
float32 scale per (expert, row); the loop over the dequantized weights, as the CPU path).
The fused output is checked against the loop before timing.

    python benchmarks/bench_moe_kernels.py            # on a GPU; on a CPU it says so and exits 0
    python benchmarks/bench_moe_kernels.py --quick    # T in (1, 64)

Writes results/bench_moe_kernels-<time>.json (``--out`` to change) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_kernels import time_us  # benchmarks/bench_kernels.py
from common import machine_description, markdown_table  # benchmarks/common.py

logger = logging.getLogger("bench_moe_kernels")

TOKENS = (1, 8, 32, 128, 512)
ADAPTERS = (0, 8)
FP8_ADAPTERS = (0,)  # FP8 experts: the base GEMMs change, the expert LoRA does not
COLUMNS = [("weights", "weights", ""), ("num_tokens", "T", "d"), ("adapters", "adapters", "d"),
           ("experts_hit", "experts hit", "d"),
           ("fused_us", "fused us", ".1f"), ("graph_us", "graph us", ".1f"), ("loop_us", "loop us", ".1f"),
           ("speedup", "x faster than loop", ".2f"), ("weight_gbps", "GB/s", ".0f")]


@dataclass(frozen=True)
class MoELayer:
    """One MoE layer's sizes (and its LoRA slots')."""

    hidden: int = 2048
    intermediate: int = 768
    num_experts: int = 128
    top_k: int = 8
    max_loras: int = 8
    rank: int = 16


QWEN3_30B_A3B = MoELayer()
TOY = MoELayer(hidden=64, intermediate=32, num_experts=8, top_k=2, max_loras=8, rank=16)  # the device dry run


def make_operands(layer: MoELayer, num_tokens: int, adapters: int, device, dtype, gen: torch.Generator) -> tuple:
    """(x, w_gate_up, w_down, topk_weights, topk_ids, lora or None), random, LoRA in moe_triton's layout."""
    from punica_kernels.moe_reference import route

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    h, i, e = layer.hidden, layer.intermediate, layer.num_experts
    x = rand(num_tokens, h)
    w_gate_up, w_down = rand(e, 2 * i, h, scale=h ** -0.5), rand(e, h, i, scale=i ** -0.5)
    weights, experts = route(torch.randn(num_tokens, e, generator=gen), layer.top_k, True)
    weights, experts = weights.to(device, dtype), experts.to(device)  # Qwen3-MoE: weights in the model dtype
    if not adapters:
        return x, w_gate_up, w_down, weights, experts, None
    slots = torch.arange(num_tokens) % adapters
    slots[7::8] = -1  # some tokens without an adapter
    lora_l, r = layer.max_loras, layer.rank
    lora = (slots.to(device), torch.full((lora_l,), r, dtype=torch.int32, device=device),
            (rand(lora_l, e, 2, r, h, scale=h ** -0.5), rand(lora_l, e, 2 * i, r, scale=0.02),
             torch.ones(lora_l, e, 2, device=device)),
            (rand(lora_l, e, 1, r, i, scale=i ** -0.5), rand(lora_l, e, h, r, scale=0.02),
             torch.ones(lora_l, e, 1, device=device)))
    return x, w_gate_up, w_down, weights, experts, lora


def _loop_delta(x: torch.Tensor, factors: tuple, expert: int, slots: torch.Tensor, out: torch.Tensor) -> None:
    """out[rows of slot s] += per slice scale * (x @ A.T) @ B.T, per adapter slot of the rows (the CPU path's loop)."""
    lora_a, lora_b, scales = factors
    n_slices = lora_a.shape[2]
    width = lora_b.shape[2] // n_slices
    for slot in slots.unique().tolist():
        if slot < 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        for j in range(n_slices):
            inter = (x[rows].float() @ lora_a[slot, expert, j].float().T) * scales[slot, expert, j]
            delta = inter @ lora_b[slot, expert, j * width:(j + 1) * width].float().T
            out[rows, j * width:(j + 1) * width] = (out[rows, j * width:(j + 1) * width].float() + delta).to(out.dtype)


def loop_moe(x, w_gate_up, w_down, weights, experts, lora=None) -> torch.Tensor:
    """The per-expert torch loop (lora_runner.model.moe's batch-invariant path, its LoRA as add_expert_lora's;
    the CPU path proper groups the experts: lora_runner.model.moe_cpu)."""
    out, intermediate = torch.zeros_like(x), w_down.shape[2]
    for expert in experts.unique().tolist():
        token_idx, k_pos = torch.where(experts == expert)
        gate_up = x[token_idx] @ w_gate_up[expert].T
        slots = None if lora is None else lora[0][token_idx]
        if slots is not None:
            _loop_delta(x[token_idx], lora[2], expert, slots, gate_up)
        hidden = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        y = hidden @ w_down[expert].T
        if slots is not None:
            _loop_delta(hidden, lora[3], expert, slots, y)
        out.index_add_(0, token_idx, (y * weights[token_idx, k_pos, None]).to(out.dtype))
    return out


def fp8_experts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Experts' W [E, N, K] -> (float8_e4m3fn [E, N, K], float32 scales [E, N], dequantized W in W's dtype)."""
    from lora_runner.model.quant.fp8 import quantize_per_channel

    quantized, scale = quantize_per_channel(weight.reshape(-1, weight.shape[-1]))
    quantized, scale = quantized.view(weight.shape), scale.view(weight.shape[:2])
    return quantized, scale, (quantized.float() * scale[:, :, None]).to(weight.dtype)


def bench_point(layer: MoELayer, num_tokens: int, adapters: int, device: torch.device, dtype: torch.dtype,
                min_seconds: float, gen: torch.Generator, fp8: bool = False) -> dict:
    from punica_kernels.moe_triton import fused_moe

    operands = make_operands(layer, num_tokens, adapters, device, dtype, gen)
    fused = lambda: fused_moe(*operands)  # noqa: E731
    if fp8:
        (q_gate_up, s_gate_up, gate_up), (q_down, s_down, down) = map(fp8_experts, operands[1:3])
        operands = (operands[0], gate_up, down, *operands[3:])  # the loop's: the dequantized weights
        scales = (s_gate_up, s_down)
        fused = lambda: fused_moe(operands[0], q_gate_up, q_down, *operands[3:], scales=scales)  # noqa: E731
    loop = lambda: loop_moe(*operands)  # noqa: E731
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(fused().float(), loop().float(), rtol=tol, atol=tol)  # time the right thing
    fused_us, loop_us = time_us(fused, device, min_seconds), time_us(loop, device, min_seconds)
    graph_us = None
    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fused()
        graph_us = time_us(graph.replay, device, min_seconds)
    hit = operands[4].unique().numel()
    weight_bytes = hit * 3 * layer.hidden * layer.intermediate * (1 if fp8 else operands[0].element_size())
    return dict(weights="fp8" if fp8 else str(dtype).removeprefix("torch."), num_tokens=num_tokens,
                adapters=adapters, experts_hit=hit, fused_us=fused_us, graph_us=graph_us,
                loop_us=loop_us, speedup=loop_us / fused_us,
                weight_gbps=weight_bytes / (graph_us or fused_us) / 1e3)


def run_rows(layer: MoELayer, tokens, device: torch.device, dtype: torch.dtype, deadline: float,
             rows: list, min_seconds: float) -> None:
    """bench_point over tokens x ADAPTERS into ``rows`` (an error row per failed point); RuntimeError if any failed."""
    gen = torch.Generator().manual_seed(0)
    for num_tokens in tokens:
        for adapters, fp8 in [*((a, False) for a in ADAPTERS), *((a, True) for a in FP8_ADAPTERS)]:
            if time.time() > deadline:
                raise TimeoutError(f"MoE benchmark stopped at T={num_tokens}: out of time")
            try:
                rows.append(bench_point(layer, num_tokens, adapters, device, dtype, min_seconds, gen, fp8))
            except Exception as exc:  # noqa: BLE001 -- one bad point must not hide the others
                logger.exception("MoE point T=%d adapters=%d failed", num_tokens, adapters)
                rows.append(dict(num_tokens=num_tokens, adapters=adapters, error=repr(exc)[:200]))
    if any("error" in row for row in rows):
        raise RuntimeError(f"{sum('error' in row for row in rows)} MoE point(s) failed (see the table)")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--quick", action="store_true", help="T in (1, 64)")
    parser.add_argument("--min-seconds", type=float, default=0.05)
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default results/...)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        logger.info("bench_moe_kernels: skipped, the fused MoE kernels run on a CUDA device (none here)")
        return []
    device, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    rows: list[dict] = []
    run_rows(QWEN3_30B_A3B, (1, 64) if args.quick else TOKENS, device, dtype, float("inf"), rows, args.min_seconds)
    print(f"\nfused MoE on {torch.cuda.get_device_name()}, {dtype}, {QWEN3_30B_A3B}")
    print(markdown_table(rows, COLUMNS))
    out = args.out or Path("results") / f"bench_moe_kernels-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(machine=machine_description("cuda"), dtype=str(dtype),
                                   layer=QWEN3_30B_A3B.__dict__, rows=rows), indent=2))
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
