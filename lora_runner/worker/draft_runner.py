"""The draft model of speculative decoding's "draft_model" method (lora_runner.spec_decode.draft_model):
loaded through the target's loading path, run over its own paged KV cache without adapters, or with each
request's draft adapter (lora_runner.spec_decode.draft_adapters) where ``draft_loras`` turns them on.

``load_draft_speculator`` is the engine's one call: it loads the draft (lora_runner.model.load_model) unless
start-up did (``load_draft``), checks that its vocabulary is the target's (one ValueError otherwise), and
builds the DraftModelSpeculator over a DraftModelRunner and the draft's own block pool. That pool has the
target's block count plus room for k more tokens per sequence (``draft_kv_blocks``: the draft writes up to
k - 1 proposals past the tokens the target holds); its blocks are the draft's size (its layers and KV heads).

Memory: start-up loads the draft before the KV budget is decided (before the target's memory profile on
CUDA, so its weights count as resident; off the RAM available on CPU), and every budget (the profiled one,
kv_cache_memory_bytes, per rank too, the CPU bound) is shared with the draft's cache block for block
(lora_runner.executor.draft_budget), so both fit the setting; the draft adapters' slots, allocated here,
after the budget, are taken off first (DraftMemory.lora_slot_bytes). Where the target captured CUDA graphs,
the draft's forwards are captured too, with its LoRA (DraftModelRunner.capture_graphs), on the target's graph
pool: the draft's graphs are smaller than the target's largest and never replay at once with one. Its eager
forwards (long catch-ups) run before the target's in each step, on activations far smaller than the profiled
target step's (a smaller model, at most max_num_batched_tokens + max_num_seqs tokens, max_num_seqs logits
rows): the allocator serves them from the memory that step freed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from lora_runner.core.block_manager import BlockManager
from lora_runner.model import ModelConfig, load_model
from lora_runner.model.forward_context import PLAIN_LORA
from lora_runner.model.layers import lora_base_weights
from lora_runner.model.vocab_lora import LMHeadLoRA
from lora_runner.spec_decode.config import SpeculativeConfig
from lora_runner.spec_decode.draft_adapters import DraftAdapters, DraftLoRASettings
from lora_runner.spec_decode.draft_model import DraftChunk, DraftModelSpeculator, check_same_vocab
from lora_runner.worker.batch_builder import BatchBuilder, BatchShape, SeqChunk
from lora_runner.worker.cuda_graphs import DecodeGraphPlan, DecodeGraphs, resident_dummy_loras
from lora_runner.worker.forward_context_builder import ForwardContextBuilder
from lora_runner.worker.kv_cache import allocate_kv_cache
from lora_runner.worker.lora_features import StepLoRAFeatures
from punica_kernels import HostTileTable, LoRAMeta

logger = logging.getLogger(__name__)

_MAX_LORA_SLICES = 3  # qkv has the most slices (as the target's runner)


@dataclass(frozen=True)
class LoadedDraft:
    """A draft model loaded ahead of its speculator (start-up, before the memory profile)."""

    model: torch.nn.Module
    config: ModelConfig
    model_dir: Path


def load_draft(config: SpeculativeConfig, *, dtype: torch.dtype, device: torch.device,
               local_files_only: bool | None = None) -> LoadedDraft:
    """Load the draft model `config` names (what load_model raises for one it cannot load)."""
    model, draft_config, draft_dir = load_model(config.model, dtype=dtype, device=device,
                                                local_files_only=local_files_only)
    return LoadedDraft(model, draft_config, Path(draft_dir))


def draft_kv_blocks(num_kv_blocks: int, *, max_num_seqs: int, k: int, block_size: int) -> int:
    """Blocks of the draft's KV pool for a target cache of num_kv_blocks: the same plus room for k more
    tokens for each of max_num_seqs sequences."""
    return num_kv_blocks + max_num_seqs * -(-k // block_size)


class DraftModelRunner:
    """The draft model's forward over DraftChunks (spec_decode.draft_model.DraftForward): its own KV
    cache and batch buffers, greedy tokens out. Without ``adapters`` every token runs on the base model;
    with them each chunk's tokens run with its ``lora_slot`` of the draft's LoRA slots (-1: none), its
    embed_tokens / lm_head LoRA included, as the target's runner does.

    After capture_graphs (CUDA), its forwards replay graphs: the one-token feed-back forwards decode graphs,
    a first forward whose rows catch up at most k + 1 tokens (the common one: the accepted drafts and the
    bonus token) a verify graph; longer catch-ups run eagerly. With adapters the graphs are captured with
    the draft's LoRA context as the target's are (cuda_graphs: the LoRA table is rebuilt per step in the
    step's upload, at the addresses the capture saw; slots are written in place), so rows of any draft
    adapters and base rows replay in one graph; base-only forwards replay the graphs without LoRA.

    Args:
        model, model_config: the draft decoder and its config.
        num_kv_blocks, block_size: its paged KV cache (the DraftModelSpeculator's block pool maps it).
        max_num_tokens, max_num_seqs, max_blocks_per_seq: the largest forward (buffer sizes).
        dtype, device: of the KV cache.
        adapters: the draft model's per-request adapters (their slots); None: no LoRA.
    """

    def __init__(self, model, model_config: ModelConfig, *, num_kv_blocks: int, block_size: int,
                 max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, dtype: torch.dtype,
                 device: torch.device, adapters: DraftAdapters | None = None) -> None:
        self.model = model
        self.adapters = adapters
        self.kv_cache = allocate_kv_cache(model_config, num_kv_blocks, block_size, dtype, device)
        self.graphs: DecodeGraphs | None = None  # set by capture_graphs
        self.num_eager_forwards = 0  # forwards run eagerly (a graph's shape or not)
        self.num_eager_fallbacks = 0  # of those, forwards of a graph's shape that no graph of their LoRA kind served
        sizes = dict(max_num_tokens=max_num_tokens, max_num_seqs=max_num_seqs,
                     max_blocks_per_seq=max_blocks_per_seq, block_size=block_size, device=device)
        self.lm_head_lora = None
        self.lora_features: StepLoRAFeatures | None = None
        if adapters is None:
            self.batch_builder = BatchBuilder(**sizes)
            self.forward_contexts = ForwardContextBuilder(self.kv_cache, lora_meta=None, lora_slots=None)
            return
        lora, vocab, rank = adapters.lora_slots, adapters.vocab_slots, adapters.lora_slots.max_rank
        meta = LoRAMeta(max_num_tokens, adapters.num_slots, device, max_rank=rank, max_slices=_MAX_LORA_SLICES)
        # one row per sampling chunk: the lm_head LoRA's meta over them
        self.lm_head_lora = (None if vocab is None else
                             LMHeadLoRA(vocab, max(max_num_seqs, max_num_tokens), adapters.num_slots, rank, device))
        self.lora_features = StepLoRAFeatures(lora, vocab)
        self.batch_builder = BatchBuilder(**sizes, lora_table=HostTileTable(meta), lm_head=self.lm_head_lora,
                                          lora_features=self.lora_features)
        self.forward_contexts = ForwardContextBuilder(self.kv_cache, meta, lora, None, vocab)

    def capture_graphs(self, num_speculative_tokens: int, make_graph=None, pool=None, progress: bool = False) -> None:
        """Capture decode and verify graphs (k + 1 tokens per sequence); make_graph and pool: see DecodeGraphs
        (default: CUDA graphs on a new pool; the engine passes the target's). With draft adapters the graphs
        with LoRA too, as the target's runner captures them: with one dummy adapter of the slots' rank resident
        in the draft's tier (removed afterwards), so a replay serves any mix of draft adapters and base rows."""
        builder = self.batch_builder
        with_lora = self.adapters is not None
        plan = DecodeGraphPlan(min(builder.max_num_seqs, builder.max_num_tokens), with_lora=with_lora,
                               full_lora=self.lora_features.most if with_lora else PLAIN_LORA,
                               verify_tokens_per_seq=num_speculative_tokens + 1, max_num_tokens=builder.max_num_tokens)
        graphs = DecodeGraphs(self.model, self.forward_contexts, builder, plan, make_graph, pool=pool)
        if not with_lora:
            graphs.capture(-1, progress=progress)
        else:
            with resident_dummy_loras(self.adapters.tier, 1, self.adapters.lora_slots.max_rank) as slots:
                graphs.capture(slots[0], progress=progress)
        self.graphs = graphs

    @torch.inference_mode()
    def __call__(self, chunks: Sequence[DraftChunk]) -> list[int]:
        """Write every chunk's K/V; the argmax token after each sampling chunk's last token, in order."""
        step = self.batch_builder.write([SeqChunk(c.token_ids, c.start, c.num_new_tokens, c.block_table,
                                                  lora_slot=c.lora_slot, sample=c.sample) for c in chunks])
        key = self.graphs.key_for(step) if self.graphs is not None else None
        if key is None:
            self._count_eager(step)
            batch = self.batch_builder.upload(step)
            hidden = self.model(batch.input_ids, batch.positions, self.forward_contexts.for_step(batch))  # [T, hidden]
        else:
            batch = self.batch_builder.upload(step, padded_seqs=key.num_seqs, tokens_per_seq=key.tokens_per_seq)
            hidden = self.graphs.replay(key, batch)  # [padded T, hidden]; sample_indices are real rows
        if not batch.num_samples:
            return []
        rows = hidden[batch.sample_indices]  # [S, hidden]
        lm_head = None if self.lm_head_lora is None else self.lm_head_lora.context(batch.lm_head_table)
        logits = self.model.compute_logits(rows) if lm_head is None else self.model.compute_logits(rows, lm_head)
        return logits.argmax(dim=-1).tolist()  # [S]

    def _count_eager(self, step: BatchShape) -> None:
        """Count an eager forward, and a fallback when its shape has a graph but its LoRA work has none (the
        graphs were captured without LoRA, or without an optional LoRA feature the step needs)."""
        self.num_eager_forwards += 1
        if self.graphs is not None and step.has_lora and self.graphs.key_for(
                dataclasses.replace(step, has_lora=False, lora_features=PLAIN_LORA)) is not None:
            self.num_eager_fallbacks += 1


def load_draft_speculator(config: SpeculativeConfig, *, target_config: ModelConfig, target_dir: str | Path,
                          vocab_of: Callable[[Path], Mapping[str, int] | None], max_model_len: int,
                          max_num_batched_tokens: int, max_num_seqs: int, num_kv_blocks: int, block_size: int,
                          dtype: torch.dtype, device: torch.device,
                          local_files_only: bool | None = None, loaded: LoadedDraft | None = None,
                          target_graphs: DecodeGraphs | None = None,
                          draft_loras: DraftLoRASettings | None = None) -> DraftModelSpeculator:
    """The "draft_model" DraftSource of an engine of these sizes (see the module docstring). ``vocab_of``:
    the token -> id map of a model dir's tokenizer (None: it has none; the engine's LazyTokenizer.vocab).
    ``loaded``: the draft start-up loaded (None: loaded here). ``target_graphs``: the target runner's decode
    graphs where it captured CUDA graphs: the draft's forwards are captured too, on their memory pool.
    ``draft_loras``: per-request draft adapters with these limits (None: none; a request naming one runs
    the draft without it). Raises ValueError when the draft's vocabulary is not the target's or its context
    is shorter than max_model_len, and what load_model raises for a draft it cannot load."""
    if loaded is None:
        loaded = load_draft(config, dtype=dtype, device=device, local_files_only=local_files_only)
    model, draft_config, draft_dir = loaded.model, loaded.config, loaded.model_dir
    check_same_vocab(config.model, target_config.vocab_size, draft_config.vocab_size,
                     vocab_of(Path(target_dir)), vocab_of(draft_dir))
    if draft_config.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config draft model {config.model!r} has a context of "
                         f"{draft_config.max_position_embeddings} tokens, shorter than max_model_len "
                         f"({max_model_len}): lower max_model_len or pick another draft")
    k = config.num_speculative_tokens
    blocks = BlockManager(draft_kv_blocks(num_kv_blocks, max_num_seqs=max_num_seqs, k=k, block_size=block_size),
                          block_size)
    max_num_tokens = max_num_batched_tokens + max_num_seqs  # slack for the proposing rows' last tokens
    adapters = (None if draft_loras is None else
                 DraftAdapters(draft_config.spec(), draft_loras, device=device, dtype=dtype,
                               base_weight=lora_base_weights(model)))
    runner = DraftModelRunner(model, draft_config, num_kv_blocks=blocks.num_blocks, block_size=block_size,
                              max_num_tokens=max_num_tokens, max_num_seqs=max_num_seqs,
                              max_blocks_per_seq=blocks.blocks_for(max_model_len), dtype=dtype, device=device,
                              adapters=adapters)
    if target_graphs is not None and target_graphs.pool is not None:
        runner.capture_graphs(k, pool=target_graphs.pool)
    logger.info("draft model %s (%d layers) proposes up to %d tokens per step; its KV cache: %d blocks%s%s",
                config.model, draft_config.num_layers, k, blocks.num_blocks,
                f"; {len(runner.graphs)} CUDA graphs" if runner.graphs is not None else "",
                "" if adapters is None else f"; {adapters.num_slots} draft adapter slots")
    return DraftModelSpeculator(config, runner, blocks, max_model_len=max_model_len, max_num_tokens=max_num_tokens,
                                adapters=adapters)

