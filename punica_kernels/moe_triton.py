"""Fused mixture-of-experts in Triton: grouped GEMMs over the aligned (token, expert) pairs, and expert
LoRA shrink / expand over (token, expert, adapter slot) blocks, one launch per op for every expert and
adapter in the batch.

The pairs come from :func:`punica_kernels.moe_align.moe_align` (pair p = t * k + j): the GEMMs take
blocks of one expert, the LoRA ops blocks of one (expert, slot); every kernel runs one program per block
(times column blocks) and skips blocks without work (past the last group, or without an adapter). Layouts (E experts, L adapter slots, R the slots' rank)::

    w_gate_up   [E, 2I, H]        gate rows, then up rows (transformers 5's fused experts.gate_up_proj)
    w_down      [E, H, I]
    lora_a      [L, E, n, R, K]   expert e's module slots stacked (adapters.slots: [L, n, R, K] each)
    lora_b      [L, E, N, R]      (adapters.slots: [L, N, R] each)
    slice_scales[L, E, n]         float32 LoRA scaling per slice
    slot_ranks  [L]               int32: each slot's real rank; the kernels read it rounded up to 16

:func:`fused_moe` chains them: gate_up GEMM (+ its LoRA), SiLU(gate) * up, down GEMM times the routing
weight (+ its LoRA, weighted alike: (y + d) w = y w + d w), the k weighted rows of each token summed.
fp32 accumulation; half dtypes multiply on tensor cores, fp32 exactly ("ieee"). CPU tensors run under
the Triton interpreter (punica_kernels.triton_ops.kernel_for).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .moe_align import MoEAlignment, moe_align
from .triton_ops import _dot_precision, _expand_precision, device_function, kernel_for

BLOCK_N = 64  # GEMM / expand: output columns per program
BLOCK_K = 64  # GEMM / shrink: reduction step
BLOCK_R = 16  # expand: rank step (the smallest tile tl.dot takes)
DECODE_BLOCK_M, PREFILL_BLOCK_M = 16, 64  # rows per block; prefill's larger blocks reuse each W tile more
PREFILL_PAIRS = 1024  # pairs from which an alignment uses PREFILL_BLOCK_M


def block_m_for(num_pairs: int) -> int:
    """Rows per block of an alignment of ``num_pairs`` pairs (depends on the batch's size only)."""
    return PREFILL_BLOCK_M if num_pairs >= PREFILL_PAIRS else DECODE_BLOCK_M


# ----------------------------------------------------------------------------- a block's prologue (all kernels)


@device_function
def _block_slot(block_slots_ptr, slot_ranks_ptr, block, RANK: tl.constexpr):
    """The adapter slot of LoRA block ``block`` (-1: none) and the rank its ops read: the slot's rank rounded
    up to 16 (tl.dot's smallest tile), at most RANK; a slot of -1 reads slot 0's rank, unused."""
    slot = tl.load(block_slots_ptr + block)
    rank = tl.minimum((tl.load(slot_ranks_ptr + tl.maximum(slot, 0)) + 15) // 16 * 16, RANK)
    return slot, rank


@device_function
def _block_pairs(sorted_pairs_ptr, block, num_pairs, BLOCK_M: tl.constexpr):
    """The pairs of block ``block`` [BLOCK_M] int64 and their mask (rows padding a group's last block hold
    num_pairs)."""
    offs_m = tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + offs_m).to(tl.int64)  # [BLOCK_M]
    return pairs, pairs < num_pairs


# top_k a runtime int, never specialized (1 for down): one config serves every model's k
@triton.jit(do_not_specialize=["num_pairs", "top_k"])
def _moe_gemm_kernel(
    a_ptr, w_ptr, c_ptr, sorted_pairs_ptr, block_experts_ptr, pair_weights_ptr, w_scale_ptr,
    num_pairs, top_k, num_columns, num_features,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_cm, stride_cn, stride_se, stride_sn,
    MUL_WEIGHT: tl.constexpr, W_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert >= 0:
        pairs, row_mask = _block_pairs(sorted_pairs_ptr, block, num_pairs, BLOCK_M)  # [BLOCK_M] each
        a_rows = (pairs // top_k) * stride_am  # [BLOCK_M] the pair's token (gate_up) or the pair itself (down)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < num_columns
        w_rows = expert.to(tl.int64) * stride_we + offs_n.to(tl.int64) * stride_wn  # [BLOCK_N]
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for k0 in range(0, num_features, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < num_features
            a_tile = tl.load(a_ptr + a_rows[:, None] + offs_k[None, :].to(tl.int64) * stride_ak,
                             mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            w_tile = tl.load(w_ptr + w_rows[None, :] + offs_k[:, None].to(tl.int64) * stride_wk,
                             mask=k_mask[:, None] & n_mask[None, :], other=0)  # [BLOCK_K, BLOCK_N]
            if W_FP8:  # e4m3 bytes -> fp16 bits of value / 256 -> value (all exact) in the activations' dtype
                bits = w_tile.to(tl.uint16)
                w_tile = (((bits & 0x80) << 8) | ((bits & 0x7F) << 7)).to(tl.float16, bitcast=True)
                w_tile = (w_tile.to(tl.float32) * 256.0).to(a_tile.dtype)
            acc = tl.dot(a_tile, w_tile, acc, input_precision=DOT_PRECISION)
        if W_FP8:  # per output channel
            scale = tl.load(w_scale_ptr + expert.to(tl.int64) * stride_se + offs_n.to(tl.int64) * stride_sn,
                            mask=n_mask, other=0.0)  # [BLOCK_N] fp32
            acc = acc * scale[None, :]
        if MUL_WEIGHT:
            acc = acc * tl.load(pair_weights_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)[:, None]
        c_ptrs = c_ptr + (pairs * stride_cm)[:, None] + (offs_n.to(tl.int64) * stride_cn)[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def moe_gemm(a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, align: MoEAlignment,
             top_k: int, pair_weights: torch.Tensor | None = None,
             weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Semantics: out[p] = a[p // top_k] @ W[expert(p)].T (* pair_weights[p]) for every pair p, W = weight,
    or with ``weight_scale`` W[e] = weight[e].float() * weight_scale[e][:, None].

    a [rows, K] (tokens for top_k = k, pairs for top_k = 1); weight [E, N, K] a's dtype, or
    float8_e4m3fn with weight_scale [E, N] float32 (each tile converted to a's dtype in the kernel,
    read as bytes: FP8 conversions are sm_89+ in Triton, this bit shift any GPU's; the scale multiplies
    the fp32 accumulator); out [P, N] any float dtype, every row written; pair_weights [P] float32 or
    None. One launch, grid (max_blocks, cdiv(N, BLOCK_N)).
    """
    num_columns, num_features = weight.shape[1], weight.shape[2]
    fp8 = weight_scale is not None
    assert fp8 == (weight.dtype == torch.float8_e4m3fn), "an FP8 weight comes with its scales, and only it"
    if align.max_blocks == 0:
        return out
    # fp32 tiles at BLOCK_K 64 spill on sm_80 (255 registers): half the K step, and 8 warps for the large block
    half = a.element_size() == 2
    block_k = BLOCK_K if half else BLOCK_K // 2
    num_warps = 4 if half or align.block_m == DECODE_BLOCK_M else 8
    grid = (align.max_blocks, triton.cdiv(num_columns, BLOCK_N))
    kernel_for(_moe_gemm_kernel, a.device)[grid](
        a, weight.view(torch.uint8) if fp8 else weight, out, align.sorted_pairs, align.block_experts,
        out if pair_weights is None else pair_weights, weight_scale if fp8 else out,
        align.num_pairs, top_k, num_columns, num_features, *a.stride(), *weight.stride(), *out.stride(),
        *(weight_scale.stride() if fp8 else (0, 0)),
        MUL_WEIGHT=pair_weights is not None, W_FP8=fp8, BLOCK_M=align.block_m, BLOCK_N=BLOCK_N,
        BLOCK_K=block_k, DOT_PRECISION=_dot_precision(a.dtype), num_warps=num_warps)
    return out


@triton.jit(do_not_specialize=["num_pairs", "top_k"])
def _moe_lora_shrink_kernel(
    x_ptr, a_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, block_slots_ptr, slot_ranks_ptr,
    num_pairs, top_k, num_features,
    stride_xm, stride_xk, stride_as, stride_ae, stride_aj, stride_ar, stride_ak, stride_om, stride_oj, stride_or,
    N_SLICES: tl.constexpr, RANK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_NR: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    slot, rank = _block_slot(block_slots_ptr, slot_ranks_ptr, block, RANK)
    if (slot >= 0) & (rank > 0):
        expert = tl.load(block_experts_ptr + block)
        pairs, row_mask = _block_pairs(sorted_pairs_ptr, block, num_pairs, BLOCK_M)  # [BLOCK_M] each
        x_rows = (pairs // top_k) * stride_xm  # [BLOCK_M]
        offs_i = tl.arange(0, BLOCK_NR)  # the slices' A rows stacked: x is read once for all slices
        slice_of_i, rank_of_i = offs_i // RANK, offs_i % RANK
        i_mask = (slice_of_i < N_SLICES) & (rank_of_i < rank)  # rows beyond the slot's rank are never read
        a_rows = (slot.to(tl.int64) * stride_as + expert.to(tl.int64) * stride_ae
                  + slice_of_i.to(tl.int64) * stride_aj + rank_of_i.to(tl.int64) * stride_ar)  # [BLOCK_NR]
        acc = tl.full((BLOCK_M, BLOCK_NR), 0.0, tl.float32)
        for k0 in range(0, num_features, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < num_features
            x_tile = tl.load(x_ptr + x_rows[:, None] + offs_k[None, :].to(tl.int64) * stride_xk,
                             mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            a_tile = tl.load(a_ptr + a_rows[:, None] + offs_k[None, :].to(tl.int64) * stride_ak,
                             mask=i_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_NR, BLOCK_K]
            acc = tl.dot(x_tile, tl.trans(a_tile), acc, input_precision=DOT_PRECISION)
        out_ptrs = (out_ptr + (pairs * stride_om)[:, None]
                    + (slice_of_i.to(tl.int64) * stride_oj + rank_of_i.to(tl.int64) * stride_or)[None, :])
        tl.store(out_ptrs, acc, mask=row_mask[:, None] & (slice_of_i < N_SLICES)[None, :])


def moe_lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, slot_ranks: torch.Tensor, align: MoEAlignment,
                    top_k: int, out: torch.Tensor) -> torch.Tensor:
    """Semantics: out[p, j] = x[p // top_k] @ lora_a[s, e, j].T for every pair p of expert e and slot s >= 0.

    x [rows, K]; lora_a [L, E, n, R, K] same dtype; slot_ranks [L] int32; out [P, n, R] float32: rows
    of pairs without a slot (or on a slot of rank 0) are not written; A is not read beyond the slot's rank
    rounded up to 16 (those columns of out are written as zeros). Grid (max_blocks,).
    """
    _, _, n_slices, rank, num_features = lora_a.shape
    block_nr = max(16, triton.next_power_of_2(n_slices * rank))
    if align.max_blocks == 0:
        return out
    # the [BLOCK_NR, BLOCK_K] A tile and the [BLOCK_M, BLOCK_K] x tile stay at 64 bytes a thread (the dense
    # shrink's bound, punica_kernels.triton_ops); beyond it fp32 spills on sm_80 at BLOCK_M 64
    block_k = max(16, min(BLOCK_K, 64 * 32 * 4 // x.element_size() // max(block_nr, align.block_m)))
    kernel_for(_moe_lora_shrink_kernel, x.device)[(align.max_blocks,)](
        x, lora_a, out, align.sorted_pairs, align.block_experts, align.block_slots, slot_ranks,
        align.num_pairs, top_k, num_features, *x.stride(), *lora_a.stride(), *out.stride(),
        N_SLICES=n_slices, RANK=rank, BLOCK_M=align.block_m, BLOCK_NR=block_nr, BLOCK_K=block_k,
        DOT_PRECISION=_dot_precision(x.dtype), num_warps=4 if block_nr <= 64 else 8)
    return out


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_lora_expand_kernel(
    y_ptr, inter_ptr, b_ptr, slice_scales_ptr, pair_weights_ptr,
    sorted_pairs_ptr, block_experts_ptr, block_slots_ptr, slot_ranks_ptr,
    num_pairs, slice_width,
    stride_ym, stride_yn, stride_im, stride_ij, stride_ir, stride_bs, stride_be, stride_bn, stride_br,
    stride_gs, stride_ge, stride_gj,
    RANK: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    slot, rank = _block_slot(block_slots_ptr, slot_ranks_ptr, block, RANK)
    if (slot >= 0) & (rank > 0):
        expert = tl.load(block_experts_ptr + block)
        # program_id(1) numbers each slice's column blocks in turn (slices of equal width)
        blocks_per_slice = (slice_width + BLOCK_N - 1) // BLOCK_N  # not tl.cdiv: plain jit, the CPU twin cannot call it
        slice_id = tl.program_id(1) // blocks_per_slice
        offs_n = (tl.program_id(1) % blocks_per_slice) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < slice_width
        columns = (slice_id * slice_width + offs_n).to(tl.int64)  # [BLOCK_N]
        pairs, row_mask = _block_pairs(sorted_pairs_ptr, block, num_pairs, BLOCK_M)  # [BLOCK_M] each
        scale = tl.load(slice_scales_ptr + slot.to(tl.int64) * stride_gs + expert.to(tl.int64) * stride_ge
                        + slice_id * stride_gj)  # fp32
        b_rows = slot.to(tl.int64) * stride_bs + expert.to(tl.int64) * stride_be + columns * stride_bn  # [BLOCK_N]
        offs_r = tl.arange(0, BLOCK_R)
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            r_mask = r0 + offs_r < RANK  # a rank under 16 pads the last step
            inter = tl.load(inter_ptr + (pairs * stride_im + slice_id * stride_ij)[:, None]
                            + (r0 + offs_r)[None, :].to(tl.int64) * stride_ir,
                            mask=row_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_R] fp32
            b_tile = tl.load(b_ptr + b_rows[None, :] + (r0 + offs_r)[:, None].to(tl.int64) * stride_br,
                             mask=r_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
            acc = tl.dot(inter * scale, b_tile.to(tl.float32), acc, input_precision=DOT_PRECISION)
        if MUL_WEIGHT:
            acc = acc * tl.load(pair_weights_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)[:, None]
        y_ptrs = y_ptr + (pairs * stride_ym)[:, None] + (columns * stride_yn)[None, :]
        y_mask = row_mask[:, None] & n_mask[None, :]
        y_tile = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y_tile + acc).to(y_ptr.dtype.element_ty), mask=y_mask)


def moe_lora_expand(y: torch.Tensor, inter: torch.Tensor, lora_b: torch.Tensor, slice_scales: torch.Tensor,
                    slot_ranks: torch.Tensor, align: MoEAlignment,
                    pair_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Semantics: y[p, off_j:off_j+W] += slice_scales[s, e, j] * inter[p, j] @ lora_b[s, e, off_j:off_j+W].T
    (* pair_weights[p]) for every pair p of expert e and slot s >= 0; other rows stay bit-identical.

    y [P, N] in place, N = n * W (slices of equal width W: gate/up, or down alone); inter [P, n, R]
    float32; lora_b [L, E, N, R]; slice_scales [L, E, n] float32; slot_ranks [L] int32; pair_weights [P]
    float32 or None. Added in
    float32 and rounded once, as the dense LoRA. Grid (max_blocks, n * cdiv(W, BLOCK_N)).
    """
    n_slices, rank = inter.shape[1], inter.shape[2]
    width = y.shape[1] // n_slices
    assert width * n_slices == y.shape[1] == lora_b.shape[2], "slices of equal width cover y and lora_b"
    if align.max_blocks == 0:
        return y
    grid = (align.max_blocks, n_slices * triton.cdiv(width, BLOCK_N))
    kernel_for(_moe_lora_expand_kernel, y.device)[grid](
        y, inter, lora_b, slice_scales, y if pair_weights is None else pair_weights,
        align.sorted_pairs, align.block_experts, align.block_slots, slot_ranks,
        align.num_pairs, width, *y.stride(), *inter.stride(), *lora_b.stride(), *slice_scales.stride(),
        RANK=rank, MUL_WEIGHT=pair_weights is not None, BLOCK_M=align.block_m, BLOCK_N=BLOCK_N,
        BLOCK_R=BLOCK_R, DOT_PRECISION=_expand_precision(y.dtype), num_warps=4)
    return y


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, lora: tuple | None = None, scales: tuple | None = None) -> torch.Tensor:
    """Semantics: out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]), each expert a SwiGLU
    down(silu(gate(x)) * up(x)) whose gate_up and down outputs get the token's adapter delta (if any).

    x [T, H]; w_gate_up [E, 2I, H], w_down [E, H, I] x's dtype; topk_weights [T, k] float (its dtype is
    the weighting's: float32 for Mixtral, the model dtype for Qwen3-MoE); topk_ids [T, k] int.
    ``lora``: None, or (token_slots [T] (-1 none), slot_ranks [L] int32, gate_up (lora_a [L, E, 2, R, H],
    lora_b [L, E, 2I, R], slice_scales [L, E, 2]), down (lora_a [L, E, 1, R, I], lora_b [L, E, H, R],
    slice_scales [L, E, 1])). Tokens on a slot of rank 0 are grouped as tokens without one: no LoRA
    block holds their pairs. ``scales``: None, or FP8 experts' (gate_up [E, 2I], down [E, H]) float32,
    w_gate_up and w_down then float8_e4m3fn (moe_gemm). Returns out [T, H] in x's dtype. No host sync:
    graph-capturable.
    """
    num_tokens, top_k = topk_ids.shape
    num_pairs, intermediate = num_tokens * top_k, w_down.shape[2]
    block_m, num_experts = block_m_for(num_pairs), w_gate_up.shape[0]
    # the GEMMs' blocks are by expert alone: blocks by (expert, slot) would read an expert's weights once
    # per adapter among its tokens, and decode is bound by reading the weights
    align = moe_align(topk_ids, num_experts, block_m)
    if lora is not None:
        token_slots, slot_ranks, gate_up_lora, down_lora = lora
        pair_slots = _slots_with_lora(token_slots[:num_tokens], slot_ranks).repeat_interleave(top_k)  # [P]
        lora_align = moe_align(topk_ids, num_experts, block_m, pair_slots, slot_ranks.shape[0])
    s_gate_up, s_down = (None, None) if scales is None else scales
    gate_up = moe_gemm(x, w_gate_up, x.new_empty(num_pairs, 2 * intermediate), align, top_k,
                       weight_scale=s_gate_up)  # [P, 2I]
    if lora is not None:
        _add_lora(gate_up, x, gate_up_lora, slot_ranks, lora_align, top_k, None)
    hidden = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]  # [P, I]
    pair_weights = topk_weights.reshape(-1).float()  # [P] exact for any dtype; one kernel variant
    down = moe_gemm(hidden, w_down, x.new_empty(num_pairs, w_down.shape[1]), align, 1, pair_weights,
                    s_down)  # [P, H]
    if lora is not None:
        _add_lora(down, hidden, down_lora, slot_ranks, lora_align, 1, pair_weights)
    return down.view(num_tokens, top_k, w_down.shape[1]).sum(dim=1, dtype=torch.float32).to(x.dtype)  # [T, H]


def _slots_with_lora(token_slots: torch.Tensor, slot_ranks: torch.Tensor) -> torch.Tensor:
    """token_slots [T] with -1 for a token whose slot has rank 0 (empty, or no LoRA on these experts), on
    the device: the alignment then puts its pairs in the base groups, and the LoRA ops never see them."""
    in_range = token_slots.clamp(0, slot_ranks.shape[0] - 1)  # [T] -1 (none) reads slot 0, masked below
    return torch.where((token_slots >= 0) & (slot_ranks[in_range] > 0), token_slots, -1)


def _add_lora(y: torch.Tensor, x: torch.Tensor, factors: tuple, slot_ranks: torch.Tensor, align: MoEAlignment,
              top_k: int, pair_weights: torch.Tensor | None) -> None:
    lora_a, lora_b, slice_scales = factors
    _, _, n_slices, rank, _ = lora_a.shape
    inter = torch.empty(y.shape[0], n_slices, rank, dtype=torch.float32, device=y.device)  # [P, n, R]
    moe_lora_shrink(x, lora_a, slot_ranks, align, top_k, inter)
    moe_lora_expand(y, inter, lora_b, slice_scales, slot_ranks, align, pair_weights)
