"""The one stop rule (lora_runner.core.stop_rule), in both of its uses: the output processor's stop
check and the sampler's min_tokens ban."""

import torch

from lora_runner.core.request import Request
from lora_runner.core.stop_rule import stop_tokens
from lora_runner.engine.output_processor import OutputProcessor
from lora_runner.sample.sampler import Sampler
from lora_runner.sampling_params import SamplingParams

EOS, STOP, OTHER = 2, 5, 9
VOCAB = 16


def request(**params):
    return Request("r", [1, 3], SamplingParams(temperature=0, max_tokens=10, **params), arrival=0)


def test_stop_ids_are_banned_until_min_tokens_and_stop_after():
    params = SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=[STOP])
    for num_generated in (0, 1):
        rule = stop_tokens(params, num_generated, {EOS})
        assert rule.banned == {EOS, STOP} and not rule.stops(EOS) and not rule.stops(STOP)
    rule = stop_tokens(params, 2, {EOS})
    assert rule.banned == frozenset() and rule.stops(EOS) and rule.stops(STOP) and not rule.stops(OTHER)
    ignoring = stop_tokens(SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[STOP]), 0, {EOS})
    assert ignoring.ids == {STOP} and not ignoring.stops(EOS)


def test_output_processor_does_not_stop_on_eos_or_stop_ids_before_min_tokens():
    """Fed directly (the sampler would have banned them), EOS and stop ids under min_tokens do not
    end the request; the same ids end it once min_tokens tokens came before them."""
    processor = OutputProcessor(None, eos_token_ids={EOS}, max_model_len=100)
    r = request(min_tokens=2, stop_token_ids=[STOP])
    assert processor.append(r, [EOS]) is None
    assert processor.append(r, [STOP]) is None
    assert processor.append(r, [STOP]) == "stop" and r.stop_reason == STOP
    r = request(min_tokens=1)
    assert processor.append(r, [EOS]) is None and processor.append(r, [EOS]) == "stop" and r.stop_reason is None


def test_the_sampler_ban_covers_stop_ids_until_min_tokens_and_not_after():
    """The ban the sampling side applies comes from the same rule: with EOS the best logit, a greedy
    request under min_tokens samples the next best (not the stop id either); after, EOS."""
    processor = OutputProcessor(None, eos_token_ids={EOS}, max_model_len=100)
    sampler = Sampler(VOCAB, "cpu")
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS], logits[0, STOP], logits[0, OTHER] = 3.0, 2.0, 1.0
    r = request(min_tokens=2, stop_token_ids=[STOP])
    for expected in (OTHER, OTHER, EOS):
        banned = [sorted(processor.stop_tokens(r).banned)]
        token = sampler(logits, sampler.make_batch([r.params], [None], banned=banned)).token_ids[0]
        assert token == expected
        processor.append(r, [token])
