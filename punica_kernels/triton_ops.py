"""SGMV shrink and expand in Triton: one launch each for every adapter and slice in the batch.

Both kernels walk the meta's tile table (tiles of <= block_m tokens of one slot, in slot-sorted
order): ``tile_programs(T)`` programs along the tile axis, each looping over the tiles g, g + G, ...
(times K splits or output column blocks), whatever the adapter mix; tiles without work are skipped.
Design points (design.md sections 4 and 8):

* fp32 intermediate, fp32 accumulation; int64 pointer offsets for rows, slots and slices.
* The expand applies the per-slot scales of :mod:`punica_kernels.scales` (LoRA scaling on the
  fp32 intermediate, DoRA's column scale in the epilogue), so B is stored unscaled.
* Ranks are tiled by 16 inside the kernels (``tl.dot`` needs >= 16), any rank 1..R works; with
  per-slot ranks only the slot's real rank (rounded up to 16) is read and multiplied.
* Slices are addressed by integer offsets/strides, never by a tensor of pointers.
* Shrink reads each x tile once for all slices: it multiplies by the slices' A matrices stacked as
  one [n*R, K] operand. At decode K is cut into chunks of whole BLOCK_K blocks (so the loads are
  aligned, vectorize and pipeline) until about SHRINK_TARGET_PROGRAMS programs run; each split
  writes an fp32 partial and the tile's last split to arrive sums them in split order:
  deterministic (the atomics only count arrivals), no zeroing launch, the expand reads one result.
* The expand indexes the output columns of all slices directly (no slice padded to the widest),
  with alignment hints from the layout so y, B and the scales load and store as vectors.
* No allocation and no host sync inside the ops: scratch lives in the meta's workspace.
* ``add_lora(..., unsplit=True)`` (the batch-invariant mode, punica_kernels.invariant, through
  punica_kernels.ops) never splits K: every other choice (BLOCK_K, warps, tiles) depends on the
  layer's shapes and dtype, never on T, and a token's sums do not depend on the other tokens of its tile.

CPU tensors run under the Triton interpreter (no bf16 there), whether or not TRITON_INTERPRET was
set when this module was imported.
"""

from __future__ import annotations

import functools
import itertools

import torch
import triton
import triton.language as tl

from .meta import FULL_RANK, LoRAMeta
from .scales import NO_SCALES, Scales

BLOCK_K = 64  # shrink: largest reduction step over the input features (smaller for wide stacked ranks)
# shrink: A-tile bytes per thread (32 half elements); twice that spills registers on sm_80/sm_90, and so
# does fp32 at 32 elements once the loads pipeline (benchmarks/kernel_report.py)
SHRINK_TILE_BYTES_PER_THREAD = 64
BLOCK_N = 64  # expand: output columns per program
BLOCK_R = 16  # expand: rank step, the smallest tile tl.dot takes
EXPAND_NUM_WARPS = 8  # 4 spill on sm_90 in fp16 since the tile loop (benchmarks/kernel_report.py)
# ptxas's own register target left the plain-LoRA fp32 expand (rank 64, two slices) at 64 registers with
# a spill on sm_80; a ceiling of 128 for fp32 lets it keep everything in registers. The half dtypes keep
# ptxas's choice: the ceiling raised their registers and cut occupancy (benchmarks/kernel_report.py).
EXPAND_FP32_MAX_REGISTERS = 128
# Both kernels run one program per this many tokens along the tile axis (each program loops over
# the tiles g, g + G, ...): at decode a tile holds a slot's few tokens, and max_tiles(T) (one
# partial tile per possible slot) would leave most programs without work.
TOKENS_PER_TILE_PROGRAM = 4
SHRINK_TARGET_PROGRAMS = 256  # split the shrink's K until about this many programs (2 per SM on an H200)
MIN_K_PER_SPLIT = 2 * BLOCK_K  # smallest K chunk of one split (its partial: 4 B x rows x rank, tiny next to A)
VECTOR_ALIGN = 16  # elements: the alignment hints the kernels get when the layout has it
assert FULL_RANK % 16 == 0  # rounding FULL_RANK up to 16 must not overflow into a smaller value


@triton.jit(do_not_specialize=["num_tiles", "k_blocks_per_split", "stride_ps"])
def _shrink_kernel(
    x_ptr, a_ptr, out_ptr, partial_ptr, counters_ptr,
    sorted_tokens_ptr, tile_slots_ptr, tile_starts_ptr, tile_ends_ptr, slot_ranks_ptr,
    num_tiles, num_features, k_blocks_per_split,
    stride_xt, stride_xk,
    stride_as, stride_aj, stride_ar, stride_ak,
    stride_ot, stride_oj, stride_or,
    stride_ps, stride_pt, stride_pj, stride_pr,
    N_SLICES: tl.constexpr, RANK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_NR: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    offs_i = tl.arange(0, BLOCK_NR)  # stacked (slice, rank) rows of A
    slice_of_i = offs_i // RANK  # [BLOCK_NR]
    rank_of_i = offs_i % RANK  # [BLOCK_NR]
    offs_m = tl.arange(0, BLOCK_M)
    # whole BLOCK_K blocks per split: k_begin is a multiple of BLOCK_K, so the loads vectorize
    k_begin = split * k_blocks_per_split * BLOCK_K
    k_end = tl.minimum(k_begin + k_blocks_per_split * BLOCK_K, num_features)
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        slot = tl.load(tile_slots_ptr + tile)
        if slot >= 0:
            start = tl.load(tile_starts_ptr + tile)
            end = tl.load(tile_ends_ptr + tile)
            rank = tl.minimum((tl.load(slot_ranks_ptr + slot) + 15) // 16 * 16, RANK)
            row_mask = start + offs_m < end  # [BLOCK_M]
            tokens = tl.load(sorted_tokens_ptr + start + offs_m, mask=row_mask, other=0)  # [BLOCK_M] int64
            i_mask = (slice_of_i < N_SLICES) & (rank_of_i < rank)  # [BLOCK_NR]
            a_rows = (slot.to(tl.int64) * stride_as + slice_of_i.to(tl.int64) * stride_aj
                      + rank_of_i.to(tl.int64) * stride_ar)  # [BLOCK_NR]
            x_rows = tokens * stride_xt  # [BLOCK_M] int64

            acc = tl.full((BLOCK_M, BLOCK_NR), 0.0, tl.float32)
            for k0 in range(k_begin, k_end, BLOCK_K):
                offs_k = tl.multiple_of(k0, BLOCK_K) + tl.arange(0, BLOCK_K)
                k_mask = offs_k < num_features  # [BLOCK_K]
                x_tile = tl.load(x_ptr + x_rows[:, None] + offs_k[None, :].to(tl.int64) * stride_xk,
                                 mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
                a_tile = tl.load(a_ptr + a_rows[:, None] + offs_k[None, :].to(tl.int64) * stride_ak,
                                 mask=i_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_NR, BLOCK_K]
                acc = tl.dot(x_tile, tl.trans(a_tile), acc, input_precision=DOT_PRECISION)

            out_mask = row_mask[:, None] & (slice_of_i < N_SLICES)[None, :]
            out_ptrs = (out_ptr + (tokens * stride_ot)[:, None]
                        + (slice_of_i.to(tl.int64) * stride_oj + rank_of_i.to(tl.int64) * stride_or)[None, :])
            if SPLIT:  # store this split's partial; the tile's last split sums all of them, in split order
                partial_rows = (tokens * stride_pt)[:, None] + (slice_of_i.to(tl.int64) * stride_pj
                                                                 + rank_of_i.to(tl.int64) * stride_pr)[None, :]
                tl.store(partial_ptr + split.to(tl.int64) * stride_ps + partial_rows, acc, mask=out_mask)
                tl.debug_barrier()  # every thread's partial is written before the counter says so
                # release our partial, acquire the others'; the sum never depends on who came last
                arrived = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel")
                if arrived == num_splits - 1:
                    total = tl.full((BLOCK_M, BLOCK_NR), 0.0, tl.float32)
                    partial_ptrs = partial_ptr + partial_rows  # split 0's; stepping the pointers keeps 64 bits
                    for _ in range(0, num_splits):
                        # .cg: read L2, where the other programs' partials are, never a stale L1 line
                        total += tl.load(partial_ptrs, mask=out_mask, other=0.0, cache_modifier=".cg")
                        partial_ptrs += stride_ps
                    tl.store(out_ptrs, total, mask=out_mask)
                    tl.atomic_xchg(counters_ptr + tile, 0)  # zero for the next launch (graph replays too)
            else:
                tl.store(out_ptrs, acc, mask=out_mask)


def _launch_shrink(x: torch.Tensor, lora_a: torch.Tensor, meta: LoRAMeta, out: torch.Tensor,
                   partials: torch.Tensor | None = None) -> None:
    """Semantics: out[t, j] = x[t] @ lora_a[s, j].T, s = token_slots[t] >= 0.

    x [T, K] (fp16/bf16/fp32); lora_a [max_loras, n_slices, R, K] same dtype; out [T, n_slices, R]
    float32 (any strides): rows of slot -1 tokens are not written. With ``partials``
    [S, T, n_slices, R] float32 (may share memory with out, as add_lora's do), K is cut into at most S
    chunks of whole BLOCK_K blocks (split_k of them, none empty), each a program writing its partial
    there; the tile's last split sums them in split order into out. Grid (tile_programs(T), split_k).
    """
    num_tokens = x.shape[0]
    _, n_slices, rank, num_features = lora_a.shape
    block_nr = max(16, triton.next_power_of_2(n_slices * rank))  # stacked (slice, rank) rows
    num_warps = 4 if block_nr <= 64 else 8
    # the [BLOCK_NR, BLOCK_K] A tile's bound
    tile_elements = SHRINK_TILE_BYTES_PER_THREAD // x.element_size() * 32 * num_warps
    block_k = max(16, min(BLOCK_K, tile_elements // block_nr))
    k_blocks = triton.cdiv(num_features, block_k)
    k_blocks_per_split = triton.cdiv(k_blocks, 1 if partials is None else partials.shape[0])
    split_k = triton.cdiv(k_blocks, k_blocks_per_split)  # <= the partials given: every split has K to work on
    counters = split_counters(meta) if split_k > 1 else meta.slot_ranks  # never touched without SPLIT
    partials = out.unsqueeze(0) if split_k == 1 else partials[:split_k]
    grid = (tile_programs(meta, num_tokens), split_k)
    kernel_for(_shrink_kernel, x.device)[grid](
        x, lora_a, out, partials, counters,
        meta.sorted_tokens, meta.tile_slots, meta.tile_starts, meta.tile_ends, meta.slot_ranks,
        meta.max_tiles(num_tokens), num_features, k_blocks_per_split,
        *x.stride(), *lora_a.stride(), *out.stride(), *partials.stride(),
        N_SLICES=n_slices, RANK=rank, BLOCK_M=meta.block_m, BLOCK_NR=block_nr, BLOCK_K=block_k,
        SPLIT=split_k > 1, DOT_PRECISION=_dot_precision(x.dtype), num_warps=num_warps,
    )


# stride_gs is n_slices: specializing its 1 (o, down) would double the expand configs for nothing
@triton.jit(do_not_specialize=["num_tiles", "stride_gs"])
def _expand_kernel(
    y_ptr, inter_ptr, b_ptr, slice_offsets_ptr, slice_scales_ptr, column_scales_ptr, bias_ptr,
    sorted_tokens_ptr, tile_slots_ptr, tile_starts_ptr, tile_ends_ptr, slot_ranks_ptr,
    num_tiles,
    stride_yt, stride_yn,
    stride_it, stride_ij, stride_ir,
    stride_bs, stride_bn, stride_br,
    stride_gs, stride_gj, stride_cs, stride_cn, stride_bias,
    N_SLICES: tl.constexpr, RANK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    COLUMN_ALIGN: tl.constexpr, B_ROW_ALIGN: tl.constexpr,
    HAS_COLUMN_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # program_id(1) numbers the column blocks of all slices in turn (no slice padded to another's width)
    column_block = tl.program_id(1)
    slice_id = 0
    first_block = 0  # the first column block of slice_id
    blocks_before = 0
    for j in tl.static_range(N_SLICES - 1):
        width_j = tl.load(slice_offsets_ptr + j + 1) - tl.load(slice_offsets_ptr + j)
        blocks_before += (width_j + BLOCK_N - 1) // BLOCK_N
        past = column_block >= blocks_before
        slice_id = tl.where(past, j + 1, slice_id)
        first_block = tl.where(past, blocks_before, first_block)
    # COLUMN_ALIGN divides every slice offset (the launcher checked): y, B and the scales vectorize
    column0 = tl.multiple_of(tl.load(slice_offsets_ptr + slice_id), COLUMN_ALIGN)  # int64
    width = tl.multiple_of(tl.load(slice_offsets_ptr + slice_id + 1) - column0, COLUMN_ALIGN)
    offs_n = (column_block - first_block) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < width  # [BLOCK_N]
    columns = column0 + offs_n  # [BLOCK_N] int64 output columns
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)

    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        slot = tl.load(tile_slots_ptr + tile)
        rank = tl.minimum((tl.load(slot_ranks_ptr + tl.maximum(slot, 0)) + 15) // 16 * 16, RANK)
        if (slot >= 0) & (rank > 0):
            start = tl.load(tile_starts_ptr + tile)
            end = tl.load(tile_ends_ptr + tile)
            slice_scale = tl.load(slice_scales_ptr + slot.to(tl.int64) * stride_gs + slice_id * stride_gj)  # fp32
            row_mask = start + offs_m < end  # [BLOCK_M]
            tokens = tl.load(sorted_tokens_ptr + start + offs_m, mask=row_mask, other=0)  # [BLOCK_M] int64
            b_rows = tl.multiple_of(slot.to(tl.int64) * stride_bs + columns * stride_bn, B_ROW_ALIGN)  # [BLOCK_N]
            inter_rows = tokens * stride_it + slice_id * stride_ij  # [BLOCK_M] int64

            acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            for r0 in range(0, rank, BLOCK_R):
                r_mask = r0 + offs_r < RANK  # [BLOCK_R]
                inter = tl.load(inter_ptr + inter_rows[:, None] + (r0 + offs_r)[None, :].to(tl.int64) * stride_ir,
                                mask=row_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_R] fp32
                inter = inter * slice_scale  # the adapter's scaling, on the fp32 intermediate
                b_tile = tl.load(b_ptr + b_rows[None, :] + (r0 + offs_r)[:, None].to(tl.int64) * stride_br,
                                 mask=r_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
                acc = tl.dot(inter, b_tile.to(tl.float32), acc, input_precision=DOT_PRECISION)

            y_ptrs = y_ptr + (tokens * stride_yt)[:, None] + (columns * stride_yn)[None, :]
            y_mask = row_mask[:, None] & n_mask[None, :]
            y_tile = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_N]
            if HAS_COLUMN_SCALES:
                # DoRA epilogue: y = c * y + c * delta + (1 - c) * bias, c the slot's column scale (1 for
                # a plain LoRA slot beside DoRA ones, which leaves y + delta exact); the bias is not scaled.
                column_scale = tl.load(column_scales_ptr + slot.to(tl.int64) * stride_cs + columns * stride_cn,
                                       mask=n_mask, other=1.0)[None, :]  # [1, BLOCK_N] fp32
                out = y_tile * column_scale
                if HAS_BIAS:
                    bias = tl.load(bias_ptr + columns * stride_bias, mask=n_mask, other=0.0).to(tl.float32)
                    out += (1.0 - column_scale) * bias[None, :]
                out += acc * column_scale
            else:  # no DoRA slot in the step: nothing to load, y + delta
                out = acc + y_tile
            tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=y_mask)


def _launch_expand(y: torch.Tensor, inter: torch.Tensor, lora_b: torch.Tensor, meta: LoRAMeta,
                   slice_sizes: tuple[int, ...], scales: Scales) -> None:
    """Semantics: y[t, cols_j] = c * y[t, cols_j] + (1 - c) * bias[cols_j]
    + c * g[s, j] * inter[t, j] @ lora_b[s, cols_j].T, with c = column_scales[s, cols_j].

    y [T, N] in place (fp16/bf16/fp32), s = token_slots[t] >= 0, rows of slot -1 tokens untouched;
    cols_j = off_j:off_j+N_j; inter [T, n_slices, R] float32; lora_b [max_loras, N, R], y's dtype;
    scales as :class:`Scales` (missing ones read as 1, a missing bias as 0).
    Grid (tile_programs(T), sum_j cdiv(N_j, BLOCK_N)): every column block of every slice, none padded.
    """
    _, n_slices, rank = inter.shape
    slice_scales = meta.unit_scales(n_slices) if scales.slices is None else scales.slices
    # without column scales the kernel reads neither them nor the bias (already inside y): the unit
    # scales only fill the pointer and stride arguments
    column_scales = meta.unit_scales(y.shape[1]) if scales.columns is None else scales.columns
    bias = scales.bias if scales.bias is not None and scales.columns is not None else None
    offsets = [0, *itertools.accumulate(slice_sizes)]
    column_align = _alignment(*offsets)
    grid = (tile_programs(meta, y.shape[0]), sum(triton.cdiv(size, BLOCK_N) for size in slice_sizes))
    kernel_for(_expand_kernel, y.device)[grid](
        y, inter, lora_b, meta.slice_offsets(slice_sizes), slice_scales, column_scales,
        y if bias is None else bias,  # never read without HAS_BIAS; y has the bias' dtype
        meta.sorted_tokens, meta.tile_slots, meta.tile_starts, meta.tile_ends, meta.slot_ranks,
        meta.max_tiles(y.shape[0]),
        *y.stride(), *inter.stride(), *lora_b.stride(), *slice_scales.stride(), *column_scales.stride(),
        0 if bias is None else bias.stride(0),
        N_SLICES=n_slices, RANK=rank, BLOCK_M=meta.block_m, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R,
        # B_ROW_ALIGN divides every row offset slot * stride(0) + column * stride(1)
        COLUMN_ALIGN=column_align, B_ROW_ALIGN=_alignment(*lora_b.stride()[:2]),
        HAS_COLUMN_SCALES=scales.columns is not None, HAS_BIAS=bias is not None,
        DOT_PRECISION=_expand_precision(lora_b.dtype), num_warps=EXPAND_NUM_WARPS,
        maxnreg=EXPAND_FP32_MAX_REGISTERS if y.dtype == torch.float32 else None,
    )


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, meta: LoRAMeta,
                out: torch.Tensor) -> torch.Tensor:
    """Semantics: out[t, j] = x[t] @ lora_a[s, j].T for s = token_slots[t] >= 0 (one launch).

    x [T, K]; lora_a [max_loras, n_slices, R, K]; out [T, n_slices, R] float32.
    """
    if x.shape[0]:
        _launch_shrink(x, lora_a, meta, out)
    return out


def lora_expand(y: torch.Tensor, inter: torch.Tensor, lora_b: torch.Tensor, meta: LoRAMeta,
                slice_sizes: tuple[int, ...], scales: Scales = NO_SCALES) -> torch.Tensor:
    """Semantics: y[t, off_j:off_j+N_j] += inter[t, j] @ lora_b[s, off_j:off_j+N_j].T, scaled as
    :mod:`punica_kernels.scales` says (one launch).

    y [T, N] in place; inter [T, n_slices, R] float32; lora_b [max_loras, N, R].
    """
    if y.shape[0]:
        _launch_expand(y, inter, lora_b, meta, slice_sizes, scales)
    return y


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             meta: LoRAMeta, slice_sizes: tuple[int, ...], scales: Scales = NO_SCALES,
             unsplit: bool = False) -> torch.Tensor:
    """Semantics: y[t, off_j:off_j+N_j] += (x[t] @ lora_a[s, j].T) @ lora_b[s, off_j:off_j+N_j].T,
    scaled as :mod:`punica_kernels.scales` says.

    Two launches, the intermediate (and the shrink's K-split partials, the first of which is the
    intermediate) in the meta's workspace; shapes as in punica_kernels.add_lora. ``unsplit``: K is never
    split (the batch-invariant mode: a split count chosen from T would sum a token's products in another
    order in another batch).
    """
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return y
    _, n_slices, rank, num_features = lora_a.shape
    row_elements = num_tokens * n_slices * rank
    workspace = meta.workspace_for(row_elements)
    split_k = 1 if unsplit else choose_split_k(tile_programs(meta, num_tokens), num_features,
                                               workspace.numel() // row_elements)
    partials = workspace[:split_k * row_elements].view(split_k, num_tokens, n_slices, rank)
    _launch_shrink(x, lora_a, meta, partials[0], partials if split_k > 1 else None)
    _launch_expand(y, partials[0], lora_b, meta, slice_sizes, scales)
    return y


def tile_programs(meta: LoRAMeta, num_tokens: int) -> int:
    """Programs along both kernels' tile axis: one per TOKENS_PER_TILE_PROGRAM tokens, at most one
    per tile. Depends on T and max_loras only, so a graph captured with one adapter replays many."""
    return min(meta.max_tiles(num_tokens), triton.cdiv(num_tokens, TOKENS_PER_TILE_PROGRAM))


def choose_split_k(tile_programs: int, num_features: int, max_split: int) -> int:
    """How many K chunks the shrink cuts K into, so tile_programs x split_k reaches about
    SHRINK_TARGET_PROGRAMS: chunks of whole BLOCK_K blocks, at least MIN_K_PER_SPLIT wide, at most
    ``max_split`` (the partials the workspace holds). Every chunk gets K to work on. Depends only on
    T and the layer's sizes, so graphs replay the same.
    """
    k_blocks = triton.cdiv(num_features, BLOCK_K)
    wanted = min(triton.cdiv(SHRINK_TARGET_PROGRAMS, tile_programs), max(1, max_split),
                 triton.cdiv(num_features, MIN_K_PER_SPLIT))
    return triton.cdiv(k_blocks, triton.cdiv(k_blocks, wanted))


def split_counters(meta: LoRAMeta) -> torch.Tensor:
    """[max_tile_count] int32 arrival counters of the shrink's split reduction (LoRAMeta.split_counters),
    zero between launches: the last split of each tile resets its own."""
    return meta.split_counters


def _alignment(*values: int) -> int:
    """The largest power of two up to VECTOR_ALIGN dividing every value (a tl.multiple_of hint)."""
    align = VECTOR_ALIGN
    while any(value % align for value in values):
        align //= 2
    return align


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


class _DeviceFunction(triton.runtime.JITFunction):
    """A jit device function the interpreted twins can call: the compiler inlines it as any other,
    but a plain JITFunction refuses the Python call an interpreted kernel makes."""

    def __call__(self, *args, **kwargs):
        return _interpreted(self)(*args, **kwargs)


def device_function(fn):
    """``@triton.jit`` for a helper that kernels call, callable from their CPU twins (kernel_for) too."""
    jitted = triton.jit(fn)
    if not isinstance(jitted, triton.runtime.JITFunction):  # TRITON_INTERPRET=1: these call each other already
        return jitted
    return _DeviceFunction(fn)
