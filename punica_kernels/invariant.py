"""Batch-invariant matmuls: a row's result the same bits whatever rows run beside it.

A CPU GEMM's summation order depends on the number of rows M: MKL (``F.linear``, ``torch.mm``)
takes a GEMV for one row and a blocked kernel for more, and oneDNN's prepacked linear blocks K by
M for wide inputs (measured, fp32: a row alone and the same row among 2..600 others differ in the
last bits of ``F.linear`` at every shape tried, and of the packed linear at K = 3072). Within one
call shape the order does not depend on a row's position or on the other rows' values (measured
at every position of blocks of 8 and 16 rows, K up to 3072). So :func:`rows_matmul` multiplies in
blocks of exactly :data:`ROW_BLOCK` rows, the last one zero-padded: every row's result comes from
the same call shape, whatever the batch.

The mode is a per-thread switch (:func:`active`, read by :func:`enabled`) so that two engines in
one process (or one engine's TP rank threads) each keep their own setting; the model runner sets
it around every forward of an engine built with ``batch_invariant=True``. The torch LoRA path
(:func:`add_lora`, :func:`lora_shrink`, :func:`lora_expand`) is here too: the ops route to it while
the mode is on.

On CUDA tensors the GEMMs (:func:`linear`, :func:`matmul`), the RMSNorm (:func:`rms_norm`) and the
sampler's softmax and log-softmax (:func:`softmax`) run the
fixed-config Triton kernels of :mod:`punica_kernels.invariant_triton` instead of row blocks (cuBLAS
picks its algorithm by M, whatever the block); the Triton LoRA ops keep K unsplit while the mode is on
(punica_kernels.ops passes ``unsplit`` to punica_kernels.triton_ops.add_lora). The sampler's other
row ops go through here too: its top-p mass (:func:`cumsum`) and its selections (:func:`argmax`,
:func:`topk`) run the per-row kernels of :mod:`punica_kernels.invariant_sampling` (the lowest column
on ties), its top-k / top-p sort (:func:`sort_descending`) is torch's stable sort; the MoE router's
softmax and top-k take the same ones. Off CUDA, or outside the mode, each is torch's own op, unchanged
(the CPU's row loops do not depend on the number of rows).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

from .meta import LoRAMeta
from .scales import Scales

ROW_BLOCK = 8  # rows per GEMM call in the mode: a decode row pays for 8 (measured cost: benchmarks/)

_state = threading.local()


def enabled() -> bool:
    """Whether the batch-invariant mode is on in this thread."""
    return getattr(_state, "on", False)


@contextlib.contextmanager
def active(on: bool = True) -> Iterator[None]:
    """Turn the mode on (or off) in this thread for the block, restoring the previous setting."""
    previous = enabled()
    _state.on = on
    try:
        yield
    finally:
        _state.on = previous


def rows_matmul(x: torch.Tensor, multiply: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """multiply(x) row by row-invariantly: x [T, K] in blocks of ROW_BLOCK rows (the last zero-padded),
    each a fresh contiguous [ROW_BLOCK, K] tensor; multiply maps [ROW_BLOCK, K] -> [ROW_BLOCK, N].
    Returns [T, N]."""
    num_rows = x.shape[0]
    padded = -(-num_rows // ROW_BLOCK) * ROW_BLOCK
    if num_rows == 0:
        return multiply(x.new_zeros(ROW_BLOCK, x.shape[1]))[:0]
    x_pad = x.new_zeros(padded, x.shape[1])  # [T_pad, K]
    x_pad[:num_rows] = x
    blocks = [multiply(x_pad[start:start + ROW_BLOCK].clone()) for start in range(0, padded, ROW_BLOCK)]
    return torch.cat(blocks)[:num_rows]


def uses_triton(x: torch.Tensor) -> bool:
    """Whether the mode runs x's row ops through the fixed-order Triton kernels: on CUDA tensors. (Tests
    patch it to run the kernels' interpreted twins on CPU tensors.)"""
    return x.is_cuda


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ weight.T ([N, K]) -> [T, N]: while the mode is on row-invariantly (:func:`linear`), else one call."""
    if enabled():
        return linear(x, weight) if uses_triton(x) else rows_matmul(x, lambda block: block @ weight.T)
    return x @ weight.T


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ weight.T ([N, K]) (+ bias [N]) -> [T, N], each row's bits independent of the other rows:
    the fixed-config Triton GEMM on CUDA (weight cast to x's dtype, as F.linear needs them equal), row
    blocks of F.linear elsewhere."""
    if uses_triton(x):
        from . import invariant_triton  # triton is optional: imported where the CUDA mode runs

        return invariant_triton.matmul(x, weight.to(x.dtype), bias)
    return rows_matmul(x, lambda block: torch.nn.functional.linear(block, weight, bias))


def softmax(x: torch.Tensor, log: bool = False) -> torch.Tensor:
    """torch.softmax(x, -1) (log: torch.log_softmax) of x [S, V]; in the mode on CUDA one Triton program per
    row (punica_kernels.invariant_triton.softmax: torch's vectorized loads start at each row's own
    alignment, so with a vocabulary not a multiple of 4 a row's sum order follows its index)."""
    if enabled() and uses_triton(x):
        from . import invariant_triton

        return invariant_triton.softmax(x, log)
    return torch.log_softmax(x, dim=-1) if log else torch.softmax(x, dim=-1)


def cumsum(x: torch.Tensor) -> torch.Tensor:
    """torch.cumsum(x, -1) of x [S, V]; in the mode on CUDA one Triton program per row in fixed chunks
    (punica_kernels.invariant_sampling.cumsum: torch scans a lone row with cub's device-wide scan, several
    rows one block each, and the two round differently)."""
    if enabled() and uses_triton(x):
        from . import invariant_sampling

        return invariant_sampling.cumsum(x)
    return x.cumsum(dim=-1)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.max(dim=-1).indices of x [S, V] -> [S] (the first maximum); in the mode on CUDA one Triton program
    per row whose ties go to the lowest column by construction (punica_kernels.invariant_sampling.argmax)."""
    if enabled() and uses_triton(x):
        from . import invariant_sampling

        return invariant_sampling.argmax(x)
    return x.max(dim=-1).indices


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) [S, k] of x.topk(k, dim=-1) of x [S, V]; in the mode on CUDA one Triton program
    per row, equal values in ascending column order (torch's CUDA topk changes algorithm with the number
    of rows and leaves the ids of equal values unspecified: punica_kernels.invariant_sampling.top)."""
    if enabled() and uses_triton(x):
        from . import invariant_sampling

        return invariant_sampling.top(x, k)
    values, indices = x.topk(k, dim=-1)
    return values, indices


def sort_descending(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, order) of x [S, V] sorted along its rows, largest first; in the mode on CUDA a stable sort
    (equal values in ascending column order: a result set by the row alone, whichever segmented sort the
    number of rows selects)."""
    values, order = x.sort(dim=-1, descending=True, stable=enabled() and uses_triton(x))
    return values, order


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """lora_runner.model.layers.RMSNorm's math on CUDA tensors, one Triton program per row (torch's mean
    picks threads and blocks per row from the number of rows)."""
    from . import invariant_triton

    return invariant_triton.rms_norm(x, weight, eps, unit_offset)


def _slot_tokens(meta: LoRAMeta, num_tokens: int) -> list[tuple[int, torch.Tensor]]:
    """(slot, its token ids [m] ascending) for every slot present among the first num_tokens tokens."""
    slots = meta.token_slots[:num_tokens].cpu()  # [T]
    return [(slot, torch.nonzero(slots == slot).flatten().to(meta.token_slots.device))
            for slot in sorted(set(slots.tolist()) - {-1})]


def _shrink(x_rows: torch.Tensor, lora_a_slot: torch.Tensor) -> torch.Tensor:
    """x_rows [m, K] @ A [n, R, K] -> [m, n, R] in float32 (float64 stays), row-invariantly."""
    n_slices, rank, in_features = lora_a_slot.shape
    weight = lora_a_slot.reshape(n_slices * rank, in_features).to(x_rows.dtype)  # [n*R, K]
    return rows_matmul(x_rows, lambda block: block @ weight.T).view(-1, n_slices, rank)


def _delta(inter_rows: torch.Tensor, lora_b_slot: torch.Tensor, slice_sizes: tuple[int, ...],
           slice_scales: torch.Tensor | None) -> torch.Tensor:
    """The slot's delta [m, N] of inter_rows [m, n, R]: slice j's intermediate (times its scale) @ B_j.T."""
    inter_rows = inter_rows.to(torch.float64 if inter_rows.dtype == torch.float64 else torch.float32)
    if slice_scales is not None:
        inter_rows = inter_rows * slice_scales.to(inter_rows.dtype)[:, None]
    parts, offset = [], 0
    for j, width in enumerate(slice_sizes):
        weight = lora_b_slot[offset:offset + width].to(inter_rows.dtype)  # [N_j, R]
        parts.append(rows_matmul(inter_rows[:, j].contiguous(), lambda block, w=weight: block @ w.T))
        offset += width
    return torch.cat(parts, dim=1)


def _update(y: torch.Tensor, tokens: torch.Tensor, slot: int, delta: torch.Tensor, scales: Scales) -> None:
    """y[tokens] += delta, or with column scales c: c * y + (1 - c) * bias + c * delta (per row)."""
    rows = y.index_select(0, tokens).to(delta.dtype)  # [m, N]
    if scales.columns is not None:
        columns = scales.columns[slot].to(delta.dtype)  # [N]
        rows = rows * columns
        if scales.bias is not None:
            rows = rows + (1 - columns) * scales.bias.to(delta.dtype)
        delta = delta * columns
    y.index_copy_(0, tokens, (rows + delta).to(y.dtype))


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, meta: LoRAMeta, out: torch.Tensor) -> torch.Tensor:
    """Semantics as punica_kernels.lora_shrink, each token's row computed independently of the batch."""
    for slot, tokens in _slot_tokens(meta, x.shape[0]):
        out.index_copy_(0, tokens, _shrink(x.index_select(0, tokens).to(out.dtype), lora_a[slot]))
    return out


def lora_expand(y: torch.Tensor, inter: torch.Tensor, lora_b: torch.Tensor, meta: LoRAMeta,
                slice_sizes: tuple[int, ...], scales: Scales) -> torch.Tensor:
    """Semantics as punica_kernels.lora_expand, each token's row computed independently of the batch."""
    for slot, tokens in _slot_tokens(meta, y.shape[0]):
        slice_scales = None if scales.slices is None else scales.slices[slot]
        delta = _delta(inter.index_select(0, tokens), lora_b[slot], slice_sizes, slice_scales)
        _update(y, tokens, slot, delta, scales)
    return y


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, meta: LoRAMeta,
             slice_sizes: tuple[int, ...], scales: Scales) -> torch.Tensor:
    """Semantics as punica_kernels.add_lora, each token's row computed independently of the batch."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    for slot, tokens in _slot_tokens(meta, x.shape[0]):
        inter = _shrink(x.index_select(0, tokens).to(dtype), lora_a[slot])  # [m, n, R]
        slice_scales = None if scales.slices is None else scales.slices[slot]
        _update(y, tokens, slot, _delta(inter, lora_b[slot], slice_sizes, slice_scales), scales)
    return y
