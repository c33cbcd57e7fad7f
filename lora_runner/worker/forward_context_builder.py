"""The model's ForwardContext for a step's BatchInputs: one builder for the eager runner and the decode graphs."""

from __future__ import annotations

import torch

from lora_runner.model.forward_context import AttentionMetadata, ForwardContext, LoRAContext, PromptAdapterContext
from lora_runner.worker.batch_builder import BatchInputs


class ForwardContextBuilder:
    """Turns a step's device views into the context the model reads, over one runner's state.

    Args:
        kv_cache: the runner's paged KV cache.
        lora_meta: the runner's punica LoRAMeta (pointed at each LoRA step's table by prepare_lora).
        lora_slots: the adapters manager's LoRASlots (``.weights(layer, packed)``, ``.slot_ranks``).
        prompt_slots: the manager's PromptSlots (``.embeddings``); None when prompt adapters are off.
        vocab_slots: the manager's VocabLoRASlots (embed_tokens / lm_head LoRA); None: not served.
    """

    def __init__(self, kv_cache: torch.Tensor, lora_meta, lora_slots, prompt_slots=None, vocab_slots=None) -> None:
        self.kv_cache = kv_cache
        self.lora_meta = lora_meta
        self.lora_slots = lora_slots
        self.prompt_slots = prompt_slots
        self.vocab_slots = vocab_slots

    def prepare_lora(self, batch: BatchInputs) -> None:
        """Point the LoRA meta at `batch`'s table, built on the host and uploaded with the step
        (BatchInputs.lora_table): no device op; the slots' ranks are read in place. Host side, outside
        any graph; no-op when no token uses an adapter.

        Raises ValueError for a step with LoRA tokens but no table (a BatchBuilder without lora_table)."""
        if not batch.has_lora:
            return
        if batch.lora_table is None:
            raise ValueError("a step with LoRA tokens carries no LoRA table: build its BatchBuilder with "
                             "lora_table=HostTileTable(lora_meta)")
        self.lora_meta.use_table(batch.lora_table, self.lora_slots.slot_ranks)

    def build(self, batch: BatchInputs) -> ForwardContext:
        """`batch`'s context, reading its device views (a graph captured with it reads whatever
        they hold at replay). The LoRA context is set only when the batch has LoRA tokens, and
        reads the meta as prepare_lora last left it, and runs the optional LoRA work the batch's
        lora_features name (a graph captured from it: whatever the steps replaying it need)."""
        attn = AttentionMetadata(slot_mapping=batch.slot_mapping, query_start_loc=batch.query_start_loc,
                                 seq_lens=batch.seq_lens, block_tables=batch.block_tables,
                                 max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len)
        lora = (LoRAContext(meta=self.lora_meta, slots=self.lora_slots, vocab=self.vocab_slots,
                            features=batch.lora_features) if batch.has_lora else None)
        prompt_adapter = None
        if batch.has_prompt_adapter:
            assert self.prompt_slots is not None, "soft-prompt placeholders scheduled with prompt adapters off"
            prompt_adapter = PromptAdapterContext(self.prompt_slots.embeddings, batch.token_prompt_slots,
                                                  batch.token_prompt_positions)
        return ForwardContext(attn=attn, kv_cache=self.kv_cache, lora=lora, prompt_adapter=prompt_adapter)

    def for_step(self, batch: BatchInputs) -> ForwardContext:
        """prepare_lora then build: the context of one eager step."""
        self.prepare_lora(batch)
        return self.build(batch)
