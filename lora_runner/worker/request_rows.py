"""Persistent per-request state in fixed rows (vLLM v1's InputBatch): a step writes only what changed.

Each running request owns one row, from the step it is first scheduled until the engine says it
left the running set (finished, aborted or preempted). A row holds the request's token ids, how
many of them are computed, its KV block table and an interned key of each of its adapters. Per step:

- rows of requests that left are freed (their ids come from the scheduler, ``StepUpdate.freed``);
- a request seen for the first time gets a row written in full (tokens, table, adapters);
- a continuing request writes nothing, except the blocks its table gained (found by comparing the
  blocks the step needs with the row's count, a vector op; only those rows are looked up);
- after sampling, ``commit`` advances every row's computed count and appends the sampled tokens.

The step's flat batch is then gathered from the rows by ``BatchBuilder.write_rows`` and adapter
slots come from the step's ref -> slot maps through the interned keys, all with numpy ops.

The rows mirror the scheduler's requests exactly as long as every request that leaves the running
set is reported (Scheduler.remove and preemption report it). As a safety net, a continuing row
whose counts disagree with the scheduled chunk (start != computed tokens, or fewer tokens than the
chunk covers) is written again from its request, and when rows run out, rows of requests not in
the step are dropped (written again when next scheduled). tests/test_input_batch.py checks the
rows against a from-scratch rebuild every step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from lora_runner.worker.batch_builder import SeqArrays

logger = logging.getLogger(__name__)


class ScheduledChunk(Protocol):
    """What the rows read of one scheduled chunk (lora_runner.core.scheduler.ScheduledRequest)."""

    request: Any  # .request_id, .token_ids, .lora_ref, .prompt_adapter_ref, .num_virtual_tokens
    start: int
    num_new_tokens: int
    samples: bool


@dataclass
class StepUpdate:
    """One step as the scheduler made it, for the runner's persistent rows.

    scheduled: the step's chunks in batch order (sampled rows in this order too).
    freed: ids of requests that left the running set since the previous update (finished, aborted,
        preempted); their rows are freed before the step's requests are placed.
    table_of: request id -> its current KV block table (BlockManager.table).
    lora_slot_of / prompt_slot_of: adapter ref -> device slot for this step (refs not in the step
        may be missing).
    """

    scheduled: Sequence[ScheduledChunk]
    freed: Iterable[str] = ()
    table_of: Callable[[str], Sequence[int]] = lambda request_id: ()
    lora_slot_of: Mapping[Hashable, int] = field(default_factory=dict)
    prompt_slot_of: Mapping[Hashable, int] = field(default_factory=dict)


@dataclass
class StepRows:
    """The step's sequences as rows: what write_rows gathers and commit advances ([B] each)."""

    rows: np.ndarray  # int64 row of each sequence
    starts: np.ndarray  # int64 first new position
    lens: np.ndarray  # int64 new tokens
    seqs: SeqArrays  # LoRA / prompt-adapter slots, sample flags, placeholder counts


class _Interned:
    """Adapter refs -> small int keys (0 = none) with reference counts, so a step maps every row's
    adapter to its slot by indexing one array."""

    def __init__(self, capacity: int) -> None:
        self._key_of: dict[Hashable, int] = {}
        self._refs = np.zeros(capacity + 1, np.int64)  # rows holding each key
        self._free = list(range(capacity, 0, -1))  # keys 1..capacity, smallest popped first
        self._slots = np.full(capacity + 1, -1, np.int64)  # scratch: key -> slot of this step

    def acquire(self, ref: Hashable | None) -> int:
        """The key of `ref` (0 for None), counted once more."""
        if ref is None:
            return 0
        key = self._key_of.get(ref)
        if key is None:
            key = self._key_of[ref] = self._free.pop()
        self._refs[key] += 1
        return key

    def release(self, key: int, ref: Hashable | None) -> None:
        """One row less holds `key` (of `ref`); the key is reused once none does."""
        if key == 0:
            return
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._key_of[ref]
            self._free.append(key)

    def slots(self, slot_of: Mapping[Hashable, int]) -> np.ndarray:
        """key -> device slot for this step (-1 for key 0 and for refs without a slot)."""
        slots = self._slots
        slots.fill(-1)
        for ref, slot in slot_of.items():
            key = self._key_of.get(ref)
            if key is not None:
                slots[key] = slot
        return slots


class InputBatch:
    """The runner's persistent request rows (see the module docstring).

    Args:
        max_num_seqs: rows (running requests at most).
        max_blocks_per_seq: block table width.
        block_size: KV-cache block size; a row holds max_blocks_per_seq * block_size + 1 token ids
            (the KV capacity plus the token sampled after the last position).
    """

    def __init__(self, *, max_num_seqs: int, max_blocks_per_seq: int, block_size: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.max_tokens = max_blocks_per_seq * block_size + 1
        self.token_ids = np.zeros((max_num_seqs, self.max_tokens), np.int32)  # [R, L] (vocab ids fit)
        self.num_tokens = np.zeros(max_num_seqs, np.int64)  # [R] token ids a row holds
        self.num_computed = np.zeros(max_num_seqs, np.int64)  # [R] of them in the KV cache
        self.block_tables = np.zeros((max_num_seqs, max_blocks_per_seq), np.int32)  # [R, W], unused 0
        self.num_blocks = np.zeros(max_num_seqs, np.int64)  # [R]
        self.num_virtual = np.zeros(max_num_seqs, np.int64)  # [R] soft-prompt placeholders
        self.lora_keys = np.zeros(max_num_seqs, np.int64)  # [R] interned LoRA ref, 0 = none
        self.prompt_keys = np.zeros(max_num_seqs, np.int64)  # [R] interned prompt-adapter ref, 0 = none
        self._loras = _Interned(max_num_seqs)
        self._prompts = _Interned(max_num_seqs)
        self.request_ids: list[str | None] = [None] * max_num_seqs  # row -> request id
        self._refs: list[tuple[Hashable, Hashable] | None] = [None] * max_num_seqs  # row -> (lora, prompt) ref
        self._row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))  # smallest popped first

    @property
    def num_rows(self) -> int:
        """Rows in use."""
        return len(self._row_of)

    def row_of(self, request_id: str) -> int | None:
        """The row of `request_id`, None when it has none."""
        return self._row_of.get(request_id)

    # ------------------------------------------------------------------ per step
    def update(self, step: StepUpdate) -> StepRows:
        """Free the rows of step.freed, place the step's requests (new rows written in full,
        continuing rows only grow their tables) and return the step's rows in batch order."""
        for request_id in step.freed:
            self.free(request_id)
        scheduled = step.scheduled
        num_seqs = len(scheduled)
        row_of = self._row_of
        rows = np.fromiter((row_of.get(s.request.request_id, -1) for s in scheduled), np.int64, num_seqs)  # [B]
        starts = np.fromiter((s.start for s in scheduled), np.int64, num_seqs)  # [B]
        lens = np.fromiter((s.num_new_tokens for s in scheduled), np.int64, num_seqs)  # [B]
        ends = starts + lens
        known = rows >= 0
        safe = np.where(known, rows, 0)
        stale = known & ((self.num_computed[safe] != starts) | (self.num_tokens[safe] < ends))
        for i in np.flatnonzero(~known | stale).tolist():  # new requests (and rows to write again)
            rows[i] = self._place(scheduled[i], step, rows)
        self._grow_tables(scheduled, step.table_of, rows, ends)
        seqs = SeqArrays(lora_slots=self._loras.slots(step.lora_slot_of)[self.lora_keys[rows]],
                         sample=np.fromiter((s.samples for s in scheduled), bool, num_seqs),
                         num_virtual=self.num_virtual[rows],
                         prompt_slots=self._prompts.slots(step.prompt_slot_of)[self.prompt_keys[rows]])
        return StepRows(rows, starts, lens, seqs)

    def commit(self, step: StepRows, sampled: Sequence[int]) -> None:
        """The step ran: its tokens are computed and `sampled` (one token per sampling sequence,
        in batch order) are appended to their rows."""
        rows = step.rows
        self.num_computed[rows] = step.starts + step.lens
        sampling = rows[step.seqs.sample]
        if sampling.shape[0] != len(sampled):
            raise ValueError(f"{len(sampled)} sampled tokens for {sampling.shape[0]} sampling sequences")
        at = self.num_tokens[sampling]
        self.token_ids[sampling, at] = sampled
        self.num_tokens[sampling] = at + 1

    # ------------------------------------------------------------------ rows
    def free(self, request_id: str) -> None:
        """Forget `request_id`'s row (no-op when it has none)."""
        row = self._row_of.pop(request_id, None)
        if row is None:
            return
        lora_ref, prompt_ref = self._refs[row]
        self._loras.release(int(self.lora_keys[row]), lora_ref)
        self._prompts.release(int(self.prompt_keys[row]), prompt_ref)
        self.request_ids[row] = self._refs[row] = None
        self._free_rows.append(row)

    def _place(self, chunk: ScheduledChunk, step: StepUpdate, rows: np.ndarray) -> int:
        """Write `chunk`'s request into a row (its own, when it is written again) and return it."""
        request = chunk.request
        self.free(request.request_id)
        if not self._free_rows:
            self._drop_unscheduled(step, rows)
        row = self._free_rows.pop()
        token_ids = request.token_ids
        if len(token_ids) >= self.max_tokens:
            self._free_rows.append(row)
            raise ValueError(f"request {request.request_id!r} holds {len(token_ids)} tokens, more than its "
                             f"KV blocks can ({self.max_tokens - 1})")
        self._row_of[request.request_id] = row
        self.request_ids[row] = request.request_id
        self.token_ids[row, :len(token_ids)] = token_ids
        self.num_tokens[row] = len(token_ids)
        self.num_computed[row] = chunk.start
        self.block_tables[row] = 0
        self.num_blocks[row] = 0
        self.num_virtual[row] = request.num_virtual_tokens
        self._refs[row] = (request.lora_ref, request.prompt_adapter_ref)
        self.lora_keys[row] = self._loras.acquire(request.lora_ref)
        self.prompt_keys[row] = self._prompts.acquire(request.prompt_adapter_ref)
        return row

    def _drop_unscheduled(self, step: StepUpdate, rows: np.ndarray) -> None:
        """Out of rows: free those of requests not in this step (written again when next scheduled)."""
        keep = {self.request_ids[r] for r in rows.tolist() if r >= 0}
        dropped = [request_id for request_id in self._row_of if request_id not in keep]
        logger.debug("input batch full: dropping the rows of %d unscheduled requests", len(dropped))
        for request_id in dropped:
            self.free(request_id)
        if not self._free_rows:
            raise RuntimeError(f"more than {self.max_num_seqs} sequences scheduled in one step")

    def _grow_tables(self, scheduled: Sequence[ScheduledChunk], table_of: Callable[[str], Sequence[int]],
                     rows: np.ndarray, ends: np.ndarray) -> None:
        """Append the blocks the step's rows gained; only rows that need more blocks are looked up."""
        needed = -(-ends // self.block_size)  # [B] blocks covering each sequence after the step
        for i in np.flatnonzero(needed > self.num_blocks[rows]).tolist():
            row = int(rows[i])
            table = table_of(scheduled[i].request.request_id)
            held, width = int(self.num_blocks[row]), self.block_tables.shape[1]
            if len(table) < needed[i] or len(table) > width:
                raise ValueError(f"request {scheduled[i].request.request_id!r}: {len(table)} KV blocks for "
                                 f"{int(ends[i])} tokens (at most {width} per sequence)")
            self.block_tables[row, held:len(table)] = table[held:]
            self.num_blocks[row] = len(table)
