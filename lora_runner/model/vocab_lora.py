"""LoRA on embed_tokens and lm_head in the forward pass (their slots: adapters.vocab_slots).

- Embedding: after the base lookup, ``hidden[t] += B_s @ A_s[:, input_ids[t]]`` for every token of
  slot s >= 0, with the step's LoRAMeta: the gather shrink ``punica_kernels.embedding_shrink``, then
  ``lora_expand``. It runs when the step's LoRAFeatures say some token's adapter has one (decode graphs
  are keyed by them): any other adapter has an all-zero slot, whose tokens' rows would get exactly + 0,
  so skipping is exact. Soft-prompt rows are overwritten afterwards, as PEFT never embeds virtual tokens.
- lm_head: on the rows compute_logits sees only, with a second LoRAMeta over those rows
  (:class:`LMHeadLoRA`); rows whose adapter has no lm_head LoRA are mapped to slot -1 and skipped.
  ``punica_kernels.add_lora`` with N = vocab size. Tied embeddings share the base weight only. Its table
  is built on the host like the layers' one: for the sampled rows the batch builder sends it in the
  step's upload (:meth:`LMHeadLoRA.row_slots`, :meth:`LMHeadLoRA.context`); rows known only after the
  forward (prompt logprobs) upload their own (:meth:`LMHeadLoRA.context_for_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import punica_kernels
from lora_runner.model.forward_context import LoRAContext
from punica_kernels import HostTileTable, LoRAMeta, TableLoader, TileTable


def add_embedding_lora(hidden: torch.Tensor, input_ids: torch.Tensor, lora: LoRAContext,
                       token_mask: torch.Tensor | None = None) -> None:
    """hidden [T, hidden] += each LoRA token's embedding delta, in place (lora.vocab: VocabLoRASlots);
    nothing to do (no launch) when the step's features say no token's adapter has an embedding LoRA.

    token_mask [T] bool (vocab-parallel ranks): only these tokens' rows of A are this rank's (input_ids
    are then local row ids); the others get + 0 here and their delta from the rank holding their row."""
    if not lora.features.embedding:
        return
    vocab, meta = lora.vocab, lora.meta
    num_tokens, rank = input_ids.shape[0], vocab.max_rank
    # the meta's workspace (sized for the widest layer) holds the [T, 1, R] intermediate: no allocation
    inter = meta.workspace_for(num_tokens * rank)[:num_tokens * rank].view(num_tokens, 1, rank)
    punica_kernels.embedding_shrink(input_ids, vocab.embedding_a, meta, inter)
    if token_mask is not None:
        inter.masked_fill_(~token_mask[:, None, None], 0)
    punica_kernels.lora_expand(hidden, inter, vocab.embedding_b, meta, (hidden.shape[1],),
                               slice_scales=vocab.embedding_scales)


@dataclass
class LMHeadLoRAContext:
    """lm_head LoRA over the rows to sample: a meta prepared over those rows and the vocab slots."""

    meta: LoRAMeta  # holding the rows' table: one slot per row (-1: no lm_head LoRA)
    slots: object  # adapters.vocab_slots.VocabLoRASlots


def add_lm_head_lora(logits: torch.Tensor, hidden: torch.Tensor, lm_head: LMHeadLoRAContext) -> None:
    """logits [S, V] += each row's lm_head LoRA delta of hidden [S, hidden], in place."""
    punica_kernels.add_lora(logits, hidden, lm_head.slots.lm_head_a, lm_head.slots.lm_head_b, lm_head.meta,
                            (logits.shape[1],), slice_scales=lm_head.slots.lm_head_scales)


class LMHeadLoRA:
    """The runner's second LoRAMeta, over the rows compute_logits sees (at most ``max_rows``).

    Args:
        slots: the adapter manager's VocabLoRASlots.
        max_rows, max_loras, max_lora_rank, device: sizes of the meta and its workspace.
    """

    def __init__(self, slots, max_rows: int, max_loras: int, max_lora_rank: int, device) -> None:
        self.slots = slots
        self.meta = LoRAMeta(max_rows, max_loras, device, max_rank=max_lora_rank, max_slices=1)
        self.table = HostTileTable(self.meta)  # the host builder of the rows' tables
        self._loader: TableLoader | None = None  # made on the first context_for_rows

    def row_slots(self, token_slots: np.ndarray) -> np.ndarray | None:
        """The rows' LoRA slots ``token_slots`` [S] (host; -1: none) with -1 for those whose adapter
        has no lm_head LoRA, or None when no row has one (host bookkeeping: no sync, no work)."""
        if not self.slots.lm_head_in_use():
            return None
        has_lm_head = self.slots.host_lm_head_ranks > 0  # [max_loras], the slots' host copy
        rows = np.where((token_slots >= 0) & has_lm_head[np.maximum(token_slots, 0)], token_slots, -1)  # [S]
        return rows if (rows >= 0).any() else None

    def context(self, table: TileTable | None) -> LMHeadLoRAContext | None:
        """The rows' context from their table as uploaded (``self.table``'s build of row_slots, in the
        step's upload): the meta reads it in place, no device op; None for no table (no lm_head work)."""
        if table is None:
            return None
        self.meta.use_table(table, self.slots.lm_head_ranks)
        return LMHeadLoRAContext(self.meta, self.slots)

    def context_for_rows(self, token_slots: np.ndarray, rows: torch.Tensor) -> LMHeadLoRAContext | None:
        """The context of rows picked after the step's upload (prompt logprobs): rows ``rows`` [S] int64
        of a batch whose tokens are on slots ``token_slots`` [T] (host). Their table is built on the host
        and uploaded here, in one small copy (reading ``rows`` syncs off the CPU: only when some
        adapter has an lm_head LoRA); None when no row has one."""
        if not self.slots.lm_head_in_use():
            return None
        row_slots = self.row_slots(token_slots[rows.cpu().numpy()])
        if row_slots is None:
            return None
        if self._loader is None:
            self._loader = TableLoader(self.meta, self.table)
        return self.context(self._loader.load(row_slots, check=False))
