"""The sparse-MoE block's routed experts through the fused Triton kernels (punica_kernels.moe_triton), for
CUDA tensors; lora_runner.model.moe dispatches here and keeps its torch loop for the CPU.

The kernels read every expert's weights (and LoRA slots) as one stacked tensor [E, ...], while the block
holds one LoRALinear per expert (and adapters.slots one ModuleSlots per expert module). The first fused
forward moves each projection's E tensors into one buffer and points each expert's tensor at its entry
(:func:`stack_in_place`): no second copy of the weights, and a later in-place write through an expert's
tensor (an adapter written into its slot) lands in the stack the kernels read. The stacked views are
kept per block (and per LoRASlots object) so a step does no per-expert Python work.
"""

from __future__ import annotations

import weakref

import torch

from lora_runner.model.forward_context import LoRAContext

_STACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # block -> {key: stacked views}


def stack_in_place(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[n, *shape] holding ``tensors`` (one shape and dtype), each of which becomes a view of its entry.

    Tensors already laid out as consecutive entries of one buffer give a view of it (no copy);
    otherwise a new contiguous buffer is filled and every tensor's ``.data`` pointed into it (their
    values, identities and parameters kept; any other view of the old storage is left behind)."""
    first = tensors[0]
    step = first.numel() * first.element_size()
    if all(t.shape == first.shape and t.stride() == first.stride() and t.is_contiguous()
           and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
           and t.data_ptr() == first.data_ptr() + i * step for i, t in enumerate(tensors)):
        return first.as_strided((len(tensors), *first.shape), (first.numel(), *first.stride()))
    stacked = torch.stack([t.detach() for t in tensors])  # [n, *shape]
    for tensor, entry in zip(tensors, stacked):
        tensor.data = entry
    return stacked


def fused_supported(block) -> bool:
    """Whether the block's experts can take the fused kernels: unquantized SwiGLU experts (a quantized
    expert keeps the torch loop)."""
    return all(not linear.method.quantized for expert in block.experts for linear in (expert.gate_up, expert.down))


def fused_routed_experts(block, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                         lora: LoRAContext | None) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{experts[t, j]}(hidden[t]) [T, H] with each token's expert LoRA, in two
    grouped GEMMs and (with adapters) one shrink and one expand per projection."""
    from punica_kernels.moe_triton import fused_moe  # triton is an extra: imported where a GPU path runs

    stacks = _STACKS.setdefault(block, {})
    if "base" not in stacks:
        stacks["base"] = (stack_in_place([e.gate_up.weight for e in block.experts]),  # [E, 2I, H]
                          stack_in_place([e.down.weight for e in block.experts]))  # [E, H, I]
    w_gate_up, w_down = stacks["base"]
    factors = None
    if lora is not None:
        if stacks.get("slots") is not lora.slots:
            stacks["slots"], stacks["lora"] = lora.slots, tuple(
                _stacked_slots(lora, block.experts, projection) for projection in ("gate_up", "down"))
        factors = (lora.meta.token_slots, lora.slots.slot_ranks, *stacks["lora"])
    return fused_moe(hidden, w_gate_up, w_down, weights, experts, factors)


def _stacked_slots(lora: LoRAContext, experts, projection: str) -> tuple[torch.Tensor, ...]:
    """(lora_a [L, E, n, R, K], lora_b [L, E, N, R], slice_scales [L, E, n]) of one projection of every expert."""
    linears = [getattr(expert, projection) for expert in experts]
    pairs = [lora.slots.weights(linear.layer, linear.name) for linear in linears]
    lora_a = stack_in_place([a for a, _ in pairs]).transpose(0, 1)
    lora_b = stack_in_place([b for _, b in pairs]).transpose(0, 1)
    scales = stack_in_place([lora.slots.scales(linear.layer, linear.name)[0] for linear in linears]).transpose(0, 1)
    return lora_a, lora_b, scales
