"""Device slots: persistent tensors the kernels read, allocated once at their maximum size.

LoRA layout (design.md section 3), per layer and packed module with slices j of widths N_j at
offsets off_j, for slot s holding an adapter whose slice j has rank r_j:
``lora_a[s, j, :r_j, :] = A_j`` and ``lora_b[s, off_j:off_j+N_j, :r_j] = B_j * scaling_j``; everything
else of the slot is zero (untargeted modules, ranks above r_j), so zero-padding to R costs nothing
in the result. Writing an adapter first zeroes the slot's whole range, so nothing of a previous,
larger-rank tenant survives. Tensors are only ever written in place (CUDA-graph safe).
"""

from __future__ import annotations

import torch

from adapters.lora import LoRAWeights
from adapters.prompt import PromptWeights
from adapters.spec import PACKED_MODULES, ModelSpec


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    # Pinned CPU sources (the CPU cache pins memory when a GPU exists) copy asynchronously.
    dst.copy_(src, non_blocking=dst.is_cuda and src.is_pinned())


class LoRASlots:
    """``max_loras`` LoRA slots of rank ``max_lora_rank`` for every layer and packed module."""

    def __init__(self, spec: ModelSpec, max_loras: int, max_lora_rank: int, device="cpu",
                 dtype: torch.dtype = torch.float32):
        if max_loras < 0 or max_lora_rank < 0 or (max_loras > 0 and max_lora_rank == 0):
            raise ValueError(f"need max_loras >= 0 and max_lora_rank > 0, got {max_loras}, {max_lora_rank}")
        self.spec, self.num_slots, self.max_rank = spec, max_loras, max_lora_rank
        layers, r = spec.num_layers, max_lora_rank
        self._a = {p: torch.zeros(layers, max_loras, len(spec.slice_sizes(p)), r, spec.in_features(p),
                                  dtype=dtype, device=device)  # [L, max_loras, n, R, K]
                   for p in PACKED_MODULES}
        self._b = {p: torch.zeros(layers, max_loras, sum(spec.slice_sizes(p)), r, dtype=dtype,
                                  device=device)  # [L, max_loras, N, R]
                   for p in PACKED_MODULES}
        self.slot_ranks = torch.zeros(max_loras, dtype=torch.int32, device=device)  # [max_loras], 0 = empty

    def weights(self, layer: int, packed: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(lora_a [max_loras, n, R, K], lora_b [max_loras, N, R]) of one layer's packed module."""
        return self._a[packed][layer], self._b[packed][layer]

    @property
    def nbytes(self) -> int:
        """Device bytes allocated for all slots."""
        return sum(t.numel() * t.element_size() for t in [*self._a.values(), *self._b.values()])

    def write(self, slot: int, adapter: LoRAWeights) -> None:
        """Zero ``slot`` everywhere, then write the adapter's factors (already validated) into it."""
        assert 0 <= slot < self.num_slots, f"slot {slot} out of range [0, {self.num_slots})"
        assert adapter.rank <= self.max_rank, f"rank {adapter.rank} > max rank {self.max_rank}"
        for packed in PACKED_MODULES:
            self._a[packed][:, slot].zero_()
            self._b[packed][:, slot].zero_()
        for (layer, packed), slices in adapter.modules.items():
            lora_a, lora_b = self.weights(layer, packed)
            offset = 0
            for j, width in enumerate(self.spec.slice_sizes(packed)):
                pair = slices[j]
                if pair is not None:
                    rank = pair.a.shape[0]
                    _copy(lora_a[slot, j, :rank], pair.a)  # [r_j, K]
                    _copy(lora_b[slot, offset:offset + width, :rank], pair.b)  # [N_j, r_j]
                offset += width
        self.slot_ranks[slot] = adapter.rank

    def clear(self, slot: int) -> None:
        """Mark ``slot`` empty (its stale weights are unread: no token maps to it, and write() zeroes)."""
        self.slot_ranks[slot] = 0


class PromptSlots:
    """``max_prompt_adapters`` soft-prompt slots of up to ``max_prompt_adapter_tokens`` virtual tokens."""

    def __init__(self, spec: ModelSpec, max_prompt_adapters: int, max_prompt_adapter_tokens: int, device="cpu",
                 dtype: torch.dtype = torch.float32):
        if max_prompt_adapters < 0 or max_prompt_adapter_tokens < 0 or (
                max_prompt_adapters > 0 and max_prompt_adapter_tokens == 0):
            raise ValueError("need max_prompt_adapters >= 0 and max_prompt_adapter_tokens > 0 when prompt "
                             f"adapters are enabled, got {max_prompt_adapters}, {max_prompt_adapter_tokens}")
        self.num_slots, self.max_tokens = max_prompt_adapters, max_prompt_adapter_tokens
        self.embeddings = torch.zeros(max_prompt_adapters, max_prompt_adapter_tokens, spec.hidden_size,
                                      dtype=dtype, device=device)  # [P, max_tokens, hidden]
        self.num_virtual_tokens = torch.zeros(max_prompt_adapters, dtype=torch.int32, device=device)  # [P]

    @property
    def nbytes(self) -> int:
        """Device bytes allocated for all slots."""
        return self.embeddings.numel() * self.embeddings.element_size()

    def write(self, slot: int, adapter: PromptWeights) -> None:
        """Zero ``slot``, then write the soft prompt into its first num_virtual_tokens rows."""
        assert 0 <= slot < self.num_slots, f"slot {slot} out of range [0, {self.num_slots})"
        n = adapter.num_virtual_tokens
        assert n <= self.max_tokens, f"{n} virtual tokens > {self.max_tokens}"
        self.embeddings[slot].zero_()
        _copy(self.embeddings[slot, :n], adapter.embeddings)  # [n, hidden]
        self.num_virtual_tokens[slot] = n

    def clear(self, slot: int) -> None:
        """Mark ``slot`` empty."""
        self.num_virtual_tokens[slot] = 0
