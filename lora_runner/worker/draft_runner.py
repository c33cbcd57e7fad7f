"""The draft model of speculative decoding's "draft_model" method (lora_runner.spec_decode.draft_model):
loaded through the target's loading path, run without adapters over its own paged KV cache.

``load_draft_speculator`` is the engine's one call: it loads the draft (lora_runner.model.load_model),
checks that its vocabulary is the target's (one ValueError otherwise), and builds the DraftModelSpeculator
over a DraftModelRunner and the draft's own block pool. That pool has the target's block count plus room
for k more tokens per sequence (the draft writes up to k - 1 proposals past the tokens the target holds);
its blocks are the draft's size (its layers and KV heads). On CUDA the draft's weights and KV cache are
allocated after the target's memory profile, so they come out of what gpu_memory_utilization leaves free.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from lora_runner.core.block_manager import BlockManager
from lora_runner.model import ModelConfig, load_model
from lora_runner.spec_decode.config import SpeculativeConfig
from lora_runner.spec_decode.draft_model import DraftChunk, DraftModelSpeculator, check_same_vocab
from lora_runner.worker.batch_builder import BatchBuilder, SeqChunk
from lora_runner.worker.forward_context_builder import ForwardContextBuilder
from lora_runner.worker.kv_cache import allocate_kv_cache

logger = logging.getLogger(__name__)

class DraftModelRunner:
    """The draft model's forward over DraftChunks (spec_decode.draft_model.DraftForward): its own KV
    cache and batch buffers, no adapter (every token on the base model), greedy tokens out.

    Args:
        model, model_config: the draft decoder and its config.
        num_kv_blocks, block_size: its paged KV cache (the DraftModelSpeculator's block pool maps it).
        max_num_tokens, max_num_seqs, max_blocks_per_seq: the largest forward (buffer sizes).
        dtype, device: of the KV cache.
    """

    def __init__(self, model, model_config: ModelConfig, *, num_kv_blocks: int, block_size: int,
                 max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.model = model
        self.kv_cache = allocate_kv_cache(model_config, num_kv_blocks, block_size, dtype, device)
        self.batch_builder = BatchBuilder(max_num_tokens=max_num_tokens, max_num_seqs=max_num_seqs,
                                          max_blocks_per_seq=max_blocks_per_seq, block_size=block_size, device=device)
        self.forward_contexts = ForwardContextBuilder(self.kv_cache, lora_meta=None, lora_slots=None)

    @torch.inference_mode()
    def __call__(self, chunks: Sequence[DraftChunk]) -> list[int]:
        """Write every chunk's K/V; the argmax token after each sampling chunk's last token, in order."""
        batch = self.batch_builder.build([SeqChunk(c.token_ids, c.start, c.num_new_tokens, c.block_table,
                                                   sample=c.sample) for c in chunks])
        hidden = self.model(batch.input_ids, batch.positions, self.forward_contexts.for_step(batch))  # [T, hidden]
        if not batch.num_samples:
            return []
        logits = self.model.compute_logits(hidden[batch.sample_indices])  # [S, vocab]
        return logits.argmax(dim=-1).tolist()


def load_draft_speculator(config: SpeculativeConfig, *, target_config: ModelConfig, target_dir: str | Path,
                          vocab_of: Callable[[Path], Mapping[str, int] | None], max_model_len: int,
                          max_num_batched_tokens: int, max_num_seqs: int, num_kv_blocks: int, block_size: int,
                          dtype: torch.dtype, device: torch.device,
                          local_files_only: bool | None = None) -> DraftModelSpeculator:
    """The "draft_model" DraftSource of an engine of these sizes (see the module docstring). ``vocab_of``:
    the token -> id map of a model dir's tokenizer (None: it has none; the engine's LazyTokenizer.vocab).
    Raises ValueError when the draft's vocabulary is not the target's or its context is shorter than
    max_model_len, and what load_model raises for a draft it cannot load."""
    model, draft_config, draft_dir = load_model(config.model, dtype=dtype, device=device,
                                                local_files_only=local_files_only)
    check_same_vocab(config.model, target_config.vocab_size, draft_config.vocab_size,
                     vocab_of(Path(target_dir)), vocab_of(Path(draft_dir)))
    if draft_config.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config draft model {config.model!r} has a context of "
                         f"{draft_config.max_position_embeddings} tokens, shorter than max_model_len "
                         f"({max_model_len}): lower max_model_len or pick another draft")
    k = config.num_speculative_tokens
    blocks = BlockManager(num_kv_blocks + max_num_seqs * -(-k // block_size), block_size)
    max_num_tokens = max_num_batched_tokens + max_num_seqs  # slack for the proposing rows' last tokens
    runner = DraftModelRunner(model, draft_config, num_kv_blocks=blocks.num_blocks, block_size=block_size,
                              max_num_tokens=max_num_tokens, max_num_seqs=max_num_seqs,
                              max_blocks_per_seq=blocks.blocks_for(max_model_len), dtype=dtype, device=device)
    logger.info("draft model %s (%d layers) proposes up to %d tokens per step; its KV cache: %d blocks",
                config.model, draft_config.num_layers, k, blocks.num_blocks)
    return DraftModelSpeculator(config, runner, blocks, max_model_len=max_model_len, max_num_tokens=max_num_tokens)

