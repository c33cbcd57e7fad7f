"""How a model and its LoRA adapters split over tensor-parallel ranks (Megatron-style).

Each LoRA-capable module declares its split (adapters.spec.LoRAModule, from the layer that owns it):

- column-parallel (a packed q,k,v; gate,up): each slice's output rows split by its :class:`Split`
  (query heads, KV heads replicated when there are fewer than ranks, intermediate rows);
- row-parallel (o, down): the input columns matching those heads / rows split, every output row
  kept (one all-reduce of the partial sums after base + LoRA);
- embed_tokens, lm_head (vocab-parallel): rows ``[rank * V_w, (rank + 1) * V_w)`` with
  ``V_w = ceil(V / W)``; rows at or past V are padding (zero).

LoRA follows the base layer, so no collective is added: a column-parallel module keeps A whole and
splits B's rows (and DoRA's column scale) with the output; a row-parallel module splits A's columns
with the input and keeps B (and the column scale, which multiplies each partial sum exactly: it is
linear per output column) whole. The embedding's A is split over its vocabulary columns, lm_head's B
over its vocabulary rows. Prompt adapters are replicated. This module imports nothing of the engine:
callers pass a ModelSpec whose modules the model declared.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from adapters.lora import LoRAPair, LoRAWeights
from adapters.spec import COLUMN, ROW, LoRAModule, ModelSpec, Range, Split


def _check_rank(rank: int, world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"tensor parallel world_size must be a positive integer, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"tensor parallel rank must lie in [0, {world_size}), got {rank!r}")


def check_splits(spec: ModelSpec, world_size: int) -> None:
    """ValueError naming the sizes when one of ``spec``'s modules cannot be split over ``world_size``
    ranks (query heads, KV heads (divisible by the ranks, or dividing them), intermediate size)."""
    for module in spec.modules:
        module.check_split(world_size)


def head_range(num_heads: int, rank: int, world_size: int) -> Range:
    """The query heads of ``rank`` (num_heads divisible by world_size)."""
    return Split(num_heads).unit_range(rank, world_size)


def kv_head_range(num_kv_heads: int, rank: int, world_size: int) -> Range:
    """The KV heads of ``rank``: an even share, or the one replicated head when there are fewer than ranks."""
    return Split(num_kv_heads, replicate=True).unit_range(rank, world_size)


def vocab_share(vocab_size: int, world_size: int) -> int:
    """Rows of the (padded) vocabulary each rank holds: ceil(V / W)."""
    return -(-vocab_size // world_size)


def vocab_range(vocab_size: int, rank: int, world_size: int) -> Range:
    """The padded-vocabulary rows of ``rank``; rows at or past vocab_size are padding."""
    share = vocab_share(vocab_size, world_size)
    return rank * share, (rank + 1) * share


def shard_spec(spec: ModelSpec, rank: int, world_size: int) -> ModelSpec:
    """The sizes ``rank`` holds (each module's share, the decoder's heads, KV heads and intermediate
    size, the padded vocabulary share), so ``LoRASlots(shard_spec(...))`` / ``VocabLoRASlots(...)``
    allocate the rank's local shapes. ValueError for an impossible split (:func:`check_splits`)."""
    _check_rank(rank, world_size)
    check_splits(spec, world_size)
    if world_size == 1:
        return spec
    decoder = {}
    if spec.num_heads is not None:  # a Llama-family decoder's sizes (the KV cache reads them)
        k0, k1 = kv_head_range(spec.num_kv_heads, rank, world_size)
        decoder = dict(num_heads=spec.num_heads // world_size, num_kv_heads=k1 - k0,
                       intermediate_size=spec.intermediate_size // world_size)
    vocab = None if spec.vocab_size is None else vocab_share(spec.vocab_size, world_size)
    return replace(spec, **decoder, vocab_size=vocab, modules=tuple(m.shard(rank, world_size) for m in spec.modules))


def _rows(tensor: torch.Tensor | None, rows: Range) -> torch.Tensor | None:
    return None if tensor is None else tensor[rows[0]:rows[1]]


def _padded(tensor: torch.Tensor, dim: int, span: Range, size: int) -> torch.Tensor:
    """``tensor``'s [start, end) along ``dim`` clipped to its length, zero-padded to the share ``size``
    (a view when nothing needs padding)."""
    start, end = span
    part = tensor.narrow(dim, start, max(0, min(end, tensor.shape[dim]) - start))
    if part.shape[dim] == size:
        return part
    shape = list(part.shape)
    shape[dim] = size - part.shape[dim]
    return torch.cat((part, part.new_zeros(shape)), dim=dim)


def shard_pairs(module: LoRAModule, pairs: tuple[LoRAPair | None, ...], rank: int,
                world_size: int) -> tuple[LoRAPair | None, ...]:
    """``rank``'s share of one module's per-slice pairs (views): a row-parallel module's A columns, a
    column-parallel one's B rows and DoRA column scales, a replicated one's whole."""
    if module.parallel == ROW:
        c0, c1 = module.input_columns(rank, world_size)
        return tuple(None if pair is None else pair._replace(a=pair.a[:, c0:c1]) for pair in pairs)
    if module.parallel != COLUMN:
        return pairs
    rows = module.slice_rows(rank, world_size)
    return tuple(None if pair is None else pair._replace(b=pair.b[r0:r1], column_scale=_rows(pair.column_scale,
                                                                                            (r0, r1)))
                 for pair, (r0, r1) in zip(pairs, rows))


def shard_lora_weights(weights: LoRAWeights, spec: ModelSpec, rank: int, world_size: int) -> LoRAWeights:
    """``rank``'s shard of a validated full CPU copy (``spec``: the full model's): views of its tensors
    except where the vocabulary is padded. ``LoRASlots(shard_spec(...)).write(slot, ...)`` and the
    vocab slots take it as they take the full copy at one rank."""
    _check_rank(rank, world_size)
    if world_size == 1:
        return weights
    check_splits(spec, world_size)
    declared = {module.key: module for module in spec.modules}
    modules = {key: shard_pairs(declared[key], pairs, rank, world_size) for key, pairs in weights.modules.items()}
    vocab = {}
    if weights.vocab:
        span, share = vocab_range(spec.vocab_size, rank, world_size), vocab_share(spec.vocab_size, world_size)
        for key, pair in weights.vocab.items():
            if key == "embed_tokens":  # a [r, V]: the vocabulary is its columns
                vocab[key] = pair._replace(a=_padded(pair.a, 1, span, share))
            else:  # lm_head: b [V, r]
                vocab[key] = pair._replace(b=_padded(pair.b, 0, span, share))
    return LoRAWeights(weights.name, weights.rank, modules, vocab)
