"""Paged attention in Triton: a split-context decode kernel (GQA-grouped) and a chunked-prefill kernel.

Cache layout as in lora_runner/model/attention.py: one layer is ``kv_layer [2, num_blocks, block_size,
num_kv_heads, head_dim]`` (0 = K, 1 = V); token position p of sequence b lives in block
``block_tables[b, p // block_size]`` at offset ``p % block_size``. Query head h reads KV head
``h // (num_heads // num_kv_heads)`` (GQA, the order of ``repeat_interleave``).

Design points:

* Context lengths (``seq_lens``), query starts and block tables are read from device tensors, and
  no launch parameter depends on them: the grid of a decode step depends on (batch size, KV heads,
  table width) only, so one captured CUDA graph serves every context length. The sliding window
  is a runtime int that Triton does not specialize.
* Decode: one program per (sequence, KV head, context split) loads the KV head's whole query group
  ([group, head_dim], padded to a power of two >= 16 rows for ``tl.dot``), so each K/V tile is read once per group.
  Long contexts are split into ``num_splits`` equal parts per sequence (computed in the kernel from
  its own length); each split writes its (max, sum, acc) partial, and a second kernel combines the
  partials in split order: deterministic, no atomics. The split count comes from the batch size
  and the table width (capacity), never from the actual lengths.
* Prefill/extend: one program per (sequence, tile of its new tokens, query head); the chunk's K/V
  are already in the cache (write_kv runs first), so the prefix and the causal chunk are read the
  same way. Sliding window w: a token at position p sees positions p-w+1..p.
* Logit soft-capping (Gemma 2), a constexpr switch: scores s become c * tanh(s / c) before the mask;
  in log2 units the cap is c * log2(e), so the scale needs no change. tanh is computed from exp2 of
  -2|x| (no overflow; libdevice's tanh does not run in the interpreter).
* Both kernels walk the keys with the same three device functions (punica_kernels.triton_ops.device_function,
  inlined by the compiler, callable by the CPU twins): a K/V tile load, its scores, one online-softmax step.
* fp32 accumulation and online softmax (exp2 with log2(e) folded into the scale); int64 offsets
  for every cache, query and output address. Positions past a sequence's length are masked at
  load time, so stale (even NaN) cache blocks are never read.

CPU tensors run under the Triton interpreter (tests), whether or not TRITON_INTERPRET was set when
this module was imported; bf16 does not run there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from punica_kernels.triton_ops import device_function, kernel_for

# Tile sizes and warps per element size, chosen so every configuration compiles without register
# spills on sm_80 and sm_90 (ptxas -v; checked for head_dim 64/128/256 and query groups up to 16) and
# fits sm_80's shared memory; fp32 (3xTF32 dots) needs smaller tiles than fp16/bf16. Heads wider
# than WIDE_HEAD_DIM (Gemma 2: 256) hold twice the registers per row: narrower tiles or more warps.
DECODE_CONFIG = {2: dict(BLOCK_N=64, num_warps=4), 4: dict(BLOCK_N=32, num_warps=4)}  # BLOCK_N: context step
PREFILL_CONFIG = {2: dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=3),  # BLOCK_M: new tokens per program
                  4: dict(BLOCK_M=32, BLOCK_N=32, num_warps=8, num_stages=3)}
WIDE_HEAD_DIM = 128
DECODE_CONFIG_WIDE = {2: dict(BLOCK_N=64, num_warps=4), 4: dict(BLOCK_N=32, num_warps=8)}
PREFILL_CONFIG_WIDE = {2: dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=3),
                       4: dict(BLOCK_M=16, BLOCK_N=32, num_warps=8, num_stages=2)}
MAX_SPLITS = 16
MIN_SPLIT_TOKENS = 256  # a context split covers at least this many tokens of the table's capacity
TARGET_PROGRAMS = 256  # split decode until about this many programs run (~2 per SM on H100/H200)
LOG2E = 1.4426950408889634
LOG2E_F = tl.constexpr(LOG2E)  # the same, for use inside kernels
_EMPTY = tl.constexpr(-1.0e30)  # running max of a row that has seen no key yet: finite, so exp2 never sees inf - inf
# The combine functions tl.max / tl.sum reduce with. The kernels call tl.reduce with them directly:
# the interpreted twins of CPU runs cannot call plain jit'd helpers such as tl.max (only builtins and
# the project's device_function helpers), and the interpreter runs these two combine functions as
# vectorized numpy reductions.
_MAX = tl.standard._elementwise_max
_SUM = tl.standard._sum_combine


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_context: int) -> int:
    """Power-of-two context split for a decode launch: enough programs to fill the GPU, at most
    MAX_SPLITS, each split covering >= MIN_SPLIT_TOKENS of `max_context` (the block table's capacity
    in tokens, not the longest actual context, so a captured graph fits every length)."""
    limit = min(MAX_SPLITS, max(1, max_context // MIN_SPLIT_TOKENS))
    splits = 1
    while splits * 2 <= limit and num_seqs * num_kv_heads * splits < TARGET_PROGRAMS:
        splits *= 2
    return splits


def _tile_config(query: torch.Tensor, narrow: dict, wide: dict) -> dict:
    """The tile sizes and warps for `query`'s element size and head width."""
    return (wide if query.shape[-1] > WIDE_HEAD_DIM else narrow)[query.element_size()]


def _dot_precision(dtype: torch.dtype) -> str:
    return "tf32x3" if dtype == torch.float32 else "tf32"  # fp32: 3xTF32 tensor-core dots, ~fp32 accuracy


def _check_cache(query: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor) -> tuple[int, int, int, int]:
    """(num_heads, num_kv_heads, head_dim, block_size) after checking shapes, dtypes and devices."""
    if kv_layer.dim() != 5 or kv_layer.shape[0] != 2:
        raise ValueError(f"kv_layer must be [2, num_blocks, block_size, H_kv, D], got {tuple(kv_layer.shape)}")
    _, _, block_size, num_kv_heads, head_dim = kv_layer.shape
    num_heads = query.shape[1]
    if query.dim() != 3 or query.shape[2] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"query {tuple(query.shape)} must be [*, H, {head_dim}] with H a multiple of {num_kv_heads}")
    if query.stride(-1) != 1 or kv_layer.stride(-1) != 1:
        raise ValueError("query and kv_layer must be contiguous in head_dim")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"query dtype must be float16, bfloat16 or float32, got {query.dtype}")
    if query.dtype != kv_layer.dtype:
        raise ValueError(f"query dtype {query.dtype} differs from the cache's {kv_layer.dtype}")
    if block_tables.dim() != 2 or seq_lens.shape != block_tables.shape[:1]:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} must be [B, max_blocks] and seq_lens "
                         f"{tuple(seq_lens.shape)} [B]")
    if len({t.device for t in (query, kv_layer, block_tables, seq_lens)}) != 1:
        raise ValueError("query, kv_layer, block_tables and seq_lens must be on one device")
    return num_heads, num_kv_heads, head_dim, block_size


# ----------------------------------------------------------------------------- one key tile (both kernels)


@device_function
def _load_kv_tile(kv_ptr, table, pos, n_mask, offs_d, d_mask, head_offset, stride_kv, stride_kvb, stride_kvs,
                  PAGE: tl.constexpr):
    """K and V [BLOCK_N, BLOCK_D] of one KV head at cache positions `pos` [BLOCK_N] of the sequence whose
    block-table row is `table`; zeros where ~n_mask (so stale blocks past the length are never read)."""
    block = tl.load(table + pos // PAGE, mask=n_mask, other=0).to(tl.int64)
    rows = block * stride_kvb + (pos % PAGE).to(tl.int64) * stride_kvs + head_offset  # [BLOCK_N]
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(kv_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    v = tl.load(kv_ptr + stride_kv + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    return k, v


@device_function
def _tile_scores(q, k, qk_scale, softcap, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    """Scores q @ k.T [rows, BLOCK_N] in log2 units, soft-capped when SOFTCAP (softcap in log2 units too)."""
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if SOFTCAP:
        decay = tl.exp2(tl.abs(scores) * (-2.0 * LOG2E_F / softcap))  # tanh(x) = sign(x) (1 - d) / (1 + d)
        capped = (1.0 - decay) / (1.0 + decay) * softcap
        scores = tl.where(scores < 0, -capped, capped)
    return scores


@device_function
def _accumulate(scores, v, row_max, row_sum, acc, DOT_PRECISION: tl.constexpr):
    """One online-softmax step: fold a tile's masked scores [rows, BLOCK_N] (-inf where hidden) and its
    V into the running (row_max, row_sum, acc); returns the new three."""
    new_max = tl.maximum(row_max, tl.reduce(scores, 1, _MAX))
    probs = tl.exp2(scores - new_max[:, None])
    rescale = tl.exp2(row_max - new_max)
    row_sum = row_sum * rescale + tl.reduce(probs, 1, _SUM)
    acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
    return new_max, row_sum, acc


# ----------------------------------------------------------------------------- decode


@triton.jit(do_not_specialize=["sliding_window", "num_splits"])
def _decode_kernel(
    q_ptr, kv_ptr, out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr,
    block_tables_ptr, seq_lens_ptr,
    qk_scale, sliding_window, num_splits, softcap,
    stride_qb, stride_qh,
    stride_kv, stride_kvb, stride_kvs, stride_kvh,
    stride_ob, stride_oh, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = tl.where(sliding_window > 0, tl.maximum(seq_len - sliding_window, 0), 0)
    # this split's part of [lo, seq_len): equal parts, rounded to whole BLOCK_N steps
    per_split = ((seq_len - lo + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g  # [GROUP_PAD] query heads of this KV head
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q_rows = seq.to(tl.int64) * stride_qb + heads.to(tl.int64) * stride_qh  # [GROUP_PAD]
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    row_max = tl.full([GROUP_PAD], _EMPTY, tl.float32)
    row_sum = tl.full([GROUP_PAD], 0.0, tl.float32)
    acc = tl.full([GROUP_PAD, BLOCK_D], 0.0, tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_offset = kv_head.to(tl.int64) * stride_kvh
    for tile in range(start, end, BLOCK_N):
        pos = tile + offs_n  # [BLOCK_N]
        n_mask = pos < end
        k, v = _load_kv_tile(kv_ptr, table, pos, n_mask, offs_d, d_mask, head_offset, stride_kv, stride_kvb,
                             stride_kvs, PAGE)  # [BLOCK_N, BLOCK_D] each
        scores = _tile_scores(q, k, qk_scale, softcap, DOT_PRECISION, SOFTCAP)  # [GROUP_PAD, BLOCK_N]
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        row_max, row_sum, acc = _accumulate(scores, v, row_max, row_sum, acc, DOT_PRECISION)

    if SPLIT:
        part_rows = (seq.to(tl.int64) * tl.num_programs(1) * GROUP + heads) * num_splits + split  # [GROUP_PAD]
        tl.store(part_max_ptr + part_rows, row_max, mask=g_mask)
        tl.store(part_sum_ptr + part_rows, row_sum, mask=g_mask)
        tl.store(part_acc_ptr + part_rows[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=g_mask[:, None] & d_mask[None, :])
    else:
        out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
        out_rows = seq.to(tl.int64) * stride_ob + heads.to(tl.int64) * stride_oh
        tl.store(out_ptr + out_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=g_mask[:, None] & d_mask[None, :])


def decode_attention(query: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                     num_splits: int | None = None, out: torch.Tensor | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """Paged attention of one new token per sequence (decode), its K/V already in the cache.

    Semantics: out[b, h] = softmax(cap(scale * q[b, h] . K[b, g(h), j])) @ V[b, g(h), j] over positions
    j in [max(0, L_b - w), L_b), L_b = seq_lens[b], w = sliding_window (None or 0: no window),
    g(h) = h // (H // H_kv), K/V[b, g, j] = kv_layer[0/1, block_tables[b, j // bs], j % bs, g].
    A sequence with L_b = 0 gets zeros. cap(s) = c * tanh(s / c) with c = softcap (None: cap(s) = s).

    Args:
        query: [B, H, D] fp16/bf16/fp32 (RoPE applied); D is padded to a power of two >= 16.
        kv_layer: [2, num_blocks, bs, H_kv, D] in query's dtype; contiguous in its last dim.
        block_tables: [B, max_blocks] int32; seq_lens: [B] int32, each <= max_blocks * bs.
        scale: softmax scale (head_dim ** -0.5 for Llama).
        num_splits: context splits (None: decode_num_splits(B, H_kv, max_blocks * bs)); with more
            than one, fp32 partials [B, H, splits] x (max, sum) and [B, H, splits, D] are allocated
            and combined by combine_decode_splits.
        out: [B, H, D] in query's dtype, written; allocated when None.

    Returns out. No host sync; the launch depends on shapes and num_splits only.
    """
    num_heads, num_kv_heads, head_dim, block_size = _check_cache(query, kv_layer, block_tables, seq_lens)
    num_seqs = query.shape[0]
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = decode_num_splits(num_seqs, num_kv_heads, block_tables.shape[1] * block_size)
    group = num_heads // num_kv_heads
    split = num_splits > 1
    part_shape = (num_seqs, num_heads, num_splits) if split else (1,)
    part_max = torch.empty(part_shape, dtype=torch.float32, device=query.device)  # [B, H, S]
    part_sum = torch.empty_like(part_max)  # [B, H, S]
    part_acc = torch.empty(*part_shape, head_dim if split else 1, dtype=torch.float32,
                           device=query.device)  # [B, H, S, D]
    kernel = kernel_for(_decode_kernel, query.device)
    kernel[(num_seqs, num_kv_heads, num_splits)](
        query, kv_layer, out, part_max, part_sum, part_acc, block_tables, seq_lens,
        scale * LOG2E, sliding_window or 0, num_splits, (softcap or 1.0) * LOG2E,
        query.stride(0), query.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), PAGE=block_size, SPLIT=split,
        DOT_PRECISION=_dot_precision(query.dtype), SOFTCAP=softcap is not None,
        **_tile_config(query, DECODE_CONFIG, DECODE_CONFIG_WIDE))
    if split:
        combine_decode_splits(part_max, part_sum, part_acc, out)
    return out


@triton.jit
def _combine_kernel(
    part_max_ptr, part_sum_ptr, part_acc_ptr, out_ptr,
    stride_ob, stride_oh,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    rows = (seq.to(tl.int64) * tl.num_programs(1) + head) * NUM_SPLITS + offs_s  # [SPLITS_PAD]
    split_max = tl.load(part_max_ptr + rows, mask=s_mask, other=_EMPTY)
    split_sum = tl.load(part_sum_ptr + rows, mask=s_mask, other=0.0)
    split_acc = tl.load(part_acc_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :],
                        mask=s_mask[:, None] & d_mask[None, :], other=0.0)  # [SPLITS_PAD, BLOCK_D]
    weight = tl.exp2(split_max - tl.reduce(split_max, 0, _MAX))  # [SPLITS_PAD]; empty splits have sum 0
    total = tl.reduce(split_sum * weight, 0, _SUM)
    out = tl.reduce(split_acc * weight[:, None], 0, _SUM) / tl.where(total > 0, total, 1.0)  # [BLOCK_D]
    out_offset = seq.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
    tl.store(out_ptr + out_offset + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def combine_decode_splits(part_max: torch.Tensor, part_sum: torch.Tensor, part_acc: torch.Tensor,
                          out: torch.Tensor) -> torch.Tensor:
    """Combine decode_attention's per-split partials into the normalized output, in split order.

    Semantics: with M = max_s part_max[b, h, s] (log2 units),
    out[b, h] = sum_s 2^(part_max[b,h,s] - M) * part_acc[b,h,s] / sum_s 2^(part_max[b,h,s] - M) * part_sum[b,h,s]
    (zeros where the denominator is 0: a sequence of length 0).

    Args:
        part_max, part_sum: [B, H, S] fp32 contiguous; part_acc: [B, H, S, D] fp32 contiguous.
        out: [B, H, D] fp16/bf16/fp32, written.
    """
    num_seqs, num_heads, num_splits = part_max.shape
    head_dim = part_acc.shape[-1]
    if part_acc.shape != (num_seqs, num_heads, num_splits, head_dim) or out.shape != (num_seqs, num_heads, head_dim):
        raise ValueError(f"partials {tuple(part_max.shape)}/{tuple(part_acc.shape)} do not match out {tuple(out.shape)}")
    kernel = kernel_for(_combine_kernel, out.device)
    kernel[(num_seqs, num_heads)](
        part_max, part_sum, part_acc, out, out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)), HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)))
    return out


# ----------------------------------------------------------------------------- prefill / extend


@triton.jit(do_not_specialize=["sliding_window"])
def _prefill_kernel(
    q_ptr, kv_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    qk_scale, sliding_window, softcap,
    stride_qt, stride_qh,
    stride_kv, stride_kvb, stride_kvs, stride_kvh,
    stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
    ALIGNED_KEYS: tl.constexpr = False,
):
    seq = tl.program_id(0)
    tile_m = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile_m * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_start = seq_len - q_len  # position of the chunk's first token

    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # rows within the chunk
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_pos = context_start + offs_m  # [BLOCK_M]
    tokens = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head.to(tl.int64) * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    # keys this tile can see: from the first row's window start to the last row's position
    hi = tl.minimum(context_start + tl.minimum((tile_m + 1) * BLOCK_M, q_len), seq_len)
    lo = tl.where(sliding_window > 0, tl.maximum(context_start + tile_m * BLOCK_M - sliding_window + 1, 0), 0)
    if ALIGNED_KEYS:  # key tiles at multiples of BLOCK_N, wherever the chunk starts (the batch-invariant mode)
        lo = lo // BLOCK_N * BLOCK_N
    row_max = tl.full([BLOCK_M], _EMPTY, tl.float32)
    row_sum = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_offset = (head // GROUP).to(tl.int64) * stride_kvh
    for tile in range(lo, hi, BLOCK_N):
        pos = tile + offs_n  # [BLOCK_N]
        n_mask = pos < hi
        k, v = _load_kv_tile(kv_ptr, table, pos, n_mask, offs_d, d_mask, head_offset, stride_kv, stride_kvb,
                             stride_kvs, PAGE)  # [BLOCK_N, BLOCK_D] each
        scores = _tile_scores(q, k, qk_scale, softcap, DOT_PRECISION, SOFTCAP)  # [BLOCK_M, BLOCK_N]
        in_window = (pos[None, :] > q_pos[:, None] - sliding_window) | (sliding_window <= 0)
        visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None]) & in_window
        scores = tl.where(visible, scores, float("-inf"))
        row_max, row_sum, acc = _accumulate(scores, v, row_max, row_sum, acc, DOT_PRECISION)

    out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_ot + head.to(tl.int64) * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def prefill_attention(query: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, scale: float,
                      sliding_window: int | None = None, out: torch.Tensor | None = None,
                      softcap: float | None = None, aligned_keys: bool = False) -> torch.Tensor:
    """Paged attention of a flat batch of prefill chunks (and decodes), their K/V already in the cache.

    Semantics: for sequence b with new tokens t in [s_b, s_b + n_b) (s = query_start_loc,
    n_b = s_{b+1} - s_b) at positions p = L_b - n_b + (t - s_b), L_b = seq_lens[b]:
    out[t, h] = softmax_j(cap(scale * q[t, h] . K[b, g(h), j])) @ V[b, g(h), j] over
    j in [max(0, p - w + 1), p] (w = sliding_window; None or 0: no window), g(h) = h // (H // H_kv),
    K/V and cap (softcap) as in decode_attention. Rows t >= s_B (padding) are zeroed.

    Args:
        query: [T, H, D] fp16/bf16/fp32 (RoPE applied).
        kv_layer: [2, num_blocks, bs, H_kv, D] in query's dtype; contiguous in its last dim.
        block_tables: [B, max_blocks] int32; seq_lens: [B] int32; query_start_loc: [B+1] int32.
        max_query_len: >= max n_b (a host int: it sizes the grid; prefill steps run eagerly).
        scale: softmax scale. out: [T, H, D] in query's dtype; allocated when None.
        aligned_keys: every program walks the keys in tiles at multiples of BLOCK_N (with a sliding window
            from the tile below its first row's window), so a token's softmax sums in an order set by
            its own position, whatever chunk or batch it came in (the batch-invariant mode).

    Returns out. No host sync.
    """
    num_heads, num_kv_heads, head_dim, block_size = _check_cache(query, kv_layer, block_tables, seq_lens)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc {tuple(query_start_loc.shape)} must be [{num_seqs + 1}]")
    if out is None:
        out = torch.empty_like(query)
    out.zero_()  # padding rows (no sequence) stay zero
    if num_seqs == 0 or query.shape[0] == 0 or max_query_len < 1:
        return out
    config = _tile_config(query, PREFILL_CONFIG, PREFILL_CONFIG_WIDE)
    grid = (num_seqs, triton.cdiv(max_query_len, config["BLOCK_M"]), num_heads)
    kernel_for(_prefill_kernel, query.device)[grid](
        query, kv_layer, out, block_tables, seq_lens, query_start_loc,
        scale * LOG2E, sliding_window or 0, (softcap or 1.0) * LOG2E,
        query.stride(0), query.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PAGE=block_size, DOT_PRECISION=_dot_precision(query.dtype), SOFTCAP=softcap is not None,
        ALIGNED_KEYS=aligned_keys, **config)
    return out
