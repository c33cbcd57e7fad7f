"""Structured outputs end to end on the engine (xgrammar): many random JSON schemas, regex, choice and
a grammar on a byte-level tokenizer; unconstrained requests in the same batch unchanged; hostile
constraints fail alone; allowed_token_ids and bad_words obeyed."""

import json
import random
import re
import threading

import jsonschema
import pytest
import torch

from adapters import LoRARequest
from engine_support import make_engine, run_to_completion
from lora_runner import SamplingParams, StructuredOutputsParams
from lora_runner.engine.structured import StructuredOutputError
from structured_support import MODEL_VOCAB, random_schema, save_byte_checkpoint

MAX_TOKENS = 400


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_byte_checkpoint(tmp_path_factory.mktemp("structured"))


@pytest.fixture(scope="module")
def engine(checkpoint):
    # xgrammar here (some tests read its matchers); tests/test_structured_backends.py runs them on llguidance
    engine = make_engine(checkpoint[0], max_model_len=512, max_num_seqs=8, structured_outputs_backend="xgrammar")
    yield engine
    engine.close()


def _constrained(so: StructuredOutputsParams, **kwargs) -> SamplingParams:
    return SamplingParams(structured_outputs=so, **{"max_tokens": MAX_TOKENS, **kwargs})


def test_random_json_schemas_parse_and_validate_greedy_and_sampled(engine, checkpoint):
    rng = random.Random(20261202)
    schemas = [random_schema(rng) for _ in range(12)]
    requests, lora = [], LoRARequest("a", checkpoint[1]["a"])
    for i, schema in enumerate(schemas):
        compact = i % 2 == 0  # half without any whitespace, half with xgrammar's any-whitespace JSON
        so = StructuredOutputsParams(json=schema, disable_any_whitespace=compact)
        sampling = dict(temperature=0.0) if i % 3 == 0 else dict(temperature=0.9, seed=i)
        requests.append((f"s{i}", f"schema {i}", _constrained(so, **sampling), lora if i % 4 == 1 else None))
    outputs = run_to_completion(engine, requests)
    for i, schema in enumerate(schemas):
        completion = outputs[f"s{i}"].outputs[0]
        assert completion.finish_reason == "stop", (schema, completion)
        jsonschema.validate(json.loads(completion.text), schema)
        assert max(completion.token_ids) < 300  # the padded ids 300..319 are no tokens: never sampled


def test_json_object_allows_an_object_only(engine):
    """Free JSON strings run long on a random model: the mask of the first token is checked instead."""
    import xgrammar as xgr

    compiler = engine.structured.compiler
    matcher = xgr.GrammarMatcher(compiler.compile(StructuredOutputsParams(json_object=True)).result(timeout=60))
    bitmask = xgr.allocate_token_bitmask(1, MODEL_VOCAB)
    matcher.fill_next_token_bitmask(bitmask)
    tokenizer = engine.tokenizer.get()
    allowed = {tokenizer.decode([t]) for t in range(300) if bitmask[0, t // 32] >> (t % 32) & 1}
    assert "{" in allowed and "[" not in allowed and "1" not in allowed
    assert all(text.strip() in ("", "{") or text.lstrip().startswith("{") for text in allowed), allowed


def test_regex_choice_and_grammar(engine):
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    choices = ["yes", "no way", "ma\"ybe"]
    cases = {
        "regex": (StructuredOutputsParams(regex=r"[a-c]{2,4}-\d\d"), lambda t: re.fullmatch(r"[a-c]{2,4}-\d\d", t)),
        "choice": (StructuredOutputsParams(choice=choices), lambda t: t in choices),
        "grammar": (StructuredOutputsParams(grammar=grammar), lambda t: re.fullmatch(r"\([1-9]\d?(\+[1-9]\d?)*\)", t)),
    }
    requests = [(f"{name}-{t}", f"try {name}", _constrained(so, temperature=t, seed=3, max_tokens=200))
                for name, (so, _) in cases.items() for t in (0.0, 1.0)]
    outputs = run_to_completion(engine, requests)
    for request_id, output in outputs.items():
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (request_id, completion)
        assert cases[request_id.split("-")[0]][1](completion.text), (request_id, completion.text)


def test_unconstrained_requests_keep_their_tokens_and_logprobs_beside_constrained_ones(engine, checkpoint):
    loras = checkpoint[1]
    plain = [(f"p{i}", f"plain prompt {i}", SamplingParams(temperature=0.0, max_tokens=12, logprobs=3),
              LoRARequest(name, loras[name]) if name else None) for i, name in enumerate([None, "a", "b"])]
    alone = run_to_completion(engine, plain)
    so = StructuredOutputsParams(json={"type": "object", "properties": {"k": {"type": "boolean"}},
                                       "required": ["k"]})
    mixed = run_to_completion(engine, [(f"m{i}", f"plain prompt {i}", _constrained(so, temperature=0.0),
                                        LoRARequest("b", loras["b"])) for i in range(3)] + plain)
    for request_id in ("p0", "p1", "p2"):
        want, got = alone[request_id].outputs[0], mixed[request_id].outputs[0]
        assert got.token_ids == want.token_ids
        # the same ids; values within float32 noise of a batch of another shape (the mask never touches them)
        assert [list(d) for d in got.logprobs] == [list(d) for d in want.logprobs]
        got_values = [v for d in got.logprobs for v in d.values()]
        assert got_values == pytest.approx([v for d in want.logprobs for v in d.values()], abs=1e-4)
    assert all(json.loads(mixed[f"m{i}"].outputs[0].text) in ({"k": True}, {"k": False}) for i in range(3))


def test_parallel_samples_each_follow_the_constraint(engine):
    so = StructuredOutputsParams(choice=["alpha", "beta", "gamma", "delta"])
    output = run_to_completion(engine, [("n", "pick", _constrained(so, temperature=1.0, seed=5, n=4))])["n"]
    assert len(output.outputs) == 4
    assert all(c.text in so.choice and c.finish_reason == "stop" for c in output.outputs)


@pytest.mark.parametrize("so, message", [
    (dict(json={"type": "nope"}), "cannot be compiled"),
    (dict(grammar="root ::= missing_rule"), "cannot be compiled"),
    (dict(regex="(unclosed"), "cannot be compiled"),
])
def test_a_constraint_that_does_not_compile_fails_its_request_alone(engine, so, message):
    outputs = run_to_completion(engine, [("bad", "x", _constrained(StructuredOutputsParams(**so))),
                                         ("good", "x", SamplingParams(temperature=0.0, max_tokens=4))])
    assert outputs["bad"].outputs[0].finish_reason == "error"
    assert isinstance(outputs["bad"].outputs[0].error, StructuredOutputError)
    assert message in str(outputs["bad"].outputs[0].error)
    assert outputs["good"].outputs[0].finish_reason == "length"


def test_a_compilation_past_its_deadline_fails_its_request_alone(checkpoint, monkeypatch):
    release = threading.Event()
    engine = make_engine(checkpoint[0], max_model_len=128, structured_outputs_compile_timeout_s=0.5)
    compiler = engine.structured.compiler
    real = compiler._compile_kind

    def stalled(kind, text):  # a pathological constraint: compiles until the test lets it go
        release.wait(60)
        return real(kind, text)

    monkeypatch.setattr(compiler, "_compile_kind", stalled)
    try:
        outputs = run_to_completion(engine, [("slow", "x", _constrained(StructuredOutputsParams(regex="stall+"))),
                                             ("good", "x", SamplingParams(temperature=0.0, max_tokens=30))])
    finally:
        release.set()
        engine.close()
    assert outputs["slow"].outputs[0].finish_reason == "error"
    assert "longer than 0.5 s" in str(outputs["slow"].outputs[0].error)
    assert outputs["good"].outputs[0].finish_reason == "length"


def test_compilations_stuck_past_their_deadline_do_not_starve_later_constraints(checkpoint, monkeypatch):
    """Two pathological constraints that never finish hold both compile threads; once past their deadline
    they give their slots back, so a later constraint still compiles and its request succeeds. Past
    MAX_STUCK_COMPILES stuck ones, new constraints are refused at once (a ValueError), never queued forever."""
    release = threading.Event()
    engine = make_engine(checkpoint[0], max_model_len=128, structured_outputs_compile_timeout_s=0.5)
    compiler = engine.structured.compiler
    real = compiler._compile_kind

    def stalls_on_z(kind, text):  # the "z" regexes compile until the test lets them go
        if "z" in text:
            release.wait(60)
        return real(kind, text)

    monkeypatch.setattr(compiler, "_compile_kind", stalls_on_z)
    try:
        outputs = run_to_completion(engine, [
            ("stuck1", "x", _constrained(StructuredOutputsParams(regex="z+"))),
            ("stuck2", "x", _constrained(StructuredOutputsParams(regex="zz+")))])
        outputs |= run_to_completion(engine, [("later", "x", _constrained(StructuredOutputsParams(
            choice=["yes", "no"])))])  # added after both deadlines: both compile threads are still stuck
        assert [outputs[name].outputs[0].finish_reason for name in ("stuck1", "stuck2")] == ["error", "error"]
        assert outputs["later"].outputs[0].finish_reason == "stop"
        assert outputs["later"].outputs[0].text in ("yes", "no")
        assert compiler.num_stuck == 2
        compiler._max_stuck = 2  # at the cap: a new constraint is refused up front
        with pytest.raises(StructuredOutputError, match="still compiling past their deadline"):
            engine.add_request("refused", "x", _constrained(StructuredOutputsParams(regex="q+")))
    finally:
        release.set()
        engine.close()


@pytest.mark.parametrize("timeout", [0, -1.0, 600.5, float("nan"), True, "30"])
def test_the_compile_timeout_is_a_bounded_engine_setting(timeout):
    from lora_runner.config import MAX_COMPILE_TIMEOUT_S, EngineConfig

    assert EngineConfig(model="m", structured_outputs_compile_timeout_s=MAX_COMPILE_TIMEOUT_S)
    with pytest.raises(ValueError, match="structured_outputs_compile_timeout_s"):
        EngineConfig(model="m", structured_outputs_compile_timeout_s=timeout)


@pytest.mark.parametrize("so", [
    dict(json="{" * 40 + "}" * 40),  # deeper than MAX_SCHEMA_DEPTH
    dict(json=json.dumps({"enum": ["x" * 70000]})),  # over MAX_CONSTRAINT_CHARS
    dict(json={"type": "object"}, regex="a"),  # two kinds
    dict(choice=[]),
])
def test_hostile_constraints_known_up_front_are_value_errors(so):
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**so)


def test_clone_copies_the_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), allowed_token_ids=[5],
                            bad_words=["x"])
    copy = params.clone()
    schema["properties"]["a"]["type"] = "string"
    params.allowed_token_ids.append(6)
    params.bad_words.append("y")
    assert copy.structured_outputs.json["properties"]["a"]["type"] == "integer"
    assert copy.allowed_token_ids == [5] and copy.bad_words == ["x"]


def test_allowed_token_ids_are_the_only_tokens_sampled(engine):
    allowed = [40, 41, 42, 310]  # 310: past the tokenizer, inside the model's vocabulary
    outputs = run_to_completion(engine, [
        (f"a{t}", "allowed", SamplingParams(temperature=t, seed=1, max_tokens=20, allowed_token_ids=allowed,
                                             ignore_eos=True)) for t in (0.0, 1.5)])
    for output in outputs.values():
        assert set(output.outputs[0].token_ids) <= set(allowed)


def test_bad_words_are_never_generated(engine, checkpoint):
    tokenizer = engine.tokenizer.get()
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    free = run_to_completion(engine, [("free", "bad words", greedy)])["free"].outputs[0]
    tokens = free.token_ids
    pairs = [tokens[i:i + 2] for i in range(len(tokens) - 1)]  # two-token words it would write, whose text
    pairs = [p for p in pairs if tokenizer.encode(tokenizer.decode(p), add_special_tokens=False) == p]  # round-trips
    words = {tokenizer.decode(p) for p in pairs[:2]}
    assert words
    params = greedy.clone()
    params.bad_words = sorted(words)
    banned = run_to_completion(engine, [("banned", "bad words", params)])["banned"].outputs[0]
    for word in words:
        ids = tokenizer.encode(word, add_special_tokens=False)
        tokens = banned.token_ids
        assert not any(tokens[i:i + len(ids)] == ids for i in range(len(tokens))), (word, tokens)
    assert banned.token_ids != free.token_ids


@pytest.mark.parametrize("field, value, message", [
    ("allowed_token_ids", [MODEL_VOCAB], "allowed_token_ids"),
    ("allowed_token_ids", [], "allowed_token_ids"),
    ("allowed_token_ids", [True], "allowed_token_ids"),
    ("bad_words", ["ok", ""], "bad_words"),
    ("bad_words", ["x" * 300], "bad_words"),
    ("bad_words", ["w"] * 300, "bad_words"),
])
def test_bad_token_filters_are_value_errors_at_add_request(engine, field, value, message):
    params = SamplingParams()
    setattr(params, field, value)
    with pytest.raises(ValueError, match=message):
        engine.add_request("filters", "x", params)
    assert not engine.has_unfinished_requests()


def test_preempted_constrained_requests_keep_their_matchers(checkpoint, engine):
    from lora_runner.model.config import ModelConfig
    from lora_runner.worker.kv_cache import kv_block_bytes

    path = checkpoint[0]
    so = StructuredOutputsParams(regex=r"[a-z]{6}-[0-9]{6}-[a-z]{6}")
    requests = [(f"q{i}", f"preempt me {i}", _constrained(so, temperature=0.0, max_tokens=30)) for i in range(4)]
    roomy = run_to_completion(engine, requests)
    # 8 tokens per step (chunked prefill); 14 blocks of 4 tokens cannot hold 4 requests of ~35 tokens
    tight = make_engine(path, max_model_len=48, max_num_batched_tokens=8,
                        kv_cache_memory_bytes=14 * kv_block_bytes(ModelConfig.from_dir(path), 4, torch.float32))
    try:
        squeezed = run_to_completion(tight, requests, per_step=2)
        assert tight.scheduler.num_preemptions > 0
    finally:
        tight.close()
    for request_id, output in squeezed.items():
        assert output.outputs[0].finish_reason == "stop"
        assert re.fullmatch(so.regex, output.outputs[0].text)
        assert output.outputs[0].token_ids == roomy[request_id].outputs[0].token_ids


def test_steps_without_constrained_requests_carry_no_bitmask(engine, monkeypatch):
    seen, execute = [], engine.runner.execute

    def spy(sched, grammar=None):
        seen.append(None if grammar is None else (list(grammar.rows), grammar.bitmask.shape))
        return execute(sched, grammar)

    monkeypatch.setattr(engine.runner, "execute", spy)
    run_to_completion(engine, [("u", "plain", SamplingParams(temperature=0.0, max_tokens=3))])
    assert seen and all(s is None for s in seen)
    seen.clear()
    so = StructuredOutputsParams(choice=["ok"])
    run_to_completion(engine, [("u", "plain", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)),
                               ("c", "plain", _constrained(so, temperature=0.0))])
    assert ([0], (1, (MODEL_VOCAB + 31) // 32)) in seen or ([1], (1, (MODEL_VOCAB + 31) // 32)) in seen


@pytest.mark.parametrize("so, check", [
    (StructuredOutputsParams(regex="ab"), lambda t: t == "ab"),
    (StructuredOutputsParams(json={"type": "boolean"}), lambda t: json.loads(t) in (True, False)),
    (StructuredOutputsParams(choice=["yes", "no"]), lambda t: t in ("yes", "no")),
])
def test_min_tokens_past_a_complete_constraint_ends_it_with_stop(engine, so, check):
    """vLLM's behaviour: a constraint that allows only an end token wins over min_tokens (which bans it),
    instead of an all-masked row; a plain request in the same batch still keeps its min_tokens."""
    min_tokens = 30
    outputs = run_to_completion(engine, [
        ("short", "x", _constrained(so, temperature=0.0, min_tokens=min_tokens, max_tokens=60)),
        ("plain", "x", SamplingParams(temperature=0.0, min_tokens=min_tokens, max_tokens=min_tokens + 1))])
    completion = outputs["short"].outputs[0]
    assert completion.finish_reason == "stop" and completion.error is None, completion
    assert check(completion.text) and len(completion.token_ids) < min_tokens
    assert len(outputs["plain"].outputs[0].token_ids) >= min_tokens


def test_a_token_sampled_with_every_token_masked_names_min_tokens(engine):
    from lora_runner.engine.structured import RequestGrammar

    future = engine.structured.compiler.compile(StructuredOutputsParams(regex="ab"))
    grammar = RequestGrammar(future, deadline=float("inf"), timeout_s=1.0)
    future.result(timeout=60)
    assert grammar.state() == "ready"
    tokenizer = engine.tokenizer.get()
    for token in tokenizer.encode("ab", add_special_tokens=False):
        grammar.accept(token)
    assert grammar.only_end_allowed()
    with pytest.raises(StructuredOutputError, match="min_tokens"):
        grammar.accept(tokenizer.encode("c", add_special_tokens=False)[0])


@pytest.mark.parametrize("bounds", [dict(maxLength=4), dict(minLength=1, maxLength=4), dict(minLength=2)])
def test_length_bounded_json_strings_keep_out_control_characters(engine, bounds):
    """xgrammar 0.2.9 alone lets raw control characters into a length-bounded string (invalid JSON)."""
    import xgrammar as xgr

    schema = {"type": "object", "properties": {"c": {"type": "string", **bounds}}, "required": ["c"]}
    compiled = engine.structured.compiler.compile(StructuredOutputsParams(json=schema)).result(timeout=60)
    for control in ("\x06", "\x1f", "\n"):
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string('{"c": "a') and not matcher.accept_string(control)
    matcher = xgr.GrammarMatcher(compiled)
    text = '{"c": "' + "é" * bounds.get("minLength", 1) + '"}'
    assert matcher.accept_string(text) and matcher.is_completed()  # the bounds count characters, as before
    too_long = xgr.GrammarMatcher(compiled)
    assert "maxLength" not in bounds or not too_long.accept_string('{"c": "abcde"}')
