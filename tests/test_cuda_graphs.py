"""CUDA-graph logic without CUDA: capture sizes, keys (size, has_lora, optional LoRA work), the eager-vs-graph decision,
padding written into the persistent buffers, memory-profile steps and the KV budget arithmetic."""

import random

import numpy as np
import pytest
import torch

from lora_runner.model.forward_context import ALL_LORA_FEATURES
from lora_runner.worker.batch_builder import BatchBuilder, SeqChunk
from lora_runner.worker.cuda_graphs import DecodeGraphKey, DecodeGraphPlan, capture_sizes
from lora_runner.worker.memory_profile import MemoryProfile, profile_steps

BUFFERS = ("input_ids", "positions", "slot_mapping", "token_lora_slots", "query_start_loc", "seq_lens",
           "block_tables", "sample_indices")


@pytest.mark.parametrize("max_num_seqs,want", [
    (1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (4, [1, 2, 4]), (5, [1, 2, 4, 5]), (8, [1, 2, 4, 8]),
    (9, [1, 2, 4, 8, 9]), (20, [1, 2, 4, 8, 16, 20]), (32, [1, 2, 4, 8, 16, 24, 32]),
])
def test_capture_sizes(max_num_seqs, want):
    assert capture_sizes(max_num_seqs) == want


@pytest.mark.parametrize("max_num_seqs", [64, 127, 128, 256])
def test_capture_sizes_every_8(max_num_seqs):
    sizes = capture_sizes(max_num_seqs)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == max_num_seqs
    assert all(b - a == 8 for a, b in zip(sizes[3:-1], sizes[4:-1]))
    # any batch up to max_num_seqs pads by less than a step of 8
    for n in range(1, max_num_seqs + 1):
        assert min(s for s in sizes if s >= n) - n < 8


def test_capture_sizes_rejects_zero():
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def decode_chunks(rng, num_seqs, block_size, width, lora_choices=(-1, 0, 1, 2)):
    """num_seqs decode chunks (one new token each) with distinct random blocks."""
    free = list(range(1, 1 + num_seqs * width))
    rng.shuffle(free)
    chunks = []
    for _ in range(num_seqs):
        total = rng.randint(1, width * block_size)
        table = [free.pop() for _ in range(-(-total // block_size))]
        chunks.append(SeqChunk(token_ids=[rng.randrange(1000) for _ in range(total)], start=total - 1,
                               num_new_tokens=1, block_table=table, lora_slot=rng.choice(lora_choices)))
    return chunks


def make_builder(max_num_seqs=32, width=8, block_size=4):
    return BatchBuilder(max_num_tokens=64, max_num_seqs=max_num_seqs, max_blocks_per_seq=width,
                        block_size=block_size, device="cpu")


def test_plan_keys_largest_first_and_decision():
    plan = DecodeGraphPlan(max_num_seqs=20)
    assert plan.sizes == [1, 2, 4, 8, 16, 20]
    keys = plan.keys()
    # per size: base, plain LoRA, LoRA with the optional work (embedding LoRA, DoRA)
    assert keys[0] == DecodeGraphKey(20, True, ALL_LORA_FEATURES) and keys[1] == DecodeGraphKey(20, True)
    assert keys[-1] == DecodeGraphKey(1, False) and len(keys) == 18
    assert all(a > b for a, b in zip(keys, keys[1:]))
    builder = make_builder(max_num_seqs=32, width=8, block_size=4)
    rng = random.Random(0)
    for num_seqs, lora_choices in ((1, (-1,)), (3, (-1, 0)), (5, (-1,)), (8, (2,)), (9, (-1,)), (17, (-1, 1)),
                                   (20, (-1,))):
        chunks = decode_chunks(rng, num_seqs, 4, 8, lora_choices)
        batch = builder.build(chunks)
        key = plan.key_for(batch)
        assert key.num_seqs == min(s for s in plan.sizes if s >= num_seqs)
        assert key.has_lora == any(c.lora_slot >= 0 for c in chunks)  # base-only steps: the graph without LoRA
    # more sequences than the largest capture size: eager
    assert plan.key_for(builder.build(decode_chunks(rng, 21, 4, 8))) is None


def test_prefill_mixed_and_prompt_adapter_steps_run_eagerly():
    plan = DecodeGraphPlan(max_num_seqs=32)
    builder = make_builder()
    rng = random.Random(1)
    decodes = decode_chunks(rng, 4, 4, 8)
    prefill = SeqChunk(token_ids=list(range(10)), start=0, num_new_tokens=10, block_table=[40, 41, 42])
    assert plan.key_for(builder.build(decodes)) is not None
    assert plan.key_for(builder.build([prefill])) is None
    assert plan.key_for(builder.build(decodes + [prefill])) is None
    # a one-token chunk that is a soft-prompt placeholder needs the prompt adapter: eager
    placeholder = SeqChunk(token_ids=list(range(10)), start=2, num_new_tokens=1, block_table=[40, 41, 42],
                           prompt_adapter_slot=0, num_virtual_tokens=4)
    batch = builder.build(decodes + [placeholder])
    assert batch.max_query_len == 1 and batch.has_prompt_adapter
    assert plan.key_for(batch) is None
    # past its soft prompt the same sequence decodes like any other
    placeholder.start = 6
    assert plan.key_for(builder.build(decodes + [placeholder])) is not None


@pytest.mark.parametrize("seed", range(4))
def test_padding_keeps_real_rows_and_writes_padding_rows(seed):
    rng = random.Random(seed)
    plan = DecodeGraphPlan(max_num_seqs=32)
    builder = make_builder()
    for _ in range(3):  # reuse: leftovers of a bigger step must be overwritten
        for name in BUFFERS:
            getattr(builder, name).cpu.fill_(-12345)
        chunks = decode_chunks(rng, rng.randint(1, 32), 4, 8)
        n = len(chunks)
        batch = builder.build(chunks)
        real = {name: getattr(batch, name).clone() for name in BUFFERS}
        key = plan.key_for(batch)
        padded = builder.upload(batch, padded_seqs=key.num_seqs)
        p = key.num_seqs
        assert padded.num_tokens == p and padded.num_seqs == p and padded.max_query_len == 1
        assert padded.max_seq_len == 8 * 4 >= batch.max_seq_len  # the tables' capacity: any context fits
        assert padded.has_lora == key.has_lora == batch.has_lora
        assert torch.equal(padded.sample_indices, torch.arange(n))
        for name in ("input_ids", "positions", "slot_mapping", "token_lora_slots", "seq_lens", "block_tables"):
            assert torch.equal(getattr(padded, name)[:n], real[name]), name
        assert torch.equal(padded.query_start_loc, torch.arange(p + 1, dtype=torch.int32))
        assert (padded.input_ids[n:] == 0).all() and (padded.positions[n:] == 0).all()
        assert (padded.slot_mapping[n:] == -1).all() and (padded.token_lora_slots[n:] == -1).all()
        assert (padded.seq_lens[n:] == 1).all() and (padded.block_tables[n:] == 0).all()


def test_decode_padding_bounds():
    builder = make_builder(max_num_seqs=8)
    rng = random.Random(0)
    three = builder.build(decode_chunks(rng, 3, 4, 8))
    with pytest.raises(ValueError, match="cannot pad"):
        builder.upload(three, padded_seqs=9)
    with pytest.raises(ValueError, match="cannot pad"):
        builder.upload(builder.build(decode_chunks(rng, 5, 4, 8)), padded_seqs=4)
    prefill = SeqChunk(token_ids=list(range(10)), start=0, num_new_tokens=10, block_table=[40, 41, 42])
    with pytest.raises(ValueError, match="decode-only"):
        builder.upload(builder.build([prefill]), padded_seqs=8)
    capture = builder.padding_batch(8, lora_slot=2)  # all padding: the capture batch
    assert np.array_equal(builder.query_start_loc.np, np.arange(9))
    assert capture.has_lora and (capture.token_lora_slots == 2).all() and capture.sample_indices.numel() == 0
    assert not builder.padding_batch(8).has_lora


@pytest.mark.parametrize("max_num_seqs,max_batched,max_model_len,block_size", [
    (64, 2048, 2048, 16), (4, 64, 48, 4), (128, 100, 512, 16), (3, 8192, 30, 7),
])
def test_profile_steps_fit_the_buffers(max_num_seqs, max_batched, max_model_len, block_size):
    width = -(-max_model_len // block_size)
    steps = profile_steps(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched,
                          max_model_len=max_model_len, block_size=block_size, lora_slots=[0, 1, 2])
    builder = BatchBuilder(max_num_tokens=max_batched, max_num_seqs=max_num_seqs, max_blocks_per_seq=width,
                           block_size=block_size, device="cpu")
    long, many, decode = steps["long prefill"], steps["many prefills"], steps["decode"]
    assert len(long) == 1 and long[0].num_new_tokens == min(max_batched, max_model_len)
    assert builder.build(long).max_seq_len == max_model_len
    batch = builder.build(many)
    assert batch.num_tokens == min(max_batched, len(many) * max_model_len)
    assert len(many) == min(max_num_seqs, max_batched) and batch.max_seq_len <= max_model_len
    batch = builder.build(decode)
    assert batch.max_query_len == 1 and batch.max_seq_len == max_model_len and len(decode) == len(many)
    assert sorted({c.lora_slot for c in many}) == [0, 1, 2][:len(many)]


def test_kv_cache_budget():
    gib = 2**30
    profile = MemoryProfile(total=100 * gib, non_torch=2 * gib, resident=30 * gib, activation=5 * gib,
                            decode_activation=3 * gib)
    assert profile.kv_cache_budget(0.9, cuda_graphs=False) == int(0.9 * 100 * gib) - 37 * gib
    assert profile.kv_cache_budget(0.9, cuda_graphs=True) == int(0.9 * 100 * gib) - 40 * gib
    with pytest.raises(ValueError, match="no device memory left"):
        profile.kv_cache_budget(0.3, cuda_graphs=True)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        profile.kv_cache_budget(1.5, cuda_graphs=False)
