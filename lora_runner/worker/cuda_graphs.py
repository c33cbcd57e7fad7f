"""CUDA graphs for decode steps: capture sizes, padding into the persistent buffers, capture, replay.

A decode-only step (every sequence adds one token, no soft-prompt placeholder) of B sequences
replays the graph of key (smallest capture size >= B, whether any token uses an adapter, and the
optional LoRA work its adapters need: none, or the plan's full set of embedding LoRA and DoRA's
column scales; lora_runner.model.forward_context.LoRAFeatures). A graph captured without that work
is never replayed for a step that needs it, so skipping it stays exact.
The runner's per-step path is ``key_for`` -> ``BatchBuilder.upload(step, padded_seqs=key.num_seqs)``
(which fills rows B..size-1 of the persistent batch buffers with padding sequences: KV slot -1,
context length 1 over block 0) -> ``replay``; the graph's context comes from the runner's
``ForwardContextBuilder``, as an eager step's does. Prefill, mixed steps and steps beyond the
largest size run eagerly.

Speculative decoding's verify step (lora_runner.spec_decode: a sequence computes its last token and
its k drafts) has its own graphs when the runner is given k: key tokens_per_seq = k + 1, one graph per
capture size B (up to max_num_tokens // (k + 1)) covering every step of at most B sequences with 1..k+1
tokens each, whatever the mix (drafts, no drafts, a short prefill chunk), padded to B * (k + 1) tokens
(BatchBuilder.upload with tokens_per_seq). The alternative, a graph per (B, q) for q = 1..k+1 keyed by
the step's longest row, would cost k + 1 times the capture time and pool memory and still pad every
row to that q; vLLM's "uniform decode" graphs take the same fixed k + 1. It is exact because nothing in
the graph depends on where the tokens sit: the prefill attention kernel reads query_start_loc and
seq_lens at run time (its grid depends on q alone), padding tokens belong to no sequence (zeroed) and
write no KV slot, padding sequences have none, and the LoRA table is rebuilt per step over the padded
tokens. The price is the padding rows' MLP and LoRA work when some rows verify fewer than k drafts.
The logits (and the rejection sampler) run after the graph over the step's real sample rows.

No context-length key: the Triton paged attention (lora_runner/model/paged_attention.py) reads
``seq_lens`` and the block tables at run time, so one graph serves every context length. Its
metadata's host int ``max_seq_len`` is the table's capacity (max_blocks_per_seq * block_size),
which only the torch attention path reads (CPU emulation with RerunGraph): it then gathers the whole
table, correct but slow. On CUDA with the torch attention forced (LORA_RUNNER_ATTENTION=torch) graphs
are off.

Base-only steps (no token with an adapter) replay graphs captured without the LoRA context, so
they run no LoRA kernel at all; steps with adapters replay graphs captured with one dummy adapter,
plain ones (2 launches per packed module, nothing for the embedding) unless a sequence's adapter has
an embedding LoRA or DoRA.

Everything a graph reads lives in fixed buffers: the batch builder's device buffers, the LoRA
meta's table (built on the host from the padded token slots and sent in the step's one upload, at the
addresses the capture saw; ``prepare_lora`` outside the graph only points the meta at it),
the LoRA slot weights (written in place, so adapters loaded after capture are served) and the KV
cache. The kernels' grid depends on the padded token count only (punica_kernels.meta), so graphs
captured with one dummy adapter replay any mix of adapters (design.md section 4, SGLang #28371).
Decode graphs carry no prompt-adapter context: decode tokens are never soft-prompt placeholders.

Mixture-of-experts layers (lora_runner.model.moe) are captured through their fused Triton kernels
(lora_runner.model.moe_fused): the (token, expert, slot) alignment is built on the device with sizes
set by the padded token count alone (punica_kernels.moe_align), so a graph replays for any routing;
the experts' weights and LoRA slots are read as stacked views taken in the warm-up forward (no copy,
nothing allocated for them under capture), and the expert LoRA reads the slots' ranks in place
(``LoRASlots.expert_ranks``), so adapters written after capture, with or without expert LoRA, are
served. The experts' torch loop (the CPU's) reads the routing on the host and refuses capture.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from lora_runner.model.attention import BACKEND_ENV
from lora_runner.model.forward_context import ALL_LORA_FEATURES, PLAIN_LORA, LoRAFeatures
from lora_runner.worker.batch_builder import BatchBuilder, BatchInputs, BatchShape
from lora_runner.worker.forward_context_builder import ForwardContextBuilder

logger = logging.getLogger(__name__)

CAPTURE_SIZE_STEP = 8  # capture sizes: 1, 2, 4, then every 8
WARMUP_LORA_NAME = "__cuda_graph_warmup__"


def cuda_graphs_available(device: torch.device) -> bool:
    """True on CUDA with the Triton LoRA kernels importable: the torch LoRA path syncs with the host
    and cannot be captured (a warning says so). False when the torch attention is forced: graphs
    no longer bucket contexts, and it would gather every sequence's whole block table."""
    if torch.device(device).type != "cuda":
        return False
    if os.environ.get(BACKEND_ENV, "auto") == "torch":
        logger.warning("CUDA graphs disabled: %s=torch forces the torch attention", BACKEND_ENV)
        return False
    import punica_kernels

    if not punica_kernels.triton_available():
        logger.warning("CUDA graphs disabled: Triton is not importable, and the torch LoRA path cannot "
                       "be captured (%s)", punica_kernels.triton_import_error())
        return False
    return True


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Padded decode batch sizes, ascending: 1, 2, 4, 8, 16, 24, ... and max_num_seqs itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += range(CAPTURE_SIZE_STEP, max_num_seqs + 1, CAPTURE_SIZE_STEP)
    if sizes[-1:] != [max_num_seqs]:
        sizes.append(max_num_seqs)  # never pad past the buffers (sized max_num_seqs)
    return sizes


@dataclass(frozen=True, order=True)
class DecodeGraphKey:
    """What a decode graph was captured for."""

    num_seqs: int  # padded batch size: a capture size
    has_lora: bool  # captured with the LoRA context (a dummy adapter); False: no LoRA kernel in the graph
    lora_features: LoRAFeatures = PLAIN_LORA  # the optional LoRA work it runs (PLAIN_LORA without LoRA)
    tokens_per_seq: int = 1  # 1: a decode graph; k + 1: a verify graph (up to that many tokens per sequence)

    @property
    def num_tokens(self) -> int:
        """Tokens the graph computes: num_seqs * tokens_per_seq."""
        return self.num_seqs * self.tokens_per_seq


class DecodeGraphPlan:
    """Which decode graphs exist and which one a step uses; pure logic, no device.

    Args:
        max_num_seqs: largest decode batch (the batch buffers' size).
        full_lora: the optional LoRA work of the second LoRA graph of each size (a step needing any
            optional work replays it); default all of it.
        verify_tokens_per_seq: k + 1 to capture verify graphs too (speculative decoding, k drafts per
            sequence); 0: none.
        max_num_tokens: the token buffers' size (bounds the verify graphs' B * (k + 1)); needed with
            verify_tokens_per_seq.
        with_lora: False: graphs without LoRA only (a model served without adapters: a speculative
            draft model without draft adapters, lora_runner.worker.draft_runner); a step with LoRA tokens
            then runs eagerly.
    """

    def __init__(self, max_num_seqs: int, full_lora: LoRAFeatures = ALL_LORA_FEATURES,
                 verify_tokens_per_seq: int = 0, max_num_tokens: int | None = None, with_lora: bool = True) -> None:
        self.sizes = capture_sizes(max_num_seqs)
        self.full_lora = full_lora
        variants = [(False, PLAIN_LORA)]
        if with_lora:
            variants += [(True, PLAIN_LORA)] + ([(True, full_lora)] if full_lora != PLAIN_LORA else [])
        self._variants = variants
        self.with_lora = with_lora
        self.verify_tokens_per_seq = verify_tokens_per_seq if verify_tokens_per_seq > 1 else 0
        self.verify_sizes: list[int] = []
        if self.verify_tokens_per_seq:
            if max_num_tokens is None:
                raise ValueError("verify graphs need max_num_tokens (the token buffers' size)")
            largest = min(max_num_seqs, max_num_tokens // self.verify_tokens_per_seq)
            self.verify_sizes = capture_sizes(largest) if largest >= 1 else []

    def keys(self) -> list[DecodeGraphKey]:
        """Every key, most tokens first (the capture order: later, smaller graphs reuse its memory)."""
        keys = [DecodeGraphKey(s, lora, features) for s in self.sizes for lora, features in self._variants]
        keys += [DecodeGraphKey(s, lora, features, self.verify_tokens_per_seq)
                 for s in self.verify_sizes for lora, features in self._variants]
        return sorted(keys, key=lambda key: (key.num_tokens, key), reverse=True)

    def key_for(self, batch: BatchShape | BatchInputs) -> DecodeGraphKey | None:
        """The graph for `batch`, or None when it must run eagerly (prefill or mixed step with a row
        longer than the verify graphs' k + 1, soft-prompt placeholders, more sequences than the largest
        capture size, optional LoRA work no graph has). A decode-only step replays a decode graph; any
        other step of at most k + 1 tokens per sequence a verify graph."""
        if batch.has_prompt_adapter:
            return None
        if batch.max_query_len == 1 and batch.num_tokens == batch.num_seqs:
            tokens_per_seq, sizes = 1, self.sizes
        elif 1 <= batch.max_query_len <= self.verify_tokens_per_seq:
            tokens_per_seq, sizes = self.verify_tokens_per_seq, self.verify_sizes
        else:
            return None
        size = _round_up(sizes, batch.num_seqs)
        if size is None:
            return None
        if not batch.has_lora:
            return DecodeGraphKey(size, False, PLAIN_LORA, tokens_per_seq)
        if not self.with_lora:
            return None
        need = batch.lora_features
        if need == PLAIN_LORA:
            return DecodeGraphKey(size, True, PLAIN_LORA, tokens_per_seq)
        covered = (not need.embedding or self.full_lora.embedding) and (not need.dora or self.full_lora.dora)
        return DecodeGraphKey(size, True, self.full_lora, tokens_per_seq) if covered else None


def _round_up(values: list[int], x: int) -> int | None:
    """Smallest of the ascending `values` >= x, None if there is none."""
    i = bisect.bisect_left(values, x)
    return values[i] if i < len(values) else None


# ----------------------------------------------------------------------------- graphs


class Graph(Protocol):
    """One captured computation: capture(fn) runs fn once under capture and returns its output
    tensor; replay() recomputes that same tensor from the current contents of fn's inputs."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor: ...

    def replay(self) -> None: ...


class CudaGraph:
    """A torch.cuda.CUDAGraph captured into a memory pool shared by all decode graphs."""

    def __init__(self, pool) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Record fn's kernels; its output lives in the pool and is rewritten by every replay."""
        # thread_local: adapter-loading threads may call CUDA (pinned copies) while we capture
        with torch.cuda.graph(self.graph, pool=self.pool, capture_error_mode="thread_local"):
            output = fn()
        return output

    def replay(self) -> None:
        """Launch the recorded kernels."""
        self.graph.replay()


class RerunGraph:
    """CPU stand-in for CudaGraph (tests, smoke runs): replay reruns fn and writes its result into
    the tensor capture returned, so anything fn reads that is not a persistent buffer shows up."""

    def __init__(self) -> None:
        self.fn: Callable[[], torch.Tensor] | None = None
        self.output: torch.Tensor | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run fn once and remember it."""
        self.fn, self.output = fn, fn()
        return self.output

    def replay(self) -> None:
        """Rerun fn into the captured output tensor."""
        self.output.copy_(self.fn())


@dataclass
class _Captured:
    graph: Graph
    batch: BatchInputs  # the static input views the graph reads
    hidden: torch.Tensor  # [num_tokens, hidden] static output


class DecodeGraphs:
    """Captured decode graphs of one model runner, and their replay.

    Args:
        model: the decoder (``model(input_ids, positions, ctx) -> [T, hidden]``).
        contexts: the runner's ForwardContextBuilder (KV cache, LoRA meta built with max_rank /
            max_slices so capture allocates nothing, LoRA slots).
        builder: the runner's BatchBuilder (its device buffers are the graphs' inputs; it pads steps).
        plan: which keys to capture.
        make_graph: () -> Graph; default a CudaGraph on one shared memory pool (CUDA only).
        pool: that memory pool (default: a new one); graphs never replayed at once may share one (the
            draft model's graphs use the target's: each step's graph outputs are read before the next replay).
    """

    def __init__(self, model, contexts: ForwardContextBuilder, builder: BatchBuilder, plan: DecodeGraphPlan,
                 make_graph: Callable[[], Graph] | None = None, pool=None) -> None:
        self.device = contexts.kv_cache.device
        self.pool = None  # the CUDA graphs' memory pool (None: emulated graphs)
        if make_graph is None:
            if self.device.type != "cuda":
                raise ValueError("CUDA graphs need a CUDA device; pass make_graph=RerunGraph to emulate")
            self.pool = pool = torch.cuda.graph_pool_handle() if pool is None else pool
            make_graph = lambda: CudaGraph(pool)  # noqa: E731
        self.model, self.contexts, self.builder, self.plan = model, contexts, builder, plan
        self._make_graph = make_graph
        self._graphs: dict[DecodeGraphKey, _Captured] = {}
        self.num_replays = 0  # decode steps served by a graph
        self.num_verify_replays = 0  # of those, steps served by a verify graph (tokens_per_seq > 1)

    def __len__(self) -> int:
        return len(self._graphs)

    @torch.inference_mode()
    def capture(self, lora_slot: int, progress: bool = True) -> None:
        """Capture every key of the plan, largest first; in graphs with LoRA every capture token is on
        `lora_slot` (the resident warmup adapter, so the LoRA kernels run for real in the warm-up pass)."""
        from tqdm.auto import tqdm

        on_cuda = self.device.type == "cuda"
        free_before = torch.cuda.mem_get_info(self.device)[0] if on_cuda else 0
        start = time.perf_counter()
        keys = self.plan.keys()
        for key in tqdm(keys, desc="capture decode graphs", disable=not progress):
            self._capture_one(key, lora_slot)
        if on_cuda:
            torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0] if on_cuda else 0
        verify = (f"; verify graphs of {self.plan.verify_tokens_per_seq} tokens per sequence for batch sizes "
                  f"{self.plan.verify_sizes}" if self.plan.verify_sizes else "")
        logger.info("captured %d decode graphs (batch sizes %s; without LoRA, plain LoRA, LoRA with %s%s) in %.1f s, "
                    "using %.0f MiB", len(keys), self.plan.sizes, self.plan.full_lora, verify,
                    time.perf_counter() - start, used / 2**20)

    def _capture_one(self, key: DecodeGraphKey, lora_slot: int) -> None:
        # every capture sequence is padding, on the warmup adapter in graphs with LoRA
        batch = self.builder.padding_batch(key.num_seqs, lora_slot if key.has_lora else -1, key.lora_features,
                                           key.tokens_per_seq)
        self.contexts.prepare_lora(batch)
        forward = self._forward_fn(batch)
        forward()  # warm-up outside capture: compiles kernels, caches slice offsets
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        graph = self._make_graph()
        self._graphs[key] = _Captured(graph, batch, graph.capture(forward))

    def _forward_fn(self, batch: BatchInputs) -> Callable[[], torch.Tensor]:
        ctx = self.contexts.build(batch)
        return lambda: self.model(batch.input_ids, batch.positions, ctx)  # [num_tokens, hidden]

    def key_for(self, step: BatchShape | BatchInputs) -> DecodeGraphKey | None:
        """The captured graph for `step`, or None when it must run eagerly."""
        key = self.plan.key_for(step)
        return key if key in self._graphs else None

    @torch.inference_mode()
    def replay(self, key: DecodeGraphKey, padded: BatchInputs) -> torch.Tensor:
        """Replay graph `key` on `padded` (the builder's upload of the step padded to key.num_seqs, with
        key.tokens_per_seq): hidden [key.num_tokens, hidden], valid until the next replay."""
        captured = self._graphs[key]
        # the packed upload puts a size's rows where its capture found them (block tables: the last
        # field the graph reads, so its offset depends on every field before it); a moved view goes unread
        assert padded.block_tables.data_ptr() == captured.batch.block_tables.data_ptr(), "padded step off the graph"
        if key.has_lora:  # the LoRA table follows block_tables
            assert padded.lora_table is not None and all(
                a.data_ptr() == b.data_ptr()
                for a, b in zip(padded.lora_table.arrays, captured.batch.lora_table.arrays)), "LoRA table off the graph"
        self.contexts.prepare_lora(padded)  # outside the graph
        captured.graph.replay()
        self.num_replays += 1
        self.num_verify_replays += key.tokens_per_seq > 1
        return captured.hidden

    @torch.inference_mode()
    def run_eager(self, batch: BatchInputs) -> torch.Tensor:
        """The captured computation of `batch`'s key run eagerly on the same padded inputs (same
        kernels, so it equals replay bit for bit): hidden [T, hidden]. For tests and checks."""
        key = self.plan.key_for(batch)
        if key is None:
            raise ValueError("this step has no decode graph (prefill, mixed, or too large)")
        padded = self.builder.upload(batch, padded_seqs=key.num_seqs, tokens_per_seq=key.tokens_per_seq)
        self.contexts.prepare_lora(padded)
        padded = dataclasses.replace(padded, lora_features=key.lora_features)  # the graph's optional work
        return self._forward_fn(padded)()[:batch.num_tokens]  # [T, hidden]


@contextmanager
def resident_dummy_loras(tier, count: int, rank: int, prefix: str = WARMUP_LORA_NAME):
    """Make `count` dummy LoRAs of `rank` resident in device slots; yields their slots and removes
    them (freeing the slots) on exit. `tier` is the adapter manager's LoRA tier; the dummies are held
    meanwhile, so the CPU cache's byte bound neither evicts nor refuses them (adapters.cpu_cache)."""
    names = [f"{prefix}{i}" for i in range(count)]
    refs = []
    try:
        for name in names:
            refs.append(tier.add_dummy(name, rank, hold=True))
        yield tier.activate(refs)
    finally:
        for ref in refs:
            tier.remove(ref.name)
            tier.release(ref)
