"""What one forward pass needs besides token ids and positions: attention metadata, the KV cache,
and the step's LoRA / prompt-adapter state. Built by the runner once per step; read by the model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adapters.slots import LoRASlots
from adapters.vocab_slots import VocabLoRASlots
from punica_kernels import LoRAMeta


@dataclass
class AttentionMetadata:
    """Flat batch of B sequences with T new tokens in all (prefill chunks and decodes mixed).

    Sequence i's new tokens are rows query_start_loc[i]:query_start_loc[i+1] of the flat batch and
    are the last (query_start_loc[i+1]-query_start_loc[i]) tokens of its context of seq_lens[i].
    """

    # [T] int64: KV-cache slot (block * block_size + offset) per token; -1 = padding, not written
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor  # [B+1] int32 cumulative new-token counts
    seq_lens: torch.Tensor  # [B] int32 context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32 block ids (unused entries: 0)
    max_query_len: int  # host ints so the torch path needs no device sync
    max_seq_len: int


@dataclass(frozen=True, order=True)
class LoRAFeatures:
    """The optional parts of a step's LoRA work; a part runs only when its flag is set. Skipping one is
    exact when no token's adapter has it: its slots hold zeros (embedding) or ones (column scales)."""

    embedding: bool = True  # embed_tokens LoRA: the gather shrink and expand after the embedding lookup
    dora: bool = True  # DoRA: the column scales (and bias term) in every LoRA linear's expand epilogue


ALL_LORA_FEATURES = LoRAFeatures()  # run everything (the safe default when nothing is known)
PLAIN_LORA = LoRAFeatures(embedding=False, dora=False)  # projection LoRA only


@dataclass
class LoRAContext:
    """The step's LoRA state: punica meta (prepared once per step) and the device slot weights."""

    meta: LoRAMeta  # prepared from the step's token slots
    slots: LoRASlots  # the manager's projection slots: .weights(layer, packed) -> (lora_a, lora_b)
    vocab: VocabLoRASlots | None = None  # the manager's embed_tokens / lm_head LoRA slots; None: none served
    features: LoRAFeatures = ALL_LORA_FEATURES  # which optional LoRA work this forward runs


@dataclass
class PromptAdapterContext:
    """Soft prompts to write over placeholder tokens' embeddings (prefill only)."""

    embeddings: torch.Tensor  # [max_prompt_adapters, max_prompt_adapter_tokens, hidden]
    token_slots: torch.Tensor  # [T] int64: prompt-adapter slot per token, -1 for ordinary tokens
    token_positions: torch.Tensor  # [T] int64: virtual-token index within the soft prompt (-1 ordinary)


@dataclass
class ForwardContext:
    attn: AttentionMetadata
    kv_cache: torch.Tensor  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    lora: LoRAContext | None = None  # None: no adapter in this step, the LoRA path costs nothing
    prompt_adapter: PromptAdapterContext | None = None
