"""The mapping builder: scheduled chunks -> the flat token batch the model reads, in persistent buffers.

A step is written in two phases. write() flattens the chunks into host arrays allocated once at
their maximum size (rows [:n] per step) and returns the step's shape; write_rows() does the same
from the runner's persistent request rows (lora_runner.worker.request_rows) by gathers alone, the
engine's path. upload() hands the rows to the device. On CPU the device views are the host arrays
themselves: nothing is copied. On CUDA, upload() packs the step's rows into one pinned staging
buffer (two of them alternate) and queues one non-blocking copy (lora_runner/worker/staging.py): a
step that samples nothing never waits for the device, and the host arrays are never a copy's
source, so write() never waits either.

Decode graphs run fixed-size steps: upload(step, padded_seqs=p) first fills rows past a decode
step with padding sequences, so the one copy carries a whole captured size (a verify graph's step,
``tokens_per_seq`` q > 1: padded to p sequences and p * q tokens); padding_batch is such a step made
of padding only (capture). The packed layout depends only on the row counts, so every
replay of one graph sees the views its capture saw.

LoRA: with a HostTileTable (punica_kernels.host_tiles) given, upload() of a step with LoRA tokens also
builds the LoRA meta's segment / tile table from the host token slots and sends it in the same copy
(BatchInputs.lora_table; the runner's meta reads those views, so a step issues no device op to prepare
it). Its arrays follow the graph-read fields and have sizes that depend on T alone. With an lm_head LoRA
given (lora_runner.model.vocab_lora.LMHeadLoRA), the table over the sampled rows whose adapter has an
lm_head LoRA rides in the same copy too, last (BatchInputs.lm_head_table: read after the forward).

Prompt adapters: a sequence's first `num_virtual_tokens` positions are its soft prompt's
placeholders. Each such token gets its prompt-adapter slot and virtual index (its position) in
`token_prompt_slots` / `token_prompt_positions`; every other token gets -1, and the model's
embedding step overwrites only the mapped tokens. Only prefill chunks can contain them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lora_runner.model.forward_context import ALL_LORA_FEATURES, LoRAFeatures
from lora_runner.model.vocab_lora import LMHeadLoRA
from lora_runner.worker.staging import StagedUpload, packed_bytes
from punica_kernels import HostTileTable, TileTable


@dataclass
class SeqChunk:
    """One sequence's part of an explicit batch (BatchBuilder.write: memory profile, tests, the rows'
    oracle), self-contained: tokens token_ids[start:start+num_new_tokens] with their table and slots.
    The engine's steps do not use it: the scheduler's ScheduledRequest names a live request and the
    runner's rows hold the rest (lora_runner.worker.request_rows)."""

    token_ids: list[int]  # the sequence's whole token list (prompt + generated); not copied
    start: int  # position of the first new token == tokens already in the KV cache
    num_new_tokens: int
    block_table: list[int]  # KV blocks covering positions [0, start + num_new_tokens)
    lora_slot: int = -1  # device LoRA slot of the sequence's adapter, -1 = base model
    sample: bool = True  # sample a token after this chunk's last token
    prompt_adapter_slot: int = -1  # device slot of its soft prompt; needed while start < num_virtual_tokens
    num_virtual_tokens: int = 0  # positions [0, num_virtual_tokens) are soft-prompt placeholders


@dataclass
class BatchInputs:
    """Device views of the step's batch: T tokens of B sequences, S of which sample."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64 KV slot per token
    token_lora_slots: torch.Tensor  # [T] int32, -1 = no adapter
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32 context length after the step
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, unused entries 0
    sample_indices: torch.Tensor  # [S] int64 rows of the flat batch whose logits are sampled (a speculating
    #                               sequence has its draft count + 1, in position order; any other one)
    max_query_len: int
    max_seq_len: int
    has_lora: bool  # any token with a LoRA slot >= 0
    # None when no token of the step is a soft-prompt placeholder (decode-only steps, for instance)
    token_prompt_slots: torch.Tensor | None = None  # [T] int64 prompt-adapter slot, -1 = ordinary token
    token_prompt_positions: torch.Tensor | None = None  # [T] int64 index in the soft prompt, -1 = ordinary
    # the LoRA meta's table built on the host; None: no LoRA token or no table
    lora_table: TileTable | None = None
    # the lm_head LoRA's table over the sampled rows; None: no sampled row's adapter has an lm_head LoRA
    lm_head_table: TileTable | None = None
    lora_features: LoRAFeatures = ALL_LORA_FEATURES  # the optional LoRA work some token of the step needs

    @property
    def has_prompt_adapter(self) -> bool:
        """True when some token of the step is a soft-prompt placeholder."""
        return self.token_prompt_slots is not None

    @property
    def num_tokens(self) -> int:
        """T."""
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        """B."""
        return self.seq_lens.shape[0]

    @property
    def num_samples(self) -> int:
        """S."""
        return self.sample_indices.shape[0]


@dataclass(frozen=True)
class BatchShape:
    """What write() put in the host arrays: the step's sizes, before any upload."""

    num_tokens: int  # T
    num_seqs: int  # B
    num_samples: int  # S
    max_query_len: int
    max_seq_len: int
    has_lora: bool  # any token with a LoRA slot >= 0
    has_prompt_adapter: bool  # any soft-prompt placeholder token
    lora_features: LoRAFeatures = ALL_LORA_FEATURES  # optional LoRA work some token needs (all: not known)


@dataclass
class SeqArrays:
    """Per-sequence values of one step, [B] each, in step order."""

    lora_slots: np.ndarray  # int: device LoRA slot, -1 = base model
    sample: np.ndarray  # bool: sample a token after the chunk's last token
    num_virtual: np.ndarray  # int: soft-prompt placeholders at the front of the sequence
    prompt_slots: np.ndarray  # int: prompt-adapter slot (needed while a placeholder is computed), -1 = none
    # int: draft tokens at the end of the chunk (speculative decoding): a sampling sequence samples
    # at its last num_drafts + 1 positions; None: none anywhere
    num_drafts: np.ndarray | None = None


class _Buffer:
    """A host tensor (plain, never a copy's source) with a numpy view."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.cpu = torch.zeros(shape, dtype=dtype)
        self.np = self.cpu.numpy()


class BatchBuilder:
    """Writes scheduled chunks into persistent buffers sized for the largest step.

    Args:
        max_num_tokens, max_num_seqs, max_blocks_per_seq: the largest step (buffer sizes).
        block_size: KV-cache block size (token position p lives in block table[p // block_size]).
        device: where the model reads the batch.
        staged: upload through packed staging buffers; default: on any device but the CPU (True on
            CPU runs the device path's packing and single copy, for tests).
        lora_table: the runner's LoRA meta's HostTileTable: steps with LoRA tokens carry the meta's table
            (BatchInputs.lora_table). None: no table (steps with LoRA tokens cannot run the model's LoRA).
        lm_head: the runner's LMHeadLoRA over the sampled rows (``row_slots``, ``table``): steps whose
            sampled rows have an lm_head LoRA carry its table (BatchInputs.lm_head_table); None: none.
        lora_features: per-sequence LoRA slots [B] -> the LoRAFeatures they need (BatchShape.lora_features);
            None: every step with LoRA is assumed to need all of them.
    """

    def __init__(self, *, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                 block_size: int, device: torch.device | str, staged: bool | None = None,
                 lora_table: HostTileTable | None = None, lm_head: LMHeadLoRA | None = None,
                 lora_features: Callable[[np.ndarray], LoRAFeatures] | None = None) -> None:
        device = torch.device(device)
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.input_ids = _Buffer((max_num_tokens,), torch.int64)
        self.positions = _Buffer((max_num_tokens,), torch.int64)
        self.slot_mapping = _Buffer((max_num_tokens,), torch.int64)
        self.token_lora_slots = _Buffer((max_num_tokens,), torch.int32)
        self.token_prompt_slots = _Buffer((max_num_tokens,), torch.int64)
        self.token_prompt_positions = _Buffer((max_num_tokens,), torch.int64)
        self.query_start_loc = _Buffer((max_num_seqs + 1,), torch.int32)
        self.seq_lens = _Buffer((max_num_seqs,), torch.int32)
        self.block_tables = _Buffer((max_num_seqs, max_blocks_per_seq), torch.int32)
        # a speculating sequence samples at each of its positions: at most one row per token
        self.max_num_samples = max(max_num_seqs, max_num_tokens)
        self.sample_indices = _Buffer((self.max_num_samples,), torch.int64)
        self._arange = np.arange(max(max_num_tokens, max_blocks_per_seq * block_size), dtype=np.int64)
        # staged: the host arrays travel through StagedUpload (always on a device; on CPU for tests)
        staged = device.type != "cpu" if staged is None else staged
        self.lora_table, self.lm_head, self.lora_features = lora_table, lm_head, lora_features
        largest = [buf.np[:n].nbytes for buf, n in self._upload_rows(max_num_tokens, max_num_seqs, self.max_num_samples,
                                                                      with_prompt=True)]
        for table in (lora_table, None if lm_head is None else lm_head.table):
            if table is not None:
                largest += [array.nbytes for array in table.build(np.full(table.max_num_tokens, -1, np.int64))]
        self.staging = StagedUpload(packed_bytes(largest), device) if staged else None

    def build(self, chunks: Sequence[SeqChunk]) -> BatchInputs:
        """Flatten `chunks` (in order) into the buffers and return this step's device views."""
        return self.upload(self.write(chunks))

    def write(self, chunks: Sequence[SeqChunk]) -> BatchShape:
        """Flatten `chunks` (in order) into the host arrays; returns the step's shape (see upload).

        Vectorized over the step: one pass over the chunks gathers their scalars, numpy does the rest.
        """
        num_seqs = len(chunks)
        starts = np.fromiter((c.start for c in chunks), np.int64, num_seqs)  # [B]
        lens = np.fromiter((c.num_new_tokens for c in chunks), np.int64, num_seqs)  # [B]
        num_tokens = self._check_size(num_seqs, lens)
        ends = starts + lens  # [B] context length after the step
        num_blocks = np.fromiter((len(c.block_table) for c in chunks), np.int64, num_seqs)  # [B]
        self._check_fit(chunks, lens, ends, num_blocks)
        token_seq, positions = self._write_positions(starts, lens, num_tokens)
        self.input_ids.np[:num_tokens] = np.fromiter(
            itertools.chain.from_iterable(c.token_ids[c.start:c.start + c.num_new_tokens] for c in chunks),
            np.int64, num_tokens)
        tables = self.block_tables.np
        tables[:num_seqs] = 0
        table_start = np.cumsum(num_blocks) - num_blocks  # [B] offset of each table in the flat list
        table_rows = np.repeat(self._arange[:num_seqs], num_blocks)  # [sum(num_blocks)]
        table_cols = np.arange(table_rows.shape[0]) - np.repeat(table_start, num_blocks)
        tables[table_rows, table_cols] = np.fromiter(itertools.chain.from_iterable(c.block_table for c in chunks),
                                                     np.int64, table_rows.shape[0])
        return self._write_rest(token_seq, positions, lens, ends, SeqArrays(
            lora_slots=np.fromiter((c.lora_slot for c in chunks), np.int64, num_seqs),
            sample=np.fromiter((c.sample for c in chunks), bool, num_seqs),
            num_virtual=np.fromiter((c.num_virtual_tokens for c in chunks), np.int64, num_seqs),
            prompt_slots=np.fromiter((c.prompt_adapter_slot for c in chunks), np.int64, num_seqs)))

    def write_rows(self, token_ids: np.ndarray, block_tables: np.ndarray, rows: np.ndarray, starts: np.ndarray,
                   lens: np.ndarray, seqs: SeqArrays) -> BatchShape:
        """write() for sequences kept in persistent rows (lora_runner.worker.request_rows): sequence i of the
        step is row rows[i] of token_ids [R, L] (its tokens) and block_tables [R, max_blocks_per_seq]
        (its table, unused entries 0), computing tokens starts[i]..starts[i]+lens[i]-1. Only gathers:
        no Python loop over the sequences. The caller guarantees the rows hold what they cover."""
        num_seqs = rows.shape[0]
        num_tokens = self._check_size(num_seqs, lens)
        token_seq, positions = self._write_positions(starts, lens, num_tokens)
        self.input_ids.np[:num_tokens] = token_ids[rows[token_seq], positions]
        self.block_tables.np[:num_seqs] = block_tables[rows]
        return self._write_rest(token_seq, positions, lens, starts + lens, seqs)

    def _check_size(self, num_seqs: int, lens: np.ndarray) -> int:
        """The step's token count; ValueError when the step does not fit the buffers."""
        num_tokens = int(lens.sum())
        if not 0 < num_seqs <= self.max_num_seqs or num_tokens > self.max_num_tokens:
            raise ValueError(f"batch of {num_seqs} sequences / {num_tokens} tokens exceeds the "
                             f"buffers ({self.max_num_seqs} / {self.max_num_tokens})")
        return num_tokens

    def _write_positions(self, starts: np.ndarray, lens: np.ndarray, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """Write query_start_loc and positions; returns (sequence of each token [T], positions [T])."""
        num_seqs = starts.shape[0]
        qsl = self.query_start_loc.np
        qsl[0] = 0
        np.cumsum(lens, out=qsl[1:num_seqs + 1])
        token_seq = np.repeat(self._arange[:num_seqs], lens)  # [T] sequence of each token
        positions = self._arange[:num_tokens] - np.repeat(qsl[:num_seqs] - starts, lens)  # [T]
        self.positions.np[:num_tokens] = positions
        return token_seq, positions

    def _write_rest(self, token_seq: np.ndarray, positions: np.ndarray, lens: np.ndarray, ends: np.ndarray,
                    seqs: SeqArrays) -> BatchShape:
        """After input ids, positions and block tables: KV slots, LoRA slots, context lengths,
        sample rows and prompt-adapter rows."""
        num_seqs, num_tokens = lens.shape[0], positions.shape[0]
        bs = self.block_size
        self.slot_mapping.np[:num_tokens] = self.block_tables.np[token_seq, positions // bs] * bs + positions % bs
        self.token_lora_slots.np[:num_tokens] = np.repeat(seqs.lora_slots, lens)
        self.seq_lens.np[:num_seqs] = ends
        num_samples = self._write_sample_indices(seqs)
        num_virtual = self._map_virtual_tokens(positions, lens, seqs)
        has_lora = bool((seqs.lora_slots >= 0).any())
        features = (self.lora_features(seqs.lora_slots) if has_lora and self.lora_features is not None
                    else ALL_LORA_FEATURES)
        return BatchShape(num_tokens=num_tokens, num_seqs=num_seqs, num_samples=num_samples,
                         max_query_len=int(lens.max()), max_seq_len=int(ends.max()),
                         has_lora=has_lora, has_prompt_adapter=num_virtual > 0, lora_features=features)

    def _write_sample_indices(self, seqs: SeqArrays) -> int:
        """Write the rows to sample: each sampling sequence's last token, and with draft tokens its
        last num_drafts + 1 tokens (the logits that verify them, then the bonus token's); returns S."""
        num_seqs = seqs.sample.shape[0]
        last = (self.query_start_loc.np[1:num_seqs + 1] - 1)[seqs.sample]  # [S'] of the sampling sequences
        if seqs.num_drafts is None or not seqs.num_drafts.any():
            self.sample_indices.np[:last.shape[0]] = last
            return int(last.shape[0])
        counts = seqs.num_drafts[seqs.sample] + 1  # [S'] positions each sampling sequence samples at
        num_samples = int(counts.sum())
        first = np.cumsum(counts) - counts  # [S'] each sequence's first entry
        self.sample_indices.np[:num_samples] = (np.repeat(last - counts + 1 - first, counts)
                                                + self._arange[:num_samples])
        return num_samples

    def _check_fit(self, chunks: Sequence[SeqChunk], lens: np.ndarray, ends: np.ndarray,
                   num_blocks: np.ndarray) -> None:
        """Raise for the first chunk whose tokens or blocks do not fit (before anything is written)."""
        num_ids = np.fromiter((len(c.token_ids) for c in chunks), np.int64, len(chunks))
        bad = ((lens < 1) | (ends > num_ids) | (num_blocks * self.block_size < ends)
               | (num_blocks > self.max_blocks_per_seq))
        if bad.any():
            i = int(bad.argmax())
            chunk = chunks[i]
            raise ValueError(f"chunk {i}: {chunk.num_new_tokens} tokens from {chunk.start} do not fit its "
                             f"{len(chunk.token_ids)} tokens / {len(chunk.block_table)} blocks")

    def upload(self, step: BatchShape | BatchInputs, padded_seqs: int | None = None,
               tokens_per_seq: int = 1) -> BatchInputs:
        """The device views of the step `step` describes (the last write()), after one host->device copy.

        padded_seqs: pad the step to that many sequences first (for a decode graph). With tokens_per_seq
        1 the step must be decode-only; padding sequences get one token each: token 0 at position 0,
        LoRA slot -1, KV slot -1 (not written), context length 1 over block 0 (only read: finite, zero
        or a real token's K/V). With tokens_per_seq q > 1 (a verify graph: speculative decoding) every
        sequence may have up to q tokens; the step is padded to padded_seqs * q tokens, the padding
        tokens (token 0, position 0, LoRA slot -1, KV slot -1) belong to no sequence (past
        query_start_loc[-1]: the attention zeroes them) and padding sequences have no token (context
        length 1 over block 0), and max_query_len becomes q. Either way sample_indices stay the step's
        and max_seq_len becomes the block tables' capacity, so the views serve any context length.
        """
        num_tokens, num_seqs, max_seq_len = step.num_tokens, step.num_seqs, step.max_seq_len
        max_query_len = step.max_query_len
        if padded_seqs is not None:
            if tokens_per_seq == 1 and (max_query_len != 1 or num_tokens != num_seqs or step.has_prompt_adapter):
                raise ValueError(f"padding needs a decode-only step without soft-prompt placeholders, got "
                                 f"{num_tokens} tokens of {num_seqs} sequences")
            if step.has_prompt_adapter or max_query_len > tokens_per_seq:
                raise ValueError(f"padding to {tokens_per_seq} tokens per sequence needs a step without soft-prompt "
                                 f"placeholders and at most that many tokens per sequence, got {max_query_len}")
            if tokens_per_seq == 1:
                self._write_decode_padding(num_seqs, padded_seqs)
            else:
                self._write_verify_padding(num_seqs, num_tokens, padded_seqs, padded_seqs * tokens_per_seq)
            num_seqs, num_tokens, max_query_len = padded_seqs, padded_seqs * tokens_per_seq, tokens_per_seq
            max_seq_len = self.max_blocks_per_seq * self.block_size
        rows = self._upload_rows(num_tokens, num_seqs, step.num_samples, step.has_prompt_adapter)
        table, lm_head = self._host_tables(step, num_tokens)
        host = [buf.np[:n] for buf, n in rows]
        # the LoRA table is graph-read: right after the graph-read rows; the lm_head one is not: last
        arrays = host[:self._GRAPH_READ] + table + host[self._GRAPH_READ:] + lm_head
        if self.staging is None:  # CPU: the host arrays are the device buffers
            views = [torch.from_numpy(array) for array in arrays]
        else:
            views = self.staging.upload(arrays)
        table_end = self._GRAPH_READ + len(table)
        rows_end = table_end + len(host) - self._GRAPH_READ
        fields = dict(zip(self._UPLOAD_ORDER, views[:self._GRAPH_READ] + views[table_end:rows_end]))
        return BatchInputs(**fields, max_query_len=max_query_len, max_seq_len=max_seq_len,
                           has_lora=step.has_lora, lora_features=step.lora_features,
                           lora_table=TileTable(views[self._GRAPH_READ:table_end], self.lora_table.host_slot_starts)
                           if table else None,
                           lm_head_table=TileTable(views[rows_end:], self.lm_head.table.host_slot_starts)
                           if lm_head else None)

    def _host_tables(self, step: BatchShape | BatchInputs, num_tokens: int) -> tuple[list, list]:
        """The step's LoRA table (over its num_tokens tokens, padding included) and the lm_head LoRA's
        table over its sampled rows, built on the host; [] for each the step does not need."""
        if not step.has_lora:
            return [], []
        table = [] if self.lora_table is None else self.lora_table.build(self.token_lora_slots.np[:num_tokens])
        rows = None if self.lm_head is None else self.lm_head.row_slots(
            self.token_lora_slots.np[self.sample_indices.np[:step.num_samples]])
        return table, [] if rows is None else self.lm_head.table.build(rows)

    # graph-read fields first: their offsets in the packed upload depend on (T, B) only
    _UPLOAD_ORDER = ("input_ids", "positions", "slot_mapping", "token_lora_slots", "query_start_loc", "seq_lens",
                     "block_tables", "sample_indices", "token_prompt_slots", "token_prompt_positions")
    _GRAPH_READ = 7  # the first seven fields; the LoRA table goes after them

    def _upload_rows(self, num_tokens: int, num_seqs: int, num_samples: int,
                     with_prompt: bool) -> list[tuple[_Buffer, int]]:
        """(buffer, rows) of one upload, in _UPLOAD_ORDER (prompt fields only when used)."""
        rows = [num_tokens] * 4 + [num_seqs + 1, num_seqs, num_seqs, num_samples] + [num_tokens] * 2
        names = self._UPLOAD_ORDER if with_prompt else self._UPLOAD_ORDER[:-2]
        return [(getattr(self, name), n) for name, n in zip(names, rows)]

    def padding_batch(self, num_seqs: int, lora_slot: int = -1,
                      lora_features: LoRAFeatures = ALL_LORA_FEATURES, tokens_per_seq: int = 1) -> BatchInputs:
        """A step of `num_seqs` padding sequences (as upload pads, with `tokens_per_seq` tokens per sequence
        room) that samples no row; lora_slot >= 0 puts every token on that adapter, with the optional LoRA
        work `lora_features` (what a graph captured from it runs). For graph capture."""
        num_tokens = num_seqs * tokens_per_seq
        if tokens_per_seq == 1:
            self._write_decode_padding(0, num_seqs)
        else:
            self._write_verify_padding(0, 0, num_seqs, num_tokens)
        self.token_lora_slots.np[:num_tokens] = lora_slot
        step = BatchShape(num_tokens=num_tokens, num_seqs=num_seqs, num_samples=0, max_query_len=tokens_per_seq,
                         max_seq_len=self.max_blocks_per_seq * self.block_size, has_lora=lora_slot >= 0,
                         has_prompt_adapter=False, lora_features=lora_features)
        return self.upload(step)

    def _write_decode_padding(self, num_seqs: int, padded_seqs: int) -> None:
        """Write padding sequences num_seqs..padded_seqs-1 of a decode step into the host arrays."""
        capacity = min(self.max_num_seqs, self.max_num_tokens)  # one token per sequence
        if not 0 <= num_seqs <= padded_seqs <= capacity:
            raise ValueError(f"cannot pad {num_seqs} sequences to {padded_seqs} (buffers hold {capacity})")
        rows = slice(num_seqs, padded_seqs)  # decode: token i belongs to sequence i
        self.input_ids.np[rows] = 0
        self.positions.np[rows] = 0
        self.slot_mapping.np[rows] = -1
        self.token_lora_slots.np[rows] = -1
        self.query_start_loc.np[num_seqs + 1:padded_seqs + 1] = np.arange(num_seqs + 1, padded_seqs + 1)
        self.seq_lens.np[rows] = 1
        self.block_tables.np[rows] = 0

    def _write_verify_padding(self, num_seqs: int, num_tokens: int, padded_seqs: int, padded_tokens: int) -> None:
        """Pad a step of num_seqs sequences / num_tokens tokens to padded_seqs / padded_tokens in the host
        arrays (upload with tokens_per_seq > 1): padding tokens of no sequence, padding sequences of no token."""
        if not (0 <= num_seqs <= padded_seqs <= self.max_num_seqs and 0 <= num_tokens <= padded_tokens
                <= self.max_num_tokens):
            raise ValueError(f"cannot pad {num_seqs} sequences / {num_tokens} tokens to {padded_seqs} / "
                             f"{padded_tokens} (buffers hold {self.max_num_seqs} / {self.max_num_tokens})")
        tokens = slice(num_tokens, padded_tokens)
        self.input_ids.np[tokens] = 0
        self.positions.np[tokens] = 0
        self.slot_mapping.np[tokens] = -1
        self.token_lora_slots.np[tokens] = -1
        self.query_start_loc.np[num_seqs + 1:padded_seqs + 1] = num_tokens  # no token: past the last real one
        self.seq_lens.np[num_seqs:padded_seqs] = 1
        self.block_tables.np[num_seqs:padded_seqs] = 0

    def _map_virtual_tokens(self, positions: np.ndarray, lens: np.ndarray, seqs: SeqArrays) -> int:
        """Write the step's prompt-adapter rows (-1 for ordinary tokens); returns its placeholder count.

        A token is a placeholder when its position is below its sequence's num_virtual (only prefill
        chunks of prompt-adapter requests have any); its virtual index is its position.
        """
        num_tokens = positions.shape[0]
        slots, virtual = self.token_prompt_slots.np, self.token_prompt_positions.np
        is_virtual = positions < np.repeat(seqs.num_virtual, lens)  # [T]
        if not is_virtual.any():
            slots[:num_tokens] = -1
            virtual[:num_tokens] = -1
            return 0
        seq_slots = np.repeat(seqs.prompt_slots, lens)  # [T]
        missing = is_virtual & (seq_slots < 0)
        if missing.any():
            seq = int(np.searchsorted(self.query_start_loc.np[1:lens.shape[0] + 1], missing.argmax(), side="right"))
            raise ValueError(f"chunk {seq}: soft-prompt placeholder(s) but no prompt-adapter slot")
        slots[:num_tokens] = np.where(is_virtual, seq_slots, -1)
        virtual[:num_tokens] = np.where(is_virtual, positions, -1)
        return int(is_virtual.sum())
