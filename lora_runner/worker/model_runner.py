"""ModelRunner: one forward pass + sampling over the step's flat batch.

It owns the model, the paged KV cache, the persistent batch buffers and the step's punica LoRAMeta.
The meta is prepared once per step and read by every LoRA-aware layer; when no token of the step
uses an adapter, ctx.lora is None and the model skips the LoRA path entirely. Likewise ctx.prompt_adapter
is set only in steps with soft-prompt placeholders (prefill of prompt-adapter requests).
After capture_decode_graphs (CUDA), decode-only steps replay CUDA graphs (lora_runner.worker.cuda_graphs).
A step with draft tokens (speculative decoding, lora_runner.spec_decode) computes the logits at every
position of each speculating sequence (its own adapter's lm_head LoRA included) and verifies them with
the RejectionSampler; with k given to capture_decode_graphs, such a step (at most k + 1 tokens per
sequence) replays a verify graph, padded to k + 1 tokens per sequence; the logits run after it.

The engine's steps come as the scheduler's SchedulerOutput (execute): each running request keeps a
persistent row (lora_runner.worker.request_rows) that the output's diffs update, so a decode step writes
only what changed and the flat batch is gathered from the rows. Explicit SeqChunk lists (memory
profiling, tests) go through execute_chunks and are flattened as given.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from lora_runner.core.scheduler_output import GrammarOutput, SchedulerOutput
from lora_runner.distributed import SINGLE, TensorParallel
from lora_runner.model.vocab_lora import LMHeadLoRA, LMHeadLoRAContext
from lora_runner.sample.prompt_logprobs import MAX_PROMPT_LOGIT_ROWS, PromptSpan, score_spans
from lora_runner.sample.sampler import Sampler, SamplerOutput
from lora_runner.sample.sampling_state import SamplingBatch, SamplingState
from lora_runner.sampling_params import SamplingParams
from lora_runner.spec_decode.rejection_sampler import RejectionSampler
from lora_runner.worker.batch_builder import BatchBuilder, BatchInputs, SeqChunk, BatchShape
from lora_runner.worker.cuda_graphs import DecodeGraphKey, DecodeGraphPlan, DecodeGraphs, resident_dummy_loras
from lora_runner.worker.forward_context_builder import ForwardContextBuilder
from lora_runner.worker.kv_cache import allocate_kv_cache
from lora_runner.worker.lora_features import StepLoRAFeatures
from lora_runner.worker.request_rows import InputBatch
from punica_kernels import HostTileTable, LoRAMeta, invariant

logger = logging.getLogger(__name__)

_MAX_LORA_SLICES = 3  # qkv has the most slices


class ModelRunner:
    """Runs the model for scheduled chunks and samples the rows that reach their last token.

    Args:
        model: the decoder (``model(input_ids, positions, ctx)``, ``model.compute_logits``).
        model_config: its ModelConfig (sizes for the KV cache, vocab size).
        lora_slots: the adapters manager's LoRASlots (``.weights(layer, packed)``, ``.slot_ranks``).
        prompt_slots: the manager's PromptSlots (``.embeddings``); None when prompt adapters are off.
        vocab_slots: the manager's VocabLoRASlots (embed_tokens / lm_head LoRA); None: not served.
        num_kv_blocks, block_size: the paged KV cache to allocate.
        max_num_tokens, max_num_seqs, max_blocks_per_seq: largest step (buffer sizes).
        max_loras, max_lora_rank: LoRA slot count and padded rank.
        dtype, device: of the KV cache and buffers. seed: for requests without their own seed.
        tp: this process's tensor-parallel rank (the model, slots and vocab slots are then that rank's
            shards): its KV cache holds the rank's KV heads; everything else is as at one rank, and
            every rank samples the same tokens (the gathered logits and the seeds are the same).

    ``eos_token_ids`` (settable, empty at first) are the end ids the rows ban until min_tokens.
    """

    def __init__(self, model, model_config, lora_slots, *, num_kv_blocks: int, block_size: int,
                 max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, max_loras: int,
                 max_lora_rank: int, dtype: torch.dtype, device: torch.device, seed: int = 0,
                 prompt_slots=None, vocab_slots=None, tp: TensorParallel = SINGLE) -> None:
        self.model = model
        self.lora_slots = lora_slots
        self.prompt_slots = prompt_slots
        self.device = device
        self.tp = tp
        self.kv_cache = allocate_kv_cache(model_config, num_kv_blocks, block_size, dtype, device, tp)
        self.lora_meta = LoRAMeta(max_num_tokens, max_loras, device, max_rank=max_lora_rank,
                                  max_slices=_MAX_LORA_SLICES)
        # the meta's table is built on the host and rides in the step's one upload; each step runs
        # only the optional LoRA work (embedding LoRA, DoRA) its adapters have
        self.lora_features = StepLoRAFeatures(lora_slots, vocab_slots)
        # lm_head LoRA: a second meta over the sampled rows (one per sequence; a speculating one samples at each
        # of its positions: one row per token at most), its table in the upload too
        self.lm_head_lora = (None if vocab_slots is None else
                             LMHeadLoRA(vocab_slots, max(max_num_seqs, max_num_tokens), max_loras, max_lora_rank,
                                        device))
        self.batch_builder = BatchBuilder(max_num_tokens=max_num_tokens, max_num_seqs=max_num_seqs,
                                          max_blocks_per_seq=max_blocks_per_seq, block_size=block_size,
                                          device=device, lora_table=HostTileTable(self.lora_meta),
                                          lm_head=self.lm_head_lora, lora_features=self.lora_features)
        self.sampling_state = SamplingState(max_num_seqs=max_num_seqs, vocab_size=model_config.vocab_size)
        self.input_batch = InputBatch(max_num_seqs=max_num_seqs, max_blocks_per_seq=max_blocks_per_seq,
                                      block_size=block_size, sampling=self.sampling_state)
        self.forward_contexts = ForwardContextBuilder(self.kv_cache, self.lora_meta, lora_slots, prompt_slots,
                                                      vocab_slots)
        # and an lm_head LoRA over the prompt positions a step scores for prompt logprobs (a piece at a time)
        self.prompt_lm_head_lora = (None if vocab_slots is None else
                                    LMHeadLoRA(vocab_slots, MAX_PROMPT_LOGIT_ROWS, max_loras, max_lora_rank, device))
        self.sampler = Sampler(model_config.vocab_size, device, seed)
        self.rejection_sampler = RejectionSampler(self.sampler)  # steps with draft tokens (spec_decode)
        self.decode_graphs: DecodeGraphs | None = None  # set by capture_decode_graphs
        # EngineConfig.batch_invariant (set by make_runner): every forward and its logits run with
        # punica_kernels.invariant's per-thread switch on, so a row's bits never depend on the batch
        self.batch_invariant = False

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The model's end ids, banned with each request's stop ids until its min_tokens."""
        return self.sampling_state.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:
        """New end ids; the rows of running requests ban them from their next step on."""
        self.sampling_state.eos_token_ids = ids

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, grammar: GrammarOutput | None = None) -> SamplerOutput:
        """The engine's path: apply the scheduler's output to the persistent rows, forward the step
        and sample one token for each sequence that reaches its last token, with the settings its
        row got when it was placed (SchedulerOutput.new_requests carry the params and generator) and
        the step's structured-output mask (``grammar``; None: no row is constrained); the rows commit each
        sequence's sampled token list (InputBatch.commit). The adapter slots are the output's
        (``sched.lora_slots`` / ``sched.prompt_slots``)."""
        rows = self.input_batch.update(sched, sched.lora_slots, sched.prompt_slots)
        shape = self.batch_builder.write_rows(self.input_batch.token_ids, self.input_batch.block_tables,
                                              rows.rows, rows.starts, rows.lens, rows.seqs)
        sampling = self.input_batch.sampling_batch(rows)
        if grammar is not None:
            sampling.grammar_rows = np.asarray(grammar.rows, np.int64)
            sampling.grammar_bitmask = grammar.bitmask
        result = self._forward_and_sample(shape, sampling, self.input_batch.prompt_spans(rows),
                                          self.input_batch.draft_tokens(rows))
        # only after the step ran: a step that raised leaves the computed counts as they were
        self.input_batch.commit(rows, result.sampled_token_ids)
        return result

    @torch.inference_mode()
    def execute_chunks(self, chunks: Sequence[SeqChunk], params: Sequence[SamplingParams],
                       generators: Sequence[torch.Generator | None], histories=None, banned=None) -> SamplerOutput:
        """Forward explicit chunks (memory profiling, tests), flattened as given; the persistent rows
        are not touched, so the sampling settings come as explicit lists, one per sampling chunk in
        order (Sampler.make_batch): params, generators (None: the sampler's), histories (the
        (prompt, generated) token ids rows with penalties count; None: none given) and banned (ids a
        row may not sample; None: none)."""
        return self._forward_and_sample(self.batch_builder.write(chunks),
                                        self.sampler.make_batch(params, generators, histories, banned))

    def forget(self, request_ids: Iterable[str]) -> None:
        """Free the persistent rows of requests that left the running set (a step that runs nothing
        passes its SchedulerOutput.left_ids here; execute frees them otherwise)."""
        for request_id in request_ids:
            self.input_batch.free(request_id)

    def _forward_and_sample(self, shape: BatchShape, sampling: SamplingBatch, prompt_spans: Sequence[PromptSpan] = (),
                            drafts: list[list[int]] | None = None) -> SamplerOutput:
        """Forward the step and sample its sampling sequences; with `drafts` (each sampling sequence's
        draft tokens, speculative decoding) every draft is verified at its position (RejectionSampler)."""
        with invariant.active(self.batch_invariant):
            return self._forward_and_sample_in_mode(shape, sampling, prompt_spans, drafts)

    def _forward_and_sample_in_mode(self, shape: BatchShape, sampling: SamplingBatch, prompt_spans: Sequence[PromptSpan],
                                    drafts: list[list[int]] | None) -> SamplerOutput:
        """_forward_and_sample's body, run inside the runner's batch-invariant setting."""
        batch, key = self._upload(shape)
        if key is not None:
            hidden = self.decode_graphs.replay(key, batch)  # [padded T, hidden]; sample_indices are real rows
        else:
            hidden = self.model(batch.input_ids, batch.positions, self.forward_contexts.for_step(batch))  # [T, hidden]
        if not sampling.num_rows:
            result = SamplerOutput([], [])
        else:
            rows, lm_head = hidden[batch.sample_indices], self._lm_head_lora(batch)  # [S, hidden]
            logits = self.model.compute_logits(rows) if lm_head is None else self.model.compute_logits(rows, lm_head)
            result = self.sampler(logits, sampling) if drafts is None else self._verify(logits, sampling, drafts)
        if prompt_spans:
            result.prompt_logprobs = score_spans(hidden, prompt_spans, lambda flat, rows: self._prompt_logits(
                batch, flat, rows))
        return result

    def _verify(self, logits: torch.Tensor, sampling: SamplingBatch, drafts: list[list[int]]) -> SamplerOutput:
        """Verify the drafts from logits [N, V] at every position of the sampling sequences; `sampling`
        has one row per position (InputBatch.sampling_batch: penalties, bans and grammar masks of
        position j see the sequence's drafts before it)."""
        return self.rejection_sampler(logits, sampling, drafts)

    def _prompt_logits(self, batch: BatchInputs, flat: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] of the flat batch's rows `flat` [n] (hidden `rows` [n, hidden]), with their
        lm_head LoRA where they have one."""
        lm_head = None
        if self.prompt_lm_head_lora is not None and batch.has_lora:
            lm_head = self.prompt_lm_head_lora.context_for_rows(self.batch_builder.token_lora_slots.np, flat)
        return self.model.compute_logits(rows) if lm_head is None else self.model.compute_logits(rows, lm_head)

    def _lm_head_lora(self, batch: BatchInputs) -> LMHeadLoRAContext | None:
        """The lm_head LoRA over the sampled rows, None when no row can have one (the plain logits)."""
        return None if self.lm_head_lora is None else self.lm_head_lora.context(batch.lm_head_table)

    def _upload(self, step: BatchShape) -> tuple[BatchInputs, DecodeGraphKey | None]:
        """The step's device views and its decode graph (None: eager), after one upload: a graphed
        decode step is padded to its graph's size before it."""
        key = self.decode_graphs.key_for(step) if self.decode_graphs is not None else None
        if key is None:
            return self.batch_builder.upload(step), None
        return self.batch_builder.upload(step, padded_seqs=key.num_seqs, tokens_per_seq=key.tokens_per_seq), key

    def capture_decode_graphs(self, lora_tier, max_lora_rank: int, make_graph=None, progress: bool = True,
                              num_speculative_tokens: int = 0) -> None:
        """Capture decode graphs with a dummy warmup LoRA of max_lora_rank resident in lora_tier (the
        manager's LoRA tier), removed afterwards; with num_speculative_tokens k > 0 the verify graphs of
        k + 1 tokens per sequence too. make_graph: see DecodeGraphs (default: CUDA graphs)."""
        builder = self.batch_builder
        # a padded decode step has as many tokens as sequences: never more than the token buffers hold
        plan = DecodeGraphPlan(min(builder.max_num_seqs, builder.max_num_tokens), full_lora=self.lora_features.most,
                               verify_tokens_per_seq=num_speculative_tokens + 1 if num_speculative_tokens else 0,
                               max_num_tokens=builder.max_num_tokens)
        graphs = DecodeGraphs(self.model, self.forward_contexts, builder, plan, make_graph)
        # captured in the runner's batch-invariant setting: a graph replays the kernels it was captured with
        with resident_dummy_loras(lora_tier, 1, max_lora_rank) as slots, invariant.active(self.batch_invariant):
            graphs.capture(slots[0], progress=progress)
        self.decode_graphs = graphs

    def make_generator(self, seed: int) -> torch.Generator:
        """A per-request generator on the sampling device."""
        return torch.Generator(device=self.device).manual_seed(seed)
