"""Shared helpers for the model tests: tiny checkpoints on disk, a paged-cache driver, oracles.

`PagedDriver` stands in for the block manager + runner: it hands out KV blocks in a shuffled order
(so tables are scattered), fills the cache with NaN first (a stale read would show), and builds
the ForwardContext of one step from (sequence id, new tokens) chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from factories import build_tiny_model, save_tiny_model
from lora_runner.model import load_model
from lora_runner.model.forward_context import AttentionMetadata, ForwardContext, LoRAContext
from lora_runner.worker.kv_cache import allocate_kv_cache

ATOL = 1e-4


@dataclass
class TinyCheckpoint:
    """A saved tiny transformers model, loaded both by transformers (oracle) and by us."""

    hf: torch.nn.Module
    model: torch.nn.Module
    config: object
    path: str


def randomize_biases(hf_model, seed: int = 0) -> None:
    """transformers initializes biases to zero; give them values so a dropped bias shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)


def make_checkpoint(path, arch: str = "llama", seed: int = 0, max_shard_size=None, biases: bool = False,
                    **overrides) -> TinyCheckpoint:
    """Save a tiny model (optionally sharded, with random biases) and load it with load_model."""
    if biases:
        hf = build_tiny_model(arch, seed, **overrides)
        randomize_biases(hf, seed)
        hf.save_pretrained(str(path), **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    else:
        hf = save_tiny_model(path, arch, seed, tokenizer=False, max_shard_size=max_shard_size, **overrides)
    model, config, _ = load_model(str(path))
    return TinyCheckpoint(hf=hf.eval(), model=model, config=config, path=str(path))


@torch.no_grad()
def hf_logits(hf_model, tokens: torch.Tensor) -> torch.Tensor:
    """transformers logits [L, vocab] of one unpadded sequence (full forward, no cache)."""
    return hf_model(tokens[None]).logits[0].float()


class PagedDriver:
    """Builds one ForwardContext per step over a NaN-filled, scattered paged KV cache."""

    def __init__(self, model, config, num_blocks: int = 48, block_size: int = 4, seed: int = 0):
        self.model, self.block_size = model, block_size
        self.kv_cache = allocate_kv_cache(config, num_blocks, block_size, torch.float32, "cpu")
        self.kv_cache.fill_(float("nan"))  # never-written slots must never be read
        gen = torch.Generator().manual_seed(seed)
        self.free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables: dict[int, list[int]] = {}
        self.num_cached: dict[int, int] = {}

    def context(self, chunks, lora: LoRAContext | None = None, num_padding: int = 0):
        """(input_ids [T], positions [T], ctx) for chunks [(seq_id, new tokens [n])].

        `num_padding` appends CUDA-graph style padding tokens (slot -1, past query_start_loc[-1]).
        """
        ids, positions, slots, starts, seq_lens, tables = [], [], [], [0], [], []
        for seq_id, tokens in chunks:
            start = self.num_cached.get(seq_id, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq_id, [])
            while len(table) * self.block_size < end:
                table.append(self.free_blocks.pop())
            pos = torch.arange(start, end)
            ids.append(tokens)
            positions.append(pos)
            slots.append(torch.tensor(table)[pos // self.block_size] * self.block_size + pos % self.block_size)
            starts.append(starts[-1] + len(tokens))
            seq_lens.append(end)
            tables.append(table)
            self.num_cached[seq_id] = end
        ids.append(torch.zeros(num_padding, dtype=torch.int64))
        positions.append(torch.zeros(num_padding, dtype=torch.int64))
        slots.append(torch.full((num_padding,), -1))
        width = max(len(t) for t in tables) + 1  # + an unused column, like a fixed-width runner buffer
        block_tables = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, table in enumerate(tables):
            block_tables[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
        attn = AttentionMetadata(
            slot_mapping=torch.cat(slots).long(), query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=block_tables,
            max_query_len=max(len(t) for _, t in chunks), max_seq_len=max(seq_lens))
        return torch.cat(ids).long(), torch.cat(positions).long(), ForwardContext(attn, self.kv_cache, lora=lora)

    @torch.no_grad()
    def step(self, chunks, lora: LoRAContext | None = None, num_padding: int = 0) -> list[torch.Tensor]:
        """Run one step; returns the logits [n, vocab] of each chunk's new tokens."""
        input_ids, positions, ctx = self.context(chunks, lora, num_padding)
        logits = self.model.compute_logits(self.model(input_ids, positions, ctx))  # [T, vocab]
        assert logits.dtype == torch.float32
        if num_padding:
            assert torch.isfinite(logits[-num_padding:]).all(), "padding rows must not produce NaN"
        return list(logits[:logits.shape[0] - num_padding].split([len(t) for _, t in chunks]))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, atol: float = ATOL) -> None:
    """Max-abs-diff check with a message naming the case."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    diff = (actual - expected).abs().max().item()
    assert diff <= atol, f"{what}: max abs diff {diff:.3g} > {atol}"


def test_driver_scatters_blocks_and_maps_slots(tmp_path):
    """The harness itself: blocks are not contiguous and every token gets its own slot."""
    ckpt = make_checkpoint(tmp_path, "llama", num_hidden_layers=1)
    driver = PagedDriver(ckpt.model, ckpt.config, block_size=4)
    _, _, ctx = driver.context([(0, torch.arange(10)), (1, torch.arange(7))], num_padding=2)
    slots = ctx.attn.slot_mapping
    assert slots[-2:].tolist() == [-1, -1]
    assert len(set(slots[:-2].tolist())) == 17
    table = driver.tables[0]
    assert table != sorted(table) or table[-1] - table[0] != len(table) - 1
    with pytest.raises(AssertionError):
        assert_close(torch.zeros(3), torch.full((3,), 1e-3), "tolerance check")
