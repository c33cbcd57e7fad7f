"""SamplingState: settings written once per row, freed and reused without leaks, the min_tokens ban
from the one stop rule, penalty histories read from the rows' token ids, and sampling through the
rows identical to sampling from explicit lists."""

import random

import numpy as np
import pytest
import torch

from engine_support import make_engine, run_to_completion
from lora_runner.core.scheduler_output import ContinuingRequestData, NewRequestData, SchedulerOutput
from lora_runner.core.stop_rule import stop_tokens
from lora_runner.sample.sampler import Sampler
from lora_runner.sample.sampling_state import SamplingBatch, SamplingState, explicit_batch
from lora_runner.sampling_params import SamplingParams
from lora_runner.worker.request_rows import InputBatch

V = 50
EOS = 2
ROWS = 4
FIELDS = ("temperature", "top_k", "top_p", "greedy", "num_logprobs", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "has_penalties", "ban_rows", "ban_ids")

LOADED = SamplingParams(temperature=0.7, top_k=5, top_p=0.6, seed=3, logprobs=4, presence_penalty=1.5,
                        frequency_penalty=-0.5, repetition_penalty=1.7, min_tokens=9,
                        stop_token_ids=[11, 12, 13, 14, 15, 16])  # every setting away from its default
PLAIN = SamplingParams(temperature=1.0, max_tokens=9)


def state(**kwargs):
    return SamplingState(max_num_seqs=ROWS, vocab_size=V, eos_token_ids=kwargs.pop("eos", {EOS}), **kwargs)


def tokens(rows: dict[int, list[int]]):
    """InputBatch-like token_ids [R, L] and num_tokens [R] holding `rows` {row: token ids}."""
    token_ids, num_tokens = np.zeros((ROWS, 64), np.int32), np.zeros(ROWS, np.int64)
    for row, ids in rows.items():
        token_ids[row, :len(ids)] = ids
        num_tokens[row] = len(ids)
    return token_ids, num_tokens


def assert_same_batch(got: SamplingBatch, want: SamplingBatch):
    for name in FIELDS:
        assert np.array_equal(getattr(got, name), getattr(want, name)), name
    assert [(r, id(g)) for r, g in got.seeded] == [(r, id(g)) for r, g in want.seeded]
    assert got.histories.keys() == want.histories.keys()
    for row, (prompt, generated) in want.histories.items():
        assert list(got.histories[row][0]) == list(prompt) and list(got.histories[row][1]) == list(generated)


def test_add_request_writes_every_setting_of_its_row():
    rows, generator = state(), torch.Generator().manual_seed(3)
    rows.add_request(2, LOADED, generator, num_prompt_tokens=3, prompt_start=1)
    batch = rows.batch(np.array([2]), *tokens({2: [0, 5, 6, 7, 8]}))  # 1 placeholder, 3 prompt, 1 generated
    assert (batch.temperature[0], batch.top_k[0], batch.top_p[0], batch.greedy[0]) == (
        np.float32(0.7), 5, np.float32(0.6), False)
    assert (batch.num_logprobs[0], batch.presence_penalty[0], batch.frequency_penalty[0],
            batch.repetition_penalty[0], batch.has_penalties[0]) == (4, 1.5, -0.5, np.float32(1.7), True)
    assert batch.seeded == [(0, generator)]
    assert list(batch.history(0)[0]) == [5, 6, 7] and list(batch.history(0)[1]) == [8]
    assert batch.ban_rows.tolist() == [0] * 7 and batch.ban_ids.tolist() == [EOS, 11, 12, 13, 14, 15, 16]


def test_defaults_read_as_off():
    rows = state()
    rows.add_request(0, SamplingParams(temperature=0.0, seed=1, top_k=-1), torch.Generator())
    rows.add_request(1, SamplingParams(top_k=V + 3, ignore_eos=True, min_tokens=5))
    batch = rows.batch(np.array([0, 1]), *tokens({0: [4], 1: [4]}))
    assert batch.top_k.tolist() == [V, V] and batch.num_logprobs.tolist() == [-1, -1]
    assert batch.temperature[0] == 1.0 and batch.greedy.tolist() == [True, False]
    assert batch.seeded == []  # a greedy row never draws from its generator
    assert not batch.has_penalties.any() and batch.histories == {}
    assert batch.ban_ids.size == 0  # ignore_eos and no stop ids: nothing to ban under min_tokens


@pytest.mark.parametrize("free", [True, False])
def test_a_reused_row_keeps_nothing_of_its_previous_occupant(free):
    """Row 0 held a request with every setting set (and more stop ids than the next one); the next
    occupant reads exactly what a fresh state gives it, whether or not the row was freed first."""
    rows = state()
    rows.add_request(0, LOADED, torch.Generator().manual_seed(3), num_prompt_tokens=2, prompt_start=1)
    rows.add_request(1, PLAIN)
    if free:
        rows.remove_request(0)
        assert rows.generators[0] is None and rows.params[0] is None  # nothing of it is held on to
    fresh = state()
    for target in (rows, fresh):
        target.add_request(0, SamplingParams(temperature=0.5, min_tokens=3, stop_token_ids=[20]),
                           num_prompt_tokens=2)
    history = tokens({0: [7, 8, 9], 1: [1]})
    assert_same_batch(rows.batch(np.array([0]), *history), fresh.batch(np.array([0]), *history))


def test_the_ban_is_the_stop_rules_at_the_rows_generated_count():
    """Random params and generated counts: each row's banned ids are stop_rule.stop_tokens(...).banned,
    the rule the output processor stops by."""
    rng, eos = random.Random(0), {EOS, 3}
    rows = SamplingState(max_num_seqs=8, vocab_size=V, eos_token_ids=eos)
    for trial in range(30):
        params, history = [], {}
        for row in range(8):
            p = SamplingParams(min_tokens=rng.randrange(4), ignore_eos=rng.random() < 0.3,
                               stop_token_ids=rng.sample(range(4, V), rng.randrange(4)))
            num_prompt, num_generated = rng.randrange(1, 5), rng.randrange(5)
            rows.add_request(row, p, num_prompt_tokens=num_prompt)
            params.append((p, num_generated))
            history[row] = [1] * (num_prompt + num_generated)
        order = np.array(rng.sample(range(8), rng.randrange(1, 9)))  # batch order is not row order
        token_ids = np.zeros((8, 16), np.int32)
        num_tokens = np.array([len(history[r]) for r in range(8)])
        batch = rows.batch(order, token_ids, num_tokens)
        for i, row in enumerate(order.tolist()):
            p, num_generated = params[row]
            want = stop_tokens(p, num_generated, eos).banned
            assert set(batch.ban_ids[batch.ban_rows == i].tolist()) == want, (trial, row)


def test_new_eos_ids_reach_held_rows_and_rows_placed_afterwards():
    rows = state()
    rows.add_request(0, SamplingParams(min_tokens=4, stop_token_ids=[9]))
    rows.eos_token_ids = {7}
    rows.add_request(1, SamplingParams(min_tokens=4))
    batch = rows.batch(np.array([0, 1]), *tokens({0: [5], 1: [5]}))
    assert batch.ban_ids[batch.ban_rows == 0].tolist() == [7, 9] and batch.ban_ids[batch.ban_rows == 1].tolist() == [7]


def test_histories_of_a_resumed_request_with_placeholders():
    """A request placed again after a preemption holds its generated tokens already: its prompt is
    the num_prompt_tokens after its placeholders, the rest is generated."""
    rows = state()
    rows.add_request(3, SamplingParams(frequency_penalty=1.0), num_prompt_tokens=2, prompt_start=2)
    batch = rows.batch(np.array([3]), *tokens({3: [0, 0, 30, 31, 40, 41, 40]}))
    prompt, generated = batch.history(0)
    assert prompt.tolist() == [30, 31] and generated.tolist() == [40, 41, 40]


def test_sampling_through_rows_matches_explicit_lists_token_and_logprob_exact():
    """Seeded, unseeded, greedy, penalised and min_tokens rows: the batch the rows give and the batch
    from explicit lists sample the same tokens and logprobs (the same draws, in the same order)."""
    params = [SamplingParams(temperature=0.8, seed=5, logprobs=3, top_k=10),
              SamplingParams(temperature=1.2, top_p=0.7, logprobs=1),
              SamplingParams(temperature=0.0, presence_penalty=2.0, repetition_penalty=1.4, logprobs=2),
              SamplingParams(temperature=0.9, min_tokens=3, stop_token_ids=[4])]
    histories = {0: [10, 11, 12], 1: [13, 14], 2: [15, 16, 17, 18, 15], 3: [19, 20]}
    num_prompt = {0: 3, 1: 1, 2: 3, 3: 2}
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1)) * 2
    order = np.array([2, 0, 3, 1])

    def via_rows():
        rows = state()
        for row, p in enumerate(params):
            generator = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
            rows.add_request(row, p, generator, num_prompt_tokens=num_prompt[row])
        return rows.batch(order, *tokens(histories))

    def via_lists():
        picked = [params[r] for r in order]
        gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in picked]
        hist = [(histories[r][:num_prompt[r]], histories[r][num_prompt[r]:]) for r in order]
        banned = [sorted(stop_tokens(params[r], len(hist[i][1]), {EOS}).banned) or None for i, r in enumerate(order)]
        return explicit_batch(picked, gens, hist, banned, V)

    rows_batch, list_batch = via_rows(), via_lists()
    for name in FIELDS:  # the generators are equal copies, not the same objects
        assert np.array_equal(getattr(rows_batch, name), getattr(list_batch, name)), name
    assert [r for r, _ in rows_batch.seeded] == [r for r, _ in list_batch.seeded] == [1]
    for _ in range(3):  # several steps: the seeded generators advance alike
        got = Sampler(V, "cpu", seed=9)(logits, rows_batch)
        want = Sampler(V, "cpu", seed=9)(logits, list_batch)
        assert got.token_ids == want.token_ids and got.logprobs == want.logprobs and got.errors == [None] * 4
    assert got.token_ids[2] not in (EOS, 4)  # row 3 (batch row 2) is under min_tokens


def test_a_failing_row_fails_alone_and_the_others_keep_their_bans_and_draws():
    """The one-at-a-time fallback hands each row its own ban, history and generator (SamplingBatch.row)."""
    logits = torch.zeros(3, V)
    logits[:, EOS] = 5.0  # EOS is everyone's argmax
    params = [SamplingParams(temperature=0.0, min_tokens=2), SamplingParams(temperature=0.0, repetition_penalty=1.5),
              SamplingParams(temperature=1.0, seed=4)]

    def run(rows_in_batch, histories):
        gens = [torch.Generator().manual_seed(4) if params[r].seed is not None else None for r in rows_in_batch]
        banned = [[EOS] if r == 0 else None for r in rows_in_batch]
        batch = explicit_batch([params[r] for r in rows_in_batch], gens, histories, banned, V)
        return Sampler(V, "cpu", seed=1)(logits[rows_in_batch], batch)

    alone = run([0, 2], None)
    out = run([0, 1, 2], [None, ([3, V + 1], []), None])  # row 1: a history token outside the vocabulary
    assert isinstance(out.errors[1], ValueError) and out.errors[0] is None and out.errors[2] is None
    assert out.token_ids[0] != EOS and [out.token_ids[0], out.token_ids[2]] == alone.token_ids


def test_input_batch_writes_and_frees_the_sampling_row_with_its_token_row():
    """Through the runner's rows: a finished request's generator is let go with its row, the row is
    reused by the next one, and bans and histories follow each row's own tokens (a request resumed
    after a preemption comes with its generated tokens)."""
    sampling = state()
    rows = InputBatch(max_num_seqs=ROWS, max_blocks_per_seq=2, block_size=4, sampling=sampling)

    def step(new=(), finished=(), continuing=()):
        out = SchedulerOutput(finished_ids=list(finished))
        for request_id, token_ids, num_prompt, params, generator in new:
            out.new_requests.append(NewRequestData(request_id, tuple(token_ids), 0, (0, 1), None, None, 0, params,
                                                   generator, num_prompt))
            out.scheduled_ids.append(request_id)
            out.num_scheduled_tokens.append(len(token_ids))
        for request_id, computed in continuing:
            out.continuing.append(ContinuingRequestData(request_id, computed, ()))
            out.scheduled_ids.append(request_id)
            out.num_scheduled_tokens.append(1)
        scheduled = rows.update(out)
        return scheduled, rows.sampling_batch(scheduled)

    generator = torch.Generator().manual_seed(3)
    scheduled, batch = step(new=[("a", [5, 6], 2, LOADED, generator)])
    assert rows.row_of("a") == 0 and batch.seeded == [(0, generator)] and batch.has_penalties.tolist() == [True]
    rows.commit(scheduled, [[7]])
    resumed = SamplingParams(min_tokens=3, presence_penalty=1.0)  # preempted after generating 20, 21
    scheduled, batch = step(new=[("b", [8, 9, 20, 21], 2, resumed, None)], continuing=[("a", 2)])
    # batch order: b (new), a (continuing)
    assert list(batch.history(0)[0]) == [8, 9] and list(batch.history(0)[1]) == [20, 21]
    assert list(batch.history(1)[1]) == [7]  # a generated 7
    assert batch.ban_ids[batch.ban_rows == 0].tolist() == [EOS]  # b: 2 of its min_tokens 3 generated
    rows.commit(scheduled, [[EOS + 1], [11]])
    scheduled, batch = step(finished=["a"], continuing=[("b", 4)])
    assert sampling.generators[0] is None and sampling.params[0] is None  # a's row lets go of a
    assert batch.ban_ids.size == 0  # b reached min_tokens
    rows.commit(scheduled, [[30]])
    _, batch = step(new=[("c", [12], 1, PLAIN, None)], continuing=[("b", 5)])
    assert rows.row_of("c") == 0  # a's row, reused by c: nothing of a's
    assert batch.seeded == [] and batch.has_penalties.tolist() == [False, True] and batch.ban_ids.size == 0
    assert batch.num_logprobs.tolist() == [-1, -1] and batch.top_k.tolist() == [V, V]


def test_settings_that_cannot_be_written_fail_their_row_alone_until_the_row_is_reused():
    broken = SamplingParams(temperature=0.7, presence_penalty=1.0, min_tokens=5)
    broken.logprobs = "many"  # gets past validation
    rows = state()
    rows.add_request(0, LOADED, torch.Generator().manual_seed(3))
    rows.add_request(0, broken)  # nothing of LOADED's, nor of broken's, is left to sample by
    rows.add_request(1, SamplingParams(temperature=0.0, logprobs=1))
    batch = rows.batch(np.array([1, 0]), *tokens({0: [3, 4], 1: [5]}))
    assert list(batch.errors) == [1] and batch.greedy.tolist() == [True, True] and batch.seeded == []
    assert batch.ban_ids.size == 0 and batch.histories == {} and batch.num_logprobs.tolist() == [1, -1]
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(2))
    out = Sampler(V, "cpu")(logits, batch)
    assert out.errors[0] is None and out.token_ids[0] == int(logits[0].argmax()) == next(iter(out.logprobs[0]))
    assert isinstance(out.errors[1], ValueError) and out.token_ids[1] == -1 and out.logprobs[1] is None
    rows.remove_request(0)
    rows.add_request(0, PLAIN)
    assert rows.batch(np.array([0]), *tokens({0: [3]})).errors == {}
    rows.add_request(0, broken)
    rows.add_request(0, PLAIN)  # overwritten without a free in between
    assert rows.batch(np.array([0]), *tokens({0: [3]})).errors == {}


def test_the_engines_eos_ids_reach_its_rows_running_requests_included(engine_checkpoint):
    """The engine hands its EOS ids to the runner's rows at start; a change reaches a request that is
    running already: from its next step the new id is banned under min_tokens."""
    path, _, _ = engine_checkpoint
    engine = make_engine(path)
    assert engine.runner.eos_token_ids == engine.eos_token_ids and engine.eos_token_ids
    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)
    reference = run_to_completion(engine, [("ref", [5, 6, 7], params)])["ref"].outputs[0].token_ids
    engine.add_request("swapped", [5, 6, 7], params)
    first = engine.step()  # the prefill samples the first token with the model's EOS ids
    assert first[0].outputs[0].token_ids == reference[:1]
    engine.eos_token_ids = {reference[1]}
    done = run_to_completion(engine)
    generated = done["swapped"].outputs[0].token_ids
    assert generated[1] != reference[1] and len(generated) == 6
