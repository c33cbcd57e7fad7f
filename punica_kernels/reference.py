"""Plain torch LoRA shrink/expand: the CPU serving path and, in float64, the test oracle.

Two vectorized strategies over the LoRA tokens grouped by slot (the meta's stable sort); both end
in one scatter-add into the rows of tokens that have a slot (slot -1 rows are never written):

- padded (decode): every present slot's tokens padded to the longest segment, the present
  slots' weights gathered once, one batched matmul for the shrink and one per slice for the
  expand: a fixed number of torch calls, whatever the number of distinct adapters.
- segmented (long prefills, very wide layers): a few matmuls per slot present, on views of the
  slot's weights (no copy); its cost grows with the number of distinct adapters.

:func:`use_padded` chooses by the elements the padded path copies per slot present (crossover
measured on CPU, see ``PADDED_ELEMENTS_PER_SLOT``). The token layout is built once per
``LoRAMeta.prepare`` and shared by every layer. Reading the segment bounds needs the host, so on
an accelerator this path syncs once per prepare and is not graph-safe (the Triton path is).

The W4A16 GEMM's torch path (:func:`w4a16_matmul`) is here too: the CPU serving path (the layer's
weight dequantized on the fly, only for the call) and, in float64, an oracle of the Triton kernel.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .meta import LoRAMeta
from .scales import NO_SCALES, Scales

# The padded path replaces ~5 + n_slices torch calls per slot present (~40 us each slot with one
# thread here) by copies of the present slots' weights and of the padded rows (~0.3-0.5 ns per
# element). Measured crossover (one thread, 8 and 32 slots, rank 16, tokens spread evenly): the
# padded path wins up to ~128K copied elements per slot present: every decode batch of the tiny
# and 100M models up to 256 tokens; the per-slot path wins on 7B-wide layers and long prefills.
PADDED_ELEMENTS_PER_SLOT = 1 << 17


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64 (the oracle), everything else uses float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class _Layout:
    """Per-prepare layout of the LoRA tokens: U slots present, each padded to ``width`` rows."""

    host_starts: list[int]  # the meta's host_slot_starts() list this layout was built from
    tokens: torch.Tensor  # [M] token ids grouped by slot (the meta's sorted order)
    segments: list[tuple[int, int, int]]  # (slot, begin, end) in tokens, for every slot present
    present: torch.Tensor  # [U] int64 slots present, ascending
    present_is_prefix: bool  # present == 0..U-1: the slots' weights are a view, not a gather
    width: int  # rows per slot in the padded layout: the longest segment
    pad_tokens: torch.Tensor  # [U * width] token id of each padded row (padding repeats a row)
    pad_rows: torch.Tensor  # [M] padded row of each of tokens
    row_slots: torch.Tensor  # [M] slot of each of tokens
    # every segment is `width` long (U * width == M): padded row i is token i, so pad_rows is the
    # identity and the padded results are the tokens' rows as they are (no gather)
    unpadded: bool


_layouts: weakref.WeakKeyDictionary[LoRAMeta, _Layout] = weakref.WeakKeyDictionary()


def _layout(meta: LoRAMeta) -> _Layout:
    """The layout of the meta's last prepare, built once per prepare (every layer reuses it)."""
    starts = meta.host_slot_starts()  # a new list after every prepare
    cached = _layouts.get(meta)
    if cached is not None and cached.host_starts is starts:
        return cached
    tokens = meta.sorted_tokens[:starts[meta.max_loras]]  # [M]
    segments = [(slot, starts[slot], starts[slot + 1]) for slot in range(meta.max_loras)
                if starts[slot + 1] > starts[slot]]
    width = max((end - begin for _, begin, end in segments), default=0)
    int64 = dict(dtype=torch.int64, device=tokens.device)
    begins = torch.tensor([begin for _, begin, _ in segments], **int64)  # [U]
    counts = torch.tensor([end - begin for _, begin, end in segments], **int64)  # [U]
    local = torch.minimum(torch.arange(width, **int64)[None, :], counts[:, None] - 1)  # [U, w]
    pad_tokens = tokens.index_select(0, (begins[:, None] + local).view(-1))  # [U * w]
    segment = torch.repeat_interleave(torch.arange(len(segments), **int64), counts)  # [M]
    pad_rows = segment * width + torch.arange(tokens.shape[0], **int64) - begins[segment]  # [M]
    present = torch.tensor([slot for slot, _, _ in segments], **int64)  # [U]
    is_prefix = all(slot == index for index, (slot, _, _) in enumerate(segments))
    unpadded = len(segments) * width == tokens.shape[0]
    layout = _Layout(starts, tokens, segments, present, is_prefix, width, pad_tokens, pad_rows, present[segment],
                     unpadded)
    _layouts[meta] = layout
    return layout


def use_padded(layout: _Layout, n_slices: int, rank: int, in_features: int,
               out_features: int) -> bool:
    """True when the padded path's copies (the present slots' A [n, R, K] and B [N, R], and
    U * width padded rows of K inputs and N outputs) stay within
    :data:`PADDED_ELEMENTS_PER_SLOT` per slot present. Pass 0 for the half an op does not touch."""
    weights = rank * (n_slices * in_features + out_features)  # one slot's A and B
    rows = layout.width * (in_features + out_features)  # one slot's padded inputs and outputs
    return weights + rows <= PADDED_ELEMENTS_PER_SLOT


# ------------------------------------------------------------------ padded: one bmm for all slots

def _shrink_padded(x: torch.Tensor, lora_a: torch.Tensor, layout: _Layout,
                   dtype: torch.dtype) -> torch.Tensor:
    """Every present slot's rows of x times its A, in one bmm -> [U, width, n*R] in dtype."""
    _, n_slices, rank, in_features = lora_a.shape
    x_pad = x.index_select(0, layout.pad_tokens).to(dtype)  # [U * w, K]
    a_present = _present_slots(lora_a, layout).to(dtype)  # [U, n, R, K]
    a_present = a_present.reshape(-1, n_slices * rank, in_features)  # [U, n*R, K]
    return torch.bmm(x_pad.view(-1, layout.width, in_features), a_present.transpose(1, 2))


def _expand_padded(inter_pad: torch.Tensor, lora_b: torch.Tensor, layout: _Layout,
                   slice_sizes: tuple[int, ...], slice_scales: torch.Tensor | None) -> torch.Tensor:
    """inter_pad [U, w, n*R] (scaled by each present slot's slice_scales [L, n] when given) times
    each present slot's B, slice by slice -> [M, N] (tokens' order)."""
    rank = lora_b.shape[2]
    b_present = _present_slots(lora_b, layout).to(inter_pad.dtype)  # [U, N, R]
    if slice_scales is not None:  # each slice's R columns times its scale, broadcast (no repeated copy)
        scales = _present_slots(slice_scales, layout).to(inter_pad.dtype)  # [U, n]
        num_present, width = inter_pad.shape[:2]
        inter_pad = (inter_pad.view(num_present, width, -1, rank)
                     * scales[:, None, :, None]).view(num_present, width, -1)  # [U, w, n*R]
    if len(slice_sizes) == 1:  # one bmm straight into the result
        delta_pad = torch.bmm(inter_pad, b_present.transpose(1, 2))  # [U, w, N]
        return _padded_rows(delta_pad.view(-1, lora_b.shape[1]), layout)
    delta_pad = inter_pad.new_empty((*inter_pad.shape[:2], lora_b.shape[1]))  # [U, w, N]
    offset = 0
    for j, width in enumerate(slice_sizes):  # at most 3 slices, whatever the adapters
        inter_j = inter_pad[:, :, j * rank:(j + 1) * rank]  # [U, w, R]
        b_j = b_present[:, offset:offset + width].transpose(1, 2)  # [U, R, N_j]
        delta_pad[:, :, offset:offset + width] = torch.bmm(inter_j, b_j)
        offset += width
    return _padded_rows(delta_pad.view(-1, lora_b.shape[1]), layout)  # [M, N]


def _padded_rows(flat: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """flat [U * w, C] padded rows -> [M, C] the LoRA tokens' rows (a view when nothing is padded)."""
    return flat if layout.unpadded else flat.index_select(0, layout.pad_rows)


def _present_slots(per_slot: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """per_slot [L, ...] at the present slots -> [U, ...]: a view when they are 0..U-1 (adapters
    fill slots from 0, so usually), else a gather (a copy of those slots' weights per call)."""
    if layout.present_is_prefix:
        return per_slot[:layout.present.shape[0]]
    return per_slot.index_select(0, layout.present)


def _unpad(inter_pad: torch.Tensor, layout: _Layout, n_slices: int) -> torch.Tensor:
    """[U, w, n*R] -> [M, n, R] rows of the LoRA tokens, in the layout's token order."""
    flat = inter_pad.reshape(-1, inter_pad.shape[2])  # [U * w, n*R]
    return _padded_rows(flat, layout).view(layout.tokens.shape[0], n_slices, -1)


def _pad(inter_rows: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """[M, n, R] in the layout's token order -> [U, w, n*R] (padding rows zero)."""
    if layout.unpadded:
        return inter_rows.reshape(layout.present.shape[0], layout.width, -1)
    flat = inter_rows.new_zeros((layout.present.shape[0] * layout.width,
                                 inter_rows.shape[1] * inter_rows.shape[2]))  # [U * w, n*R]
    flat.index_copy_(0, layout.pad_rows, inter_rows.reshape(inter_rows.shape[0], -1))
    return flat.view(layout.present.shape[0], layout.width, -1)


# ------------------------------------------------------------------ segmented: per-slot matmuls

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


def _shrink_segmented(x_rows: torch.Tensor, lora_a: torch.Tensor, layout: _Layout) -> torch.Tensor:
    inter = x_rows.new_empty((x_rows.shape[0], *lora_a.shape[1:3]))  # [M, n, R]
    for slot, begin, end in layout.segments:
        inter[begin:end] = _shrink_rows(x_rows[begin:end], lora_a[slot])
    return inter


def _expand_segmented(inter_rows: torch.Tensor, lora_b: torch.Tensor, layout: _Layout,
                      slice_sizes: tuple[int, ...], out: torch.Tensor) -> None:
    for slot, begin, end in layout.segments:
        _expand_rows(inter_rows[begin:end], lora_b[slot], slice_sizes, out[begin:end])


# ------------------------------------------------------------------ the ops

def _update_rows(y: torch.Tensor, layout: _Layout, delta: torch.Tensor, scales: Scales) -> None:
    """y[tokens] += delta (tokens unique), or with column scales c of the rows' slots:
    y[tokens] = c * y[tokens] + (1 - c) * bias + c * delta. Computed in delta's dtype and rounded
    once to y's."""
    tokens = layout.tokens
    if scales.columns is None and delta.dtype == y.dtype:
        y.index_add_(0, tokens, delta)
        return
    updated = y.index_select(0, tokens).to(delta.dtype)  # [M, N]
    if scales.columns is not None:
        columns = scales.columns.index_select(0, layout.row_slots).to(delta.dtype)  # [M, N]
        updated = updated * columns
        if scales.bias is not None:
            updated += (1 - columns) * scales.bias.to(delta.dtype)
        delta = delta * columns
    y.index_copy_(0, tokens, (updated + delta).to(y.dtype))


def _scale_rows(inter_rows: torch.Tensor, layout: _Layout, slice_scales: torch.Tensor | None) -> torch.Tensor:
    """inter_rows [M, n, R] times the slice scales [L, n] of each row's slot (when given)."""
    if slice_scales is None:
        return inter_rows
    return inter_rows * slice_scales.index_select(0, layout.row_slots).to(inter_rows.dtype)[:, :, None]


def _padded(path: str | None, layout: _Layout, n_slices: int, rank: int, in_features: int,
            out_features: int) -> bool:
    """Whether to take the padded path; ``path`` forces one ("padded" / "segmented")."""
    if path is None:
        return use_padded(layout, n_slices, rank, in_features, out_features)
    if path not in ("padded", "segmented"):
        raise ValueError(f'path must be None, "padded" or "segmented", got {path!r}')
    return path == "padded"


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, meta: LoRAMeta,
                out: torch.Tensor, *, path: str | None = None) -> torch.Tensor:
    """Semantics: out[t, j] = x[t] @ lora_a[s, j].T for s = token_slots[t] >= 0.

    x [T, K]; lora_a [max_loras, n_slices, R, K]; out [T, n_slices, R] (float32, or float64 for
    float64 x). Rows of tokens with slot -1 are not written. ``path``: None chooses by size;
    "padded" or "segmented" forces one (tests).
    """
    layout = _layout(meta)
    if not layout.segments:
        return out
    _, n_slices, rank, in_features = lora_a.shape
    if _padded(path, layout, n_slices, rank, in_features, 0):
        inter = _unpad(_shrink_padded(x, lora_a, layout, out.dtype), layout, n_slices)
    else:
        x_rows = x.index_select(0, layout.tokens).to(out.dtype)  # [M, K]
        inter = _shrink_segmented(x_rows, lora_a, layout)
    out.index_copy_(0, layout.tokens, inter)
    return out


def lora_expand(y: torch.Tensor, inter: torch.Tensor, lora_b: torch.Tensor, meta: LoRAMeta,
                slice_sizes: tuple[int, ...], scales: Scales = NO_SCALES, *,
                path: str | None = None) -> torch.Tensor:
    """Semantics: y[t, off_j:off_j+N_j] += inter[t, j] @ lora_b[s, off_j:off_j+N_j].T, s >= 0,
    scaled as :mod:`punica_kernels.scales` says.

    y [T, N] in place; inter [T, n_slices, R]; lora_b [max_loras, N, R]. Rows of tokens with
    slot -1 are left bit-identical. ``path`` as in :func:`lora_shrink`.
    """
    layout = _layout(meta)
    if not layout.segments:
        return y
    inter_rows = inter.index_select(0, layout.tokens).to(compute_dtype(y.dtype))  # [M, n, R]
    inter_rows = _scale_rows(inter_rows, layout, scales.slices)
    if _padded(path, layout, 0, lora_b.shape[2], 0, y.shape[1]):
        delta = _expand_padded(_pad(inter_rows, layout), lora_b, layout, slice_sizes, None)
    else:
        delta = inter_rows.new_empty((inter_rows.shape[0], y.shape[1]))  # [M, N]
        _expand_segmented(inter_rows, lora_b, layout, slice_sizes, delta)
    _update_rows(y, layout, delta, scales)
    return y


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             meta: LoRAMeta, slice_sizes: tuple[int, ...], scales: Scales = NO_SCALES, *,
             path: str | None = None) -> torch.Tensor:
    """Semantics: y[t, off_j:off_j+N_j] += (x[t] @ lora_a[s, j].T) @ lora_b[s, off_j:off_j+N_j].T,
    scaled as :mod:`punica_kernels.scales` says.

    Shapes as in :func:`punica_kernels.add_lora`. Gathers the LoRA tokens' rows of x, runs the
    shrink and expand matmuls (padded or per slot, see the module docstring) and scatter-adds
    into y. ``path`` as in :func:`lora_shrink`.
    """
    layout = _layout(meta)
    if not layout.segments:
        return y
    dtype = compute_dtype(x.dtype)
    _, n_slices, rank, in_features = lora_a.shape
    if _padded(path, layout, n_slices, rank, in_features, y.shape[1]):
        delta = _expand_padded(_shrink_padded(x, lora_a, layout, dtype), lora_b, layout,
                               slice_sizes, scales.slices)  # [M, N]
    else:
        x_rows = x.index_select(0, layout.tokens).to(dtype)  # [M, K]
        inter_rows = _scale_rows(_shrink_segmented(x_rows, lora_a, layout), layout, scales.slices)
        delta = x_rows.new_empty((x_rows.shape[0], y.shape[1]))  # [M, N]
        _expand_segmented(inter_rows, lora_b, layout, slice_sizes, delta)
    _update_rows(y, layout, delta, scales)
    return y


def w4a16_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                     g_idx: torch.Tensor | None, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in ``dtype`` of a 4-bit weight (punica_kernels.w4a16_matmul's layout), computed in
    float32 (float64 when asked); g_idx values outside [0, K/G) are clamped, as in the kernel."""
    compute = compute_dtype(dtype)
    out_features, in_features = qweight.shape[0], qweight.shape[1] * 8
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)  # [8]
    q = ((qweight[:, :, None] >> shifts) & 0xF).reshape(out_features, in_features).to(compute)  # [N, K]
    if g_idx is None:
        groups = torch.arange(in_features, device=qweight.device) // group_size  # [K]
    else:
        groups = g_idx.long().clamp(0, in_features // group_size - 1)  # [K]
    zero = zeros.to(compute)[:, groups] if zeros is not None else 8.0  # [N, K] or the symmetric 8
    return ((q - zero) * scales.to(compute)[:, groups]).to(dtype)


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 g_idx: torch.Tensor | None, group_size: int, bias: torch.Tensor | None,
                 out: torch.Tensor) -> torch.Tensor:
    """Semantics as :func:`punica_kernels.w4a16_matmul`: out = x @ W.T + bias, W dequantized in x's
    dtype for this call only (the weight stays packed); float64 x gives the float64 oracle."""
    weight = w4a16_dequantize(qweight, scales, zeros, g_idx, group_size, x.dtype)  # [N, K]
    out.copy_(F.linear(x, weight, bias))
    return out
