"""Plain torch LoRA shrink/expand: the CPU serving path and, in float64, the test oracle.

A run is a stretch of consecutive tokens of one slot: a prefill's chunk, or neighbouring decode
requests of one adapter. Its rows of x and y are views, so a run long enough for the layer
(:func:`min_run_tokens`) is multiplied in place: its shrink, then one ``addmm_`` per slice into
its rows of y (no gather of its rows, no scatter of its delta). The other LoRA tokens, grouped by
slot (the meta's stable sort), take one of two vectorized strategies; both end in one scatter-add
into the rows of their tokens (slot -1 rows are never written):

- padded (decode): every present slot's tokens padded to the longest segment, one batched matmul
  for the shrink and one per slice for the expand: a fixed number of torch calls, whatever the
  number of distinct adapters. The slots' weights are a view when the slots present are a range
  with at most as many absent slots as present ones (absent slots' rows are computed and
  dropped), else gathered.
- segmented (long segments that are not runs, very wide layers): a few matmuls per slot
  present, on views of the slot's weights (no copy); its cost grows with the number of distinct
  adapters.

:func:`use_padded` chooses by the elements the padded path copies per slot present (crossover
measured on CPU, see ``PADDED_ELEMENTS_PER_SLOT``). The token layout (runs, and the others'
segments) is built once per table (``LoRAMeta.use_table``; and set of runs) and shared by every layer.
Reading the segment bounds and the runs needs the host, so on an accelerator this path syncs once
per table (a few times when a segment is long enough to hold a run) and is not graph-safe (the
Triton path is).

The W4A16 GEMM's torch path (:func:`w4a16_matmul`) is here too: the CPU serving path (the layer's
weight dequantized on the fly, only for the call) and, in float64, an oracle of the Triton kernel.
"""

from __future__ import annotations

import bisect
import sys
import weakref
from dataclasses import dataclass, field

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

# A run in place costs ~6 + n_slices torch calls (~40-60 us with one thread here) and copies
# nothing; gathered, its tokens cost their share of the padded or segmented path (copies of K inputs
# and a scatter-add of N outputs per token, ~2-3 ns per element all told). Measured crossover (one
# thread, rank 16, a run next to 16 tokens over 7 other slots): ~8 tokens on the 100M model's
# qkv (K + N = 2048), ~64-100 on the tiny model's layers (K + N = 160-256): about 16K elements of
# K + N per run, and not below a few tokens (the calls' cost) on very wide layers.
MIN_RUN_ELEMENTS = 1 << 14
MIN_RUN_TOKENS = 4
NO_RUNS = sys.maxsize  # the shortest run done in place when a gather path is forced: none


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64 (the oracle), everything else uses float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class _Layout:
    """Per-table layout of the LoRA tokens: the runs done in place, and the M other tokens
    grouped by slot, laid out for the padded path over U slots, each padded to ``width`` rows."""

    runs: list[tuple[int, int, int]]  # (slot, first token, one past the last) of each run in place
    tokens: torch.Tensor  # [M] token ids of the other LoRA tokens, grouped by slot (sorted order)
    segments: list[tuple[int, int, int]]  # (slot, begin, end) in tokens, for every slot present
    # [U] int64 slots of the padded path, ascending: those present, or every slot from the first
    # present to the last when that range is a view of the weights (absent slots' rows are dropped)
    present: torch.Tensor
    first_slot: int | None  # present == first_slot, first_slot + 1, ...: a view, None: a gather
    width: int  # rows per slot in the padded layout: the longest segment
    pad_tokens: torch.Tensor  # [U * width] token id of each padded row (padding repeats a row)
    pad_rows: torch.Tensor  # [M] padded row of each of tokens
    row_slots: torch.Tensor  # [M] slot of each of tokens
    # every segment is `width` long (U * width == M): padded row i is token i, so pad_rows is the
    # identity and the padded results are the tokens' rows as they are (no gather)
    unpadded: bool


@dataclass
class _Prepared:
    """The torch path's reading of one table: the LoRA tokens grouped by slot, their runs, and
    the layouts built from them (one per set of runs done in place: layers of other widths may
    take different runs in place)."""

    host_starts: list[int]  # the meta's host_slot_starts() list (a new list per table)
    tokens: torch.Tensor  # [M] LoRA token ids grouped by slot (the meta's sorted order)
    segments: list[tuple[int, int, int]]  # (slot, begin, end) in tokens, for every slot present
    width: int  # the longest segment
    run_bounds: tuple[torch.Tensor, torch.Tensor] | None = None  # [n_runs] sorted position and length of each run
    runs: dict[int, tuple] = field(default_factory=dict)  # shortest run -> (slot, position, length, first token)s
    layouts: dict[tuple, _Layout] = field(default_factory=dict)  # runs in place -> layout


_prepared_by_meta: weakref.WeakKeyDictionary[LoRAMeta, _Prepared] = weakref.WeakKeyDictionary()


def _prepared(meta: LoRAMeta) -> _Prepared:
    """The meta's table as the torch path reads it, built once per table."""
    starts = meta.host_slot_starts()  # a new list per table
    prepared = _prepared_by_meta.get(meta)
    if prepared is None or prepared.host_starts is not starts:
        segments = [(slot, starts[slot], starts[slot + 1]) for slot in range(meta.max_loras)
                    if starts[slot + 1] > starts[slot]]
        width = max((end - begin for _, begin, end in segments), default=0)
        prepared = _prepared_by_meta[meta] = _Prepared(starts, meta.sorted_tokens[:starts[meta.max_loras]],
                                                       segments, width)
    return prepared


def _layout(meta: LoRAMeta, min_run: int = NO_RUNS) -> _Layout:
    """The layout of the meta's table with its runs of at least ``min_run`` tokens in
    place, built once per table and set of runs (every layer reuses it)."""
    prepared = _prepared(meta)
    runs = _runs(prepared, min_run)
    layout = prepared.layouts.get(runs)
    if layout is None:
        layout = prepared.layouts[runs] = _gather_layout(
            [(slot, token, token + length) for slot, _, length, token in runs], *_outside_runs(prepared, runs))
    return layout


def _runs(prepared: _Prepared, min_run: int) -> tuple[tuple[int, int, int, int], ...]:
    """(slot, sorted position, length, first token) of every run of at least ``min_run`` tokens.
    Within a slot's segment the tokens ascend (stable sort), so a run is a stretch of the segment
    where each token follows the one before it."""
    if prepared.width < min_run:
        return ()  # no segment is long enough: nothing read back (most decode steps)
    runs = prepared.runs.get(min_run)
    if runs is not None:
        return runs
    tokens, begins = prepared.tokens, [begin for _, begin, _ in prepared.segments]
    if prepared.run_bounds is None:
        first = torch.ones(tokens.shape[0], dtype=torch.bool, device=tokens.device)  # [M] starts a run
        first[1:] = tokens[1:] != tokens[:-1] + 1
        first[torch.tensor(begins, device=tokens.device)] = True
        positions = first.nonzero().view(-1)  # [n_runs]
        prepared.run_bounds = positions, torch.diff(positions, append=positions.new_tensor([tokens.shape[0]]))
    positions, lengths = prepared.run_bounds
    long = lengths >= min_run  # [n_runs]
    found = torch.stack((positions[long], lengths[long], tokens[positions[long]])).tolist()
    slots = [prepared.segments[bisect.bisect_right(begins, position) - 1][0] for position in found[0]]
    runs = prepared.runs[min_run] = tuple(zip(slots, *found))
    return runs


def _outside_runs(prepared: _Prepared, runs: tuple[tuple[int, int, int, int], ...]):
    """The LoRA tokens [M'] outside ``runs``, and their segments."""
    if not runs:
        return prepared.tokens, prepared.segments
    keep = torch.ones(prepared.tokens.shape[0], dtype=torch.bool, device=prepared.tokens.device)  # [M]
    in_runs = dict.fromkeys((slot for slot, *_ in prepared.segments), 0)
    for slot, position, length, _ in runs:
        keep[position:position + length] = False
        in_runs[slot] += length
    segments, begin = [], 0
    for slot, first, end in prepared.segments:
        count = end - first - in_runs[slot]
        if count:
            segments.append((slot, begin, begin + count))
            begin += count
    return prepared.tokens[keep], segments


def _gather_layout(runs: list[tuple[int, int, int]], tokens: torch.Tensor,
                   segments: list[tuple[int, int, int]]) -> _Layout:
    """The layout of the tokens [M] that are not in a run, grouped by slot as ``segments`` say."""
    width = max((end - begin for _, begin, end in segments), default=0)
    padded, first_slot = _padded_segments(segments)
    int64 = dict(dtype=torch.int64, device=tokens.device)
    begins = torch.tensor([begin for _, begin, _ in padded], **int64)  # [U]
    counts = torch.tensor([end - begin for _, begin, end in padded], **int64)  # [U]
    # an absent slot's rows repeat the next segment's first token (one follows: the range ends present)
    local = torch.minimum(torch.arange(width, **int64)[None, :], counts[:, None] - 1).clamp(min=0)  # [U, w]
    pad_tokens = tokens.index_select(0, (begins[:, None] + local).view(-1))  # [U * w]
    segment = torch.repeat_interleave(torch.arange(len(padded), **int64), counts)  # [M]
    pad_rows = segment * width + torch.arange(tokens.shape[0], **int64) - begins[segment]  # [M]
    present = torch.tensor([slot for slot, _, _ in padded], **int64)  # [U]
    unpadded = len(padded) * width == tokens.shape[0]
    return _Layout(runs, tokens, segments, present, first_slot, width, pad_tokens, pad_rows, present[segment],
                   unpadded)


def _padded_segments(segments: list[tuple[int, int, int]]) -> tuple[list[tuple[int, int, int]], int | None]:
    """The padded path's segments and first slot: every slot from the first present to the last
    (absent ones empty) when that range holds no more absent slots than present ones (reading an
    absent slot's weights in the bmm costs less than copying a present one's), else the present
    slots alone (first slot None: their weights are gathered)."""
    if not segments or segments[-1][0] - segments[0][0] + 1 > 2 * len(segments):
        return segments, None
    bounds = {slot: (begin, end) for slot, begin, end in segments}
    padded, position = [], 0
    for slot in range(segments[0][0], segments[-1][0] + 1):
        begin, end = bounds.get(slot, (position, position))
        padded.append((slot, begin, end))
        position = end
    return padded, segments[0][0]


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
    x_pad = _cast(x.index_select(0, layout.pad_tokens), dtype)  # [U * w, K]
    a_present = _cast(_present_slots(lora_a, layout), dtype)  # [U, n, R, K]
    a_present = a_present.view(-1, n_slices * rank, in_features)  # [U, n*R, K]
    return torch.bmm(x_pad.view(-1, layout.width, in_features), a_present.transpose(1, 2))


def _expand_padded(inter_pad: torch.Tensor, lora_b: torch.Tensor, layout: _Layout,
                   slice_sizes: tuple[int, ...], slice_scales: torch.Tensor | None) -> torch.Tensor:
    """inter_pad [U, w, n*R] (a new tensor: scaled in place by each present slot's slice_scales
    [L, n] when given) times each present slot's B, slice by slice -> [M, N] (tokens' order)."""
    num_present, width, _ = inter_pad.shape
    rank, out_features = lora_b.shape[2], lora_b.shape[1]
    b_present = _cast(_present_slots(lora_b, layout), inter_pad.dtype).transpose(1, 2)  # [U, R, N]
    if slice_scales is not None:  # each slice's R columns times its scale, broadcast (no repeated copy)
        scales = _cast(_present_slots(slice_scales, layout), inter_pad.dtype)  # [U, n]
        inter_pad.view(num_present, width, -1, rank).mul_(scales.reshape(num_present, 1, -1, 1))
    if len(slice_sizes) == 1:  # one bmm straight into the result
        delta_pad = torch.bmm(inter_pad, b_present)  # [U, w, N]
        return _padded_rows(delta_pad.view(-1, out_features), layout)
    delta_pad = inter_pad.new_empty((num_present, width, out_features))  # [U, w, N]
    offset = 0
    for j, size in enumerate(slice_sizes):  # at most 3 slices, whatever the adapters
        product = torch.bmm(inter_pad.narrow(2, j * rank, rank), b_present.narrow(2, offset, size))  # [U, w, N_j]
        delta_pad.narrow(2, offset, size).copy_(product)
        offset += size
    return _padded_rows(delta_pad.view(-1, out_features), layout)  # [M, N]


def _padded_rows(flat: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """flat [U * w, C] padded rows -> [M, C] the LoRA tokens' rows (a view when nothing is padded)."""
    return flat if layout.unpadded else flat.index_select(0, layout.pad_rows)


def _present_slots(per_slot: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """per_slot [L, ...] at the padded path's slots -> [U, ...]: a view when they are a range
    (usually: adapters fill slots from 0), else a gather (a copy of those slots' weights per call)."""
    if layout.first_slot is None:
        return per_slot.index_select(0, layout.present)
    if layout.first_slot == 0 and layout.present.shape[0] == per_slot.shape[0]:
        return per_slot  # every slot
    return per_slot.narrow(0, layout.first_slot, layout.present.shape[0])


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """tensor in dtype (itself when it is: no call into torch, this path runs once per layer)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


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


# ------------------------------------------------------------------ runs: views of x and y

def _scaled_run(inter_run: torch.Tensor, slice_scales: torch.Tensor | None, slot: int) -> torch.Tensor:
    """inter_run [m, n*R] times the slot's slice scales [n] (when given), a new tensor then."""
    if slice_scales is None:
        return inter_run
    num_tokens, n_slices = inter_run.shape[0], slice_scales.shape[1]
    scales = slice_scales[slot].to(inter_run.dtype)[:, None]  # [n, 1]
    return (inter_run.reshape(num_tokens, n_slices, -1) * scales).view(num_tokens, -1)


def _expand_run(y_run: torch.Tensor, inter_run: torch.Tensor, lora_b_slot: torch.Tensor,
                slice_sizes: tuple[int, ...], scales: Scales, slot: int) -> None:
    """y_run [m, N] (a view of y's rows) += inter_run [m, n*R] @ B[slot].T slice by slice, in place;
    with column scales c: y_run = c * y_run + (1 - c) * bias + inter_run @ (c * B).T. Computed in
    inter_run's dtype: in y's rows when that is y's, else in a copy rounded once into them."""
    dtype, rank = inter_run.dtype, lora_b_slot.shape[1]
    rows = y_run if y_run.dtype == dtype else y_run.to(dtype)  # [m, N]
    lora_b_slot = lora_b_slot.to(dtype)  # [N, R]
    if scales.columns is not None:  # the run has one slot: c scales B's rows instead of the delta
        columns = scales.columns[slot].to(dtype)  # [N]
        rows.mul_(columns)
        if scales.bias is not None:
            rows += (1 - columns) * scales.bias.to(dtype)
        lora_b_slot = lora_b_slot * columns[:, None]
    offset = 0
    for j, width in enumerate(slice_sizes):
        rows[:, offset:offset + width].addmm_(inter_run[:, j * rank:(j + 1) * rank],
                                              lora_b_slot[offset:offset + width].T)
        offset += width
    if rows is not y_run:
        y_run.copy_(rows)


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


PATHS = (None, "runs", "padded", "segmented")


def min_run_tokens(in_features: int, out_features: int) -> int:
    """The shortest run done in place: K + N elements per token times its tokens reach
    :data:`MIN_RUN_ELEMENTS`, and at least :data:`MIN_RUN_TOKENS`. Pass 0 for the half an op does
    not touch."""
    return max(MIN_RUN_TOKENS, -(-MIN_RUN_ELEMENTS // (in_features + out_features)))


def _min_run(path: str | None, in_features: int, out_features: int) -> int:
    """The shortest run done in place: by the layer's widths, every run for "runs", none when a
    gather path is forced."""
    if path not in PATHS:
        raise ValueError(f'path must be None, "runs", "padded" or "segmented", got {path!r}')
    if path is None:
        return min_run_tokens(in_features, out_features)
    return 1 if path == "runs" else NO_RUNS


def _padded(path: str | None, layout: _Layout, n_slices: int, rank: int, in_features: int,
            out_features: int) -> bool:
    """Whether the tokens outside runs take the padded path; ``path`` may force one."""
    if path in ("padded", "segmented"):
        return path == "padded"
    return use_padded(layout, n_slices, rank, in_features, out_features)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, meta: LoRAMeta,
                out: torch.Tensor, *, path: str | None = None) -> torch.Tensor:
    """Semantics: out[t, j] = x[t] @ lora_a[s, j].T for s = token_slots[t] >= 0.

    x [T, K]; lora_a [max_loras, n_slices, R, K]; out [T, n_slices, R] (float32, or float64 for
    float64 x). Rows of tokens with slot -1 are not written. ``path``: None chooses by size;
    "runs" (every run in place), "padded" or "segmented" (no run in place) force one (tests).
    """
    _, n_slices, rank, in_features = lora_a.shape
    layout = _layout(meta, _min_run(path, in_features, 0))
    for slot, begin, end in layout.runs:
        out[begin:end] = _shrink_rows(x[begin:end].to(out.dtype), lora_a[slot])
    if not layout.segments:
        return out
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
    layout = _layout(meta, _min_run(path, 0, y.shape[1]))
    dtype = compute_dtype(y.dtype)
    for slot, begin, end in layout.runs:
        inter_run = inter[begin:end].reshape(end - begin, -1).to(dtype)  # [m, n*R]
        _expand_run(y[begin:end], _scaled_run(inter_run, scales.slices, slot), lora_b[slot], slice_sizes,
                    scales, slot)
    if not layout.segments:
        return y
    inter_rows = inter.index_select(0, layout.tokens).to(dtype)  # [M, n, R]
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

    Shapes as in :func:`punica_kernels.add_lora`. Runs in place on views of x and y; the other
    LoRA tokens' rows of x gathered, the shrink and expand matmuls (padded or per slot, see the
    module docstring) and a scatter-add into y. ``path`` as in :func:`lora_shrink`.
    """
    _, n_slices, rank, in_features = lora_a.shape
    layout = _layout(meta, _min_run(path, in_features, y.shape[1]))
    dtype = compute_dtype(x.dtype)
    for slot, begin, end in layout.runs:
        inter_run = _shrink_rows(x[begin:end].to(dtype), lora_a[slot]).view(end - begin, -1)  # [m, n*R]
        _expand_run(y[begin:end], _scaled_run(inter_run, scales.slices, slot), lora_b[slot], slice_sizes,
                    scales, slot)
    if not layout.segments:
        return y
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
