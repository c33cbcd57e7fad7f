"""Scheduler: continuous batching, chunked prefill, preemption by recompute, adapter-aware admission."""

import random

import pytest

from lora_runner.core.block_manager import BlockManager
from lora_runner.core.request import Request, RequestStatus
from lora_runner.core.scheduler import Scheduler
from lora_runner.engine.output_processor import OutputProcessor
from lora_runner.sample.sampler import SamplerOutput
from lora_runner.sampling_params import SamplingParams


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=4, max_tokens=32, max_loras=2, states=None,
                   policy="fair"):
    states = {} if states is None else states
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
                      max_loras=max_loras, adapter_state=lambda ref: states[ref], policy=policy)
    return sched, bm


def make_request(i, prompt_len, max_tokens=4, lora=None, tenant=None):
    """tenant None: every request is the base model's tenant "" (fair admission is then FIFO)."""
    return Request(f"r{i}", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                   arrival=i, lora_ref=lora, tenant=tenant)


def run_step(sched, out, next_token=7):
    """What the engine does after the model ran (the shared Scheduler.postprocess): advance, append
    sampled tokens, finish; returns the requests that finished."""
    num_sampled = sum(s.samples for s in out.scheduled)
    sampled = SamplerOutput.one_per_row([next_token] * num_sampled, [None] * num_sampled)
    results = sched.postprocess(out.scheduled, sampled, OutputProcessor(None, eos_token_ids=(), max_model_len=10**6))
    assert all(error is None for _, error in results)
    return [request for request, _ in results if request.is_finished]


def test_prefill_then_decode_and_join_between_steps():
    sched, bm = make_scheduler(max_tokens=32)
    a, b = make_request(0, 10), make_request(1, 6)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.request, s.start, s.num_new_tokens, s.samples) for s in out.scheduled] == \
        [(a, 0, 10, True), (b, 0, 6, True)]
    run_step(sched, out)
    c = make_request(2, 5)
    sched.add(c)  # joins while a and b decode
    out = sched.schedule()
    assert [(s.request, s.start, s.num_new_tokens) for s in out.scheduled] == [(a, 10, 1), (b, 6, 1), (c, 0, 5)]
    assert len(bm.table("r0")) == 3  # 11 tokens in blocks of 4


def test_chunked_prefill_under_token_budget():
    sched, _ = make_scheduler(max_tokens=8)
    a, b = make_request(0, 13), make_request(1, 3)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.request, s.num_new_tokens, s.samples) for s in out.scheduled] == [(a, 8, False)]
    run_step(sched, out)
    out = sched.schedule()  # a's last 5 tokens, then b's 3: the budget is exactly used
    assert [(s.request, s.start, s.num_new_tokens, s.samples) for s in out.scheduled] == \
        [(a, 8, 5, True), (b, 0, 3, True)]


def test_max_num_seqs_limits_admission():
    sched, _ = make_scheduler(max_num_seqs=2)
    reqs = [make_request(i, 3) for i in range(4)]
    for r in reqs:
        sched.add(r)
    out = sched.schedule()
    assert [s.request for s in out.scheduled] == reqs[:2]
    assert list(sched.waiting) == reqs[2:]


def test_preemption_recomputes_newest_and_requeues_it_first():
    sched, bm = make_scheduler(num_blocks=4, block_size=4, max_tokens=64)
    a, b = make_request(0, 8, max_tokens=8), make_request(1, 7, max_tokens=8)
    sched.add(a)
    sched.add(b)
    run_step(sched, sched.schedule())  # a: 9 tokens (needs block 3 next), b: 8 tokens
    assert bm.num_free_blocks == 0
    out = sched.schedule()  # a needs a third block: b (newest) is preempted
    assert out.preempted_ids == ["r1"] and [s.request for s in out.scheduled] == [a]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and bm.table("b") == []
    assert sched.waiting[0] is b and b.num_preemptions == 1
    run_step(sched, out)
    while a.status is not RequestStatus.FINISHED:
        out = sched.schedule()
        assert b not in [s.request for s in out.scheduled]  # a holds every block
        run_step(sched, out)
    out = sched.schedule()  # b comes back and recomputes prompt + its generated token
    assert [(s.request, s.start, s.num_new_tokens) for s in out.scheduled] == [(b, 0, 8)]


def test_single_request_preempts_itself_only_when_alone_and_full():
    sched, bm = make_scheduler(num_blocks=2, block_size=4)
    a = make_request(0, 8, max_tokens=4)
    sched.add(a)
    run_step(sched, sched.schedule())
    out = sched.schedule()
    assert out.preempted_ids == ["r0"] and out.scheduled == [] and bm.num_free_blocks == 2


def test_loading_adapter_is_skipped_not_waited_on():
    states = {"A": "loading", "B": "ready"}
    sched, _ = make_scheduler(states=states)
    a, base, b = make_request(0, 3, lora="A"), make_request(1, 3), make_request(2, 3, lora="B")
    for r in (a, base, b):
        sched.add(r)
    out = sched.schedule()
    assert [s.request for s in out.scheduled] == [base, b] and list(sched.waiting) == [a]
    run_step(sched, out)
    states["A"] = "ready"
    out = sched.schedule()
    assert [s.request for s in out.scheduled] == [base, b, a]


def test_failed_adapter_is_handed_back_alone():
    states = {"A": "failed", "B": "ready"}
    sched, bm = make_scheduler(states=states)
    a, b = make_request(0, 3, lora="A"), make_request(1, 3, lora="B")
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert out.failed == [a] and [s.request for s in out.scheduled] == [b]
    assert a not in sched.waiting and bm.table("r0") == []


def test_at_most_max_loras_distinct_adapters_run():
    states = {"A": "ready", "B": "ready", "C": "ready"}
    sched, _ = make_scheduler(max_num_seqs=8, max_loras=2, states=states)
    reqs = [make_request(0, 3, lora="A"), make_request(1, 3, lora="B"), make_request(2, 3, lora="C"),
            make_request(3, 3, lora="A"), make_request(4, 3)]
    for r in reqs:
        sched.add(r)
    out = sched.schedule()
    assert [s.request for s in out.scheduled] == [reqs[0], reqs[1], reqs[3], reqs[4]]
    assert list(sched.waiting) == [reqs[2]]


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
@pytest.mark.parametrize("seed", range(6))
def test_random_workload_keeps_invariants_and_frees_every_block(seed, policy):
    rng = random.Random(seed)
    states = {name: "ready" for name in "ABCDE"}
    max_loras, max_seqs, budget = 2, 3, rng.choice([4, 8, 16])
    sched, bm = make_scheduler(num_blocks=rng.randint(6, 12), block_size=4, max_num_seqs=max_seqs,
                               max_tokens=budget, max_loras=max_loras, states=states, policy=policy)
    loras = [rng.choice([None, *"ABCDE"]) for _ in range(20)]  # one tenant per adapter: handover runs too
    pending = [make_request(i, rng.randint(1, 12), max_tokens=rng.randint(1, 10), lora=lora, tenant=lora or "")
               for i, lora in enumerate(loras)]
    finished, steps = [], 0
    while pending or sched.has_unfinished():
        for _ in range(rng.randint(0, 2)):
            if pending:
                sched.add(pending.pop(0))
        out = sched.schedule()
        assert out.num_tokens <= budget and len(out.scheduled) <= max_seqs
        assert len({s.request.lora_ref for s in out.scheduled} - {None}) <= max_loras
        for s in out.scheduled:
            assert s.start == s.request.num_computed_tokens
            assert len(bm.table(s.request.request_id)) * 4 >= s.start + s.num_new_tokens
        held = sum(len(bm.table(r)) for r in bm.holders())
        assert held == bm.num_used_blocks
        finished += run_step(sched, out)
        steps += 1
        assert steps < 2000
    assert len(finished) == 20 and bm.num_free_blocks == bm.num_blocks
    assert all(r.num_output_tokens == r.params.max_tokens for r in finished)
    assert not any(sched.fairness.is_active(t) for t in ["", *"ABCDE"])  # every join left again


def test_pinned_slots_outside_the_step_reduce_lora_room():
    states = {"A": "ready", "B": "ready", "P": "ready"}
    pinned = {"P"}
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_loras=2,
                      adapter_state=lambda ref: states[ref], reserved_lora_slots=lambda refs: len(pinned - refs))
    a, b, p = make_request(0, 3, lora="A"), make_request(1, 3, lora="B"), make_request(2, 3, lora="P")
    for r in (a, b, p):
        sched.add(r)
    out = sched.schedule()  # P keeps a slot, so only one of A/B fits; P itself needs no extra slot
    assert [s.request for s in out.scheduled] == [a, p] and list(sched.waiting) == [b]


def test_adapter_that_can_never_get_a_slot_fails_with_capacity_error():
    from adapters import AdapterCapacityError

    states = {"A": "ready"}
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_loras=2,
                      adapter_state=lambda ref: states[ref], reserved_lora_slots=lambda refs: 2)
    a, base = make_request(0, 3, lora="A"), make_request(1, 3)
    sched.add(a)
    sched.add(base)
    out = sched.schedule()
    assert out.failed == [a] and isinstance(a.error, AdapterCapacityError) and "pinned" in str(a.error)
    assert [s.request for s in out.scheduled] == [base]


def test_postprocess_finishes_frees_and_leaves_a_failed_append_to_the_caller():
    sched, bm = make_scheduler()
    a, b, c = make_request(0, 3, max_tokens=1), make_request(1, 3, max_tokens=1), make_request(2, 3, max_tokens=1)
    for r in (a, b, c):
        sched.add(r)
    out = sched.schedule()

    def decode(ids):
        if 99 in ids:
            raise RuntimeError("cannot decode 99")
        return " ".join(map(str, ids))

    sampler_error = FloatingPointError("row 2")
    sampled = SamplerOutput.one_per_row([7, 99, -1], [None] * 3, [None, None, sampler_error])
    results = sched.postprocess(out.scheduled, sampled, OutputProcessor(decode, eos_token_ids=(), max_model_len=64))
    assert [r for r, _ in results] == [a, b, c]
    assert results[0][1] is None and a.finish_reason == "length" and bm.holders() == ["r1", "r2"]
    assert isinstance(results[1][1], RuntimeError) and not b.is_finished  # the caller finishes it with "error"
    assert results[2][1] is sampler_error and c.token_ids == [1, 2, 3]  # a failed row appends nothing
    assert all(r.num_computed_tokens == 3 for r in (a, b, c))


def test_postprocess_takes_each_rows_tokens_in_order_and_drops_those_after_a_finish():
    """Rows of several tokens (speculative decoding's verified tokens): a request that reaches
    max_tokens on the 2nd of 3 keeps 2 and is freed; one that does not keeps all; a failed row none."""
    sched, bm = make_scheduler()
    a, b, c = make_request(0, 3, max_tokens=2), make_request(1, 3, max_tokens=8), make_request(2, 3, max_tokens=8)
    for r in (a, b, c):
        sched.add(r)
    out = sched.schedule()
    error = FloatingPointError("row 2")
    sampled = SamplerOutput([[7, 8, 9], [10, 11, 12], []], [[None] * 3, [None] * 3, []], [None, None, error])
    results = sched.postprocess(out.scheduled, sampled, OutputProcessor(None, eos_token_ids=(), max_model_len=64))
    assert [(r, e) for r, e in results] == [(a, None), (b, None), (c, error)]
    assert a.output_token_ids == [7, 8] and a.finish_reason == "length" and bm.holders() == ["r1", "r2"]
    assert b.output_token_ids == [10, 11, 12] and not b.is_finished and c.output_token_ids == []
    assert [r.num_computed_tokens for r in (a, b, c)] == [3, 3, 3]
    sched.remove(c)  # what the engine does with a failed request
    out = sched.schedule()  # b's 3 sampled tokens, none computed yet, are its next chunk
    assert [(s.request, s.start, s.num_new_tokens, s.samples) for s in out.scheduled] == [(b, 3, 3, True)]
    assert out.finished_ids == ["r0", "r2"]


def test_output_says_what_is_new_what_continues_and_what_left():
    """The runner's rows read only these fields: new requests in full, continuing ones as block
    diffs, preempted ids at once and finished ids with the next output."""
    sched, bm = make_scheduler(num_blocks=4, block_size=4, max_tokens=64)
    a, b = make_request(0, 8, max_tokens=8), make_request(1, 7, max_tokens=1)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [n.request_id for n in out.new_requests] == ["r0", "r1"] and out.continuing == []
    assert out.new_requests[0].token_ids == tuple(a.token_ids) and out.new_requests[0].num_computed_tokens == 0
    assert out.new_requests[0].block_ids == tuple(bm.table("r0")) and len(bm.table("r0")) == 2
    assert out.scheduled_ids == ["r0", "r1"] and out.num_scheduled_tokens == [8, 7]
    run_step(sched, out)  # b finishes (max_tokens=1): its id comes with the next output
    assert b.is_finished
    out = sched.schedule()
    assert out.finished_ids == ["r1"] and out.new_requests == [] and out.preempted_ids == []
    assert [(c.request_id, c.num_computed_tokens, c.new_block_ids) for c in out.continuing] == \
        [("r0", 8, tuple(bm.table("r0")[2:]))]  # token 8 starts a third block: only it is sent
    run_step(sched, out)
    out = sched.schedule()
    assert out.finished_ids == [] and [(c.request_id, c.new_block_ids) for c in out.continuing] == [("r0", ())]


def test_a_preempted_request_is_reported_at_once_and_comes_back_in_full():
    sched, bm = make_scheduler(num_blocks=4, block_size=4, max_tokens=64)
    a, b = make_request(0, 8, max_tokens=8), make_request(1, 7, max_tokens=8)
    sched.add(a)
    sched.add(b)
    run_step(sched, sched.schedule())  # a: 9 tokens, b: 8 tokens, no block free
    out = sched.schedule()  # a needs a third block: b is preempted
    assert out.preempted_ids == ["r1"] and out.scheduled_ids == ["r0"] and out.finished_ids == []
    assert [(c.request_id, len(c.new_block_ids)) for c in out.continuing] == [("r0", 1)]
    run_step(sched, out)
    while not a.is_finished:
        out = sched.schedule()
        run_step(sched, out)
    out = sched.schedule()
    assert out.finished_ids == ["r0"] and out.continuing == []
    [resumed] = out.new_requests  # its row was freed: it comes back as new, its generated token too
    assert (resumed.request_id, resumed.num_computed_tokens, resumed.token_ids) == ("r1", 0, tuple(b.token_ids))
    assert len(b.token_ids) == 8 and resumed.block_ids == tuple(bm.table("r1"))


def test_a_waiting_request_without_kv_blocks_holds_back_those_behind_it():
    """Admission in line order: when the first waiting request finds too few free KV blocks, a
    later one that would fit must not jump ahead of it (it would keep the first one starving)."""
    sched, bm = make_scheduler(num_blocks=4, block_size=4, max_tokens=64)
    a = make_request(0, 7, max_tokens=8)  # holds 2 of the 4 blocks (8 tokens in its second step)
    sched.add(a)
    run_step(sched, sched.schedule())
    big, small = make_request(1, 12), make_request(2, 3)  # big needs 3 blocks, small 1 (2 are free)
    sched.add(big)
    sched.add(small)
    out = sched.schedule()
    assert [s.request for s in out.scheduled] == [a] and list(sched.waiting) == [big, small]
    assert bm.num_free_blocks == 2
