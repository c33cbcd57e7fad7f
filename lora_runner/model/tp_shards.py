"""Which part of each checkpoint tensor a tensor-parallel rank reads, and reading only that part.

The split itself is adapters.sharding's (Megatron-style, see there). Per checkpoint tensor, a rank
reads one or more row ranges (column-parallel weights and biases: its heads of q / k / v, its
intermediate rows of gate / up; vocabulary rows of embed_tokens and lm_head) or one column range
(row-parallel o / down weights), through ``safe_open(...).get_slice``, so a large model is never
whole in one process. Row-parallel biases, norms and per-tensor scales are read whole (they are
small and replicated). A Phi-3 fused ``qkv_proj`` is three row ranges read and concatenated.

4-bit checkpoints (GPTQ, AWQ, compressed-tensors) are read in their own layouts: each format names,
per tensor, its N and K dimensions and how many rows / columns one element covers (8 for a packed
word, the group size for scales and zero points); a split is read only where it falls on whole
elements (:func:`check_int4_split` refuses the rest before any weight is read). A row-parallel
GPTQ ``g_idx`` is shifted to the shard's own groups; compressed-tensors' ``weight_shape`` becomes the
shard's. Act-order GPTQ (``desc_act``) is refused over several ranks: its groups are permuted across
the input columns, so one rank's columns need other ranks' scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adapters.sharding import COLUMN_PARALLEL, ROW_PARALLEL, input_columns, shard_spec, slice_rows, vocab_share
from lora_runner.distributed import TensorParallel
from lora_runner.model.quant.int4_layout import PACK

Range = tuple[int, int]


@dataclass(frozen=True)
class TensorShard:
    """Read ``ranges`` along ``dim`` and concatenate them, then zero-pad to ``size`` along ``dim``
    (vocabulary padding; ``size`` None: no padding). ``shift`` is subtracted from the values read
    (a GPTQ g_idx's groups); ``replace``: read nothing, these values instead (compressed-tensors'
    weight_shape)."""

    dim: int
    ranges: tuple[Range, ...]
    size: int | None = None
    shift: int = 0
    replace: tuple[int, ...] | None = None


def checkpoint_shard(model, name: str, shape: tuple[int, ...]) -> TensorShard | None:
    """The part of checkpoint tensor ``name`` (full shape ``shape``) that ``model`` (a rank's
    LlamaForCausalLM) holds; None: the whole tensor (replicated, or not the model's at all)."""
    tp, config = model.tp, model.config
    if not tp.is_parallel:
        return None
    target = model._map_name(name)
    if target is None:
        return None
    param, index = target
    if param in ("embed_tokens", "lm_head"):
        share = vocab_share(config.vocab_size, tp.world_size)
        start = min(model.vocab_start, config.vocab_size)
        return TensorShard(0, ((start, min(model.vocab_end, config.vocab_size)),), share)
    parts = param.split(".")
    packed, kind = (parts[3], parts[4]) if len(parts) == 5 and parts[0] == "layers" else (None, None)
    if packed not in (*COLUMN_PARALLEL, *ROW_PARALLEL):
        return None  # norms (Qwen3's q / k norms are over head_dim: whole on every rank)
    spec = config.spec()
    form = getattr(model.get_submodule(param.rsplit(".", 1)[0]).method, "form", None)
    axes = getattr(form, "shard_axes", None)
    if axes is not None and kind != "bias":  # a 4-bit layout (a tensor it does not know is ignored: read whole)
        return _int4_shard(form, spec, packed, index, kind, tp) if kind in axes else None
    if packed in ROW_PARALLEL:
        # input columns split: the weight's columns; bias and per-row scales are per output row, whole
        return TensorShard(1, (input_columns(spec, packed, tp.rank, tp.world_size),)) if kind == "weight" else None
    if len(shape) == 0 or (kind != "weight" and shape[0] == 1):  # a per-tensor scale
        return None
    return TensorShard(0, _slice_ranges(spec, packed, index, tp))  # fused (Phi-3): every slice's rows in order


def _slice_ranges(spec, packed: str, index: int | None, tp: TensorParallel) -> tuple[Range, ...]:
    """This rank's rows of a column-parallel checkpoint tensor: its slice's, or (fused) every slice's."""
    rows = slice_rows(spec, packed, tp.rank, tp.world_size)
    if index is not None:
        return (rows[index],)
    offsets = [sum(spec.slice_sizes(packed)[:j]) for j in range(len(rows))]
    return tuple((offset + r0, offset + r1) for offset, (r0, r1) in zip(offsets, rows))


def _int4_shard(form, spec, packed: str, index: int | None, kind: str, tp: TensorParallel) -> TensorShard | None:
    """The part of one 4-bit checkpoint tensor (layout: ``form.shard_axes``) this rank reads."""
    n_axis, k_axis = form.shard_axes[kind]
    units = {1: 1, "pack": PACK, "group": form.group_size}
    if packed in ROW_PARALLEL:
        c0, c1 = input_columns(spec, packed, tp.rank, tp.world_size)
        if kind == "weight_shape":
            return TensorShard(0, (), replace=(spec.slice_sizes(packed)[0], c1 - c0))
        if k_axis is None:
            return None
        dim, unit = k_axis[0], units[k_axis[1]]
        return TensorShard(dim, ((c0 // unit, c1 // unit),), shift=c0 // form.group_size if kind == "g_idx" else 0)
    ranges = _slice_ranges(spec, packed, index, tp)
    if kind == "weight_shape":
        return TensorShard(0, (), replace=(sum(r1 - r0 for r0, r1 in ranges), spec.in_features(packed)))
    if n_axis is None:
        return None
    dim, unit = n_axis[0], units[n_axis[1]]
    return TensorShard(dim, tuple((r0 // unit, r1 // unit) for r0, r1 in ranges))


def check_int4_split(config, tp: TensorParallel) -> None:
    """ValueError naming the sizes when a 4-bit checkpoint cannot be split over ``tp``'s ranks on whole
    packed words and groups (or is act-order GPTQ); called before any weight is read."""
    quant = config.quantization
    if not tp.is_parallel or quant is None or quant.int4 is None:
        return
    form = quant.int4
    if getattr(form, "desc_act", False):
        raise ValueError(f"act-order GPTQ (desc_act=True) cannot be split over tensor_parallel_size={tp.world_size}: "
                         "its groups are permuted across the input columns of the row-parallel o / down projections")
    local = shard_spec(config.spec(), tp.rank, tp.world_size)
    try:
        quant.check_in_features({packed: local.in_features(packed) for packed in ROW_PARALLEL})
    except ValueError as err:
        raise ValueError(f"{err}, as one rank of tensor_parallel_size={tp.world_size} holds it") from err
    packs_n = any(axes[0] is not None and axes[0][1] == "pack" for axes in form.shard_axes.values())
    for packed in COLUMN_PARALLEL:
        for size in local.slice_sizes(packed):
            if packs_n and size % PACK:
                raise ValueError(f"{quant.source} packs {PACK} output rows per word: a rank's {size} rows of a "
                                 f"{packed} slice at tensor_parallel_size={tp.world_size} are not whole words")


def read_shard(handle, name: str, shard: TensorShard | None) -> torch.Tensor:
    """Tensor ``name`` of an open safetensors ``handle``, only ``shard``'s part of it (all when None)."""
    if shard is None:
        return handle.get_tensor(name)
    if shard.replace is not None:
        return torch.tensor(shard.replace, dtype=torch.int64)
    view = handle.get_slice(name)
    index = (slice(None),) * shard.dim
    parts = [view[(*index, slice(start, end))] for start, end in shard.ranges]
    tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=shard.dim)
    if shard.size is not None and tensor.shape[shard.dim] < shard.size:
        pad = list(tensor.shape)
        pad[shard.dim] = shard.size - tensor.shape[shard.dim]
        tensor = torch.cat((tensor, tensor.new_zeros(pad)), dim=shard.dim)
    return tensor - shard.shift if shard.shift else tensor
