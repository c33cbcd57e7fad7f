"""Persistent per-request state in fixed rows (vLLM v1's InputBatch): a step writes only what changed.

Each running request owns one row, from the step it is first scheduled until the scheduler says it
left the running set (finished, aborted or preempted). A row holds the request's token ids, how
many of them are computed, its KV block table and an interned key of each of its adapters. Per step
the rows read the scheduler's explicit data (lora_runner.core.scheduler_output.SchedulerOutput):

- rows of requests that left are freed (`finished_ids`, `preempted_ids`);
- each of `new_requests` gets a row written in full (tokens, computed count, table, adapters, and,
  when the rows keep them, its sampling settings in the same row of a
  lora_runner.sample.sampling_state.SamplingState);
- each of `continuing` appends the block ids its table gained, nothing else;
- after sampling, ``commit`` advances every row's computed count and appends each row's sampled
  tokens (a list per row: one from the Sampler, several from a multi-token step).

The step's flat batch is then gathered from the rows by ``BatchBuilder.write_rows`` and adapter
slots come from the step's ref -> slot maps through the interned keys, all with numpy ops.

The rows trust the scheduler and repair nothing: data that disagree with them (a new request that
has a row already, a continuing or scheduled one without a row, a computed count that is not the
row's, a table that does not cover the step's tokens, more rows than there are) is a bug and raises
RowsOutOfSyncError. tests/test_input_batch.py checks the rows against a from-scratch rebuild every step.

Speculative decoding (lora_runner.spec_decode) tells commit how many of a row's draft tokens were
accepted by the length of its list. A step that schedules the row's last token and d draft tokens
(SchedulerOutput.scheduled_spec_decode_tokens; update writes them in the row after its tokens, where
the step's chunk reads them, but does not count them in num_tokens) and accepts a of them samples
a + 1 tokens; commit then sets the computed count to start + len - (d - a) (the rejected drafts' KV
positions are written again later) and writes the a + 1 tokens over the drafts (ScheduledRows.drafts
holds d per sequence, 0 for the others). Scheduler.postprocess subtracts the same d - a from the
request's count, so the next output's num_computed_tokens agrees with the row; when they disagree
the rows raise RowsOutOfSyncError as for any other output.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from lora_runner.core.scheduler_output import ContinuingRequestData, NewRequestData, SchedulerOutput
from lora_runner.sample.prompt_logprobs import PromptSpan, prompt_spans
from lora_runner.sample.sampling_state import SamplingBatch, SamplingState
from lora_runner.worker.batch_builder import SeqArrays

logger = logging.getLogger(__name__)


class RowsOutOfSyncError(RuntimeError):
    """The scheduler's output disagrees with the runner's rows (a bug in whoever made the output:
    the rows do not guess what it meant)."""


@dataclass
class ScheduledRows:
    """The step's sequences as row indices: what write_rows gathers and commit advances ([B] each)."""

    rows: np.ndarray  # int64 row of each sequence
    starts: np.ndarray  # int64 first new position
    lens: np.ndarray  # int64 new tokens (draft tokens included)
    seqs: SeqArrays  # LoRA / prompt-adapter slots, sample flags, placeholder counts, draft counts

    @property
    def drafts(self) -> np.ndarray:
        """[B] int64 draft tokens of each sequence (speculative decoding; 0: none)."""
        drafts = self.seqs.num_drafts
        return np.zeros_like(self.lens) if drafts is None else drafts


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
        sampling: the rows' sampling settings (max_num_seqs rows), written and freed with the rows;
            None: the rows keep none (new requests may then come without params).
    """

    def __init__(self, *, max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
                 sampling: SamplingState | None = None) -> None:
        self.max_num_seqs = max_num_seqs
        self.sampling = sampling
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
        self.prompt_logprobs = np.full(max_num_seqs, -1, np.int64)  # [R] SamplingParams.prompt_logprobs, -1 = none
        self.num_prompt = np.zeros(max_num_seqs, np.int64)  # [R] user prompt tokens (after the placeholders)
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
    def update(self, sched: SchedulerOutput, lora_slot_of: Mapping[Hashable, int] | None = None,
               prompt_slot_of: Mapping[Hashable, int] | None = None) -> ScheduledRows:
        """Apply the scheduler's output (free the rows that left, write new rows, grow continuing
        tables) and return the step's rows in batch order. lora_slot_of / prompt_slot_of: adapter
        ref -> device slot this step (refs not in the step may be missing).
        Raises RowsOutOfSyncError when the output disagrees with the rows (see the module docstring)."""
        for request_id in sched.left_ids:
            self.free(request_id)
        for new in sched.new_requests:
            self._place(new)
        for continuing in sched.continuing:
            self._extend(continuing)
        num_seqs = len(sched.scheduled_ids)
        rows = np.fromiter((self._scheduled_row(request_id) for request_id in sched.scheduled_ids),
                           np.int64, num_seqs)  # [B]
        starts = self.num_computed[rows]  # [B] checked against the scheduler's counts above
        lens = np.asarray(sched.num_scheduled_tokens, np.int64)  # [B]
        ends = starts + lens  # [B]
        drafts = self._write_drafts(sched, rows)  # [B]
        self._check_cover(sched.scheduled_ids, rows, ends - drafts)
        seqs = SeqArrays(lora_slots=self._loras.slots(lora_slot_of or {})[self.lora_keys[rows]],
                         # the chunk reaches the row's last token (and its drafts after it)
                         sample=ends - drafts == self.num_tokens[rows],
                         num_virtual=self.num_virtual[rows],
                         prompt_slots=self._prompts.slots(prompt_slot_of or {})[self.prompt_keys[rows]],
                         num_drafts=drafts)
        return ScheduledRows(rows, starts, lens, seqs)

    def _write_drafts(self, sched: SchedulerOutput, rows: np.ndarray) -> np.ndarray:
        """Write each speculating sequence's draft tokens after its row's tokens (not counted in
        num_tokens); returns the draft count of every sequence [B]."""
        drafts = np.zeros(rows.shape[0], np.int64)  # [B]
        if not sched.scheduled_spec_decode_tokens:
            return drafts
        for i, request_id in enumerate(sched.scheduled_ids):
            tokens = sched.scheduled_spec_decode_tokens.get(request_id)
            if tokens:
                row, at = int(rows[i]), int(self.num_tokens[rows[i]])
                if at + len(tokens) > self.max_tokens:
                    raise RowsOutOfSyncError(f"request {request_id!r}: {len(tokens)} draft tokens after token {at} "
                                             f"exceed its row ({self.max_tokens} tokens)")
                self.token_ids[row, at:at + len(tokens)] = tokens
                drafts[i] = len(tokens)
        return drafts

    def draft_tokens(self, step: ScheduledRows) -> list[list[int]] | None:
        """The draft tokens of each sampling sequence in batch order ([] for one without), None when
        the step has none (update wrote them after each row's tokens)."""
        if not step.drafts.any():
            return None
        sampling = step.rows[step.seqs.sample]  # [S]
        return [self.token_ids[row, at:at + d].tolist() for row, at, d in
                zip(sampling.tolist(), self.num_tokens[sampling].tolist(), step.drafts[step.seqs.sample].tolist())]

    def commit(self, step: ScheduledRows, sampled: Sequence[Sequence[int]]) -> None:
        """The step ran: its tokens are computed, and each sampling sequence's sampled tokens
        (`sampled`: one list per sampling sequence in batch order, its tokens in order; the Sampler
        gives one, a failed row none) are appended to its row.

        Every token of a list is appended, also those after one that finishes the request (a stop
        string is found only when the engine detokenizes): such a request's row is freed with the
        next output's finished_ids, and no live row holds a token its request dropped. Tokens past
        the row's capacity are left out: the request ends at max_model_len before them.
        The computed count covers the step's scheduled tokens, less each speculating row's rejected
        drafts: a list of a + 1 tokens accepted a of its d drafts (a failed row's, none).
        """
        rows = step.rows
        sampling = rows[step.seqs.sample]  # [S]
        if sampling.shape[0] != len(sampled):
            raise ValueError(f"{len(sampled)} sampled token lists for {sampling.shape[0]} sampling sequences")
        counts = np.fromiter(map(len, sampled), np.int64, len(sampled))  # [S] k per row
        rejected = np.zeros_like(step.lens)  # [B]
        drafts = step.drafts[step.seqs.sample]  # [S]; a row without drafts keeps all its tokens uncomputed
        rejected[step.seqs.sample] = np.where(drafts > 0, drafts - np.maximum(counts - 1, 0), 0)
        self.num_computed[rows] = step.starts + step.lens - rejected
        tokens = np.fromiter(itertools.chain.from_iterable(sampled), np.int64, int(counts.sum()))  # [N]
        at = self.num_tokens[sampling]  # [S] where each row's first new token goes
        first = np.cumsum(counts) - counts  # [S] each row's first entry in `tokens`
        positions = np.repeat(at - first, counts) + np.arange(tokens.shape[0])  # [N]
        fits = positions < self.max_tokens  # [N]
        self.token_ids[np.repeat(sampling, counts)[fits], positions[fits]] = tokens[fits]
        self.num_tokens[sampling] = np.minimum(at + counts, self.max_tokens)

    def sampling_batch(self, step: ScheduledRows) -> SamplingBatch:
        """The sampling settings of the step's sampling sequences, in batch order (their min_tokens
        bans and penalty histories read from the rows' token ids, before commit appends to them).
        A speculating sequence with d drafts has d + 1 rows, one per verified position in order, each
        seeing the drafts before it (SamplingState.batch's offsets)."""
        assert self.sampling is not None, "these rows keep no sampling settings"
        sampling = step.rows[step.seqs.sample]  # [S]
        drafts = step.drafts[step.seqs.sample]  # [S]
        if not drafts.any():
            return self.sampling.batch(sampling, self.token_ids, self.num_tokens)
        counts = drafts + 1  # [S] positions per sequence
        offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)  # [N] 0..d per sequence
        return self.sampling.batch(np.repeat(sampling, counts), self.token_ids, self.num_tokens, offsets)

    def prompt_spans(self, step: ScheduledRows) -> list[PromptSpan]:
        """The prompt positions the step's chunks score for rows that ask for prompt logprobs
        (lora_runner.sample.prompt_logprobs); [] in steps without such rows."""
        return prompt_spans(self.request_ids, self.token_ids, step.rows, step.starts, step.lens,
                            self.prompt_logprobs, self.num_virtual, self.num_prompt)

    # ------------------------------------------------------------------ rows
    def free(self, request_id: str) -> None:
        """Forget `request_id`'s row (no-op when it has none: it left before it was ever scheduled)."""
        row = self._row_of.pop(request_id, None)
        if row is None:
            return
        lora_ref, prompt_ref = self._refs[row]
        self._loras.release(int(self.lora_keys[row]), lora_ref)
        self._prompts.release(int(self.prompt_keys[row]), prompt_ref)
        self.request_ids[row] = self._refs[row] = None
        if self.sampling is not None:
            self.sampling.remove_request(row)
        self._free_rows.append(row)

    def _place(self, new: NewRequestData) -> None:
        """Write a new request's row in full."""
        request_id, token_ids, block_ids = new.request_id, new.token_ids, new.block_ids
        if request_id in self._row_of:
            raise RowsOutOfSyncError(f"request {request_id!r} is new to the scheduler but has row "
                                     f"{self._row_of[request_id]} (was its preemption or finish not reported?)")
        if not self._free_rows:
            raise RowsOutOfSyncError(f"request {request_id!r} is new but all {self.max_num_seqs} rows are held "
                                     f"(more running requests than max_num_seqs?)")
        if len(token_ids) >= self.max_tokens:
            raise ValueError(f"request {request_id!r} holds {len(token_ids)} tokens, more than its "
                             f"KV blocks can ({self.max_tokens - 1})")
        width = self.block_tables.shape[1]
        if len(block_ids) > width:
            raise ValueError(f"request {request_id!r}: {len(block_ids)} KV blocks, at most {width} per sequence")
        if self.sampling is not None and new.params is None:
            raise RowsOutOfSyncError(f"request {request_id!r} is new but comes without its sampling params")
        row = self._free_rows.pop()
        self._row_of[request_id] = row
        self.request_ids[row] = request_id
        self.token_ids[row, :len(token_ids)] = token_ids
        self.num_tokens[row] = len(token_ids)
        self.num_computed[row] = new.num_computed_tokens
        self.block_tables[row] = 0
        self.block_tables[row, :len(block_ids)] = block_ids
        self.num_blocks[row] = len(block_ids)
        self.num_virtual[row] = new.num_virtual_tokens
        self.num_prompt[row] = new.num_prompt_tokens
        k = None if new.params is None else new.params.prompt_logprobs
        self.prompt_logprobs[row] = -1 if k is None else k
        self._refs[row] = (new.lora_ref, new.prompt_adapter_ref)
        self.lora_keys[row] = self._loras.acquire(new.lora_ref)
        self.prompt_keys[row] = self._prompts.acquire(new.prompt_adapter_ref)
        if self.sampling is not None:
            self.sampling.add_request(row, new.params, new.generator, num_prompt_tokens=new.num_prompt_tokens,
                                      prompt_start=new.num_virtual_tokens)

    def _extend(self, continuing: ContinuingRequestData) -> None:
        """Check a continuing request against its row and append the blocks its table gained."""
        request_id, new_blocks = continuing.request_id, continuing.new_block_ids
        row = self._row_of.get(request_id)
        if row is None:
            raise RowsOutOfSyncError(f"request {request_id!r} continues but has no row (was it sent as new?)")
        computed = int(self.num_computed[row])
        if continuing.num_computed_tokens != computed:
            raise RowsOutOfSyncError(f"request {request_id!r} continues from token {continuing.num_computed_tokens} "
                                     f"but its row computed {computed}")
        held, width = int(self.num_blocks[row]), self.block_tables.shape[1]
        if held + len(new_blocks) > width:
            raise ValueError(f"request {request_id!r}: {held + len(new_blocks)} KV blocks, at most {width} "
                             f"per sequence")
        self.block_tables[row, held:held + len(new_blocks)] = new_blocks
        self.num_blocks[row] = held + len(new_blocks)

    def _scheduled_row(self, request_id: str) -> int:
        row = self._row_of.get(request_id)
        if row is None:
            raise RowsOutOfSyncError(f"request {request_id!r} is scheduled but is neither new nor continuing")
        return row

    def _check_cover(self, request_ids: Sequence[str], rows: np.ndarray, ends: np.ndarray) -> None:
        """Every row holds the tokens its chunk computes and blocks that cover them."""
        bad = (ends > self.num_tokens[rows]) | (self.num_blocks[rows] * self.block_size < ends)  # [B]
        if bad.any():
            i = int(bad.argmax())
            row = int(rows[i])
            raise RowsOutOfSyncError(
                f"request {request_ids[i]!r}: the step computes up to token {int(ends[i])} but its row holds "
                f"{int(self.num_tokens[row])} tokens in {int(self.num_blocks[row])} blocks of {self.block_size}")
