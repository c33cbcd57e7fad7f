"""The sparse-MoE block's routed experts through the fused Triton kernels (punica_kernels.moe_triton), for
CUDA tensors; lora_runner.model.moe dispatches here and keeps its torch loop for the CPU.

The kernels read every expert's weights (and LoRA slots) as one stacked tensor [E, ...], while the block
holds one LoRALinear per expert (and adapters.slots one ModuleSlots per expert module). Both are
allocated stacked from the start: the block's experts' weights are entries of one buffer per projection
(lora_runner.model.moe), and so are the expert modules' slots (adapters.slots, ``LoRAModule.stacked``).
The first fused forward only takes a view of each stack (:func:`stack_in_place`, which would still copy
tensors found apart: never a second copy of the weights otherwise), and a later in-place write through
an expert's tensor (an adapter written into its slot) lands in the stack the kernels read. The views
are kept per block (and per LoRASlots object) so a step does no per-expert Python work.

The expert LoRA reads ``LoRASlots.expert_ranks`` as the slots' ranks: a slot whose adapter has no LoRA
on the experts (attention only) has rank 0 there, so its tokens' pairs are grouped with the base pairs
and no LoRA block runs for them. No host sync and sizes set by the batch alone (punica_kernels.moe_align),
so the decode graphs capture this path (lora_runner.worker.cuda_graphs).
"""

from __future__ import annotations

import logging
import weakref

import torch

from lora_runner.model.forward_context import LoRAContext
from lora_runner.model.moe_fp8 import StackedFp8Linear

logger = logging.getLogger(__name__)

_STACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # block -> {key: stacked views}


def stack_in_place(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[n, *shape] holding ``tensors`` (one shape and dtype), each of which becomes a view of its entry.

    Tensors already laid out as entries of one buffer (one storage, equal strides, evenly spaced: the
    loader's experts and adapters.slots' stacked slots, contiguous or not) give a view of it, no copy;
    otherwise a new contiguous buffer is filled and every tensor's ``.data`` pointed into it (their
    values, identities and parameters kept; any other view of the old storage is left behind)."""
    first = tensors[0]
    size = first.element_size()
    gap = tensors[1].data_ptr() - first.data_ptr() if len(tensors) > 1 else first.numel() * size
    if gap > 0 and gap % size == 0 and all(
            t.shape == first.shape and t.stride() == first.stride() and t.dtype == first.dtype
            and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            and t.data_ptr() == first.data_ptr() + i * gap for i, t in enumerate(tensors)):
        return first.as_strided((len(tensors), *first.shape), (gap // size, *first.stride()))
    logger.debug("stacking %d tensors of %s by a copy: they were not entries of one buffer", len(tensors),
                 tuple(first.shape))
    stacked = torch.stack([t.detach() for t in tensors])  # [n, *shape]
    for tensor, entry in zip(tensors, stacked):
        tensor.data = entry
    return stacked


def fused_supported(block) -> bool:
    """Whether the block's experts can take the fused kernels (and moe_cpu's grouped GEMM): SwiGLU experts
    with dense weights (routed experts stay dense after loading: moe.StackedDenseLinear), unquantized or
    FP8 (moe_fp8.StackedFp8Linear)."""
    return all(linear.weight is not None
               and (not linear.method.quantized or isinstance(linear.method, StackedFp8Linear))
               for expert in block.experts for linear in (expert.gate_up, expert.down))


def base_stacks(block) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]] | None:
    """{"gate_up": (weight [E, 2I, H], weight_scale [E, 2I] or None), "down": (weight [E, H, I], [E, H] or
    None)}: views of the block's stacked expert tensors (scales for FP8 experts, moe_fp8; None unquantized);
    None for a block :func:`fused_supported` does not take. Kept per block while its first expert's
    weight is the same tensor (None once packed for oneDNN: made again then)."""
    stacks = _STACKS.setdefault(block, {})
    first = block.experts[0].gate_up.weight
    if "base" not in stacks or stacks["weight"] is not first:
        scaled = isinstance(block.experts[0].gate_up.method, StackedFp8Linear)
        stacks["weight"], stacks["base"] = first, {projection: (
            stack_in_place([getattr(e, projection).weight for e in block.experts]),
            stack_in_place([getattr(e, projection).weight_scale for e in block.experts]) if scaled else None)
            for projection in ("gate_up", "down")} if fused_supported(block) else None
    return stacks["base"]


def use_fused(block, hidden: torch.Tensor) -> bool:
    """Whether the block's routed experts over ``hidden`` take the fused kernels: CUDA tensors the
    kernels support (tests force it to run them on the CPU, under the Triton interpreter)."""
    return hidden.is_cuda and fused_supported(block)


def fused_routed_experts(block, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                         lora: LoRAContext | None) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{experts[t, j]}(hidden[t]) [T, H] with each token's expert LoRA, in two
    grouped GEMMs and (with adapters) one shrink and one expand per projection."""
    from punica_kernels.moe_triton import fused_moe  # triton is an extra: imported where a GPU path runs

    base = base_stacks(block)
    (w_gate_up, s_gate_up), (w_down, s_down) = base["gate_up"], base["down"]  # [E, 2I, H], [E, H, I] (+ scales)
    stacks, factors = _STACKS[block], None
    if lora is not None:
        if stacks.get("slots") is not lora.slots:
            stacks["slots"], stacks["lora"] = lora.slots, tuple(
                stacked_slots(lora, block.experts, projection) for projection in ("gate_up", "down"))
        # expert_ranks, not slot_ranks: a slot without expert LoRA (0 there) runs no expert LoRA op
        factors = (lora.meta.token_slots, lora.slots.expert_ranks, *stacks["lora"])
    scales = None if s_gate_up is None else (s_gate_up, s_down)
    return fused_moe(hidden, w_gate_up, w_down, weights, experts, factors, scales)


def stacked_slots(lora: LoRAContext, experts, projection: str) -> tuple[torch.Tensor, ...]:
    """(lora_a [L, E, n, R, K], lora_b [L, E, N, R], slice_scales [L, E, n]) of one projection of every expert."""
    linears = [getattr(expert, projection) for expert in experts]
    pairs = [lora.slots.weights(linear.layer, linear.name) for linear in linears]
    lora_a = stack_in_place([a for a, _ in pairs]).transpose(0, 1)
    lora_b = stack_in_place([b for _, b in pairs]).transpose(0, 1)
    scales = stack_in_place([lora.slots.scales(linear.layer, linear.name)[0] for linear in linears]).transpose(0, 1)
    return lora_a, lora_b, scales
