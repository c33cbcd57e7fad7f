"""How a Llama-family model and its LoRA adapters split over tensor-parallel ranks (Megatron-style).

Rank ``rank`` of ``world_size`` holds:

- qkv (column-parallel): query heads ``[rank * H / W, (rank + 1) * H / W)`` and KV heads split alike;
  with fewer KV heads than ranks (``W % H_kv == 0``) each KV head is replicated on ``W / H_kv`` ranks,
  rank r holding KV head ``r * H_kv // W`` (vLLM's rule), so its query heads still find their group;
- gate_up (column-parallel): rows ``[rank * I / W, (rank + 1) * I / W)`` of gate and of up;
- o, down (row-parallel): the input columns matching the heads / intermediate rows above, every
  output row (one all-reduce of the partial sums after base + LoRA);
- embed_tokens, lm_head (vocab-parallel): rows ``[rank * V_w, (rank + 1) * V_w)`` with
  ``V_w = ceil(V / W)``; rows at or past V are padding (zero).

LoRA follows the base layer, so no collective is added: a column-parallel module keeps A whole and
splits B's rows (and DoRA's column scale) with the output; a row-parallel module splits A's columns
with the input and keeps B (and the column scale, which multiplies each partial sum exactly: it is
linear per output column) whole. The embedding's A is split over its vocabulary columns, lm_head's B
over its vocabulary rows. Prompt adapters are replicated. This module imports nothing of the engine:
callers pass plain sizes (a ModelSpec).
"""

from __future__ import annotations

import torch

from adapters.lora import LoRAPair, LoRAWeights
from adapters.spec import ModelSpec

COLUMN_PARALLEL: tuple[str, ...] = ("qkv", "gate_up")  # output rows split
ROW_PARALLEL: tuple[str, ...] = ("o", "down")  # input columns split, outputs all-reduced

Range = tuple[int, int]  # [start, end)


def _check_rank(rank: int, world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"tensor parallel world_size must be a positive integer, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"tensor parallel rank must lie in [0, {world_size}), got {rank!r}")


def check_splits(spec: ModelSpec, world_size: int) -> None:
    """ValueError naming the sizes when ``spec`` cannot be split over ``world_size`` ranks: query
    heads, KV heads (divisible by the ranks, or dividing them) or the intermediate size."""
    heads, kv_heads, inter = spec.num_heads, spec.num_kv_heads, spec.intermediate_size
    if heads % world_size:
        raise ValueError(f"num_attention_heads ({heads}) is not divisible by tensor_parallel_size ({world_size})")
    if kv_heads >= world_size and kv_heads % world_size:
        raise ValueError(f"num_key_value_heads ({kv_heads}) is not divisible by tensor_parallel_size "
                         f"({world_size})")
    if kv_heads < world_size and world_size % kv_heads:
        raise ValueError(f"tensor_parallel_size ({world_size}) is not a multiple of num_key_value_heads "
                         f"({kv_heads}): fewer KV heads than ranks are replicated, which needs an even share")
    if inter % world_size:
        raise ValueError(f"intermediate_size ({inter}) is not divisible by tensor_parallel_size ({world_size})")


def head_range(num_heads: int, rank: int, world_size: int) -> Range:
    """The query heads of ``rank`` (num_heads divisible by world_size)."""
    share = num_heads // world_size
    return rank * share, (rank + 1) * share


def kv_head_range(num_kv_heads: int, rank: int, world_size: int) -> Range:
    """The KV heads of ``rank``: an even share, or the one replicated head when there are fewer than ranks."""
    if num_kv_heads >= world_size:
        return head_range(num_kv_heads, rank, world_size)
    head = rank * num_kv_heads // world_size
    return head, head + 1


def vocab_share(vocab_size: int, world_size: int) -> int:
    """Rows of the (padded) vocabulary each rank holds: ceil(V / W)."""
    return -(-vocab_size // world_size)


def vocab_range(vocab_size: int, rank: int, world_size: int) -> Range:
    """The padded-vocabulary rows of ``rank``; rows at or past vocab_size are padding."""
    share = vocab_share(vocab_size, world_size)
    return rank * share, (rank + 1) * share


def slice_rows(spec: ModelSpec, packed: str, rank: int, world_size: int) -> tuple[Range, ...]:
    """Per slice of ``packed``, the rows of that slice (relative to its start) ``rank`` holds:
    its share for a column-parallel module, every row for a row-parallel one."""
    dim = spec.head_dim
    if packed == "qkv":
        q0, q1 = head_range(spec.num_heads, rank, world_size)
        k0, k1 = kv_head_range(spec.num_kv_heads, rank, world_size)
        return (q0 * dim, q1 * dim), (k0 * dim, k1 * dim), (k0 * dim, k1 * dim)
    if packed == "gate_up":
        share = spec.intermediate_size // world_size
        return ((rank * share, (rank + 1) * share),) * 2
    return tuple((0, size) for size in spec.slice_sizes(packed))


def input_columns(spec: ModelSpec, packed: str, rank: int, world_size: int) -> Range:
    """The input columns of ``packed`` that ``rank`` holds (all of them for a column-parallel module)."""
    if packed == "o":
        h0, h1 = head_range(spec.num_heads, rank, world_size)
        return h0 * spec.head_dim, h1 * spec.head_dim
    if packed == "down":
        share = spec.intermediate_size // world_size
        return rank * share, (rank + 1) * share
    return 0, spec.in_features(packed)


def shard_spec(spec: ModelSpec, rank: int, world_size: int) -> ModelSpec:
    """The sizes ``rank`` holds (heads, KV heads, intermediate size, padded vocabulary share), so
    ``LoRASlots(shard_spec(...))`` / ``VocabLoRASlots(...)`` allocate the rank's local shapes.
    ValueError for an impossible split (:func:`check_splits`)."""
    _check_rank(rank, world_size)
    check_splits(spec, world_size)
    if world_size == 1:
        return spec
    k0, k1 = kv_head_range(spec.num_kv_heads, rank, world_size)
    vocab = None if spec.vocab_size is None else vocab_share(spec.vocab_size, world_size)
    return ModelSpec(num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                     num_heads=spec.num_heads // world_size, num_kv_heads=k1 - k0, head_dim=spec.head_dim,
                     intermediate_size=spec.intermediate_size // world_size, model_name=spec.model_name,
                     vocab_size=vocab, fused_projections=spec.fused_projections)


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


def _shard_module(pairs: tuple[LoRAPair | None, ...], spec: ModelSpec, packed: str, rank: int,
                  world_size: int) -> tuple[LoRAPair | None, ...]:
    if packed in ROW_PARALLEL:
        c0, c1 = input_columns(spec, packed, rank, world_size)
        return tuple(None if pair is None else pair._replace(a=pair.a[:, c0:c1]) for pair in pairs)
    rows = slice_rows(spec, packed, rank, world_size)
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
    modules = {(layer, packed): _shard_module(pairs, spec, packed, rank, world_size)
               for (layer, packed), pairs in weights.modules.items()}
    vocab = {}
    if weights.vocab:
        span, share = vocab_range(spec.vocab_size, rank, world_size), vocab_share(spec.vocab_size, world_size)
        for key, pair in weights.vocab.items():
            if key == "embed_tokens":  # a [r, V]: the vocabulary is its columns
                vocab[key] = pair._replace(a=_padded(pair.a, 1, span, share))
            else:  # lm_head: b [V, r]
                vocab[key] = pair._replace(b=_padded(pair.b, 0, span, share))
    return LoRAWeights(weights.name, weights.rank, modules, vocab)
