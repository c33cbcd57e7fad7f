"""Presence / frequency / repetition penalties: validation, the sampler against a float64 per-row
reference and transformers' RepetitionPenaltyLogitsProcessor, and greedy decoding through the
engine against transformers (generate with repetition_penalty; a manual loop for the others)."""

import math
import random

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from lora_runner import LLM, SamplingParams
from lora_runner.sample.sampler import Sampler

V = 40


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.01), ("presence_penalty", -2.5), ("presence_penalty", math.nan),
    ("presence_penalty", math.inf), ("presence_penalty", True), ("presence_penalty", "1"),
    ("frequency_penalty", -2.01), ("frequency_penalty", math.nan), ("frequency_penalty", None),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.nan),
    ("repetition_penalty", math.inf), ("repetition_penalty", True), ("repetition_penalty", None)])
def test_bad_penalties_name_their_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
    params = SamplingParams()
    setattr(params, field, value)  # changed after construction: caught by validate (add_request)
    with pytest.raises(ValueError, match=field):
        params.validate()


def test_penalty_bounds_accepted_and_has_penalties():
    for kwargs in ({"presence_penalty": 2}, {"presence_penalty": -2.0}, {"frequency_penalty": 2.0},
                   {"repetition_penalty": 1e-2}, {"repetition_penalty": 7}):
        assert SamplingParams(**kwargs).has_penalties
    assert not SamplingParams().has_penalties


# ----------------------------------------------------------------------------- sampler vs references
def reference_penalized(logits, prompt, generated, params):
    """float64, one row, element by element: HF's repetition rule over prompt + generated tokens,
    then OpenAI's  logit - frequency * count - presence * [count > 0]  over the generated ones."""
    out = logits.double().clone()
    for token in set(prompt) | set(generated):
        value = out[token]
        out[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token in set(generated):
        count = generated.count(token)
        out[token] -= params.frequency_penalty * count + params.presence_penalty
    return out


def random_rows(rng, num_rows):
    params, histories = [], []
    for row in range(num_rows):
        if row % 3 == 0:
            params.append(SamplingParams(temperature=0.0))  # no penalties
        else:
            params.append(SamplingParams(temperature=0.0, presence_penalty=rng.uniform(-2, 2),
                                         frequency_penalty=rng.uniform(-2, 2),
                                         repetition_penalty=rng.choice([1.0, rng.uniform(0.2, 3.0)])))
        histories.append(([rng.randrange(V) for _ in range(rng.randrange(1, 12))],
                          [rng.randrange(V // 4) for _ in range(rng.randrange(0, 15))]))  # repeats likely
    return params, histories


@pytest.mark.parametrize("seed", range(4))
def test_penalized_logits_match_float64_reference(seed):
    rng = random.Random(seed)
    params, histories = random_rows(rng, 9)
    logits = torch.randn(9, V, generator=torch.Generator().manual_seed(seed)) * 3
    sampler = Sampler(V, "cpu")
    got = sampler._apply_penalties(logits, sampler.make_batch(params, [None] * 9, histories))
    for row, (p, (prompt, generated)) in enumerate(zip(params, histories)):
        if not p.has_penalties:
            assert torch.equal(got[row], logits[row])  # untouched, bit for bit
        else:
            torch.testing.assert_close(got[row].double(), reference_penalized(logits[row], prompt, generated, p),
                                       rtol=1e-6, atol=1e-5)
    out = sampler(logits, sampler.make_batch(params, [None] * 9, histories))  # greedy: argmax of the penalised row
    expected = [int(reference_penalized(logits[r], *histories[r], params[r]).argmax()) for r in range(9)]
    assert out.token_ids == expected and out.errors == [None] * 9


@pytest.mark.parametrize("penalty", [0.3, 1.7])
def test_repetition_penalty_matches_transformers_processor(penalty):
    rng = random.Random(int(penalty * 10))
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(7)) * 2
    histories = [([rng.randrange(V) for _ in range(6)], [rng.randrange(V) for _ in range(5)]) for _ in range(5)]
    params = [SamplingParams(repetition_penalty=penalty)] * 5
    sampler = Sampler(V, "cpu")
    got = sampler._apply_penalties(logits, sampler.make_batch(params, [None] * 5, histories))
    input_ids = torch.tensor([prompt + generated for prompt, generated in histories])
    expected = RepetitionPenaltyLogitsProcessor(penalty)(input_ids, logits.clone())
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_rows_without_penalties_are_bit_identical_and_logprobs_stay_raw():
    """Seeded random rows and greedy rows get the same tokens and logprobs whether or not penalised
    rows share their batch; a penalised row's logprobs are the raw model ones."""
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(3))
    plain = [SamplingParams(temperature=0.9, top_k=10, seed=1, logprobs=3), SamplingParams(temperature=0.0, logprobs=2),
             SamplingParams(temperature=1.3, top_p=0.8, seed=2, logprobs=1)]
    penalised = SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=1.0, logprobs=2)
    history = ([1, 2, 3], [int(logits[4].argmax())] * 3)  # the raw argmax is penalised away

    def run(rows, params, histories):
        sampler = Sampler(V, "cpu", seed=5)
        gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
        return sampler(logits[rows], sampler.make_batch(params, gens, histories))

    alone = run([0, 2, 5], plain, None)
    mixed = run([0, 4, 2, 5], [plain[0], penalised, *plain[1:]], [None, history, None, None])
    assert [mixed.token_ids[i] for i in (0, 2, 3)] == alone.token_ids
    assert [mixed.logprobs[i] for i in (0, 2, 3)] == alone.logprobs
    raw = torch.log_softmax(logits[4], -1)
    assert mixed.token_ids[1] != int(logits[4].argmax())
    for token, value in mixed.logprobs[1].items():
        assert value == pytest.approx(float(raw[token]), abs=1e-6)


def test_a_row_whose_penalties_fail_errors_alone():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, repetition_penalty=1.5),
              SamplingParams(temperature=0.0, frequency_penalty=0.5)]
    sampler = Sampler(V, "cpu")
    histories = [None, ([3, V + 5], []), None]  # row 1: a token outside the vocabulary; row 2: none given
    out = sampler(logits, sampler.make_batch(params, [None] * 3, histories))
    assert out.token_ids[0] == int(logits[0].argmax()) and out.errors[0] is None
    assert isinstance(out.errors[1], ValueError) and isinstance(out.errors[2], ValueError)


def test_overflowing_repetition_penalty_fails_its_row_alone():
    logits = torch.full((2, V), 1e37)  # / 0.01 overflows float32
    params = [SamplingParams(temperature=0.0, repetition_penalty=0.01), SamplingParams(temperature=0.0)]
    sampler = Sampler(V, "cpu")
    out = sampler(logits, sampler.make_batch(params, [None] * 2, [([0], []), None]))
    assert out.errors[0] is not None and out.errors[1] is None


# ----------------------------------------------------------------------------- engine vs transformers
@pytest.fixture(scope="module")
def llm(engine_checkpoint):
    path, _, _ = engine_checkpoint
    return LLM(path, device="cpu", max_num_seqs=4, max_model_len=64, block_size=4)


PROMPTS = [[5, 6, 7, 5, 6], [30, 31], [40, 41, 42, 43, 44, 45, 46]]


@pytest.mark.parametrize("penalty", [1.8, 0.6])
def test_greedy_repetition_penalty_equals_transformers_generate(llm, engine_checkpoint, penalty):
    _, hf, _ = engine_checkpoint
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=penalty)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out, prompt in zip(outs, PROMPTS):
        expected = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8, min_new_tokens=8,
                               repetition_penalty=penalty, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == expected
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert any(o.outputs[0].token_ids != p.outputs[0].token_ids for o, p in zip(outs, plain))  # it did something


@torch.inference_mode()
def manual_greedy(model, prompt, max_tokens, presence, frequency):
    ids, generated = list(prompt), []
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].double()
        for token in set(generated):
            logits[token] -= frequency * generated.count(token) + presence
        token = int(logits.argmax())
        ids.append(token)
        generated.append(token)
    return generated


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (0.0, 0.7), (0.4, 1.1), (-1.0, -0.5)])
def test_greedy_presence_frequency_equal_manual_transformers_loop(llm, engine_checkpoint, presence, frequency):
    _, hf, _ = engine_checkpoint
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, presence_penalty=presence,
                            frequency_penalty=frequency)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out, prompt in zip(outs, PROMPTS):
        assert out.outputs[0].token_ids == manual_greedy(hf, prompt, 10, presence, frequency)


def test_mixed_batch_leaves_unpenalised_requests_bit_identical(llm):
    """The same batch shapes with and without a penalised partner: the plain requests' tokens and
    logprobs are equal bit for bit."""
    plain = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2),
             SamplingParams(temperature=0.8, seed=11, max_tokens=8, ignore_eos=True, logprobs=2)]
    partner = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    penalised = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, frequency_penalty=-2.0,
                               presence_penalty=-2.0, repetition_penalty=1.4)  # negative: repeats itself
    without = llm.generate(PROMPTS, [plain[0], partner, plain[1]], use_tqdm=False)
    mixed = llm.generate(PROMPTS, [plain[0], penalised, plain[1]], use_tqdm=False)
    for i in (0, 2):
        assert mixed[i].outputs[0].token_ids == without[i].outputs[0].token_ids
        assert mixed[i].outputs[0].logprobs == without[i].outputs[0].logprobs
    assert mixed[1].outputs[0].token_ids != without[1].outputs[0].token_ids
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
