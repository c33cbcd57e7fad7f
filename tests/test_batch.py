"""BatchBuilder: scheduled chunks -> flat input ids, positions, KV slots, LoRA slots, sample rows."""

import random

import pytest
import torch

from lora_runner.batch import BatchBuilder, SeqChunk


def reference(chunks, block_size, width):
    """The mapping written out token by token."""
    ids, pos, slots, loras, qsl, lens, tables, samples = [], [], [], [], [0], [], [], []
    for c in chunks:
        for p in range(c.start, c.start + c.num_new_tokens):
            ids.append(c.token_ids[p])
            pos.append(p)
            slots.append(c.block_table[p // block_size] * block_size + p % block_size)
            loras.append(c.lora_slot)
        qsl.append(len(ids))
        lens.append(c.start + c.num_new_tokens)
        tables.append(c.block_table + [0] * (width - len(c.block_table)))
        if c.sample:
            samples.append(len(ids) - 1)
    return dict(input_ids=ids, positions=pos, slot_mapping=slots, token_lora_slots=loras,
                query_start_loc=qsl, seq_lens=lens, block_tables=tables, sample_indices=samples)


def random_chunks(rng, num_seqs, block_size, width, num_blocks=64):
    free = list(range(num_blocks))
    rng.shuffle(free)
    chunks = []
    for _ in range(num_seqs):
        total = rng.randint(1, width * block_size)
        start = rng.randint(0, total - 1)
        table = [free.pop() for _ in range(-(-total // block_size))]
        chunks.append(SeqChunk(token_ids=[rng.randrange(1000) for _ in range(total)], start=start,
                               num_new_tokens=total - start, block_table=table,
                               lora_slot=rng.choice([-1, 0, 1, 2]), sample=rng.random() < 0.8))
    return chunks


def poison(builder):
    for buf in (builder.input_ids, builder.positions, builder.slot_mapping, builder.token_lora_slots,
                builder.query_start_loc, builder.seq_lens, builder.block_tables, builder.sample_indices):
        buf.cpu.fill_(-12345)


@pytest.mark.parametrize("seed", range(5))
def test_matches_token_by_token_reference(seed):
    rng = random.Random(seed)
    block_size, width = rng.choice([1, 4, 16]), 6
    builder = BatchBuilder(max_num_tokens=512, max_num_seqs=8, max_blocks_per_seq=width,
                           block_size=block_size, device="cpu")
    for _ in range(3):  # reuse: stale contents of a bigger batch must not leak
        poison(builder)
        chunks = random_chunks(rng, rng.randint(1, 8), block_size, width)
        batch = builder.build(chunks)
        want = reference(chunks, block_size, width)
        for name, values in want.items():
            got = getattr(batch, name)
            assert got.tolist() == values, name
        assert batch.input_ids.dtype == torch.int64 and batch.slot_mapping.dtype == torch.int64
        assert batch.token_lora_slots.dtype == torch.int32 and batch.block_tables.dtype == torch.int32
        assert batch.max_query_len == max(c.num_new_tokens for c in chunks)
        assert batch.max_seq_len == max(want["seq_lens"])
        assert batch.has_lora == any(c.lora_slot >= 0 for c in chunks)
        assert batch.num_tokens == len(want["input_ids"]) and batch.num_seqs == len(chunks)


def test_views_share_the_persistent_buffers():
    builder = BatchBuilder(max_num_tokens=16, max_num_seqs=2, max_blocks_per_seq=2, block_size=4, device="cpu")
    batch = builder.build([SeqChunk([5, 6, 7], 0, 3, [1])])
    assert batch.input_ids.data_ptr() == builder.input_ids.cpu.data_ptr()


@pytest.mark.parametrize("chunk, match", [
    (SeqChunk([1, 2, 3], 0, 3, []), "do not fit"),
    (SeqChunk([1, 2, 3], 2, 2, [0]), "do not fit"),
    (SeqChunk([1, 2, 3], 0, 0, [0]), "do not fit"),
    (SeqChunk(list(range(20)), 0, 10, [0, 1, 2]), "do not fit"),
])
def test_rejects_chunks_that_do_not_fit(chunk, match):
    builder = BatchBuilder(max_num_tokens=16, max_num_seqs=2, max_blocks_per_seq=2, block_size=4, device="cpu")
    with pytest.raises(ValueError, match=match):
        builder.build([chunk])


def test_rejects_oversized_batch():
    builder = BatchBuilder(max_num_tokens=4, max_num_seqs=1, max_blocks_per_seq=2, block_size=4, device="cpu")
    with pytest.raises(ValueError, match="exceeds the buffers"):
        builder.build([SeqChunk([1] * 5, 0, 5, [0, 1])])
    with pytest.raises(ValueError, match="exceeds the buffers"):
        builder.build([SeqChunk([1], 0, 1, [0]), SeqChunk([1], 0, 1, [1])])
