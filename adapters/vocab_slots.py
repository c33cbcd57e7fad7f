"""Device slots of embed_tokens / lm_head LoRAs: one set per model (not per layer), beside the LoRA slots.

Slot s is the same adapter as LoRA slot s: the adapter tier writes and clears both through one
:class:`SlotGroup`. Layout for slot s holding embedding rank r_e and lm_head rank r_h (every tensor
padded to ``max_lora_rank`` R and zero beyond the adapter's rank, or all zero when the adapter has
no such LoRA):

- ``embedding_a[s, :, :r_e] = A.T`` [V, r_e]: PEFT's ``lora_embedding_A`` transposed, so a token's
  R values are one contiguous row (the gather shrink reads one row per token);
  ``embedding_b[s, :, :r_e] = B`` [hidden, r_e];
- ``lm_head_a[s, 0, :r_h] = A`` [r_h, hidden], ``lm_head_b[s, :, :r_h] = B`` [V, r_h]: the
  layout of a one-slice packed module, for ``punica_kernels.add_lora`` (B's storage transposed on
  the CPU, as the LoRA slots': ``adapters.slots.zeros_b``);
- ``embedding_scales[s, 0]`` / ``lm_head_scales[s, 0]`` float32: the LoRA scaling, applied by the
  expand to the fp32 intermediate (as the LoRA slots' slice scales: folding it into a half B would
  round it).

Tensors are written in place only (CUDA-graph safe). Writing zeroes the whole slot first; clearing
(eviction, removal) zeroes it too, so no later tenant of the slot can read a former one's factors.
"""

from __future__ import annotations

import numpy as np
import torch

from adapters.lora import LoRAWeights
from adapters.slots import _copy, zeros_b
from adapters.spec import ModelSpec


class VocabLoRASlots:
    """``max_loras`` slots of embed_tokens and lm_head LoRA factors of rank up to ``max_lora_rank``.

    ``embedding_ranks`` / ``lm_head_ranks`` [max_loras] int32 on the device hold each slot's rank
    (0: no such LoRA); ``host_lm_head_ranks`` [max_loras] int32 is their host copy (``lm_head_in_use`` and the
    lm_head LoRA's tile table read it without a device sync), and ``host_embedding`` [max_loras] bool (host)
    says which slots have an embed_tokens LoRA.
    """

    def __init__(self, spec: ModelSpec, max_loras: int, max_lora_rank: int, device="cpu",
                 dtype: torch.dtype = torch.float32):
        if spec.vocab_size is None:
            raise ValueError("VocabLoRASlots needs ModelSpec.vocab_size")
        vocab, hidden, rank = spec.vocab_size, spec.hidden_size, max_lora_rank
        self.num_slots, self.max_rank = max_loras, max_lora_rank
        like = dict(dtype=dtype, device=device)
        self.embedding_a = torch.zeros(max_loras, vocab, rank, **like)  # [max_loras, V, R]
        self.embedding_b = zeros_b(max_loras, hidden, rank, **like)  # [max_loras, hidden, R]
        self.lm_head_a = torch.zeros(max_loras, 1, rank, hidden, **like)  # [max_loras, 1, R, hidden]
        self.lm_head_b = zeros_b(max_loras, vocab, rank, **like)  # [max_loras, V, R]
        self.embedding_scales = torch.ones(max_loras, 1, dtype=torch.float32, device=device)  # [max_loras, 1]
        self.lm_head_scales = torch.ones(max_loras, 1, dtype=torch.float32, device=device)  # [max_loras, 1]
        self.embedding_ranks = torch.zeros(max_loras, dtype=torch.int32, device=device)  # [max_loras]
        self.lm_head_ranks = torch.zeros(max_loras, dtype=torch.int32, device=device)  # [max_loras]
        self.host_lm_head_ranks = np.zeros(max_loras, dtype=np.int32)  # [max_loras] host copy of lm_head_ranks
        self.host_embedding = np.zeros(max_loras, dtype=bool)  # [max_loras] slot has an embed_tokens LoRA

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return self.embedding_a, self.embedding_b, self.lm_head_a, self.lm_head_b

    @property
    def nbytes(self) -> int:
        """Device bytes allocated for all slots."""
        tensors = (*self._tensors(), self.embedding_scales, self.lm_head_scales)
        return sum(t.numel() * t.element_size() for t in tensors)

    def write(self, slot: int, adapter: LoRAWeights) -> None:
        """Zero ``slot``, then write the adapter's embed_tokens / lm_head factors (already validated)."""
        self.clear(slot)
        embedding, lm_head = adapter.vocab.get("embed_tokens"), adapter.vocab.get("lm_head")
        if embedding is not None:
            rank = embedding.a.shape[0]
            _copy(self.embedding_a[slot, :, :rank], embedding.a.T)  # [V, r]
            _copy(self.embedding_b[slot, :, :rank], embedding.b)  # [hidden, r]
            self.embedding_scales[slot] = embedding.scaling
            self.embedding_ranks[slot] = rank
            self.host_embedding[slot] = True
        if lm_head is not None:
            rank = lm_head.a.shape[0]
            _copy(self.lm_head_a[slot, 0, :rank], lm_head.a)  # [r, hidden]
            _copy(self.lm_head_b[slot, :, :rank], lm_head.b)  # [V, r]
            self.lm_head_scales[slot] = lm_head.scaling
            self.lm_head_ranks[slot] = rank
            self.host_lm_head_ranks[slot] = rank

    def clear(self, slot: int) -> None:
        """Zero ``slot``: factors and ranks (scales back to 1)."""
        assert 0 <= slot < self.num_slots, f"slot {slot} out of range [0, {self.num_slots})"
        for tensor in self._tensors():
            tensor[slot].zero_()
        self.embedding_scales[slot] = 1.0
        self.lm_head_scales[slot] = 1.0
        self.embedding_ranks[slot] = 0
        self.lm_head_ranks[slot] = 0
        self.host_lm_head_ranks[slot] = 0
        self.host_embedding[slot] = False

    def lm_head_in_use(self) -> bool:
        """True when some slot holds an lm_head LoRA (host bookkeeping: no device sync)."""
        return bool(self.host_lm_head_ranks.any())


class SlotGroup:
    """Several slot sets of one adapter kind written and cleared as one (the tier's ``slots``):
    slot s of each set belongs to the same adapter."""

    def __init__(self, *members) -> None:
        assert len({m.num_slots for m in members}) == 1, "every member needs the same number of slots"
        self.members = members
        self.num_slots = members[0].num_slots

    @property
    def nbytes(self) -> int:
        """Device bytes allocated by every member."""
        return sum(m.nbytes for m in self.members)

    def write(self, slot: int, adapter) -> None:
        """Write ``adapter`` into ``slot`` of every member."""
        for member in self.members:
            member.write(slot, adapter)

    def clear(self, slot: int) -> None:
        """Clear ``slot`` of every member."""
        for member in self.members:
            member.clear(slot)
