"""Which optional LoRA work a step needs (LoRAFeatures), read from the adapter slots' host bookkeeping.

The embedding LoRA's gather + expand and DoRA's column-scale epilogue are exact no-ops for adapters
without them (zero embedding factors, unit column scales), so a step runs them only when one of its
sequences' adapters has one. The answer is a pure host computation over the step's [B] sequence slots
(no device read), made while the batch is written, so the decode-graph key can depend on it.
"""

from __future__ import annotations

import numpy as np

from lora_runner.model.forward_context import LoRAFeatures


class StepLoRAFeatures:
    """Callable: per-sequence LoRA slots [B] (-1: base model) -> the LoRAFeatures the step needs.

    Args:
        lora_slots: the adapter manager's LoRASlots (``host_dora`` [max_loras] bool, host).
        vocab_slots: its VocabLoRASlots (``host_embedding`` [max_loras] bool, host); None: not served.
    """

    def __init__(self, lora_slots, vocab_slots=None) -> None:
        self.lora_slots, self.vocab_slots = lora_slots, vocab_slots

    @property
    def most(self) -> LoRAFeatures:
        """Everything a step can need here (the embedding LoRA only where vocab slots are served)."""
        return LoRAFeatures(embedding=self.vocab_slots is not None, dora=True)

    def __call__(self, seq_slots: np.ndarray) -> LoRAFeatures:
        """The features of the adapters on `seq_slots` (entries < 0 are base-model sequences)."""
        used = seq_slots[seq_slots >= 0]  # [<= B]
        embedding = self.vocab_slots is not None and bool(self.vocab_slots.host_embedding[used].any())
        return LoRAFeatures(embedding=embedding, dora=bool(self.lora_slots.host_dora[used].any()))
