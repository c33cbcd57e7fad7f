"""OutputProcessor.append with several tokens per row (speculative decoding's verified tokens): each
token is checked in order at its own position, and a request that finishes on one drops the rest
(not appended, detokenized, counted, nor fed to its grammar)."""

import pytest

from lora_runner.core.request import Request
from lora_runner.engine.output_processor import OutputProcessor
from lora_runner.engine.structured.grammar_compiler import StructuredOutputError
from lora_runner.sampling_params import SamplingParams

EOS = 2
PROMPT = [1, 3]


class RecordingDecode:
    """Joins ids with spaces and records every id list it was asked to decode."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def __call__(self, ids: list[int]) -> str:
        self.seen.update(ids)
        return " ".join(map(str, ids))


class FakeGrammar:
    """A structured-output grammar that completes on `end` and rejects `bad` (RequestGrammar.accept)."""

    def __init__(self, end: int | None = None, bad: int | None = None) -> None:
        self.end, self.bad = end, bad
        self.accepted: list[int] = []

    def accept(self, token_id: int, may_stop: bool = True) -> bool:
        if token_id == self.bad:
            raise StructuredOutputError(f"token {token_id} does not continue the output's constraint")
        self.accepted.append(token_id)
        return token_id == self.end


def make(decode=None, max_model_len=100, **params):
    processor = OutputProcessor(decode, eos_token_ids={EOS}, max_model_len=max_model_len)
    return processor, Request("r", list(PROMPT), SamplingParams(temperature=0, **params), arrival=0)


def test_a_stop_string_completed_by_the_second_of_three_tokens_drops_the_third():
    decode = RecordingDecode()
    processor, request = make(decode, stop=["6 7"], logprobs=1)
    entries = [{5: -0.5}, {6: -0.6}, {7: -0.7}]
    assert processor.append(request, [5, 6], entries[:2]) is None
    assert processor.append(request, [7, 8, 9], [entries[2], {8: -0.8}, {9: -0.9}]) == "stop"
    assert request.stop_reason == "6 7"
    assert request.output_token_ids == [5, 6, 7] and request.logprobs == entries  # one dict per accepted token
    assert 8 not in decode.seen and 9 not in decode.seen  # the dropped tokens were never detokenized
    request.finish(processor.finish(request, "stop"))
    final = processor.completion(request)
    assert (final.text, final.token_ids, final.logprobs) == ("5 ", [5, 6, 7], entries)


def test_eos_counts_only_at_its_own_position_past_min_tokens():
    """Under min_tokens an EOS is an ordinary token (the sampler banned it); the first EOS at a
    position past min_tokens ends the request, within the same list."""
    processor, request = make(min_tokens=3, max_tokens=10)
    assert processor.append(request, [EOS, 9, 9, EOS, 11]) == "stop"
    assert request.output_token_ids == [EOS, 9, 9, EOS] and request.stop_reason is None
    processor, request = make(min_tokens=3, max_tokens=10, stop_token_ids=[7])
    assert processor.append(request, [7, EOS, 8]) is None  # all three under min_tokens: none stops
    assert processor.append(request, [7, 8]) == "stop" and request.stop_reason == 7
    assert request.output_token_ids == [7, EOS, 8, 7]


@pytest.mark.parametrize("limit", ["max_tokens", "max_model_len"])
def test_the_length_limit_reached_mid_list_drops_the_rest(limit):
    settings = {"max_tokens": 2} if limit == "max_tokens" else {"max_model_len": len(PROMPT) + 2, "max_tokens": 50}
    processor, request = make(RecordingDecode(), logprobs=0, **settings)
    assert processor.append(request, [5, 6, 7], [{5: -1.0}, {6: -2.0}, {7: -3.0}]) == "length"
    assert request.output_token_ids == [5, 6] and request.logprobs == [{5: -1.0}, {6: -2.0}]
    assert processor.text_of(request).text == "5 6"


def test_the_grammar_sees_each_accepted_token_once_and_nothing_after_it_completes():
    processor, request = make(max_tokens=10)
    request.grammar = FakeGrammar(end=6)
    assert processor.append(request, [5, 6, 7]) == "stop"
    assert request.grammar.accepted == [5, 6] and request.output_token_ids == [5, 6]


def test_a_token_the_grammar_rejects_raises_and_the_tokens_after_it_are_not_taken():
    """Scheduler.postprocess fails the request with the error (tests/test_scheduler.py)."""
    processor, request = make(max_tokens=10)
    request.grammar = FakeGrammar(bad=7)
    with pytest.raises(StructuredOutputError, match="token 7"):
        processor.append(request, [5, 7, 8])
    assert request.grammar.accepted == [5] and 8 not in request.output_token_ids


def test_one_token_lists_give_what_tokens_one_at_a_time_give():
    """The Sampler's case: k lists of one token equal one list of k (the rules are per token)."""
    tokens = [5, EOS, 6, 7, EOS, 8]
    finished = []
    for lists in ([tokens], [[t] for t in tokens]):
        processor, request = make(RecordingDecode(), min_tokens=2, stop=["6 7"], include_stop_str_in_output=True)
        reasons = []
        for row in lists:  # as Scheduler.postprocess: a finished request gets no more tokens
            reasons.append(processor.append(request, row))
            if reasons[-1] is not None:
                break
        finished.append((request.output_token_ids, reasons[-1], request.stop_reason, processor.text_of(request).text))
    assert finished[0] == finished[1] == ([5, EOS, 6, 7], "stop", "6 7", "5 2 6 7")
