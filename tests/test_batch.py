"""BatchBuilder: scheduled chunks -> flat input ids, positions, KV slots, LoRA slots, sample rows."""

import random

import pytest
import torch

from lora_runner.model.attention import paged_attention, write_kv
from lora_runner.model.forward_context import AttentionMetadata
from lora_runner.worker.batch_builder import BatchBuilder, SeqChunk


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


def attention_metadata(batch):
    return AttentionMetadata(slot_mapping=batch.slot_mapping, query_start_loc=batch.query_start_loc,
                             seq_lens=batch.seq_lens, block_tables=batch.block_tables,
                             max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len)


@pytest.mark.parametrize("seed", range(4))
def test_decode_padding_writes_no_kv_and_attends_finitely(seed):
    """upload(padded_seqs=): real rows as build() wrote them; padding rows (token 0, position 0, LoRA slot -1,
    KV slot -1, context 1 over block 0) leave the cache as the real rows alone leave it, and attend
    to finite values although every block outside the step (block 0 aside) holds NaN."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    block_size, width, num_blocks, heads, kv_heads, head_dim = 4, 6, 64, 4, 2, 8
    builder = BatchBuilder(max_num_tokens=32, max_num_seqs=16, max_blocks_per_seq=width, block_size=block_size,
                           device="cpu")
    poison(builder)  # leftovers must not survive in the padding rows either
    num_seqs, padded_seqs = rng.randint(1, 8), rng.randint(8, 16)
    chunks = random_chunks(rng, num_seqs, block_size, width, num_blocks)
    for chunk in chunks:  # decode: one new token each, never in block 0 (padding reads it)
        chunk.block_table = [b if b else num_blocks - 1 for b in chunk.block_table]
        chunk.start, chunk.num_new_tokens = len(chunk.token_ids) - 1, 1
    batch = builder.build(chunks)
    real = {name: getattr(batch, name).clone() for name in ("input_ids", "positions", "slot_mapping",
                                                            "token_lora_slots", "seq_lens", "block_tables")}
    padded = builder.upload(batch, padded_seqs=padded_seqs)
    pad = slice(num_seqs, padded_seqs)
    assert padded.num_seqs == padded.num_tokens == padded_seqs and padded.max_query_len == 1
    assert padded.max_seq_len == width * block_size and padded.has_lora == batch.has_lora
    assert torch.equal(padded.sample_indices, batch.sample_indices)  # the real step's
    for name, want in real.items():
        assert torch.equal(getattr(padded, name)[:num_seqs], want), name
    assert torch.equal(padded.query_start_loc, torch.arange(padded_seqs + 1, dtype=torch.int32))
    assert (padded.slot_mapping[pad] == -1).all() and (padded.token_lora_slots[pad] == -1).all()
    assert (padded.input_ids[pad] == 0).all() and (padded.positions[pad] == 0).all()
    assert (padded.seq_lens[pad] == 1).all() and (padded.block_tables[pad] == 0).all()

    kv = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=torch.float64)
    for block in {0, *(b for c in chunks for b in c.block_table)}:
        kv[:, block] = torch.randn(2, block_size, kv_heads, head_dim, dtype=torch.float64)
    key, value = torch.randn(2, padded_seqs, kv_heads, head_dim, dtype=torch.float64)
    query = torch.randn(padded_seqs, heads, head_dim, dtype=torch.float64)
    want_kv = kv.clone()
    write_kv(want_kv, key[:num_seqs], value[:num_seqs], real["slot_mapping"])
    write_kv(kv, key, value, padded.slot_mapping)
    assert torch.equal(kv.nan_to_num(7.0), want_kv.nan_to_num(7.0))  # padding wrote no slot
    got = paged_attention(query, kv, attention_metadata(padded), 0.3, backend="torch")  # [P, H, D]
    assert torch.isfinite(got).all()
    unpadded = attention_metadata(batch)
    unpadded.seq_lens, unpadded.block_tables = real["seq_lens"], real["block_tables"]
    want = paged_attention(query[:num_seqs], kv, unpadded, 0.3, backend="torch")
    torch.testing.assert_close(got[:num_seqs], want, rtol=1e-12, atol=1e-12)


FIELDS = ("input_ids", "positions", "slot_mapping", "token_lora_slots", "query_start_loc", "seq_lens",
          "block_tables", "sample_indices", "token_prompt_slots", "token_prompt_positions")


def staged_pair(block_size=4, width=6):
    """An unstaged builder (views = host arrays) and a staged one (the device path's packing, on CPU)."""
    sizes = dict(max_num_tokens=128, max_num_seqs=8, max_blocks_per_seq=width, block_size=block_size, device="cpu")
    return BatchBuilder(**sizes), BatchBuilder(**sizes, staged=True)


@pytest.mark.parametrize("seed", range(4))
def test_staged_upload_is_one_packed_copy_alternating_staging_buffers(seed):
    rng = random.Random(seed)
    plain, staged = staged_pair()
    assert plain.staging is None
    device_bytes = staged.staging.device_bytes
    lo, hi = device_bytes.data_ptr(), device_bytes.data_ptr() + device_bytes.numel()
    for step in range(4):
        poison(staged)
        staged.staging.device_bytes.fill_(0xAB)  # stale device bytes must all be overwritten
        chunks = random_chunks(rng, rng.randint(1, 8), 4, 6)
        if step % 2:  # a prefill with soft-prompt placeholders: the prompt fields travel too
            chunks[0].start, chunks[0].num_virtual_tokens, chunks[0].prompt_adapter_slot = 0, 2, 1
            chunks[0].num_new_tokens = len(chunks[0].token_ids)
        want, got = plain.build(chunks), staged.build(chunks)
        assert staged.staging.num_uploads == step + 1 and staged.staging.stage == (step + 1) % 2
        for name in FIELDS:
            expected, actual = getattr(want, name), getattr(got, name)
            if expected is None:
                assert actual is None, name
                continue
            assert torch.equal(actual, expected), name
            assert actual.data_ptr() != getattr(staged, name).cpu.data_ptr(), name  # a copy, not the host array
            assert lo <= actual.data_ptr() and actual.data_ptr() + actual.nbytes <= hi, name  # one device buffer
        assert (got.max_query_len, got.max_seq_len, got.has_lora) == (want.max_query_len, want.max_seq_len,
                                                                      want.has_lora)


def test_staged_padded_steps_of_one_size_share_their_views():
    """A decode graph reads the views its capture saw: every padded upload of one size (any real
    size, any sample count) puts the graph-read fields at the capture's addresses."""
    rng = random.Random(5)
    plain, staged = staged_pair()
    capture = staged.padding_batch(8)
    graph_read = ("input_ids", "positions", "slot_mapping", "token_lora_slots", "query_start_loc", "seq_lens",
                  "block_tables")
    for num_seqs in (1, 3, 8, 5):
        chunks = random_chunks(rng, num_seqs, 4, 6)
        for chunk in chunks:
            chunk.start, chunk.num_new_tokens = len(chunk.token_ids) - 1, 1
        padded = staged.upload(staged.write(chunks), padded_seqs=8)
        want = plain.upload(plain.write(chunks), padded_seqs=8)
        for name in graph_read:
            assert getattr(padded, name).data_ptr() == getattr(capture, name).data_ptr(), name
            assert torch.equal(getattr(padded, name), getattr(want, name)), name
        assert torch.equal(padded.sample_indices, want.sample_indices)


def test_staged_upload_rejects_prompt_steps_for_padding():
    builder = BatchBuilder(max_num_tokens=16, max_num_seqs=4, max_blocks_per_seq=2, block_size=4, device="cpu",
                           staged=True)
    step = builder.write([SeqChunk(list(range(6)), 1, 1, [0, 1], prompt_adapter_slot=0, num_virtual_tokens=3)])
    with pytest.raises(ValueError, match="decode-only"):
        builder.upload(step, padded_seqs=4)
