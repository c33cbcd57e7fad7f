"""Speculative decoding for requests whose logits depend on the tokens before them: penalties
(presence, frequency, repetition), min_tokens (stop ids banned while it holds), bad words and
structured-output grammars are applied at every verified position as if the drafts before it were
generated, so greedy requests get the tokens and logprobs they get without speculation, in a mixed
batch of adapters, for k in {1, 3, 5}; seeded sampled ones keep their tokens. Also: drafts cut where
the grammar rejects them, the grammar left as it came, and the acceptance / batch-size gates."""

from __future__ import annotations

import math

import numpy as np
import pytest

from adapters import LoRARequest
from engine_support import make_engine, run_to_completion
from lora_runner import SamplingParams, StructuredOutputsParams
from lora_runner.core.block_manager import BlockManager
from lora_runner.core.request import Request
from lora_runner.core.scheduler import Scheduler
from lora_runner.sample.sampler import SamplerOutput
from lora_runner.sample.sampling_state import SamplingState
from lora_runner.spec_decode.adaptive import SpeculationPolicy
from lora_runner.spec_decode.config import SpeculativeConfig
from lora_runner.spec_decode.grammar_masks import grammar_prefix, position_bitmask
from lora_runner.spec_decode.ngram import Speculator
from structured_support import save_byte_checkpoint

REGEX = "[ac ]{4,40}"  # after "a" the n-gram proposes the "abcd" prompt's "b", which the grammar cuts
# request kind -> its settings beside greedy decoding with logprobs. Penalties small enough that the tiny
# random model's greedy loops (where n-gram drafts are accepted) hold for a while and then break where
# the counts, including the drafts before each position, reach the gap between its top logits.
KINDS = {
    "penalties": dict(presence_penalty=0.02, frequency_penalty=0.05, repetition_penalty=1.05),
    "frequency": dict(frequency_penalty=0.08),
    "min_tokens": dict(min_tokens=10),  # with the ids of STOP_WORDS as stop ids (_requests)
    "grammar": dict(structured_outputs=StructuredOutputsParams(regex=REGEX)),  # with the "abcd" prompt first
    "bad_words": dict(bad_words=["nd", "R"]),
    "plain": {},
}
STOP_WORDS = ("nd", "R", "r")  # one token each, the loops below: proposed as drafts, banned until min_tokens
# the model loops on these (drafts get accepted); on the "R" one min_tokens' ban of "R" ends where a
# verify step crosses min_tokens, and the request stops on the first "R" allowed
PROMPTS = ["aaaaaaaaaaaa", "..........", "RRRRRRRRRRRR", "abcdabcdabcd"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_byte_checkpoint(tmp_path_factory.mktemp("spec_rows"))


def ngram(k: int, **extra) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "min_acceptance_rate": 0, **extra}


def token_ids(checkpoint, words) -> list[int]:
    """The byte-level tokenizer's id of each word of `words` (each one token)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint[0])
    ids = [tokenizer.encode(word, add_special_tokens=False) for word in words]
    assert all(len(one) == 1 for one in ids), ids
    return [one[0] for one in ids]


def _requests(checkpoint, seeded: bool = False) -> list[tuple]:
    """Every kind on every adapter (base, LoRA a, LoRA b) with its own prompt."""
    loras = [None, LoRARequest("a", checkpoint[1]["a"]), LoRARequest("b", checkpoint[1]["b"])]
    requests, stop_ids = [], token_ids(checkpoint, STOP_WORDS)
    for i, (kind, settings) in enumerate(KINDS.items()):
        if kind == "min_tokens":
            settings = {**settings, "stop_token_ids": stop_ids}
        for j, lora in enumerate(loras):
            sampling = (dict(temperature=0.8, top_k=20, seed=10 * i + j) if seeded
                        else dict(temperature=0.0, logprobs=2))
            params = SamplingParams(max_tokens=32, ignore_eos=kind != "grammar", **sampling, **settings)
            requests.append((f"{kind}-{j}", PROMPTS[(i + j) % len(PROMPTS)], params, lora))
    return requests


def _run(checkpoint, spec, seeded: bool = False):
    engine = make_engine(checkpoint[0], max_model_len=128, max_num_seqs=6, max_logprobs=2, speculative_config=spec)
    try:
        return run_to_completion(engine, _requests(checkpoint, seeded), per_step=3), engine
    finally:
        engine.close()


@pytest.fixture(scope="module")
def plain(checkpoint):
    return _run(checkpoint, None)[0]


def _assert_same(want, got, label: str) -> None:
    """Same tokens, text and finish reason; logprobs within 1e-5 (a verified token ran in a multi-token
    query: float32 sums in another order than the one-token decode)."""
    a, b = want.outputs[0], got.outputs[0]
    assert b.error is None, (label, b.error)
    assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), label
    for position, (x, y) in enumerate(zip(a.logprobs, b.logprobs, strict=True)):
        assert x.keys() == y.keys(), (label, position)
        assert all(math.isclose(x[t], y[t], rel_tol=1e-5, abs_tol=1e-5) for t in x), (label, position, x, y)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_rows_with_per_position_settings_equal_greedy_without(checkpoint, plain, k):
    done, engine = _run(checkpoint, ngram(k))
    for request_id, want in plain.items():
        _assert_same(want, done[request_id], request_id)
    for kind in KINDS:  # each kind verified drafts, on some adapter, and some were accepted
        stats = [done[f"{kind}-{j}"].spec_decode for j in range(3)]
        assert sum(s.num_drafts for s in stats) > 0, kind
    for kind in ("penalties", "frequency", "min_tokens", "bad_words", "grammar"):
        assert sum(done[f"{kind}-{j}"].spec_decode.num_accepted_tokens for j in range(3)) > 0, kind
    assert done["min_tokens-0"].outputs[0].token_ids  # ran past min_tokens with its stop id banned until then
    spec = engine.stats.spec_decode
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens


def test_seeded_rows_with_per_position_settings_keep_their_tokens(checkpoint):
    """A seeded request's k-th token uses its generator's k-th draws with or without speculation."""
    plain, _ = _run(checkpoint, None, seeded=True)
    done, engine = _run(checkpoint, ngram(3), seeded=True)
    assert {i: o.outputs[0].token_ids for i, o in done.items()} == {i: o.outputs[0].token_ids for i, o in plain.items()}
    assert engine.stats.spec_decode.num_accepted_tokens > 0


# ------------------------------------------------------------------ per-position settings without a model
def test_each_position_sees_the_drafts_before_it():
    """Position j of a row with drafts reads the row's tokens and its first j drafts: its penalty
    history, its min_tokens count and its bad-word prefix."""
    state = SamplingState(max_num_seqs=2, vocab_size=50, eos_token_ids=[2])
    state.add_request(0, SamplingParams(temperature=0.0, repetition_penalty=1.5, min_tokens=3,
                                        bad_words_token_ids=[[7, 8]]), num_prompt_tokens=3)
    token_ids = np.zeros((2, 16), np.int32)
    token_ids[0, :7] = [4, 5, 6, 9, 7, 8, 7]  # prompt 4 5 6, generated 9, then drafts 7 8 7 after it
    batch = state.batch(np.array([0, 0, 0, 0]), token_ids, np.array([4, 0]), offsets=np.arange(4))
    assert [list(batch.histories[i][1]) for i in range(4)] == [[9], [9, 7], [9, 7, 8], [9, 7, 8, 7]]
    bans = [sorted(batch.ban_ids[batch.ban_rows == i].tolist()) for i in range(4)]
    assert bans == [[2], [2, 8], [], [8]]  # EOS until 3 generated; 8 after a 7


# ------------------------------------------------------------------ grammar: cut drafts, masks per position
@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def grammar_engine(checkpoint, request):
    """Both backends: drafts are probed and rolled back through each one's matcher."""
    engine = make_engine(checkpoint[0], max_model_len=128, structured_outputs_backend=request.param)
    yield engine
    engine.close()


def _constrained(engine, regex: str) -> Request:
    request = Request("g", [ord("x")], SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(
        regex=regex)), arrival=0)
    request.grammar = engine.structured.request_grammar(request.params)
    request.grammar._future.result(timeout=60)  # noqa: SLF001 - compiled before the test reads it
    assert request.grammar.state() == "ready"
    return request


def test_grammar_cuts_drafts_and_is_left_as_it_came(checkpoint, grammar_engine):
    request = _constrained(grammar_engine, "ab(c|d)x")
    a, b, c, d, x = token_ids(checkpoint, "abcdx")
    assert grammar_prefix(request, [a, b, b, c]) == 2  # "abb" breaks it: the drafts stop before the second b
    eos = 1  # the checkpoint's end id: the grammar's stop token
    assert grammar_prefix(request, [a, b, c, x]) == 4  # "abcx" is complete: only its end may follow
    assert grammar_prefix(request, [a, b, c, x, eos, a]) == 4  # the end ends it: no draft from it on is verified
    assert grammar_prefix(request, [a, b, d]) == 3
    assert request.grammar.accept(a) is False  # the matcher is where it started: "a" is still its first token
    rows, bitmask = position_bitmask([request], [[b, c]], grammar_engine.structured.vocab_size, 1.0)
    allowed = [sorted(t for t in range(300) if bitmask[row, t // 32] >> (t % 32) & 1) for row in range(3)]
    assert rows == [0, 1, 2] and allowed == [[b], [c, d], [x]]  # after "a", "ab", "abc"
    assert request.grammar.accept(b) is False and request.grammar.accept(d) is False  # rolled back again


# ------------------------------------------------------------------ adaptation: rows that speculate
def _policy(**keys) -> SpeculationPolicy:
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                      "prompt_lookup_max": 3, **keys})
    return SpeculationPolicy(Speculator(config, max_model_len=256), config)


def _repeating(request_id: str) -> Request:
    return Request(request_id, [5, 6, 7, 8] * 4, SamplingParams(temperature=0.0, max_tokens=100), arrival=0)


def test_low_acceptance_pauses_a_request_and_probes_it_periodically():
    policy = _policy(min_acceptance_rate=0.3, acceptance_probe_interval=4)
    request = _repeating("r")
    assert policy.drafts(request, 100) == [5, 6, 7]
    policy.observe(request, 3, 0)  # EMA 1 -> 0.5: still speculates
    assert policy.drafts(request, 100)
    policy.observe(request, 3, 0)  # 0.25 < 0.3: paused
    proposing = [bool(policy.drafts(request, 100)) for _ in range(8)]
    assert proposing == [False, False, False, True] * 2  # a probe every 4th decode step
    policy.observe(request, 3, 3)  # the probe hit everything: 0.625, speculating again
    assert all(policy.drafts(request, 100) for _ in range(3))
    assert policy.acceptance_rate(request) == pytest.approx(0.625)
    off = _policy(min_acceptance_rate=0)
    for _ in range(10):
        off.observe(request, 3, 0)
    assert off.drafts(request, 100)


class _Appender:
    def append(self, request, tokens, logprobs):
        request.token_ids += tokens

    def finish(self, request, reason):
        return reason


def _speculating_rows(limit: int | None, num_requests: int) -> int:
    """How many of `num_requests` decoding requests verify drafts in one step."""
    scheduler = Scheduler(BlockManager(128, 4), max_num_seqs=8, max_num_batched_tokens=256, max_loras=1,
                          adapter_state=lambda ref: "ready", speculator=_policy(disable_by_batch_size=limit))
    for i in range(num_requests):
        scheduler.add(_repeating(f"r{i}"))
    out = scheduler.schedule()  # prefills
    scheduler.postprocess(out.scheduled, SamplerOutput([[5]] * num_requests, [[None]] * num_requests), _Appender())
    return len(scheduler.schedule().scheduled_spec_decode_tokens)


def test_a_large_batch_verifies_no_drafts():
    assert _speculating_rows(None, 5) == 5
    assert _speculating_rows(5, 5) == 5  # at the limit: still on
    assert _speculating_rows(4, 5) == 0  # past it: every row decodes one token
    assert _speculating_rows(4, 4) == 4


def test_speculative_config_checks_the_adaptation_keys():
    assert _policy(disable_by_batch_size=3).disable_by_batch_size == 3
    for keys, message in (({"disable_by_batch_size": 0}, "disable_by_batch_size"),
                          ({"min_acceptance_rate": 1.5}, "min_acceptance_rate"),
                          ({"acceptance_probe_interval": 0}, "acceptance_probe_interval")):
        with pytest.raises(ValueError, match=message):
            _policy(**keys)
