"""CUDA graphs for decode steps: capture sizes, padding into the persistent buffers, capture, replay.

A decode-only step (every sequence adds one token, no soft-prompt placeholder) of B sequences
replays the graph of key (smallest capture size >= B, whether any token uses an adapter). Padding
sequences fill rows B..size-1 of the persistent batch buffers: token 0 at position 0, LoRA slot -1,
KV slot -1 (``write_kv`` skips it), context length 1 over block 0 (read, never written). Prefill,
mixed steps and steps beyond the largest size run eagerly.

No context-length key: the Triton paged attention (lora_runner/model/paged_attention.py) reads
``seq_lens`` and the block tables at run time, so one graph serves every context length. Its
metadata's host int ``max_seq_len`` is the table's capacity (max_blocks_per_seq * block_size),
which only the torch attention path reads (CPU emulation with RerunGraph): it then gathers the whole
table, correct but slow. On CUDA with the torch attention forced (LORA_RUNNER_ATTENTION=torch) graphs
are off.

Base-only steps (no token with an adapter) replay graphs captured without the LoRA context, so
they run no LoRA kernel at all; steps with adapters replay graphs captured with one dummy adapter.

Everything a graph reads lives in fixed buffers: the batch builder's device buffers, the LoRA
meta's buffers (``meta.prepare`` runs outside the graph each step, with the padded token slots),
the LoRA slot weights (written in place, so adapters loaded after capture are served) and the KV
cache. The kernels' grid depends on the padded token count only (punica_kernels.meta), so graphs
captured with one dummy adapter replay any mix of adapters (design.md section 4, SGLang #28371).
Decode graphs carry no prompt-adapter context: decode tokens are never soft-prompt placeholders.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from lora_runner.model.attention import BACKEND_ENV
from lora_runner.batch import BatchBuilder, BatchInputs
from lora_runner.model.forward_context import AttentionMetadata, ForwardContext, LoRAContext

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

    num_seqs: int  # padded batch size (== tokens): a capture size
    has_lora: bool  # captured with the LoRA context (a dummy adapter); False: no LoRA kernel in the graph


class DecodeGraphPlan:
    """Which decode graphs exist and which one a step uses; pure logic, no device.

    Args:
        max_num_seqs: largest decode batch (the batch buffers' size).
    """

    def __init__(self, max_num_seqs: int) -> None:
        self.sizes = capture_sizes(max_num_seqs)

    def keys(self) -> list[DecodeGraphKey]:
        """Every key, largest first (the capture order: later, smaller graphs reuse its memory)."""
        return sorted((DecodeGraphKey(s, lora) for s in self.sizes for lora in (True, False)), reverse=True)

    def key_for(self, batch: BatchInputs) -> DecodeGraphKey | None:
        """The graph for `batch`, or None when it must run eagerly (prefill or mixed step, soft-prompt
        placeholders, more sequences than the largest capture size)."""
        decode_only = batch.max_query_len == 1 and batch.num_tokens == batch.num_seqs
        if not decode_only or batch.has_prompt_adapter:
            return None
        size = _round_up(self.sizes, batch.num_seqs)
        return None if size is None else DecodeGraphKey(size, batch.has_lora)


def _round_up(values: list[int], x: int) -> int | None:
    """Smallest of the ascending `values` >= x, None if there is none."""
    i = bisect.bisect_left(values, x)
    return values[i] if i < len(values) else None


def write_decode_padding(builder: BatchBuilder, num_seqs: int, padded_seqs: int) -> None:
    """Write padding sequences num_seqs..padded_seqs-1 of a decode step into the CPU buffers.

    One token each (token 0, position 0, LoRA slot -1, KV slot -1: not written), context length 1
    over block 0, which is only read. Rows [:num_seqs] (the real step) are left as build() wrote them.
    """
    capacity = min(builder.max_num_seqs, builder.max_num_tokens)  # one token per sequence
    if not 0 <= num_seqs <= padded_seqs <= capacity:
        raise ValueError(f"cannot pad {num_seqs} sequences to {padded_seqs} (buffers hold {capacity})")
    rows = slice(num_seqs, padded_seqs)  # decode: token i belongs to sequence i
    builder.input_ids.np[rows] = 0
    builder.positions.np[rows] = 0
    builder.slot_mapping.np[rows] = -1
    builder.token_lora_slots.np[rows] = -1
    builder.query_start_loc.np[num_seqs + 1:padded_seqs + 1] = np.arange(num_seqs + 1, padded_seqs + 1)
    builder.seq_lens.np[rows] = 1
    builder.block_tables.np[rows] = 0


def padded_decode_batch(builder: BatchBuilder, batch: BatchInputs, key: DecodeGraphKey) -> BatchInputs:
    """Pad the decode step `batch` (just built by `builder`) to key.num_seqs sequences and copy the
    padded rows to the device buffers; returns views of the first key.num_seqs rows.

    sample_indices stay the real step's; max_seq_len becomes the block tables' capacity.
    """
    write_decode_padding(builder, batch.num_seqs, key.num_seqs)
    return _device_views(builder, key, batch.sample_indices)


def _device_views(builder: BatchBuilder, key: DecodeGraphKey, sample_indices: torch.Tensor) -> BatchInputs:
    """Copy rows [:key.num_seqs] of the decode buffers to the device; their views as a batch."""
    n = key.num_seqs
    batch = BatchInputs(
        input_ids=builder.input_ids.copy_to_device(n), positions=builder.positions.copy_to_device(n),
        slot_mapping=builder.slot_mapping.copy_to_device(n),
        token_lora_slots=builder.token_lora_slots.copy_to_device(n),
        query_start_loc=builder.query_start_loc.copy_to_device(n + 1),
        seq_lens=builder.seq_lens.copy_to_device(n), block_tables=builder.block_tables.copy_to_device(n),
        sample_indices=sample_indices, max_query_len=1, max_seq_len=builder.max_blocks_per_seq * builder.block_size,
        has_lora=key.has_lora)
    builder.record_copies()  # the next build() waits for these copies before rewriting the CPU rows
    return batch


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
    hidden: torch.Tensor  # [num_seqs, hidden] static output


class DecodeGraphs:
    """Captured decode graphs of one model runner, and their replay.

    Args:
        model: the decoder (``model(input_ids, positions, ctx) -> [T, hidden]``).
        kv_cache: the runner's KV cache tensor.
        builder: the runner's BatchBuilder (its device buffers are the graphs' inputs).
        lora_meta: the runner's LoRAMeta (built with max_rank / max_slices: no allocation in capture).
        lora_slots: LoRASlots (``weights``, ``slot_ranks``).
        plan: which keys to capture.
        make_graph: () -> Graph; default a CudaGraph on one shared memory pool (CUDA only).
    """

    def __init__(self, model, kv_cache: torch.Tensor, builder: BatchBuilder, lora_meta, lora_slots,
                 plan: DecodeGraphPlan, make_graph: Callable[[], Graph] | None = None) -> None:
        if make_graph is None:
            if kv_cache.device.type != "cuda":
                raise ValueError("CUDA graphs need a CUDA device; pass make_graph=RerunGraph to emulate")
            pool = torch.cuda.graph_pool_handle()
            make_graph = lambda: CudaGraph(pool)  # noqa: E731
        self.model, self.kv_cache, self.builder = model, kv_cache, builder
        self.lora_meta, self.lora_slots, self.plan = lora_meta, lora_slots, plan
        self._make_graph = make_graph
        self._graphs: dict[DecodeGraphKey, _Captured] = {}
        self.num_replays = 0  # decode steps served by a graph

    def __len__(self) -> int:
        return len(self._graphs)

    @torch.inference_mode()
    def capture(self, lora_slot: int, progress: bool = True) -> None:
        """Capture every key of the plan, largest first; in graphs with LoRA every capture token is on
        `lora_slot` (the resident warmup adapter, so the LoRA kernels run for real in the warm-up pass)."""
        from tqdm.auto import tqdm

        on_cuda = self.kv_cache.device.type == "cuda"
        free_before = torch.cuda.mem_get_info(self.kv_cache.device)[0] if on_cuda else 0
        start = time.perf_counter()
        keys = self.plan.keys()
        for key in tqdm(keys, desc="capture decode graphs", disable=not progress):
            self._capture_one(key, lora_slot)
        if on_cuda:
            torch.cuda.synchronize(self.kv_cache.device)
        used = free_before - torch.cuda.mem_get_info(self.kv_cache.device)[0] if on_cuda else 0
        logger.info("captured %d decode graphs (batch sizes %s, with and without LoRA) in %.1f s, using %.0f MiB",
                    len(keys), self.plan.sizes, time.perf_counter() - start, used / 2**20)

    def _capture_one(self, key: DecodeGraphKey, lora_slot: int) -> None:
        write_decode_padding(self.builder, 0, key.num_seqs)  # every capture sequence is padding...
        if key.has_lora:
            self.builder.token_lora_slots.np[:key.num_seqs] = lora_slot  # ...on the warmup adapter
        batch = _device_views(self.builder, key, self.builder.sample_indices.device[:0])
        self._prepare_lora(batch)
        forward = self._forward_fn(batch)
        forward()  # warm-up outside capture: compiles kernels, caches slice offsets
        if self.kv_cache.device.type == "cuda":
            torch.cuda.synchronize(self.kv_cache.device)
        graph = self._make_graph()
        self._graphs[key] = _Captured(graph, batch, graph.capture(forward))

    def _forward_fn(self, batch: BatchInputs) -> Callable[[], torch.Tensor]:
        attn = AttentionMetadata(slot_mapping=batch.slot_mapping, query_start_loc=batch.query_start_loc,
                                 seq_lens=batch.seq_lens, block_tables=batch.block_tables,
                                 max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len)
        lora = LoRAContext(meta=self.lora_meta, slots=self.lora_slots) if batch.has_lora else None
        ctx = ForwardContext(attn=attn, kv_cache=self.kv_cache, lora=lora)
        return lambda: self.model(batch.input_ids, batch.positions, ctx)  # [num_seqs, hidden]

    def _prepare_lora(self, padded: BatchInputs) -> None:
        """Prepare the LoRA meta for a padded step of a graph with LoRA (outside the graph)."""
        if padded.has_lora:
            self.lora_meta.prepare(padded.token_lora_slots, self.lora_slots.slot_ranks)

    @torch.inference_mode()
    def run(self, batch: BatchInputs) -> torch.Tensor | None:
        """Replay the graph for the step `batch` (just built by the builder): hidden [T, hidden]
        of its real tokens, valid until the next replay. None when the step must run eagerly."""
        key = self.plan.key_for(batch)
        captured = self._graphs.get(key) if key is not None else None
        if captured is None:
            return None
        padded = padded_decode_batch(self.builder, batch, key)
        self._prepare_lora(padded)
        captured.graph.replay()
        self.num_replays += 1
        return captured.hidden[:batch.num_tokens]  # [T, hidden]

    @torch.inference_mode()
    def run_eager(self, batch: BatchInputs) -> torch.Tensor:
        """The captured computation of `batch`'s key run eagerly on the same padded inputs (same
        kernels, so it equals replay bit for bit): hidden [T, hidden]. For tests and checks."""
        key = self.plan.key_for(batch)
        if key is None:
            raise ValueError("this step has no decode graph (prefill, mixed, or too large)")
        padded = padded_decode_batch(self.builder, batch, key)
        self._prepare_lora(padded)
        return self._forward_fn(padded)()[:batch.num_tokens]  # [T, hidden]


@contextmanager
def resident_dummy_loras(tier, count: int, rank: int, prefix: str = WARMUP_LORA_NAME):
    """Make `count` dummy LoRAs of `rank` resident in device slots; yields their slots and removes
    them (freeing the slots) on exit. `tier` is the adapter manager's LoRA tier."""
    names = [f"{prefix}{i}" for i in range(count)]
    refs = []
    try:
        for name in names:
            refs.append(tier.add_dummy(name, rank))
        yield tier.activate(refs)
    finally:
        for ref in refs:
            tier.remove(ref.name)
