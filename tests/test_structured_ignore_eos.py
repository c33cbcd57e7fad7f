"""ignore_eos and min_tokens beside a constraint (issue 39 item 5), through LLMEngine: while either
holds, the constraint's end token may not be sampled, so a grammar that could end early goes on
("length" at max_tokens under ignore_eos); a grammar that allows nothing but its end still ends with
"stop" (nothing else could be sampled). A plain request in the same batch keeps its exact tokens."""

import re

import pytest

from engine_support import make_engine, run_to_completion
from lora_runner import SamplingParams, StructuredOutputsParams
from structured_support import save_byte_checkpoint

OPEN_ENDED = StructuredOutputsParams(regex="[ab]+")  # complete after one token, may go on forever
MAX_TOKENS = 16
SEEDS = range(6)  # a hot temperature samples the end token often where the mask lets it through


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    engine = make_engine(save_byte_checkpoint(tmp_path_factory.mktemp("ignore-eos"))[0], max_model_len=256,
                         max_num_seqs=16, structured_outputs_backend="xgrammar")  # llguidance: test_structured_backends
    yield engine
    engine.close()


def _hot(seed: int, **kwargs) -> SamplingParams:
    return SamplingParams(structured_outputs=OPEN_ENDED, temperature=5.0, seed=seed, max_tokens=MAX_TOKENS, **kwargs)


def _plain() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_ignore_eos_keeps_a_constraint_that_could_end_going_to_max_tokens(engine):
    alone = run_to_completion(engine, [("plain", "x", _plain())])["plain"].outputs[0].token_ids
    requests = [(f"hot-{seed}", "x", _hot(seed, ignore_eos=True)) for seed in SEEDS]
    requests += [(f"min-{seed}", "x", _hot(seed, ignore_eos=True, min_tokens=MAX_TOKENS // 2)) for seed in SEEDS]
    outputs = run_to_completion(engine, [*requests, ("plain", "x", _plain())])
    for request_id, _, _ in requests:
        completion = outputs[request_id].outputs[0]
        assert completion.error is None and completion.finish_reason == "length", (request_id, completion)
        assert len(completion.token_ids) == MAX_TOKENS and re.fullmatch("[ab]+", completion.text), completion
    assert outputs["plain"].outputs[0].token_ids == alone


def test_min_tokens_alone_keeps_the_end_token_out_until_it_is_reached(engine):
    minimum = MAX_TOKENS // 2
    outputs = run_to_completion(engine, [(f"min-{seed}", "x", _hot(seed, min_tokens=minimum)) for seed in SEEDS])
    for output in outputs.values():
        completion = output.outputs[0]
        assert completion.error is None and len(completion.token_ids) >= minimum, completion
        assert re.fullmatch("[ab]+", completion.text), completion


def test_a_constraint_that_allows_only_its_end_still_stops_under_ignore_eos(engine):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="ab"), temperature=0.0,
                            max_tokens=MAX_TOKENS, ignore_eos=True)
    completion = run_to_completion(engine, [("ab", "x", params)])["ab"].outputs[0]
    assert (completion.text, completion.finish_reason, completion.error) == ("ab", "stop", None)
