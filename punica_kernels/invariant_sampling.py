"""The batch-invariant mode's sampler kernels: a row scan and an ordered selection whose results never
depend on the other rows.

torch's CUDA ops pick their algorithm from the batch: ``cumsum`` of a single row runs cub's
device-wide scan (a tree over thread blocks) while several rows run one block per row, so the top-p
mass of a request alone and the same request beside others round differently; ``topk`` switches
between a sort, a one-block and a multi-block radix select by the number of rows, and where values tie
(common with bf16 logits) the ids it returns are not specified. Here each kernel runs one program per
row with a block width fixed at import (never chosen from the number of rows):

* :func:`cumsum`: the row walked from column 0 in CUMSUM_BLOCK-wide chunks, each scanned by
  ``tl.associative_scan`` (a tree fixed by the block width) and offset by the running total of the
  chunks before it, carried sequentially. The sampler's top-p mass takes it in the mode.
* :func:`top`: the k largest entries of a row in a total order (NaN above everything, then larger
  values, then on equal values the lower column), found by k walks over the row, each taking the
  largest entry after the previous one in that order: an exact selection (no arithmetic), its ties
  broken by the lowest column, as torch's argmax documents. The sampler's argmax (greedy and the
  exponential race, k = 1) and its top logprobs take it in the mode.

The mode's full sort (top-k / top-p masking) stays torch's, asked to be stable: a stable sort's
result is a function of the row alone, whatever algorithm the batch selects.

CPU tensors run the interpreted twins (punica_kernels.triton_ops.kernel_for); tests under
TRITON_INTERPRET=1 in tests/test_batch_invariant_sampling.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_ops import kernel_for

CUMSUM_BLOCK, CUMSUM_WARPS = 1024, 4  # columns per step of a row's scan
TOP_BLOCK, TOP_WARPS = 1024, 4  # columns per step of a row's selection walk
# the combine functions tl.max / tl.min / tl.sum reduce with, called through tl.reduce and tl.associative_scan:
# the interpreted twins cannot call plain jit'd helpers such as tl.sum, only builtins and device_function ones
# (punica_kernels.triton_ops.device_function; lora_runner.model.paged_attention says more)
_SUM = tl.standard._sum_combine
_MAX = tl.standard._elementwise_max
_MIN = tl.standard._elementwise_min


@triton.jit
def _cumsum_kernel(x_ptr, out_ptr, width, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row, out_row = x_ptr + row * stride_x, out_ptr + row * stride_o
    carry = 0.0  # the sum of the chunks before this one, as the last column of the previous chunk holds it
    for start in range(0, width, BLOCK):
        mask = start + offs < width
        x = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
        running = tl.associative_scan(x, 0, _SUM) + carry  # [BLOCK]; masked columns add 0
        tl.store(out_row + start + offs, running.to(out_ptr.dtype.element_ty), mask=mask)
        carry = tl.reduce(tl.where(offs == BLOCK - 1, running, float("-inf")), 0, _MAX)  # running[BLOCK - 1]


def cumsum(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Semantics: torch.cumsum(x.float(), -1), accumulated in fp32 left to right in CUMSUM_BLOCK chunks.

    x [S, V] fp16/bf16/fp32 (rows at any stride, columns contiguous or copied so); out [S, V] float32
    (allocated when None; a running mass is never rounded to a half dtype). Returns out; one program per
    row, each row's bits independent of the others.
    """
    rows = x if x.stride(-1) == 1 else x.contiguous()
    if out is None:
        out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)  # [S, V]
    assert out.shape == rows.shape and out.stride(-1) == 1 and out.dtype == torch.float32, (out.shape, out.dtype)
    if rows.shape[0]:
        kernel_for(_cumsum_kernel, x.device)[(rows.shape[0],)](
            rows, out, rows.shape[1], rows.stride(0), out.stride(0), BLOCK=CUMSUM_BLOCK, num_warps=CUMSUM_WARPS)
    return out


@triton.jit(do_not_specialize=["num_top"])
def _top_kernel(x_ptr, values_ptr, indices_ptr, width, num_top, stride_x, stride_v, stride_i,
                BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    # the entry taken last, as (class: 1 for NaN, 0 for a number; value with NaN as +inf; column); class 2
    # stands before every entry, so the first walk may take any
    last_class, last_value, last_column = 2, float("inf"), -1
    for j in range(0, num_top):
        # per lane: its best entry after the last one taken (class -1: none yet)
        lane_class = tl.full([BLOCK], -1, tl.int32)
        lane_value = tl.full([BLOCK], float("-inf"), tl.float32)
        lane_column = tl.full([BLOCK], 0, tl.int32)
        for start in range(0, width, BLOCK):
            columns = start + offs  # [BLOCK] int32: vocabularies stay below 2**31
            x = tl.load(x_row + columns, mask=columns < width, other=0.0).to(tl.float32)
            is_nan = x != x
            klass = is_nan.to(tl.int32)
            value = tl.where(is_nan, float("inf"), x)
            after = (klass < last_class) | ((klass == last_class) & (
                (value < last_value) | ((value == last_value) & (columns > last_column))))
            # strictly better only: a lane meets its columns in ascending order, so it keeps the lowest on ties
            better = (klass > lane_class) | ((klass == lane_class) & (value > lane_value))
            take = (columns < width) & after & better
            lane_class = tl.where(take, klass, lane_class)
            lane_value = tl.where(take, value, lane_value)
            lane_column = tl.where(take, columns, lane_column)
        # the lanes' best: max class, then max value, then min column; each an exact reduction in any order
        best_class = tl.reduce(lane_class, 0, _MAX)
        best_value = tl.reduce(tl.where(lane_class == best_class, lane_value, float("-inf")), 0, _MAX)
        tied = (lane_class == best_class) & (lane_value == best_value)
        best_column = tl.reduce(tl.where(tied, lane_column, width), 0, _MIN)
        out_value = tl.where(best_class == 1, float("nan"), best_value)
        tl.store(values_ptr + row * stride_v + j, out_value.to(values_ptr.dtype.element_ty))
        tl.store(indices_ptr + row * stride_i + j, best_column.to(tl.int64))
        last_class, last_value, last_column = best_class, best_value, best_column


def top(x: torch.Tensor, k: int, out: tuple[torch.Tensor, torch.Tensor] | None = None
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: torch.topk(x, k, dim=-1) (sorted), with the order made total: NaN first, then larger
    values, equal values (and NaNs) by ascending column. k = 1 is argmax with torch's documented ties.

    x [S, V] fp16/bf16/fp32, 1 <= k <= V; out (values [S, k] in x's dtype, indices [S, k] int64), allocated
    when None. Returns (values, indices); one program per row walking it k times, each row independent.
    """
    rows = x if x.stride(-1) == 1 else x.contiguous()
    num_rows, width = rows.shape
    assert 1 <= k <= width, f"k = {k} of a row of {width}"
    if out is None:
        out = (torch.empty(num_rows, k, dtype=x.dtype, device=x.device),  # [S, k]
               torch.empty(num_rows, k, dtype=torch.int64, device=x.device))  # [S, k]
    values, indices = out
    assert values.shape == indices.shape == (num_rows, k) and values.dtype == x.dtype, (values.shape, indices.shape)
    assert indices.dtype == torch.int64 and values.stride(-1) == indices.stride(-1) == 1
    if num_rows:
        kernel_for(_top_kernel, x.device)[(num_rows,)](
            rows, values, indices, width, k, rows.stride(0), values.stride(0), indices.stride(0),
            BLOCK=TOP_BLOCK, num_warps=TOP_WARPS)
    return values, indices


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Semantics: x.max(dim=-1).indices of x [S, V] (NaN counts as the largest; the lowest column on ties) -> [S] int64."""
    return top(x, 1)[1][:, 0]
