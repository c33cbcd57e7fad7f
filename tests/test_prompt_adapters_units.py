"""Prompt adapters without a model: the batch builder's per-token soft-prompt mapping, a request's
placeholders, and the scheduler's admission (at most max_prompt_adapters soft prompts per step,
held only while the placeholders are computed)."""

import random

import pytest

from lora_runner.core.block_manager import BlockManager
from lora_runner.core.request import PLACEHOLDER_TOKEN_ID, Request
from lora_runner.core.scheduler import Scheduler
from lora_runner.sampling_params import SamplingParams
from lora_runner.worker.batch_builder import BatchBuilder, SeqChunk


def reference_mapping(chunks):
    """(slot, virtual index) per token, written out token by token."""
    slots, virtual = [], []
    for c in chunks:
        for p in range(c.start, c.start + c.num_new_tokens):
            is_virtual = p < c.num_virtual_tokens
            slots.append(c.prompt_adapter_slot if is_virtual else -1)
            virtual.append(p if is_virtual else -1)
    return slots, virtual


def random_chunk(rng, block_size=4, width=8):
    num_virtual = rng.choice([0, 0, 1, 3, 7])
    total = rng.randint(num_virtual + 1, width * block_size)
    start = rng.choice([0, rng.randint(0, total - 1), total - 1])  # whole prefill, a chunk, a decode
    return SeqChunk(token_ids=[rng.randrange(1000) for _ in range(total)], start=start,
                    num_new_tokens=rng.randint(1, total - start), block_table=list(range(-(-total // block_size))),
                    lora_slot=rng.choice([-1, 0]), prompt_adapter_slot=rng.randrange(3) if num_virtual else -1,
                    num_virtual_tokens=num_virtual)


@pytest.mark.parametrize("seed", range(4))
def test_mapping_matches_token_by_token_reference(seed):
    rng = random.Random(seed)
    builder = BatchBuilder(max_num_tokens=256, max_num_seqs=8, max_blocks_per_seq=8, block_size=4, device="cpu")
    for _ in range(6):  # reuse: a stale mapping of an earlier, bigger step must not leak
        for buf in (builder.token_prompt_slots, builder.token_prompt_positions):
            buf.cpu.fill_(-12345)
        chunks = [random_chunk(rng) for _ in range(rng.randint(1, 8))]
        batch = builder.build(chunks)
        slots, virtual = reference_mapping(chunks)
        assert batch.has_prompt_adapter == any(s >= 0 for s in slots)
        if batch.has_prompt_adapter:
            assert batch.token_prompt_slots.tolist() == slots
            assert batch.token_prompt_positions.tolist() == virtual
        else:
            assert batch.token_prompt_slots is None and batch.token_prompt_positions is None


def test_chunk_across_the_soft_prompt_and_decode_steps():
    builder = BatchBuilder(max_num_tokens=32, max_num_seqs=4, max_blocks_per_seq=4, block_size=4, device="cpu")
    ids = [0] * 5 + [40, 41, 42]
    straddle = SeqChunk(ids, 3, 4, [0, 1], prompt_adapter_slot=1, num_virtual_tokens=5)  # virtual 3, 4 + 2 real
    plain = SeqChunk([7, 8], 0, 2, [2])
    batch = builder.build([straddle, plain])
    assert batch.token_prompt_slots.tolist() == [1, 1, -1, -1, -1, -1]
    assert batch.token_prompt_positions.tolist() == [3, 4, -1, -1, -1, -1]
    assert batch.positions.tolist() == [3, 4, 5, 6, 0, 1]  # placeholders keep positions 0..n-1, as PEFT
    decode = SeqChunk(ids, 7, 1, [0, 1], prompt_adapter_slot=-1, num_virtual_tokens=5)  # slot no longer needed
    assert not builder.build([decode]).has_prompt_adapter
    with pytest.raises(ValueError, match="no prompt-adapter slot"):
        builder.build([SeqChunk(ids, 0, 3, [0, 1], num_virtual_tokens=5)])


def make_request(i, prompt, pa=None, lora=None, max_tokens=3):
    return Request(f"r{i}", list(prompt), SamplingParams(max_tokens=max_tokens), arrival=i, lora_ref=lora,
                   prompt_adapter_ref=pa)


def test_placeholders_lead_the_tokens_and_are_not_output():
    request = make_request(0, [5, 6, 7], pa="pa")
    assert request.awaiting_virtual_tokens and request.needs_prompt_adapter
    request.insert_virtual_tokens(4)
    assert request.token_ids == [PLACEHOLDER_TOKEN_ID] * 4 + [5, 6, 7] and request.num_tokens == 7
    assert request.prompt_token_ids == [5, 6, 7] and request.num_prompt_tokens == 3
    request.num_computed_tokens = 4  # the soft prompt is in the KV cache
    assert not request.needs_prompt_adapter and not request.awaiting_virtual_tokens
    request.num_computed_tokens = 7
    request.token_ids += [9, 10]
    assert request.output_token_ids == [9, 10] and request.num_output_tokens == 2
    request.preempt()  # recompute: placeholders stay, the soft prompt is needed again
    assert request.needs_prompt_adapter and request.token_ids[:4] == [PLACEHOLDER_TOKEN_ID] * 4
    with pytest.raises(AssertionError, match="inserted twice"):
        request.insert_virtual_tokens(4)


def make_scheduler(states, max_prompt_adapters=1, max_tokens=64, pinned=()):
    bm = BlockManager(64, 4)
    return Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=max_tokens, max_loras=2,
                     adapter_state=lambda ref: states[ref], max_prompt_adapters=max_prompt_adapters,
                     prompt_adapter_state=lambda ref: states[ref],
                     reserved_prompt_slots=lambda refs: len(set(pinned) - refs))


def advance(out):
    for s in out.scheduled:
        s.request.num_computed_tokens += s.num_new_tokens
        if s.samples:
            s.request.token_ids.append(7)


def test_admission_holds_at_most_max_prompt_adapters_until_placeholders_are_computed():
    states = {"a": "ready", "b": "ready", "c": "loading", "bad": "failed"}
    sched = make_scheduler(states, max_tokens=19)
    sched.policy = "fcfs"  # arrival order; the fair policy's slot handover: test_fairness.py
    reqs = [make_request(0, [5] * 10, pa="a"), make_request(1, [6] * 2, pa="b"), make_request(2, [7], pa="c"),
            make_request(3, [8] * 2), make_request(4, [9], pa="bad"), make_request(5, [4], pa="a")]
    for request in reqs[:2] + reqs[3:]:
        if request.prompt_adapter_ref not in (None, "bad"):
            request.insert_virtual_tokens(3)
        sched.add(request)
    sched.add(reqs[2])  # "c" is loading: not inserted yet
    out = sched.schedule()
    assert out.failed == [reqs[4]]
    # one slot: b waits while a's placeholders are computed; another request on "a" shares it
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("r0", 13), ("r3", 2), ("r5", 4)]
    advance(out)
    out = sched.schedule()  # a's soft prompt is computed: b may take the slot while a decodes
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == \
        [("r0", 1), ("r3", 1), ("r5", 1), ("r1", 5)]
    states["c"] = "ready"
    advance(out)
    out = sched.schedule()
    assert "r2" not in [s.request.request_id for s in out.scheduled]  # ready, but its placeholders are missing
    reqs[2].insert_virtual_tokens(2)
    advance(out)
    assert "r2" in [s.request.request_id for s in sched.schedule().scheduled]


def test_pinned_prompt_adapters_reserve_slots():
    states = {"a": "ready", "p": "ready"}
    sched = make_scheduler(states, pinned=("p",))
    request = make_request(0, [5], pa="a")
    request.insert_virtual_tokens(2)
    sched.add(request)
    out = sched.schedule()
    assert out.scheduled == [] and out.failed == [request]
    assert "can never get a device slot" in str(request.error) and "max_prompt_adapters" in str(request.error)
