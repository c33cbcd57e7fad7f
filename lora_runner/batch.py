"""The mapping builder: scheduled chunks -> the flat token batch the model reads, in persistent buffers.

Every buffer is allocated once at its maximum size, as a CPU tensor (written through a numpy view)
plus a device copy; a step writes rows [:n] and copies only those. On CPU the device tensor is the
CPU tensor itself, so nothing is copied. On CUDA the CPU tensors are pinned and copied with
non_blocking=True, so the copies may still be queued when build() returns (a step that samples
nothing never waits for the device): the next build() first waits for them (a CUDA event) before
it overwrites the CPU tensors.

Decode graphs run fixed-size steps: pad_decode fills the rows past a decode step with padding
sequences, so the graph's buffers hold a whole captured size; padding_batch is such a step made of
padding only (capture).

Prompt adapters: a sequence's first `num_virtual_tokens` positions are its soft prompt's
placeholders. Each such token gets its prompt-adapter slot and virtual index (its position) in
`token_prompt_slots` / `token_prompt_positions`; every other token gets -1, and the model's
embedding step overwrites only the mapped tokens. Only prefill chunks can contain them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class SeqChunk:
    """One sequence's part of a step: tokens token_ids[start:start+num_new_tokens]."""

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
    sample_indices: torch.Tensor  # [S] int64 rows of the flat batch whose logits are sampled
    max_query_len: int
    max_seq_len: int
    has_lora: bool  # any token with a LoRA slot >= 0
    # None when no token of the step is a soft-prompt placeholder (decode-only steps, for instance)
    token_prompt_slots: torch.Tensor | None = None  # [T] int64 prompt-adapter slot, -1 = ordinary token
    token_prompt_positions: torch.Tensor | None = None  # [T] int64 index in the soft prompt, -1 = ordinary

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


class _Buffer:
    """A CPU tensor with a numpy view, mirrored on the device."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.np = self.cpu.numpy()
        self.device = self.cpu if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)

    def copy_to_device(self, n: int, first: int = 0) -> torch.Tensor:
        """Copy rows [first:n] to the device; returns the device view [:n]."""
        if self.device is not self.cpu and first < n:
            self.device[first:n].copy_(self.cpu[first:n], non_blocking=True)
        return self.device[:n]


class BatchBuilder:
    """Writes scheduled chunks into persistent buffers sized for the largest step."""

    def __init__(self, *, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                 block_size: int, device: torch.device | str) -> None:
        device = torch.device(device)
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.input_ids = _Buffer((max_num_tokens,), torch.int64, device)
        self.positions = _Buffer((max_num_tokens,), torch.int64, device)
        self.slot_mapping = _Buffer((max_num_tokens,), torch.int64, device)
        self.token_lora_slots = _Buffer((max_num_tokens,), torch.int32, device)
        self.token_prompt_slots = _Buffer((max_num_tokens,), torch.int64, device)
        self.token_prompt_positions = _Buffer((max_num_tokens,), torch.int64, device)
        self.query_start_loc = _Buffer((max_num_seqs + 1,), torch.int32, device)
        self.seq_lens = _Buffer((max_num_seqs,), torch.int32, device)
        self.block_tables = _Buffer((max_num_seqs, max_blocks_per_seq), torch.int32, device)
        self.sample_indices = _Buffer((max_num_seqs,), torch.int64, device)
        self._arange = np.arange(max(max_num_tokens, max_blocks_per_seq * block_size), dtype=np.int64)
        # recorded after each step's host->device copies; the next write of the CPU buffers waits for it
        self._copies_done = torch.cuda.Event() if device.type == "cuda" else None
        self._device = device

    def wait_for_copies(self) -> None:
        """Block until the last recorded host->device copies have read the CPU buffers (CUDA only)."""
        if self._copies_done is not None:
            self._copies_done.synchronize()

    def record_copies(self) -> None:
        """Mark the copies queued so far; call after copy_to_device, before the CPU buffers change again."""
        if self._copies_done is not None:
            self._copies_done.record(torch.cuda.current_stream(self._device))  # the copies' stream

    def build(self, chunks: Sequence[SeqChunk]) -> BatchInputs:
        """Flatten `chunks` (in order) into the buffers and return this step's device views."""
        num_seqs = len(chunks)
        num_tokens = sum(c.num_new_tokens for c in chunks)
        if not 0 < num_seqs <= self.max_num_seqs or num_tokens > self.max_num_tokens:
            raise ValueError(f"batch of {num_seqs} sequences / {num_tokens} tokens exceeds the "
                             f"buffers ({self.max_num_seqs} / {self.max_num_tokens})")
        bs = self.block_size
        self.wait_for_copies()  # the previous step's non_blocking copies may not have read the buffers yet
        self.block_tables.np[:num_seqs] = 0
        self.query_start_loc.np[0] = 0
        offset, num_samples, max_query_len, max_seq_len, num_virtual = 0, 0, 0, 0, 0
        for i, chunk in enumerate(chunks):
            n, start = chunk.num_new_tokens, chunk.start
            end = start + n
            if (n < 1 or end > len(chunk.token_ids) or len(chunk.block_table) * bs < end
                    or len(chunk.block_table) > self.max_blocks_per_seq):
                raise ValueError(f"chunk {i}: {n} tokens from {start} do not fit its "
                                 f"{len(chunk.token_ids)} tokens / {len(chunk.block_table)} blocks")
            rows = slice(offset, offset + n)
            positions = self._arange[start:end]  # [n]
            table = np.asarray(chunk.block_table, dtype=np.int64)  # [num_blocks]
            self.input_ids.np[rows] = chunk.token_ids[start:end]
            self.positions.np[rows] = positions
            self.slot_mapping.np[rows] = table[positions // bs] * bs + positions % bs
            self.token_lora_slots.np[rows] = chunk.lora_slot
            num_virtual += self._map_virtual_tokens(i, chunk, offset, positions)
            self.block_tables.np[i, :len(table)] = table
            self.seq_lens.np[i] = end
            offset += n
            self.query_start_loc.np[i + 1] = offset
            if chunk.sample:
                self.sample_indices.np[num_samples] = offset - 1
                num_samples += 1
            max_query_len, max_seq_len = max(max_query_len, n), max(max_seq_len, end)
        has_lora = any(c.lora_slot >= 0 for c in chunks)
        prompt_slots = prompt_positions = None
        if num_virtual:
            prompt_slots = self.token_prompt_slots.copy_to_device(num_tokens)
            prompt_positions = self.token_prompt_positions.copy_to_device(num_tokens)
        batch = BatchInputs(
            input_ids=self.input_ids.copy_to_device(num_tokens),
            positions=self.positions.copy_to_device(num_tokens),
            slot_mapping=self.slot_mapping.copy_to_device(num_tokens),
            token_lora_slots=self.token_lora_slots.copy_to_device(num_tokens),
            query_start_loc=self.query_start_loc.copy_to_device(num_seqs + 1),
            seq_lens=self.seq_lens.copy_to_device(num_seqs),
            block_tables=self.block_tables.copy_to_device(num_seqs),
            sample_indices=self.sample_indices.copy_to_device(num_samples),
            max_query_len=max_query_len, max_seq_len=max_seq_len, has_lora=has_lora,
            token_prompt_slots=prompt_slots, token_prompt_positions=prompt_positions)
        self.record_copies()
        return batch

    def pad_decode(self, batch: BatchInputs, num_seqs: int) -> BatchInputs:
        """Pad the decode step `batch` (the last build()) to `num_seqs` sequences: the device views of
        a step of that size whose first batch.num_seqs rows are `batch`'s (for a decode graph).

        Padding sequences get one token each: token 0 at position 0, LoRA slot -1, KV slot -1 (not
        written), context length 1 over block 0 (only read: finite, zero or a real token's K/V).
        Only the padding rows are copied (build() copied the real ones). sample_indices stay
        `batch`'s; max_seq_len becomes the block tables' capacity, so the views serve any context.
        """
        if batch.max_query_len != 1 or batch.num_tokens != batch.num_seqs:
            raise ValueError(f"pad_decode needs a decode-only step, got {batch.num_tokens} tokens of "
                             f"{batch.num_seqs} sequences")
        self._write_decode_padding(batch.num_seqs, num_seqs)
        return self._decode_views(num_seqs, batch.num_seqs, batch.sample_indices, batch.has_lora)

    def padding_batch(self, num_seqs: int, lora_slot: int = -1) -> BatchInputs:
        """A decode step of `num_seqs` padding sequences (as pad_decode writes them) that samples no
        row; lora_slot >= 0 puts every token on that adapter. For graph capture."""
        self.wait_for_copies()
        self._write_decode_padding(0, num_seqs)
        self.token_lora_slots.np[:num_seqs] = lora_slot
        return self._decode_views(num_seqs, 0, self.sample_indices.device[:0], lora_slot >= 0)

    def _write_decode_padding(self, num_seqs: int, padded_seqs: int) -> None:
        """Write padding sequences num_seqs..padded_seqs-1 of a decode step into the CPU buffers."""
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

    def _decode_views(self, num_seqs: int, first: int, sample_indices: torch.Tensor, has_lora: bool) -> BatchInputs:
        """Copy rows [first:num_seqs] of the decode buffers to the device; rows [:num_seqs] as a batch."""
        n = num_seqs
        batch = BatchInputs(
            input_ids=self.input_ids.copy_to_device(n, first), positions=self.positions.copy_to_device(n, first),
            slot_mapping=self.slot_mapping.copy_to_device(n, first),
            token_lora_slots=self.token_lora_slots.copy_to_device(n, first),
            query_start_loc=self.query_start_loc.copy_to_device(n + 1, first + 1),
            seq_lens=self.seq_lens.copy_to_device(n, first), block_tables=self.block_tables.copy_to_device(n, first),
            sample_indices=sample_indices, max_query_len=1, max_seq_len=self.max_blocks_per_seq * self.block_size,
            has_lora=has_lora)
        self.record_copies()  # the next build() waits for these copies before rewriting the CPU rows
        return batch

    def _map_virtual_tokens(self, i: int, chunk: SeqChunk, offset: int, positions: np.ndarray) -> int:
        """Write chunk i's prompt-adapter rows (positions: its [n] positions); returns its virtual-token count."""
        n = chunk.num_new_tokens
        num_virtual = min(max(chunk.num_virtual_tokens - chunk.start, 0), n)  # placeholders lead the chunk
        if num_virtual and chunk.prompt_adapter_slot < 0:
            raise ValueError(f"chunk {i}: {num_virtual} soft-prompt placeholder(s) but no prompt-adapter slot")
        slots, virtual = self.token_prompt_slots.np, self.token_prompt_positions.np
        slots[offset:offset + n] = -1
        virtual[offset:offset + n] = -1
        slots[offset:offset + num_virtual] = chunk.prompt_adapter_slot
        virtual[offset:offset + num_virtual] = positions[:num_virtual]
        return num_virtual
