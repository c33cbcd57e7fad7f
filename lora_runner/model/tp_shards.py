"""Which part of each checkpoint tensor a tensor-parallel rank reads, and reading only that part.

The split itself is adapters.sharding's (Megatron-style, see there). Per checkpoint tensor, a rank
reads one or more row ranges (column-parallel weights and biases: its heads of q / k / v, its
intermediate rows of gate / up; vocabulary rows of embed_tokens and lm_head) or one column range
(row-parallel o / down weights), through ``safe_open(...).get_slice``, so a large model is never
whole in one process. Row-parallel biases, norms and per-tensor scales are read whole (they are
small and replicated). A Phi-3 fused ``qkv_proj`` is three row ranges read and concatenated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adapters.sharding import COLUMN_PARALLEL, ROW_PARALLEL, input_columns, slice_rows, vocab_share

Range = tuple[int, int]


@dataclass(frozen=True)
class TensorShard:
    """Read ``ranges`` along ``dim`` and concatenate them, then zero-pad to ``size`` along ``dim``
    (vocabulary padding; ``size`` None: no padding)."""

    dim: int
    ranges: tuple[Range, ...]
    size: int | None = None


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
    if packed in ROW_PARALLEL:
        # input columns split: the weight's columns; bias and per-row scales are per output row, whole
        return TensorShard(1, (input_columns(spec, packed, tp.rank, tp.world_size),)) if kind == "weight" else None
    if len(shape) == 0 or (kind != "weight" and shape[0] == 1):  # a per-tensor scale
        return None
    rows = slice_rows(spec, packed, tp.rank, tp.world_size)
    if index is not None:
        return TensorShard(0, (rows[index],))
    offsets = [sum(spec.slice_sizes(packed)[:j]) for j in range(len(rows))]  # fused (Phi-3): slices in order
    return TensorShard(0, tuple((offset + r0, offset + r1) for offset, (r0, r1) in zip(offsets, rows)))


def read_shard(handle, name: str, shard: TensorShard | None) -> torch.Tensor:
    """Tensor ``name`` of an open safetensors ``handle``, only ``shard``'s part of it (all when None)."""
    if shard is None:
        return handle.get_tensor(name)
    view = handle.get_slice(name)
    index = (slice(None),) * shard.dim
    parts = [view[(*index, slice(start, end))] for start, end in shard.ranges]
    tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=shard.dim)
    if shard.size is not None and tensor.shape[shard.dim] < shard.size:
        pad = list(tensor.shape)
        pad[shard.dim] = shard.size - tensor.shape[shard.dim]
        tensor = torch.cat((tensor, tensor.new_zeros(pad)), dim=shard.dim)
    return tensor
