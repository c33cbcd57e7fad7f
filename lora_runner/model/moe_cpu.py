"""The sparse-MoE block's routed experts in torch (the CPU's path): the (token, k) pairs sorted by expert
once per block, one grouped GEMM per projection over the sorted rows, the expert LoRA in the same pass.

    key     = expert * (L + 1) + slot                # slot L: no expert LoRA; pairs p = t * k + j
    order   = argsort(key, stable)                   # by expert, within an expert by adapter slot
    rows    = hidden[order // k]                     # [P, H] gathered once
    gate_up = grouped_mm(rows, W_gate_up[e].T)       # [P, 2I] one call over every expert's segment
    gate_up[lora rows] += (rows @ A[e, s].T) * scale[e, s] @ B[e, s].T   grouped by (expert, slot)
    y       = grouped_mm(silu(gate) * up, W_down[e].T) (+ its LoRA)       # [P, H]
    out.index_add_(0, order // k, y * w)             # scattered once

index_add_ adds the sorted rows in order, so each token sums its experts in ascending expert order
(transformers' order, and the per-expert loop's that lora_runner.model.moe keeps for the batch-invariant
mode). The base GEMM is ``torch._grouped_mm`` over the experts' stacked weights (views of one buffer per
projection, moe_fused.stack_in_place; left dense after loading: moe.StackedDenseLinear); FP8 experts
(lora_runner.model.moe_fp8) are dequantized for the experts the batch routes to, then the same grouped
GEMM; weights that are not dense (packed for oneDNN by lora_runner.model.cpu_gemm) take a loop over the
expert segments calling each expert's linear. Off the CPU (the fused kernels' stand-in in tests) the
grouped GEMM is a matmul per segment. The LoRA runs only over the pairs whose slot has expert LoRA (``LoRASlots.expert_ranks``
> 0), at the batch's largest such rank (the slots are zero past each adapter's rank: exact), on the
stacked slot tensors with no copy in float32; half dtypes compute in float32 (as punica_kernels.add_lora)
on a float32 copy of the (expert, slot) groups present.

Measured (benchmarks/bench_moe.py, one thread, 4 layers, hidden 256, 16 experts, top-4), against the
per-expert loop with oneDNN-packed experts it replaces: engine base decode 0.60x -> 0.90x transformers,
prefill 0.84x -> 0.98x; with 8 expert LoRAs decode 0.31x -> 0.46x of the engine base, prefill
0.52x -> 0.70x. In decode the expert LoRA's (expert, slot) groups are mostly one row each, so its
grouped GEMMs cost per group, not per FLOP.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lora_runner.model import moe_fp8, moe_fused
from lora_runner.model.forward_context import LoRAContext

_STACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # block -> {key: stacked views}


@dataclass(frozen=True)
class LoRAGroups:
    """The sorted pairs whose adapter slot has expert LoRA, grouped by (expert, slot)."""

    rows: torch.Tensor | None  # [P'] their positions in the sorted order; None: every pair (P' = P)
    groups: torch.Tensor  # [P'] expert * L + slot of each
    sizes: list[int]  # [E * L] pairs per (expert, slot) group, on the host
    ends: torch.Tensor  # [E * L] int32 cumulative sizes (torch._grouped_mm's offsets)
    rank: int  # the largest expert rank among their slots


@dataclass(frozen=True)
class PairGroups:
    """The (token, k) pairs of a block's routing sorted by (expert, adapter slot)."""

    order: torch.Tensor  # [P] pair ids p = t * k + j in sorted order
    tokens: torch.Tensor  # [P] each sorted pair's token
    sizes: list[int]  # [E] pairs per expert, on the host
    ends: torch.Tensor  # [E] int32 cumulative sizes
    lora: LoRAGroups | None  # None: no pair has expert LoRA


def group_pairs(experts: torch.Tensor, num_experts: int, token_slots: torch.Tensor | None,
                expert_ranks: torch.Tensor | None) -> PairGroups:
    """Sort the pairs of ``experts`` [T, k] by expert and, within an expert, by adapter slot.

    token_slots [T]: each token's slot where it has expert LoRA, else -1 (moe.expert_token_slots), or
    None; expert_ranks [L]: each slot's expert rank (LoRASlots.expert_ranks)."""
    top_k = experts.shape[1]
    flat = experts.reshape(-1).to(torch.int64)  # [P]
    num_slots = 0 if token_slots is None else expert_ranks.shape[0]
    if token_slots is None:
        key = flat
    else:
        slots = token_slots.to(torch.int64).repeat_interleave(top_k)  # [P]
        key = flat * (num_slots + 1) + torch.where(slots >= 0, slots, num_slots)
    order = torch.argsort(key, stable=True)  # [P]
    counts = torch.bincount(key, minlength=num_experts * (num_slots + 1)).view(num_experts, num_slots + 1)
    sizes = counts.sum(1)  # [E]
    lora = None
    if token_slots is not None:
        group_sizes = counts[:, :num_slots].reshape(-1)  # [E * L]
        sorted_key = key[order]
        with_lora = sorted_key % (num_slots + 1) < num_slots  # [P]
        rows = None if bool(with_lora.all()) else with_lora.nonzero().squeeze(1)  # [P']
        lora_keys = sorted_key if rows is None else sorted_key[rows]
        groups = lora_keys // (num_slots + 1) * num_slots + lora_keys % (num_slots + 1)  # [P'] expert * L + slot
        rank = int(expert_ranks[token_slots[token_slots >= 0]].max())
        lora = LoRAGroups(rows, groups, group_sizes.tolist(), torch.cumsum(group_sizes, 0).to(torch.int32), rank)
    return PairGroups(order, order // top_k, sizes.tolist(), torch.cumsum(sizes, 0).to(torch.int32), lora)


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, sizes: list[int], ends: torch.Tensor) -> torch.Tensor:
    """out[s_g:e_g] = x[s_g:e_g] @ weight[g].T for the consecutive row segments of sizes ``sizes``.

    x [M, K] (M = sum(sizes)), weight [G, N, K] (any strides), ends [G] int32 -> [M, N] in x's dtype:
    one ``torch._grouped_mm`` on the CPU where its layout rules hold, else a matmul per non-empty segment."""
    x, weight_t = x.contiguous(), weight.transpose(1, 2)  # [M, K], [G, K, N]
    if x.device.type == "cpu" and hasattr(torch, "_grouped_mm") and _aligned(x) and _aligned(weight_t):
        return torch._grouped_mm(x, weight_t, offs=ends)
    out, start = x.new_empty(x.shape[0], weight.shape[1]), 0
    for group, size in enumerate(sizes):
        if size:
            torch.mm(x[start:start + size], weight[group].T, out=out[start:start + size])
        start += size
    return out


def _aligned(matrices: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes these matrices (last two dims): one unit stride, the other a
    multiple of 16 bytes (its check, ATen/native/GroupedMMUtils.h)."""
    rows, cols = matrices.stride()[-2:]
    lead = cols if rows == 1 else rows if cols == 1 else None
    return lead is not None and lead * matrices.element_size() % 16 == 0


def routed_experts(block, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                   token_slots: torch.Tensor | None, lora: LoRAContext | None) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{experts[t, j]}(hidden[t]) [T, H] with each token's expert LoRA
    (token_slots [T]: moe.expert_token_slots, None: no expert LoRA), as described in the module docstring."""
    if hidden.shape[0] == 0:
        return torch.zeros_like(hidden)
    num_experts = len(block.experts)
    pairs = group_pairs(experts, num_experts, token_slots, None if token_slots is None else lora.slots.expert_ranks)
    rows = hidden[pairs.tokens]  # [P, H]
    stacks = _stacks(block, lora if pairs.lora is not None else None)
    gate_up = _base(block, "gate_up", rows, pairs, stacks)  # [P, 2I]
    if pairs.lora is not None:
        add_grouped_lora(gate_up, rows, pairs.lora, stacks["lora_gate_up"], block.experts[0].gate_up)
    gate, up = gate_up.chunk(2, dim=-1)  # [P, I] each
    hidden_rows = F.silu(gate) * up  # [P, I]
    out_rows = _base(block, "down", hidden_rows, pairs, stacks)  # [P, H]
    if pairs.lora is not None:
        add_grouped_lora(out_rows, hidden_rows, pairs.lora, stacks["lora_down"], block.experts[0].down)
    pair_weights = weights.reshape(-1)[pairs.order, None]  # [P, 1]
    out = torch.zeros_like(hidden)  # [T, H]
    return out.index_add_(0, pairs.tokens, (out_rows * pair_weights).to(out.dtype))


def _base(block, projection: str, x: torch.Tensor, pairs: PairGroups, stacks: dict) -> torch.Tensor:
    """x [P, K] sorted rows through each row's expert's ``projection`` -> [P, N]."""
    stacked = stacks.get(projection)
    if stacked is not None:
        weight, weight_scale = stacked  # [E, N, K], FP8's [E, N] or None
        if weight_scale is None:
            return grouped_matmul(x, weight, pairs.sizes, pairs.ends)
        return grouped_matmul(x, *moe_fp8.dequantize_experts(weight, weight_scale, pairs.sizes, x.dtype))
    parts, start = [], 0
    for expert, size in zip(block.experts, pairs.sizes):  # weights not dense (packed, quantized): each its linear
        if size:
            parts.append(getattr(expert, projection)(x[start:start + size], None))
        start += size
    return torch.cat(parts)


def _stacks(block, lora: LoRAContext | None) -> dict:
    """The block's stacked expert weights ("gate_up", "down": moe_fused.base_stacks' (weight, FP8 scale or
    None); absent where not dense: packed for oneDNN, or quantized other than FP8) and, with ``lora``,
    its slots ("lora_gate_up", "lora_down": moe_fused's (lora_a [E, L, n, R, K], lora_b [E, L, N, R],
    slice_scales [E, L, n])); views kept per block."""
    stacks = _STACKS.setdefault(block, {})
    views = dict(moe_fused.base_stacks(block) or {})
    if lora is not None:
        if stacks.get("slots") is not lora.slots:
            stacks["slots"], stacks["lora"] = lora.slots, {
                f"lora_{projection}": tuple(t.transpose(0, 1) for t in moe_fused.stacked_slots(
                    lora, block.experts, projection)) for projection in ("gate_up", "down")}
        views.update(stacks["lora"])
    return views


def add_grouped_lora(y: torch.Tensor, x: torch.Tensor, groups: LoRAGroups, slots: tuple[torch.Tensor, ...],
                     linear) -> None:
    """Add each sorted row's expert LoRA delta to y [P, N] in place, x [P, K] the projection's input.

    Semantics: y[p, off_j:off_j+N_j] += slice_scales[e, s, j] * (x[p] @ lora_a[e, s, j, :r].T)
    @ lora_b[e, s, off_j:off_j+N_j, :r].T for each row p of ``groups`` (expert e, slot s), r its rank;
    slots (lora_a [E, L, n, R, K], lora_b [E, L, N, R], slice_scales [E, L, n]); ``linear`` gives the
    slices (an expert's projection). Other rows stay as they are."""
    lora_a, lora_b, slice_scales = slots
    compute = torch.float32 if y.dtype in (torch.float16, torch.bfloat16) else y.dtype
    x_lora = (x if groups.rows is None else x[groups.rows]).to(compute)  # [P', K]
    scales = slice_scales.flatten(0, 1)[groups.groups].to(compute)  # [P', n]
    sizes, ends, present = groups.sizes, groups.ends, None
    if compute != y.dtype:  # a float32 copy of the groups present only
        present = torch.tensor([g for g, size in enumerate(sizes) if size], dtype=torch.int64)
        sizes = [size for size in sizes if size]
        ends = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
    # rounded up to 16 bytes of float32 for grouped_mm's layout rule: exact, the slots are zero past each rank
    r = min(-(-groups.rank // 4) * 4, lora_a.shape[-2])
    for j, (offset, size) in enumerate(zip(linear.slice_offsets(), linear.slice_sizes)):
        a = lora_a[:, :, j, :r].flatten(0, 1)  # [E * L, r, K]
        b = lora_b[:, :, offset:offset + size, :r].flatten(0, 1)  # [E * L, N_j, r]
        if present is not None:
            a, b = a[present].to(compute), b[present].to(compute)
        inter = grouped_matmul(x_lora, a, sizes, ends) * scales[:, j:j + 1]  # [P', r]
        delta = grouped_matmul(inter, b, sizes, ends)  # [P', N_j]
        target = y[:, offset:offset + size]  # [P, N_j]
        if compute == y.dtype:  # rows are distinct: one addition per element
            if groups.rows is None:
                target += delta
            else:
                target.index_add_(0, groups.rows, delta)
        else:  # added in float32 and rounded once, as the dense linears' LoRA
            rows = slice(None) if groups.rows is None else groups.rows
            y[rows, offset:offset + size] = (target[rows].to(compute) + delta).to(y.dtype)
