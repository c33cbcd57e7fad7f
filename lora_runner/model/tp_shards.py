"""Which part of each checkpoint tensor a tensor-parallel rank reads, and reading only that part.

The split is the one each LoRA-aware linear declares (its LoRAModule: lora_runner.model.lora_linear;
Megatron-style, see adapters.sharding). Per checkpoint tensor, a rank
reads one or more row ranges (column-parallel weights and biases: its heads of q / k / v, its
intermediate rows of gate / up; vocabulary rows of embed_tokens and lm_head) or one column range
(row-parallel o / down weights), through ``safe_open(...).get_slice``, so a large model is never
whole in one process. Row-parallel biases, norms and per-tensor scales are read whole (they are
small and replicated). A Phi-3 fused ``qkv_proj`` is three row ranges read and concatenated; a
mixture of experts' fused ``experts.gate_up_proj`` [E, 2I, H] two row ranges along dim 1 (every
expert's gate, then up rows), its ``experts.down_proj`` [E, H, I] one column range along dim 2.

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

from adapters.sharding import vocab_share
from adapters.spec import COLUMN, ROW, LoRAModule
from lora_runner.distributed import TensorParallel
from lora_runner.model.lora_linear import LoRALinear, decoder_lora_modules
from lora_runner.model.moe import match_fused_experts
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
    if config.num_experts and (fused := match_fused_experts(name, config)) is not None:
        return _fused_experts_shard(model, *fused)
    target = model._map_name(name)
    if target is None:
        return None
    param, index = target
    if param in ("embed_tokens", "lm_head"):
        share = vocab_share(config.vocab_size, tp.world_size)
        start = min(model.vocab_start, config.vocab_size)
        return TensorShard(0, ((start, min(model.vocab_end, config.vocab_size)),), share)
    path, kind = param.rsplit(".", 1) if "." in param else (param, None)
    linear = model.get_submodule(path) if kind is not None else None
    if not isinstance(linear, LoRALinear) or linear.lora_module.parallel not in (COLUMN, ROW):
        return None  # norms (Qwen3's q / k norms are over head_dim: whole on every rank)
    module = linear.lora_module  # the whole model's: sizes and split
    axes = getattr(getattr(linear.method, "form", None), "shard_axes", None)
    if axes is not None and kind != "bias":  # a 4-bit layout (a tensor it does not know is ignored: read whole)
        return _int4_shard(linear.method.form, module, index, kind, tp) if kind in axes else None
    if module.parallel == ROW:
        # input columns split: the weight's columns; bias and per-row scales are per output row, whole
        return TensorShard(1, (module.input_columns(tp.rank, tp.world_size),)) if kind == "weight" else None
    if len(shape) == 0 or (kind != "weight" and shape[0] == 1):  # a per-tensor scale
        return None
    return TensorShard(0, _slice_ranges(module, index, tp))  # fused (Phi-3): every slice's rows in order


def _fused_experts_shard(model, layer: int, what: str) -> TensorShard | None:
    """This rank's part of a transformers 5 fused expert tensor (lora_runner.model.moe): of
    ``experts.gate_up_proj`` [E, 2I, H] its gate rows and its up rows (dim 1), of ``experts.down_proj``
    [E, H, I] its intermediate columns (dim 2); the router (``gate.weight``) whole. Every expert
    splits alike, so expert 0's descriptor gives the ranges."""
    if what == "gate.weight":
        return None
    expert = model.layers[layer].mlp.experts[0]
    if what == "experts.gate_up_proj":
        return TensorShard(1, _slice_ranges(expert.gate_up.lora_module, None, model.tp))
    return TensorShard(2, (expert.down.lora_module.input_columns(model.tp.rank, model.tp.world_size),))


def _slice_ranges(module: LoRAModule, index: int | None, tp: TensorParallel) -> tuple[Range, ...]:
    """This rank's rows of a column-parallel checkpoint tensor: its slice's, or (fused) every slice's."""
    rows = module.slice_rows(tp.rank, tp.world_size)
    if index is not None:
        return (rows[index],)
    return tuple((offset + r0, offset + r1) for offset, (r0, r1) in zip(module.slice_offsets, rows))


def _int4_shard(form, module: LoRAModule, index: int | None, kind: str, tp: TensorParallel) -> TensorShard | None:
    """The part of one 4-bit checkpoint tensor (layout: ``form.shard_axes``) this rank reads."""
    n_axis, k_axis = form.shard_axes[kind]
    units = {1: 1, "pack": PACK, "group": form.group_size}
    if module.parallel == ROW:
        c0, c1 = module.input_columns(tp.rank, tp.world_size)
        if kind == "weight_shape":
            return TensorShard(0, (), replace=(module.slice_sizes[0], c1 - c0))
        if k_axis is None:
            return None
        dim, unit = k_axis[0], units[k_axis[1]]
        return TensorShard(dim, ((c0 // unit, c1 // unit),), shift=c0 // form.group_size if kind == "g_idx" else 0)
    ranges = _slice_ranges(module, index, tp)
    if kind == "weight_shape":
        return TensorShard(0, (), replace=(sum(r1 - r0 for r0, r1 in ranges), module.in_features))
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
    modules = decoder_lora_modules(config)
    for module in modules:
        module.check_split(tp.world_size)
    local = [module.shard(tp.rank, tp.world_size) for module in modules]
    try:
        quant.check_in_features({m.name: m.in_features for m in local if m.parallel == ROW})
    except ValueError as err:
        raise ValueError(f"{err}, as one rank of tensor_parallel_size={tp.world_size} holds it") from err
    packs_n = any(axes[0] is not None and axes[0][1] == "pack" for axes in form.shard_axes.values())
    for module in local:
        for size in module.slice_sizes if module.parallel == COLUMN and packs_n else ():
            if size % PACK:
                raise ValueError(f"{quant.source} packs {PACK} output rows per word: a rank's {size} rows of a "
                                 f"{module.name} slice at tensor_parallel_size={tp.world_size} are not whole words")


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
