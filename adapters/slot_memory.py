"""How much device memory the LoRA slots take: bytes per slot, and the slots of every rank together.

A slot holds one adapter at ``max_lora_rank`` for every LoRA-capable module of the model, whatever
the adapter targets (adapters.slots: A and B padded to R, float32 scales), plus its embed_tokens /
lm_head LoRA (adapters.vocab_slots). On a dense model that is small beside the weights; on a mixture
of experts every expert of every layer has its own A and B, so a slot is large: Qwen3-30B-A3B at
rank 16 in bf16 is about 1.55 GiB a slot (48 layers x 128 experts x (gate, up, down); no DoRA column
scales for experts, which apply plain LoRA only: 1.59 GiB a slot in all, 84 MiB less than with them), and
``max_loras`` slots of it compete with the KV cache. The figures here are exactly what
adapters.manager.build_slots allocates: the slots' own tensors, built on the meta device (no
memory, no layout formula written twice). A slot bounds one adapter's CPU weights too, so the LoRA
CPU cache's default byte bound is ``max_cpu_loras`` slots (:func:`cpu_cache_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adapters.sharding import shard_spec
from adapters.slots import ModuleSlots
from adapters.spec import ModelSpec
from adapters.vocab_slots import VocabLoRASlots


@dataclass(frozen=True)
class SlotBytes:
    """Device bytes of one LoRA slot on one rank: in all, and the share of the experts' modules."""

    per_slot: int  # every LoRA-capable module's and the vocabulary LoRA's tensors of one slot
    experts: int  # of which the mixture-of-experts' routed experts (stacked modules; 0 for a dense model)

    def describe(self, max_loras: int) -> str:
        """One line for the start-up log: per slot, the experts' share, and max_loras slots in all."""
        experts = f" ({self.experts / self.per_slot:.0%} experts' LoRA)" if self.experts else ""
        return (f"{_gib(self.per_slot)} per LoRA slot{experts}, max_loras={max_loras}: "
                f"{_gib(self.per_slot * max_loras)}")


def lora_slot_bytes(spec: ModelSpec, max_lora_rank: int, dtype: torch.dtype, rank: int = 0,
                    world_size: int = 1) -> SlotBytes:
    """Bytes one LoRA slot of ``spec`` (the whole model's) takes at ``rank``'s share of it, at
    ``max_lora_rank`` in ``dtype``: what build_slots allocates per slot. Each distinct module shape
    is built once on the meta device (a 30B MoE declares 12k modules of four shapes)."""
    local = shard_spec(spec, rank, world_size)
    shapes: dict[tuple, int] = {}  # (K, slice sizes, DoRA) -> one slot's bytes of a module of that shape
    total = experts = 0
    for module in local.modules:
        shape = (module.in_features, module.slice_sizes, module.dora)
        if shape not in shapes:
            tensors = ModuleSlots(module, 1, max_lora_rank, "meta", dtype).tensors
            shapes[shape] = sum(t.numel() * t.element_size() for t in tensors)
        total += shapes[shape]
        experts += shapes[shape] if module.stacked is not None else 0
    if local.vocab_size is not None:  # embed_tokens / lm_head LoRA, beside the modules' (build_slots)
        total += VocabLoRASlots(local, 1, max_lora_rank, "meta", dtype).nbytes
    return SlotBytes(total, experts)


def all_ranks_slot_bytes(spec: ModelSpec, max_loras: int, max_lora_rank: int, dtype: torch.dtype,
                         world_size: int) -> int:
    """Bytes the ``max_loras`` LoRA slots of every rank of ``world_size`` take together (replicated
    modules, the router, counted on each rank): what they add to one host's memory on CPU."""
    return max_loras * sum(lora_slot_bytes(spec, max_lora_rank, dtype, rank, world_size).per_slot
                           for rank in range(world_size))


def cpu_cache_bytes(spec: ModelSpec, max_cpu_loras: int, max_lora_rank: int, dtype: torch.dtype,
                    max_cpu_lora_bytes: int | None = None) -> int:
    """The LoRA CPU cache's byte bound: ``max_cpu_lora_bytes``, or when None its default, ``max_cpu_loras``
    adapters of the largest size one can be at ``max_lora_rank``: one whole slot at tp=1 (a slot holds an
    A per slice at the full rank and the DoRA column scales, plus float32 scalings no adapter holds, so
    no valid adapter is larger). Under the default the count bound binds first, as in vLLM (which has
    max_cpu_loras only): no setup that runs by count is refused by bytes."""
    if max_cpu_lora_bytes is not None:
        return max_cpu_lora_bytes
    # at least one byte: a spec with no LoRA-capable module (or max_cpu_loras=0) caches adapters of no bytes
    return max(max_cpu_loras * lora_slot_bytes(spec, max_lora_rank, dtype).per_slot, 1)


def describe_cpu_cache(max_cpu_loras: int, max_bytes: int, default: bool) -> str:
    """One line for the start-up log: the CPU cache's two bounds."""
    how = f" (default: {max_cpu_loras} adapters of the largest size at max_lora_rank)" if default else ""
    return f"LoRA CPU cache: max_cpu_loras={max_cpu_loras}, max_cpu_lora_bytes={max_bytes} ({_gib(max_bytes)}){how}"


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"
