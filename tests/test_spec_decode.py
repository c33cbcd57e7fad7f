"""Speculative decoding's parts without a model: the config, n-gram proposals, the scheduler's
budget and rollback, the rows' draft positions, and the rejection sampler (greedy exactness and the
sampled distribution, by chi-square on a small vocabulary)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from lora_runner.config import EngineConfig
from lora_runner.core.block_manager import BlockManager
from lora_runner.core.request import Request
from lora_runner.core.scheduler import Scheduler
from lora_runner.entrypoints.vllm_compat import engine_kwargs
from lora_runner.sample.sampler import Sampler, SamplerOutput
from lora_runner.sampling_params import SamplingParams
from lora_runner.spec_decode.config import SpeculativeConfig
from lora_runner.spec_decode.adaptive import SpeculationPolicy
from lora_runner.spec_decode.ngram import Speculator, propose_ngram
from lora_runner.spec_decode.rejection_sampler import RejectionSampler
from lora_runner.worker.batch_builder import BatchBuilder
from lora_runner.worker.request_rows import InputBatch

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


# ------------------------------------------------------------------ config
def test_config_parses_vllm_spelling_and_json_text():
    text = '{"method": "ngram", "num_speculative_tokens": 2}'
    config = EngineConfig(model="m", device="cpu", speculative_config=text)
    assert config.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    assert config.speculative() == SpeculativeConfig("ngram", 2, 5, 5)  # vLLM's default lookup size
    assert SpeculativeConfig.parse({**NGRAM, "prompt_lookup_min": None}) == SpeculativeConfig("ngram", 3, 3, 3)
    assert EngineConfig(model="m", device="cpu").speculative() is None
    assert engine_kwargs("m", {"speculative_config": NGRAM}) == {"speculative_config": NGRAM}  # LLM(...) as vLLM


@pytest.mark.parametrize("value, message", [
    ({"method": "eagle", "model": "m", "num_speculative_tokens": 2}, "not supported yet"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, 'needs "model"'),
    ({"method": "draft_model", "model": "m", "num_speculative_tokens": 2, "prompt_lookup_min": 2}, "unknown keys"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "not supported yet"),
    ({"method": "ngramm", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram"}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({**NGRAM, "prompt_lookup_min": 4}, "must be <= prompt_lookup_max"),
    ({**NGRAM, "typo": 1}, "unknown keys"),
    ("{not json", "must be a JSON object"),
    ("[1, 2]", "must be a dict"),
])
def test_config_refuses_what_it_cannot_do(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", device="cpu", speculative_config=value)


# ------------------------------------------------------------------ n-gram proposals
@pytest.mark.parametrize("tokens, k, low, high, expected", [
    ([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, 1, 3, [7, 1]),  # the most recent earlier occurrence of [1, 2, 3]
    ([1, 2, 3, 4, 5, 1, 2], 5, 2, 2, [3, 4, 5, 1, 2]),  # k tokens after the match, up to the end
    ([5, 6, 5, 7, 8, 7], 3, 1, 3, [8, 7]),  # [7, 8, 7] and [8, 7] miss; [7] at 3 hits
    ([1, 2, 3, 4], 3, 1, 3, []),  # nothing repeats
    ([4, 4, 4, 4], 2, 2, 3, [4]),  # overlapping occurrence: [4, 4, 4] at 0 is followed by one token
    ([1, 2, 1, 3, 1, 2], 2, 1, 1, [1, 3]),  # n = 1 only: [2] at index 1 is followed by 1, 3
])
def test_ngram_proposes_what_followed_the_most_recent_match(tokens, k, low, high, expected):
    assert propose_ngram(np.asarray(tokens), k, low, high) == expected


def test_ngram_prefers_the_longest_n():
    # last 2 tokens [1, 2] occur at 0 (then 8); the last 1 token [2] occurs more recently at 5 (then 9)
    tokens = np.asarray([1, 2, 8, 0, 0, 2, 9, 1, 2])
    assert propose_ngram(tokens, 1, 1, 2) == [8]
    assert propose_ngram(tokens, 1, 1, 1) == [9]


def _request(prompt, output=(), **params) -> Request:
    request = Request("r", list(prompt), SamplingParams(temperature=0.0, **params), arrival=0)
    request.token_ids += list(output)
    return request


def test_speculator_bounds_drafts_for_every_kind_of_request():
    speculator = Speculator(SpeculativeConfig.parse(NGRAM), max_model_len=64)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    assert speculator.drafts(_request(prompt, max_tokens=20), budget=100) == [7, 8, 5]
    assert speculator.drafts(_request(prompt, max_tokens=20), budget=3) == [7, 8]  # the last token takes one
    assert speculator.drafts(_request(prompt, [7], max_tokens=3), budget=100) == [8]  # 2 tokens left: 1 draft
    assert speculator.drafts(_request(prompt, max_tokens=1), budget=100) == []
    assert Speculator(SpeculativeConfig.parse(NGRAM), max_model_len=11).drafts(
        _request(prompt, max_tokens=20), budget=100) == [7]  # no draft past max_model_len
    # settings applied per verified position (tests/test_spec_decode_rows.py) do not stop proposals
    assert speculator.drafts(_request(prompt, max_tokens=20, repetition_penalty=1.2), budget=100) == [7, 8, 5]
    assert speculator.drafts(_request(prompt, max_tokens=20, min_tokens=5), budget=100) == [7, 8, 5]


# ------------------------------------------------------------------ scheduler: budget, blocks, rollback
def _scheduler(num_blocks=32, budget=64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 4, enable_caching=True), max_num_seqs=4, max_num_batched_tokens=budget,
                     max_loras=1, adapter_state=lambda ref: "ready",
                     speculator=SpeculationPolicy(Speculator(SpeculativeConfig.parse(NGRAM), max_model_len=64),
                                                  SpeculativeConfig.parse(NGRAM)))


class _Appender:
    """An OutputProcessor that appends every token and never stops."""

    def append(self, request, tokens, logprobs):
        request.token_ids += tokens

    def finish(self, request, reason):
        return reason


def test_scheduler_budgets_drafts_and_rolls_back_rejected_ones():
    scheduler = _scheduler()
    request = _request([5, 6, 7, 8, 5, 6, 7, 8, 5], max_tokens=20)
    scheduler.add(request)
    out = scheduler.schedule()  # prefill: never speculates
    assert out.scheduled_spec_decode_tokens == {} and out.num_scheduled_tokens == [9]
    scheduler.postprocess(out.scheduled, SamplerOutput([[6]], [[None]]), _Appender())
    out = scheduler.schedule()  # decode: the last token + 3 drafts, and blocks for all of them
    assert out.scheduled_spec_decode_tokens == {"r": (7, 8, 5)} and out.num_scheduled_tokens == [4]
    assert out.scheduled[0].samples
    assert len(scheduler.block_manager.table("r")) == 4  # 13 tokens of 4
    scheduler.postprocess(out.scheduled, SamplerOutput([[7, 8, 1]], [[None] * 3]), _Appender())  # 2 accepted
    assert request.num_computed_tokens == 12 and request.num_tokens == 13  # 10 + 2 accepted; the new token next
    assert (request.spec.num_draft_tokens, request.spec.num_accepted_tokens) == (3, 2)
    assert request.spec.accepted_per_position == [1, 1, 0] and scheduler.spec.num_drafts == 1
    out = scheduler.schedule()
    assert out.continuing[0].num_computed_tokens == 12


def test_prefix_cache_registers_only_blocks_of_accepted_tokens():
    scheduler = _scheduler()
    request = _request([5, 6, 7, 8, 5, 6, 7, 8, 5], max_tokens=20)
    scheduler.add(request)
    out = scheduler.schedule()
    scheduler.postprocess(out.scheduled, SamplerOutput([[6]], [[None]]), _Appender())
    assert scheduler.block_manager.num_cached_blocks == 2  # tokens 0..7
    out = scheduler.schedule()  # verifies tokens 9..12: the block of tokens 8..11 fills up with 2 drafts
    assert out.scheduled_spec_decode_tokens == {"r": (7, 8, 5)}
    scheduler.postprocess(out.scheduled, SamplerOutput([[9]], [[None]]), _Appender())  # all 3 rejected
    assert request.num_computed_tokens == 10 and scheduler.block_manager.num_cached_blocks == 2


def test_speculation_never_preempts_and_a_small_budget_shortens_drafts():
    scheduler = _scheduler(num_blocks=3, budget=2)
    request = _request([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], max_tokens=20)
    scheduler.add(request)
    for _ in range(5):  # the prompt in chunks of 2; the last one samples 7
        out = scheduler.schedule()
        sampled = [[7]] if out.scheduled[0].samples else []
        scheduler.postprocess(out.scheduled, SamplerOutput(sampled, [[None]] * len(sampled)), _Appender())
    out = scheduler.schedule()  # 11 tokens, 10 computed: a budget of 2 leaves room for one draft
    assert out.scheduled_spec_decode_tokens == {"r": (8,)}
    scheduler.postprocess(out.scheduled, SamplerOutput([[5]], [[None]]), _Appender())  # rejected: 5 instead
    assert request.num_computed_tokens == 11 and request.num_tokens == 12
    out = scheduler.schedule()  # its draft (6) would need a 4th block: there are 3, so none is proposed
    assert out.scheduled_spec_decode_tokens == {} and out.num_scheduled_tokens == [1]
    assert scheduler.num_preemptions == 0


# ------------------------------------------------------------------ rows and sample indices
def test_rows_read_drafts_sample_every_position_and_commit_accepted_ones():
    scheduler = _scheduler()
    rows = InputBatch(max_num_seqs=4, max_blocks_per_seq=16, block_size=4)
    builder = BatchBuilder(max_num_tokens=32, max_num_seqs=4, max_blocks_per_seq=16, block_size=4, device="cpu")
    a, b = _request([5, 6, 7, 5, 6], max_tokens=20), _request([9, 10, 11, 12], max_tokens=20)
    b.request_id = "b"
    for request in (a, b):
        scheduler.add(request)
    out = scheduler.schedule()
    step = rows.update(out)
    rows.commit(step, [[7], [13]])
    scheduler.postprocess(out.scheduled, SamplerOutput([[7], [13]], [[None], [None]]), _Appender())
    out = scheduler.schedule()  # a: [7] + drafts [5, 6, 7]; b: nothing repeats
    assert out.scheduled_spec_decode_tokens == {"r": (5, 6, 7)}
    step = rows.update(out)
    assert step.drafts.tolist() == [3, 0] and step.seqs.sample.tolist() == [True, True]
    assert rows.draft_tokens(step) == [[5, 6, 7], []]
    shape = builder.write_rows(rows.token_ids, rows.block_tables, step.rows, step.starts, step.lens, step.seqs)
    assert builder.input_ids.np[:shape.num_tokens].tolist() == [7, 5, 6, 7, 13]
    assert builder.sample_indices.np[:shape.num_samples].tolist() == [0, 1, 2, 3, 4]
    rows.commit(step, [[5, 8], [14]])  # a accepted 1 of 3 drafts
    row = rows.row_of("r")
    assert rows.num_computed[row] == 7 and rows.num_tokens[row] == 8
    assert rows.token_ids[row, :8].tolist() == [5, 6, 7, 5, 6, 7, 5, 8]
    scheduler.postprocess(out.scheduled, SamplerOutput([[5, 8], [14]], [[None] * 2, [None]]), _Appender())
    rows.update(scheduler.schedule())  # the scheduler's rolled-back count agrees with the row's


# ------------------------------------------------------------------ rejection sampler
VOCAB = 6


def _verify(logits_per_position, drafts, params, generators=None):
    sampler = Sampler(VOCAB, "cpu", seed=0)
    counts = [len(d) + 1 for d in drafts]
    batch = sampler.make_batch(params, generators or [None] * len(params))
    batch = batch.select(np.repeat(np.arange(len(drafts)), counts))
    return RejectionSampler(sampler)(logits_per_position, batch, drafts)


def test_greedy_accepts_while_drafts_equal_the_argmax_then_takes_the_argmax():
    argmax = [[3, 1, 4, 2], [5, 0], [2]]  # per sequence, the argmax at each position
    logits = torch.cat([torch.nn.functional.one_hot(torch.tensor(a), VOCAB).float() * 5 for a in argmax])
    drafts = [[3, 1, 0], [5], []]
    out = _verify(logits, drafts, [SamplingParams(temperature=0.0, logprobs=1)] * 3)
    assert out.sampled_token_ids == [[3, 1, 4], [5, 0], [2]]  # mismatch at the 3rd; all accepted + bonus; none
    lp = torch.log_softmax(logits, dim=-1)
    assert out.sampled_logprobs[0][2][4] == pytest.approx(float(lp[2, 4]))  # the position's own logprobs


def _chi_square_first_token(temperature, top_k, draft, trials=6000, seed=0):
    """Sample `trials` one-draft sequences over fixed logits; returns (p-value, observed, expected) of
    the first token against the sampler's own distribution at that position."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(2, VOCAB, generator=gen) * 1.5  # [positions, V]
    logits = base.repeat(trials, 1)  # [2 * trials, V]
    params = SamplingParams(temperature=temperature, top_k=top_k)
    sampler = Sampler(VOCAB, "cpu", seed=seed)
    batch = sampler.make_batch([params], [None]).select(np.zeros(2 * trials, np.int64))
    out = RejectionSampler(sampler)(logits, batch, [[draft]] * trials)
    first = np.asarray([tokens[0] for tokens in out.sampled_token_ids])
    prepared = sampler.prepare(base[:1], sampler.make_batch([params], [None]))
    p = sampler.probs(prepared.penalized, prepared.settings)[0].numpy().astype(np.float64)
    observed = np.bincount(first, minlength=VOCAB)
    support = p > 0
    assert observed[~support].sum() == 0, "a token outside top-k was sampled"
    accepted = np.asarray([len(tokens) == 2 for tokens in out.sampled_token_ids])
    return chisquare(observed[support], p[support] / p[support].sum() * trials).pvalue, accepted.mean(), p[draft]


@pytest.mark.parametrize("temperature, top_k, draft", [(1.0, -1, 0), (0.7, 4, 2), (1.3, -1, 5), (1.0, 2, 3)])
def test_rejection_sampling_keeps_the_distribution(temperature, top_k, draft):
    """The first token after a draft is distributed as the one-token sampler's p (whatever the draft:
    likely, unlikely or outside top-k), and the draft is accepted with probability p(draft)."""
    pvalue, acceptance, p_draft = _chi_square_first_token(temperature, top_k, draft)
    assert pvalue > 1e-3
    assert acceptance == pytest.approx(p_draft, abs=0.03)


def test_seeded_verification_reproduces():
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(3))
    drafts = [[1, 2, 3], [4, 0, 1]]

    def run():
        params = [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=1.0, seed=8)]
        return _verify(logits, drafts, params, [torch.Generator().manual_seed(p.seed) for p in params])
    assert run().sampled_token_ids == run().sampled_token_ids


def test_a_non_finite_position_fails_its_sequence_alone():
    logits = torch.zeros(5, VOCAB)
    logits[1, 2] = float("nan")  # sequence 0's second position
    out = _verify(logits, [[0, 1], [3]], [SamplingParams(temperature=0.0)] * 2)
    assert out.sampled_token_ids[0] == [] and out.errors[0] is not None
    assert out.sampled_token_ids[1] == [0] and out.errors[1] is None  # draft 3 is not the argmax (0)


def test_select_repeats_each_rows_settings_bans_generator_and_grammar_row():
    sampler = Sampler(VOCAB, "cpu", seed=0)
    generator = torch.Generator().manual_seed(1)
    batch = sampler.make_batch([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1),
                                SamplingParams(temperature=0.5, allowed_token_ids=[1, 2])],
                               [None, generator, None], banned=[{4}, None, {0, 5}])
    batch.grammar_rows = np.asarray([2], np.int64)
    batch.grammar_bitmask = torch.tensor([[0b110]], dtype=torch.int32)
    batch.errors = {1: ValueError("broken")}
    picked = batch.select(np.asarray([0, 0, 2, 1, 1, 1]))
    assert picked.greedy.tolist() == [True, True, False, False, False, False]
    assert picked.temperature.tolist() == pytest.approx([1.0, 1.0, 0.5, 1.0, 1.0, 1.0])
    assert sorted(zip(picked.ban_rows.tolist(), picked.ban_ids.tolist())) == [(0, 4), (1, 4), (2, 0), (2, 5)]
    assert picked.seeded == [(3, generator), (4, generator), (5, generator)]
    assert picked.grammar_rows.tolist() == [2] and picked.grammar_bitmask.tolist() == [[0b110]]
    assert list(picked.allowed) == [2] and set(picked.errors) == {3, 4, 5}
