"""Sampler: greedy, temperature / top-k / top-p distributions, per-request seeds, logprobs."""

import pickle

import pytest
import torch

from lora_runner.sample.sampler import Sampler, SamplerOutput
from lora_runner.sampling_params import SamplingParams

V = 8


def sample(sampler, logits, params, generators=None):
    generators = generators or [None] * len(params)
    return sampler(logits, sampler.make_batch(params, generators))


def reference_probs(logits, temperature, top_k, top_p):
    """float64 target distribution: softmax(logits / T) restricted to top-k, then to the top-p nucleus."""
    scaled = logits.double() / temperature
    order = scaled.argsort(descending=True)
    keep = torch.zeros_like(scaled, dtype=torch.bool)
    keep[order[:top_k if top_k > 0 else len(scaled)]] = True
    probs = torch.where(keep, scaled, torch.tensor(float("-inf"), dtype=torch.float64)).softmax(-1)
    sorted_probs = probs[order]
    before = sorted_probs.cumsum(0) - sorted_probs
    nucleus = torch.zeros_like(keep)
    nucleus[order[before <= top_p]] = True
    probs = torch.where(nucleus & keep, probs, 0.0)
    return probs / probs.sum()


def test_greedy_is_argmax_whatever_top_k_top_p():
    logits = torch.randn(6, V)
    params = [SamplingParams(temperature=0.0, top_k=k, top_p=p) for k, p in
              [(-1, 1.0), (2, 0.5), (1, 0.1), (-1, 1.0), (3, 1.0), (-1, 0.3)]]
    out = sample(Sampler(V, "cpu"), logits, params)
    assert out.token_ids == logits.argmax(-1).tolist() and out.logprobs == [None] * 6


def test_greedy_and_random_rows_in_one_batch_keep_their_own_settings():
    """Even rows greedy, odd rows temperature 1 over nearly flat logits: the greedy rows take the
    argmax, the random rows spread over the vocabulary (all-greedy batches take a shortcut)."""
    logits = torch.zeros(400, V)
    logits[:, 3] = 0.01  # the argmax of every row
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(400)]
    tokens = sample(Sampler(V, "cpu", seed=5), logits, params).token_ids
    assert all(t == 3 for t in tokens[0::2])
    assert set(tokens[1::2]) == set(range(V))


def test_min_p_drops_the_tokens_less_likely_than_min_p_times_the_top_one():
    """vLLM's min_p, after temperature: with min_p 0.3 only tokens with p >= 0.3 * p_max are sampled,
    in proportion to their own probability; rows without min_p in the same batch keep every token."""
    probs = torch.tensor([0.40, 0.20, 0.13, 0.11, 0.08, 0.05, 0.02, 0.01], dtype=torch.float64)
    logits = probs.log().float()
    n = 12000
    params = [SamplingParams(temperature=1.0, min_p=0.3 if i % 2 == 0 else 0.0) for i in range(n)]
    tokens = torch.tensor(sample(Sampler(V, "cpu", seed=3), logits.expand(n, V).clone(), params).token_ids)
    kept = probs >= 0.3 * probs.max()  # tokens 0, 1, 2 (0.13 >= 0.12)
    freq = torch.bincount(tokens[0::2], minlength=V).double() / (n // 2)
    assert set(tokens[0::2].tolist()) == set(kept.nonzero().flatten().tolist())
    torch.testing.assert_close(freq, torch.where(kept, probs, 0.0) / probs[kept].sum(), atol=0.02, rtol=0)
    assert set(tokens[1::2].tolist()) == set(range(V))  # the same batch's rows without min_p


@pytest.mark.parametrize("min_p", [-0.1, 1.5, float("nan"), "0.1"])
def test_min_p_outside_0_1_is_refused(min_p):
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=min_p)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, -1, 1.0), (0.7, 3, 1.0), (1.5, -1, 0.6),
                                                       (1.0, 4, 0.8)])
def test_sampled_frequencies_match_distribution(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(V) * 1.5
    n = 20000
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    out = sample(Sampler(V, "cpu", seed=1), logits.expand(n, V).clone(), [params] * n)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=V).double() / n
    want = reference_probs(logits, temperature, top_k, top_p)
    assert torch.all(freq[want == 0] == 0), "a token outside top-k/top-p was sampled"
    assert torch.allclose(freq, want, atol=0.015), (freq, want)


def test_seeded_rows_reproduce_regardless_of_batch():
    logits = torch.randn(5, V)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    other = SamplingParams(temperature=1.0)

    def run(row, batch_size, sampler_seed):
        sampler = Sampler(V, "cpu", seed=sampler_seed)
        gen = torch.Generator().manual_seed(seeded.seed)
        tokens = []
        for _ in range(20):  # one generator, several steps, like a request's decode steps
            params = [other] * batch_size
            params[row] = seeded
            gens = [None] * batch_size
            gens[row] = gen
            batch_logits = torch.randn(batch_size, V)
            batch_logits[row] = logits[0]
            tokens.append(sample(sampler, batch_logits, params, gens).token_ids[row])
        return tokens

    first = run(0, 1, 0)
    assert run(3, 5, 99) == first and run(1, 2, 7) == first
    assert len(set(first)) > 1  # actually random

    gen_other = torch.Generator().manual_seed(4321)
    sampler = Sampler(V, "cpu")
    diff = [sample(sampler, logits[:1], [seeded], [gen_other]).token_ids[0] for _ in range(20)]
    assert diff != first


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_raw_log_softmax_with_chosen_token(temperature):
    logits = torch.randn(4, 64) * 3
    params = [SamplingParams(temperature=temperature, logprobs=k, top_k=5 if temperature else -1)
              for k in (None, 0, 3, 10)]
    out = sample(Sampler(64, "cpu"), logits, params)
    ref = torch.log_softmax(logits.double(), -1)
    assert out.logprobs[0] is None
    assert list(out.logprobs[1]) == [out.token_ids[1]]
    for row, k in ((2, 3), (3, 10)):
        lp = out.logprobs[row]
        top = ref[row].topk(k).indices.tolist()
        assert set(top) | {out.token_ids[row]} == set(lp)
        for tok, value in lp.items():
            assert abs(value - ref[row, tok].item()) < 1e-5
    for row in range(1, 4):
        chosen = out.token_ids[row]
        assert abs(out.logprobs[row][chosen] - ref[row, chosen].item()) < 1e-5


def test_huge_finite_logits_whose_sum_overflows_are_sampled_not_failed():
    # the CPU finite check sums each row first: an overflowing sum of finite entries must fall back
    # to the entry check, not fail the row; ties keep argmax's first maximum
    logits = torch.zeros(3, V)
    logits[0] = 3e38  # finite, sum = inf
    logits[0, 5] = 3.3e38
    logits[1, 2] = logits[1, 6] = 1.0  # tie: the first maximum
    logits[2, 4] = float("nan")
    out = sample(Sampler(V, "cpu"), logits, [SamplingParams(temperature=0.0)] * 3)
    assert out.token_ids[:2] == [5, 2]
    assert out.errors[:2] == [None, None]
    assert out.errors[2] is not None


def test_each_row_holds_a_token_list_and_a_failed_row_an_empty_one():
    """The step's currency (SamplerOutput): a list per row, one token from the Sampler, none for a
    row that failed; it crosses processes as a pickle (tensor-parallel ranks) unchanged."""
    logits = torch.randn(3, V)
    logits[1, 2] = float("nan")
    params = [SamplingParams(temperature=0.0, logprobs=1), SamplingParams(temperature=0.0, logprobs=1),
              SamplingParams(temperature=0.0)]
    out = sample(Sampler(V, "cpu"), logits, params)
    best = logits.argmax(-1).tolist()
    assert out.sampled_token_ids == [[best[0]], [], [best[2]]]
    assert [len(entries) for entries in out.sampled_logprobs] == [1, 0, 1] and out.sampled_logprobs[2] == [None]
    assert isinstance(out.errors[1], FloatingPointError) and out.token_ids == [best[0], -1, best[2]]
    again = pickle.loads(pickle.dumps(out))
    assert (again.sampled_token_ids, again.sampled_logprobs) == (out.sampled_token_ids, out.sampled_logprobs)
    several = SamplerOutput([[4, 5], [6]], [[None, None], [None]])
    with pytest.raises(AssertionError, match="row 0 holds 2 tokens"):
        several.token_ids  # the one-token view refuses a multi-token step
