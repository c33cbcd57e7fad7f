"""Plain torch LoRA shrink/expand: the CPU serving path and, in float64, the test oracle.

Vectorized per adapter segment: the meta's stable sort groups each slot's tokens, so the work is
one gather of the LoRA tokens, a few matmuls per slot *present* in the batch (at most
``max_loras``) and one scatter-add, never a Python loop over tokens. Each adapter's weights are
read once per call, unlike a per-token gather. Reading the segment bounds needs the host, so on
an accelerator this path syncs once per call and is not graph-safe (the Triton path is).
"""

from __future__ import annotations

import torch

from .meta import LoRAMeta


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64 (the oracle), everything else uses float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _segments(meta: LoRAMeta) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """Token ids of all LoRA tokens in slot-sorted order [M], and (slot, begin, end) row ranges
    of that order for every slot present in the last prepare."""
    starts = meta.host_slot_starts()
    tokens = meta.sorted_tokens[:starts[meta.max_loras]]  # [M] tokens with a slot, grouped by slot
    ranges = [(slot, starts[slot], starts[slot + 1]) for slot in range(meta.max_loras)
              if starts[slot + 1] > starts[slot]]
    return tokens, ranges


def _shrink_rows(x_rows: torch.Tensor, lora_a_slot: torch.Tensor) -> torch.Tensor:
    """x_rows [m, K] @ A[j].T for every slice j -> [m, n_slices, R], x_rows' dtype."""
    n_slices, rank, in_features = lora_a_slot.shape
    a_stacked = lora_a_slot.reshape(n_slices * rank, in_features).to(x_rows.dtype)  # [n*R, K]
    return (x_rows @ a_stacked.T).view(-1, n_slices, rank)  # [m, n, R]


def _expand_rows(inter_rows: torch.Tensor, lora_b_slot: torch.Tensor,
                 slice_sizes: tuple[int, ...], out: torch.Tensor) -> None:
    """Per slice j: out[:, off_j:off_j+N_j] = inter_rows[:, j] [m, R] @ B[off_j:off_j+N_j].T."""
    lora_b_slot = lora_b_slot.to(inter_rows.dtype)  # [N, R]
    if len(slice_sizes) == 1:
        torch.matmul(inter_rows[:, 0], lora_b_slot.T, out=out)  # [m, N], no copy
        return
    offset = 0
    for j, width in enumerate(slice_sizes):
        out[:, offset:offset + width] = inter_rows[:, j] @ lora_b_slot[offset:offset + width].T
        offset += width


def _add_rows(y: torch.Tensor, tokens: torch.Tensor, delta: torch.Tensor) -> None:
    """y[tokens] += delta (tokens unique), added in delta's dtype and rounded once to y's."""
    if delta.dtype == y.dtype:
        y.index_add_(0, tokens, delta)
        return
    updated = y.index_select(0, tokens).to(delta.dtype) + delta  # [M, N]
    y.index_copy_(0, tokens, updated.to(y.dtype))


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, meta: LoRAMeta,
                out: torch.Tensor) -> torch.Tensor:
    """Semantics: out[t, j] = x[t] @ lora_a[s, j].T for s = token_slots[t] >= 0.

    x [T, K]; lora_a [max_loras, n_slices, R, K]; out [T, n_slices, R] (float32, or float64 for
    float64 x). Rows of tokens with slot -1 are not written.
    """
    tokens, ranges = _segments(meta)
    x_rows = x.index_select(0, tokens).to(out.dtype)  # [M, K]
    inter = x_rows.new_empty((x_rows.shape[0], *out.shape[1:]))  # [M, n, R]
    for slot, begin, end in ranges:
        inter[begin:end] = _shrink_rows(x_rows[begin:end], lora_a[slot])
    out.index_copy_(0, tokens, inter)
    return out


def lora_expand(y: torch.Tensor, inter: torch.Tensor, lora_b: torch.Tensor, meta: LoRAMeta,
                slice_sizes: tuple[int, ...]) -> torch.Tensor:
    """Semantics: y[t, off_j:off_j+N_j] += inter[t, j] @ lora_b[s, off_j:off_j+N_j].T, s >= 0.

    y [T, N] in place; inter [T, n_slices, R]; lora_b [max_loras, N, R]. Rows of tokens with
    slot -1 are left bit-identical.
    """
    tokens, ranges = _segments(meta)
    inter_rows = inter.index_select(0, tokens).to(compute_dtype(y.dtype))  # [M, n, R]
    delta = inter_rows.new_empty((inter_rows.shape[0], y.shape[1]))  # [M, N]
    for slot, begin, end in ranges:
        _expand_rows(inter_rows[begin:end], lora_b[slot], slice_sizes, delta[begin:end])
    _add_rows(y, tokens, delta)
    return y


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             meta: LoRAMeta, slice_sizes: tuple[int, ...]) -> torch.Tensor:
    """Semantics: y[t, off_j:off_j+N_j] += (x[t] @ lora_a[s, j].T) @ lora_b[s, off_j:off_j+N_j].T.

    Shapes as in :func:`punica_kernels.add_lora`. One gather of the LoRA tokens' rows of x, two
    matmuls (plus one per extra slice) per slot present, one scatter-add into y.
    """
    tokens, ranges = _segments(meta)
    x_rows = x.index_select(0, tokens).to(compute_dtype(x.dtype))  # [M, K]
    delta = x_rows.new_empty((x_rows.shape[0], y.shape[1]))  # [M, N]
    for slot, begin, end in ranges:
        inter = _shrink_rows(x_rows[begin:end], lora_a[slot])  # [m, n, R]
        _expand_rows(inter, lora_b[slot], slice_sizes, delta[begin:end])
    _add_rows(y, tokens, delta)
    return y
