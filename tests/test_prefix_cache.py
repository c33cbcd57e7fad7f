"""Prefix caching without a model: block keys, the block manager's cached/evictable blocks, and the
scheduler's admission past a cached prefix (hits, preemption, isolation, a flood that evicts)."""

import random

import pytest

from adapters.versions import AdapterRef
from lora_runner.core.block_manager import BlockManager
from lora_runner.core.prefix_cache import request_block_hashes
from lora_runner.core.request import Request, RequestStatus
from lora_runner.core.scheduler import Scheduler
from lora_runner.engine.output_processor import OutputProcessor
from lora_runner.sample.sampler import SamplerOutput
from lora_runner.sampling_params import SamplingParams

BS = 4
A1 = AdapterRef("A", "/adapters/a", None, 0)
A2 = AdapterRef("A", "/adapters/a-v2", None, 1)  # "A" replaced under the same name
A1_READDED = AdapterRef("A", "/adapters/a", None, 2)  # the same files, removed and added again: a new version
B = AdapterRef("B", "/adapters/b", None, 3)
P = AdapterRef("P", "/adapters/p", None, 0)  # a prompt adapter (its own tier numbers its versions)


def make_request(i, tokens, max_tokens=2, lora=None, prompt=None, salt=None, **kwargs):
    request = Request(f"r{i}", list(tokens), SamplingParams(max_tokens=max_tokens), arrival=i, lora_ref=lora,
                      prompt_adapter_ref=prompt, cache_salt=salt, **kwargs)
    if prompt is not None:
        request.insert_virtual_tokens(4)  # the soft prompt's placeholders: one block in front
    return request


def make_scheduler(num_blocks=32, max_tokens=64, max_num_seqs=4, caching=True):
    bm = BlockManager(num_blocks, BS, enable_caching=caching)
    sched = Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens, max_loras=4,
                      adapter_state=lambda ref: "ready", max_prompt_adapters=2,
                      prompt_adapter_state=lambda ref: "ready", policy="fcfs")
    return sched, bm


def run_step(sched, out):
    num_sampled = sum(s.samples for s in out.scheduled)
    sampled = SamplerOutput.one_per_row([7] * num_sampled, [None] * num_sampled)
    results = sched.postprocess(out.scheduled, sampled, OutputProcessor(None, eos_token_ids=(), max_model_len=10**6))
    assert all(error is None for _, error in results)
    return [request for request, _ in results if request.is_finished]


def run_all(sched, requests):
    for request in requests:
        sched.add(request)
    finished, steps = [], 0
    while sched.has_unfinished():
        finished += run_step(sched, sched.schedule())
        steps += 1
        assert steps < 1000
    return finished


def admission_start(sched, request):
    """Add `request`, schedule once and return where its first chunk starts (its cached prefix)."""
    sched.add(request)
    out = sched.schedule()
    start = next(s.start for s in out.scheduled if s.request is request)
    run_step(sched, out)
    return start


PROMPT = list(range(10, 22))  # 12 tokens: 3 full blocks, of which 2 may be cached (the last token computes)


# ---------------------------------------------------------------- keys
@pytest.mark.parametrize("other", [dict(lora=A2), dict(lora=A1_READDED), dict(lora=B), dict(lora=None),
                                   dict(prompt=P), dict(lora=A1, prompt=P), dict(salt="t2"), dict(salt=None)])
def test_every_part_of_the_identity_changes_every_key(other):
    base = dict(lora=A1, prompt=None, salt="t1")
    mine = request_block_hashes(make_request(0, PROMPT, **base), BS)
    theirs = request_block_hashes(make_request(1, PROMPT, **{**base, **other}), BS)
    assert len(mine) == 3 and not set(mine) & set(theirs)
    assert request_block_hashes(make_request(2, PROMPT, **base), BS) == mine  # the same identity: the same keys


def test_a_key_chains_its_parent_and_hashes_each_block_once():
    request = make_request(0, PROMPT)
    keys = list(request_block_hashes(request, BS))
    changed_first = request_block_hashes(make_request(1, [99, *PROMPT[1:]]), BS)
    assert all(a != b for a, b in zip(keys, changed_first))  # a different first block: no later block matches
    request.token_ids += [1, 2, 3]  # 15 tokens: still 3 full blocks
    assert request_block_hashes(request, BS) is request.block_hashes and len(request.block_hashes) == 3
    request.token_ids.append(4)
    assert request_block_hashes(request, BS)[:3] == keys and len(request.block_hashes) == 4


# ---------------------------------------------------------------- block manager
def computed(bm, request_id, tokens, **kwargs):
    """Allocate a request, mark all its tokens computed and register its full blocks; returns it."""
    request = make_request(int(request_id[1:]), tokens, **kwargs)
    bm.allocate(request.request_id, len(tokens))
    request.num_computed_tokens = len(tokens)
    bm.cache_computed(request)
    return request


def test_a_freed_cached_block_counts_free_and_answers_hits():
    bm = BlockManager(8, BS, enable_caching=True)
    first = computed(bm, "r0", PROMPT)
    table = list(bm.table("r0"))
    assert bm.num_cached_blocks == 3 and bm.num_free_blocks == 5
    bm.free("r0")
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0 and bm.num_cached_blocks == 3
    again = make_request(1, PROMPT)
    prefix = bm.cached_prefix(again)
    assert prefix == table[:2]  # the last block stays to compute: the request needs its own logits
    assert bm.can_allocate("r1", 12, prefix)
    assert bm.allocate("r1", 12, prefix)[:2] == prefix
    assert [bm.ref_count(b) for b in prefix] == [1, 1] and bm.num_free_blocks == 5
    assert first.block_hashes == again.block_hashes


def test_a_block_in_use_is_shared_not_overwritten_and_evicted_only_once_free():
    bm = BlockManager(4, BS, enable_caching=True)
    computed(bm, "r0", PROMPT)  # holds 3 of 4 blocks, all cached
    prefix = bm.cached_prefix(make_request(1, PROMPT))
    bm.allocate("r1", 12, prefix)  # shares 2 held blocks, takes the one free block
    assert [bm.ref_count(b) for b in prefix] == [2, 2] and bm.num_free_blocks == 0
    assert not bm.can_allocate("r2", 4)  # held cached blocks are never taken
    bm.free("r0")
    assert bm.num_free_blocks == 1  # r0's last block only: the shared ones are still r1's
    assert bm.allocate("r2", 4) == [bm.table("r2")[0]] and bm.table("r2")[0] not in prefix


def test_allocation_takes_uncached_blocks_first_then_chain_ends_before_parents():
    bm = BlockManager(6, BS, enable_caching=True)
    computed(bm, "r0", PROMPT)  # blocks a0 a1 a2 cached
    chain = list(bm.table("r0"))
    bm.free("r0")
    uncached = set(range(6)) - set(chain)
    assert set(bm.allocate("r1", 12)) == uncached and bm.num_cached_blocks == 3
    assert bm.allocate("r2", 4) == [chain[2]]  # the end of the chain goes first
    assert bm.num_cached_blocks == 2 and bm.cached_prefix(make_request(3, PROMPT)) == chain[:2]
    assert bm.allocate("r4", 4) == [chain[1]]
    assert bm.cached_prefix(make_request(5, PROMPT)) == chain[:1]


def test_caching_off_keeps_nothing_and_reuses_the_most_recently_freed_block_first():
    bm = BlockManager(8, BS)
    computed(bm, "r0", PROMPT)
    last = bm.table("r0")[-1]
    bm.free("r0")
    assert bm.num_cached_blocks == 0 and bm.cached_prefix(make_request(1, PROMPT)) == []
    assert bm.allocate("r1", 4) == [last]


def test_a_second_copy_of_a_computed_prefix_stays_uncached():
    bm = BlockManager(8, BS, enable_caching=True)
    computed(bm, "r0", PROMPT)
    computed(bm, "r1", PROMPT)  # computed at the same time (no hit): r0's blocks keep the keys
    assert bm.num_cached_blocks == 3
    twin = list(bm.table("r1"))
    bm.free("r1")
    assert bm.allocate("r2", 12) == twin[::-1]  # uncached: plain free blocks, the most recently freed first
    assert bm.cached_prefix(make_request(3, PROMPT)) == bm.table("r0")[:2]


# ---------------------------------------------------------------- scheduler
def test_a_repeated_prompt_starts_past_its_cached_blocks_and_counts_the_hit():
    sched, bm = make_scheduler()
    run_all(sched, [make_request(0, PROMPT)])
    again = make_request(1, PROMPT)
    assert admission_start(sched, again) == 8 and again.num_cached_tokens == 8
    assert (sched.prefix_query_tokens, sched.prefix_hit_tokens) == (24, 8)
    run_all(sched, [])
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("other", [dict(lora=A2), dict(lora=B), dict(lora=None), dict(salt="t2"),
                                   dict(prompt=P), dict(lora=A1, prompt=P)])
def test_only_the_same_lora_version_prompt_adapter_and_salt_hit(other):
    sched, _ = make_scheduler()
    run_all(sched, [make_request(0, PROMPT, lora=A1, salt="t1")])
    assert admission_start(sched, make_request(1, PROMPT, **{"lora": A1, "salt": "t1", **other})) == 0
    assert admission_start(sched, make_request(2, PROMPT, lora=A1, salt="t1")) == 8


@pytest.mark.parametrize("length, cached", [(4, 0), (5, 4), (8, 4), (9, 8)])
def test_exactly_one_block_and_one_token_past_a_block(length, cached):
    sched, _ = make_scheduler()
    run_all(sched, [make_request(0, PROMPT[:length], max_tokens=1)])
    assert admission_start(sched, make_request(1, PROMPT[:length])) == cached


def test_generated_tokens_are_cached_for_the_next_turn():
    sched, _ = make_scheduler()
    (first,) = run_all(sched, [make_request(0, PROMPT[:6], max_tokens=4)])  # 6 + 4 tokens, 9 computed
    next_turn = make_request(1, first.token_ids + [40, 41, 42])
    assert admission_start(sched, next_turn) == 8


def test_a_preempted_request_resumes_through_the_cache():
    sched, bm = make_scheduler(num_blocks=5, max_tokens=64)
    a, b = make_request(0, list(range(1, 9)), max_tokens=8), make_request(1, list(range(50, 57)), max_tokens=8)
    sched.add(a)
    sched.add(b)
    run_step(sched, sched.schedule())  # a: 9 tokens, b: 8, both computed, 4 blocks held
    run_step(sched, sched.schedule())  # a needs its third block
    out = sched.schedule()
    while not out.preempted_ids:
        run_step(sched, out)
        out = sched.schedule()
    assert out.preempted_ids == ["r1"] and b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    run_step(sched, out)
    starts = []
    while b.status is not RequestStatus.RUNNING:
        out = sched.schedule()
        starts += [s.start for s in out.scheduled if s.request is b]
        run_step(sched, out)
    assert starts and starts[0] > 0 and starts[0] % BS == 0  # its computed blocks survived as cached ones
    assert b.num_cached_tokens == 0  # counted at its first admission only
    run_all(sched, [])
    assert bm.num_free_blocks == bm.num_blocks


def test_a_flood_of_distinct_prompts_evicts_without_failing_anyone():
    sched, bm = make_scheduler(num_blocks=12, max_tokens=32)
    rng = random.Random(0)
    flood = [make_request(i, [rng.randrange(3, 200) for _ in range(15)], max_tokens=3) for i in range(30)]
    finished = run_all(sched, flood)
    assert len(finished) == 30 and all(r.finish_reason == "length" for r in finished)
    assert bm.num_cached_blocks <= bm.num_blocks and bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("seed", range(4))
def test_random_shared_prefixes_keep_the_counts_consistent(seed):
    rng = random.Random(seed)
    sched, bm = make_scheduler(num_blocks=rng.randint(8, 14), max_tokens=rng.choice([8, 16]), max_num_seqs=3)
    stems = [[rng.randrange(3, 200) for _ in range(rng.randint(4, 12))] for _ in range(3)]
    pending = [make_request(i, rng.choice(stems) + [rng.randrange(3, 200) for _ in range(rng.randint(1, 5))],
                            max_tokens=rng.randint(1, 6), salt=rng.choice([None, "t"])) for i in range(25)]
    finished, steps = [], 0
    while pending or sched.has_unfinished():
        if pending and rng.random() < 0.6:
            sched.add(pending.pop(0))
        out = sched.schedule()
        for s in out.scheduled:
            assert s.start == s.request.num_computed_tokens
        refs = {}
        for holder in bm.holders():
            for block in bm.table(holder):
                refs[block] = refs.get(block, 0) + 1
        assert all(bm.ref_count(block) == n for block, n in refs.items())
        assert len(refs) == bm.num_used_blocks  # held blocks are exactly the non-free ones
        finished += run_step(sched, out)
        steps += 1
        assert steps < 2000
    assert len(finished) == 25 and bm.num_free_blocks == bm.num_blocks
    assert sched.prefix_hit_tokens > 0
