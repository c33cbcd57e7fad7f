"""SGMV shrink and expand in Triton: one launch each for every adapter and slice in the batch.

Both kernels walk the meta's tile table (tiles of <= block_m tokens of one slot, in slot-sorted
order), so the grid is ``meta.max_tiles(T)`` programs (times splits or output blocks) whatever the
adapter mix; tiles without work exit at once. Design points (design.md section 4):

* fp32 intermediate, fp32 accumulation; int64 pointer offsets for rows, slots and slices.
* The expand applies the per-slot scales of :mod:`punica_kernels.scales` (LoRA scaling on the
  fp32 intermediate, DoRA's column scale in the epilogue), so B is stored unscaled.
* Ranks are tiled by 16 inside the kernels (``tl.dot`` needs >= 16), any rank 1..R works; with
  per-slot ranks only the slot's real rank (rounded up to 16) is read and multiplied.
* Slices are addressed by integer offsets/strides, never by a tensor of pointers.
* Shrink reads each x tile once for all slices: it multiplies by the slices' A matrices stacked as
  one [n*R, K] operand. Few tiles (decode) are split over K into separate fp32 partials that the
  expand sums: deterministic, no atomics, no zeroing launch.
* No allocation and no host sync inside the ops: scratch lives in the meta's workspace.

CPU tensors run under the Triton interpreter (no bf16 there), whether or not TRITON_INTERPRET was
set when this module was imported.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .meta import FULL_RANK, LoRAMeta
from .scales import NO_SCALES, Scales

BLOCK_K = 64  # shrink: largest reduction step over the input features (smaller for wide stacked ranks)
# shrink: A-tile elements per thread; 64 spills registers on sm_80/sm_90 (benchmarks/kernel_report.py)
SHRINK_TILE_ELEMENTS_PER_THREAD = 32
BLOCK_N = 64  # expand: output columns per program
BLOCK_R = 16  # expand: rank step, the smallest tile tl.dot takes
MAX_SPLIT_K = 16
SPLIT_K_TARGET_PROGRAMS = 64  # split the shrink's K until about this many programs run
assert FULL_RANK % 16 == 0  # rounding FULL_RANK up to 16 must not overflow into a smaller value


@triton.jit(do_not_specialize=["k_per_split", "stride_os"])
def _shrink_kernel(
    x_ptr, a_ptr, out_ptr,
    sorted_tokens_ptr, tile_slots_ptr, tile_starts_ptr, tile_ends_ptr, slot_ranks_ptr,
    num_features, k_per_split,
    stride_xt, stride_xk,
    stride_as, stride_aj, stride_ar, stride_ak,
    stride_os, stride_ot, stride_oj, stride_or,
    N_SLICES: tl.constexpr, RANK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_NR: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    slot = tl.load(tile_slots_ptr + tile)
    if slot < 0:
        return
    start = tl.load(tile_starts_ptr + tile)
    end = tl.load(tile_ends_ptr + tile)
    rank = tl.minimum((tl.load(slot_ranks_ptr + slot) + 15) // 16 * 16, RANK)

    offs_m = tl.arange(0, BLOCK_M)
    row_mask = start + offs_m < end  # [BLOCK_M]
    tokens = tl.load(sorted_tokens_ptr + start + offs_m, mask=row_mask, other=0)  # [BLOCK_M] int64
    offs_i = tl.arange(0, BLOCK_NR)  # stacked (slice, rank) rows of A
    slice_of_i = offs_i // RANK  # [BLOCK_NR]
    rank_of_i = offs_i % RANK  # [BLOCK_NR]
    i_mask = (slice_of_i < N_SLICES) & (rank_of_i < rank)  # [BLOCK_NR]
    a_rows = (slot.to(tl.int64) * stride_as + slice_of_i.to(tl.int64) * stride_aj
              + rank_of_i.to(tl.int64) * stride_ar)  # [BLOCK_NR]
    x_rows = tokens * stride_xt  # [BLOCK_M] int64

    acc = tl.full((BLOCK_M, BLOCK_NR), 0.0, tl.float32)
    k_begin = split * k_per_split  # k_per_split is a multiple of BLOCK_K
    k_end = tl.minimum(k_begin + k_per_split, num_features)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < num_features  # [BLOCK_K]
        x_tile = tl.load(x_ptr + x_rows[:, None] + offs_k[None, :].to(tl.int64) * stride_xk,
                         mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        a_tile = tl.load(a_ptr + a_rows[:, None] + offs_k[None, :].to(tl.int64) * stride_ak,
                         mask=i_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_NR, BLOCK_K]
        acc = tl.dot(x_tile, tl.trans(a_tile), acc, input_precision=DOT_PRECISION)

    out_cols = slice_of_i.to(tl.int64) * stride_oj + rank_of_i.to(tl.int64) * stride_or  # [BLOCK_NR]
    out_ptrs = out_ptr + split.to(tl.int64) * stride_os + (tokens * stride_ot)[:, None] + out_cols[None, :]
    tl.store(out_ptrs, acc, mask=row_mask[:, None] & (slice_of_i < N_SLICES)[None, :])


def _launch_shrink(x: torch.Tensor, lora_a: torch.Tensor, meta: LoRAMeta,
                   out: torch.Tensor, split_k: int) -> None:
    """Semantics: out[p, t, j] = sum over K-split p of x[t] @ lora_a[s, j].T, s = token_slots[t] >= 0.

    x [T, K] (fp16/bf16/fp32); lora_a [max_loras, n_slices, R, K] same dtype;
    out [split_k, T, n_slices, R] float32 (any strides): rows of slot -1 tokens are not written.
    Summing out over its first dim gives x[t] @ lora_a[s, j].T. Grid (max_tiles(T), split_k).
    """
    _, n_slices, rank, num_features = lora_a.shape
    block_nr = max(16, triton.next_power_of_2(n_slices * rank))  # stacked (slice, rank) rows
    num_warps = 4 if block_nr <= 64 else 8
    tile_elements = SHRINK_TILE_ELEMENTS_PER_THREAD * 32 * num_warps  # the [BLOCK_NR, BLOCK_K] A tile's bound
    block_k = max(16, min(BLOCK_K, tile_elements // block_nr))
    k_per_split = triton.cdiv(triton.cdiv(num_features, split_k), block_k) * block_k
    grid = (meta.max_tiles(x.shape[0]), split_k)
    kernel_for(_shrink_kernel, x.device)[grid](
        x, lora_a, out,
        meta.sorted_tokens, meta.tile_slots, meta.tile_starts, meta.tile_ends, meta.slot_ranks,
        num_features, k_per_split,
        *x.stride(), *lora_a.stride(), *out.stride(),
        N_SLICES=n_slices, RANK=rank, BLOCK_M=meta.block_m, BLOCK_NR=block_nr, BLOCK_K=block_k,
        DOT_PRECISION=_dot_precision(x.dtype), num_warps=num_warps,
    )


# stride_gs is n_slices: specializing its 1 (o, down) would double the expand configs for nothing
@triton.jit(do_not_specialize=["stride_is", "stride_gs"])
def _expand_kernel(
    y_ptr, inter_ptr, b_ptr, slice_offsets_ptr, slice_scales_ptr, column_scales_ptr, bias_ptr,
    sorted_tokens_ptr, tile_slots_ptr, tile_starts_ptr, tile_ends_ptr, slot_ranks_ptr,
    stride_yt, stride_yn,
    stride_is, stride_it, stride_ij, stride_ir,
    stride_bs, stride_bn, stride_br,
    stride_gs, stride_gj, stride_cs, stride_cn, stride_bias,
    RANK: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    slice_id = tl.program_id(1)
    n0 = tl.program_id(2) * BLOCK_N
    slot = tl.load(tile_slots_ptr + tile)
    column0 = tl.load(slice_offsets_ptr + slice_id)  # first output column of this slice
    width = tl.load(slice_offsets_ptr + slice_id + 1) - column0
    rank = tl.minimum((tl.load(slot_ranks_ptr + tl.maximum(slot, 0)) + 15) // 16 * 16, RANK)
    if (slot < 0) | (n0 >= width) | (rank == 0):
        return
    start = tl.load(tile_starts_ptr + tile)
    end = tl.load(tile_ends_ptr + tile)
    slice_scale = tl.load(slice_scales_ptr + slot.to(tl.int64) * stride_gs + slice_id * stride_gj)  # fp32

    offs_m = tl.arange(0, BLOCK_M)
    row_mask = start + offs_m < end  # [BLOCK_M]
    tokens = tl.load(sorted_tokens_ptr + start + offs_m, mask=row_mask, other=0)  # [BLOCK_M] int64
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < width  # [BLOCK_N]
    columns = column0 + offs_n  # [BLOCK_N] int64 output columns
    b_rows = slot.to(tl.int64) * stride_bs + columns * stride_bn  # [BLOCK_N]
    inter_rows = tokens * stride_it + slice_id.to(tl.int64) * stride_ij  # [BLOCK_M]

    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < RANK  # [BLOCK_R]
        inter_ptrs = inter_ptr + inter_rows[:, None] + offs_r[None, :].to(tl.int64) * stride_ir
        inter_mask = row_mask[:, None] & r_mask[None, :]
        inter = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)
        for split in tl.static_range(SPLIT_K):  # sum the shrink's K-split partials
            inter += tl.load(inter_ptrs + stride_is.to(tl.int64) * split, mask=inter_mask,
                             other=0.0)
        inter = inter * slice_scale  # the adapter's scaling, on the fp32 intermediate
        b_tile = tl.load(b_ptr + b_rows[None, :] + offs_r[:, None].to(tl.int64) * stride_br,
                         mask=r_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
        acc = tl.dot(inter, b_tile.to(tl.float32), acc, input_precision=DOT_PRECISION)

    # DoRA epilogue: y = c * y + c * delta + (1 - c) * bias, c the slot's column scale (1 for plain
    # LoRA, which leaves y + delta exact); the base bias is not scaled.
    column_scale = tl.load(column_scales_ptr + slot.to(tl.int64) * stride_cs + columns * stride_cn,
                           mask=n_mask, other=1.0)[None, :]  # [1, BLOCK_N] fp32
    y_ptrs = y_ptr + (tokens * stride_yt)[:, None] + (columns * stride_yn)[None, :]
    y_mask = row_mask[:, None] & n_mask[None, :]
    y_tile = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_N]
    out = y_tile * column_scale
    if HAS_BIAS:
        bias = tl.load(bias_ptr + columns * stride_bias, mask=n_mask, other=0.0).to(tl.float32)
        out += (1.0 - column_scale) * bias[None, :]
    tl.store(y_ptrs, (out + acc * column_scale).to(y_ptr.dtype.element_ty), mask=y_mask)


def _launch_expand(y: torch.Tensor, inter: torch.Tensor, lora_b: torch.Tensor, meta: LoRAMeta,
                   slice_sizes: tuple[int, ...], scales: Scales) -> None:
    """Semantics: y[t, cols_j] = c * y[t, cols_j] + (1 - c) * bias[cols_j]
    + c * g[s, j] * (sum_p inter[p, t, j]) @ lora_b[s, cols_j].T, with c = column_scales[s, cols_j].

    y [T, N] in place (fp16/bf16/fp32), s = token_slots[t] >= 0, rows of slot -1 tokens untouched;
    cols_j = off_j:off_j+N_j; inter [split_k, T, n_slices, R] float32 (the shrink's partials);
    lora_b [max_loras, N, R], y's dtype; scales as :class:`Scales` (missing ones read as 1, a
    missing bias as 0). Grid (max_tiles(T), n_slices, cdiv(max N_j, BLOCK_N)).
    """
    split_k, _, n_slices, rank = inter.shape
    slice_scales = meta.unit_scales(n_slices) if scales.slices is None else scales.slices
    column_scales = meta.unit_scales(y.shape[1]) if scales.columns is None else scales.columns
    bias = scales.bias if scales.bias is not None and scales.columns is not None else None
    grid = (meta.max_tiles(y.shape[0]), len(slice_sizes), triton.cdiv(max(slice_sizes), BLOCK_N))
    kernel_for(_expand_kernel, y.device)[grid](
        y, inter, lora_b, meta.slice_offsets(slice_sizes), slice_scales, column_scales,
        y if bias is None else bias,  # never read without HAS_BIAS; y has the bias' dtype
        meta.sorted_tokens, meta.tile_slots, meta.tile_starts, meta.tile_ends, meta.slot_ranks,
        *y.stride(), *inter.stride(), *lora_b.stride(), *slice_scales.stride(), *column_scales.stride(),
        0 if bias is None else bias.stride(0),
        RANK=rank, SPLIT_K=split_k, BLOCK_M=meta.block_m, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R,
        HAS_BIAS=bias is not None, DOT_PRECISION=_expand_precision(lora_b.dtype),
    )


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, meta: LoRAMeta,
                out: torch.Tensor) -> torch.Tensor:
    """Semantics: out[t, j] = x[t] @ lora_a[s, j].T for s = token_slots[t] >= 0 (one launch).

    x [T, K]; lora_a [max_loras, n_slices, R, K]; out [T, n_slices, R] float32.
    """
    if x.shape[0]:
        _launch_shrink(x, lora_a, meta, out.unsqueeze(0), split_k=1)
    return out


def lora_expand(y: torch.Tensor, inter: torch.Tensor, lora_b: torch.Tensor, meta: LoRAMeta,
                slice_sizes: tuple[int, ...], scales: Scales = NO_SCALES) -> torch.Tensor:
    """Semantics: y[t, off_j:off_j+N_j] += inter[t, j] @ lora_b[s, off_j:off_j+N_j].T, scaled as
    :mod:`punica_kernels.scales` says (one launch).

    y [T, N] in place; inter [T, n_slices, R] float32; lora_b [max_loras, N, R].
    """
    if y.shape[0]:
        _launch_expand(y, inter.unsqueeze(0), lora_b, meta, slice_sizes, scales)
    return y


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             meta: LoRAMeta, slice_sizes: tuple[int, ...], scales: Scales = NO_SCALES) -> torch.Tensor:
    """Semantics: y[t, off_j:off_j+N_j] += (x[t] @ lora_a[s, j].T) @ lora_b[s, off_j:off_j+N_j].T,
    scaled as :mod:`punica_kernels.scales` says.

    Two launches, the intermediate in the meta's workspace; shapes as in punica_kernels.add_lora.
    """
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return y
    _, n_slices, rank, num_features = lora_a.shape
    row_elements = num_tokens * n_slices * rank
    workspace = meta.workspace_for(row_elements)
    split_k = choose_split_k(meta.max_tiles(num_tokens), num_features,
                             workspace.numel() // row_elements)
    inter = workspace[:split_k * row_elements].view(split_k, num_tokens, n_slices, rank)
    _launch_shrink(x, lora_a, meta, inter, split_k)
    _launch_expand(y, inter, lora_b, meta, slice_sizes, scales)
    return y


def choose_split_k(num_tiles: int, num_features: int, max_split: int) -> int:
    """Power-of-two K split so a small batch still spreads the shrink over enough programs.

    Bounded by MAX_SPLIT_K, by the BLOCK_K steps in K, and by how many partials the workspace
    holds (``max_split``). Depends only on T and the layer's sizes, so graphs replay the same.
    """
    limit = min(MAX_SPLIT_K, triton.cdiv(num_features, BLOCK_K), max_split)
    split_k = 1
    while split_k * 2 <= limit and num_tiles * split_k < SPLIT_K_TARGET_PROGRAMS:
        split_k *= 2
    return split_k


def _dot_precision(dtype: torch.dtype) -> str:
    # The shrink: half inputs multiply exactly on tensor cores whatever this says; fp32 inputs
    # get exact fp32 products.
    return "ieee" if dtype == torch.float32 else "tf32"


def _expand_precision(dtype: torch.dtype) -> str:
    # The expand multiplies the fp32 intermediate (scaled) by B cast to fp32. One tf32 pass would
    # round the intermediate to 10 mantissa bits: as much error as folding the scaling into a
    # half B. tf32x3 (three tensor-core passes) keeps it to about fp32's; the expand is memory-bound.
    return "ieee" if dtype == torch.float32 else "tf32x3"


def kernel_for(kernel, device: torch.device):
    """The compiled kernel for GPU tensors; an interpreted twin for CPU tensors (shared by every
    Triton kernel in the project, the paged attention too)."""
    if device.type != "cpu" or not isinstance(kernel, triton.runtime.JITFunction):
        return kernel  # GPU, or this module was imported under TRITON_INTERPRET=1
    return _interpreted(kernel)


@functools.cache
def _interpreted(kernel):
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(kernel.fn)
