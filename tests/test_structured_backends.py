"""The second structured-output backend (llguidance, structured_outputs_backend="guidance"): the engine's key
exactness tests of tests/test_structured_outputs.py and tests/test_structured_ignore_eos.py run again here
with every engine of this module on llguidance (ENGINE_DEFAULTS patched, so their extra engines too); then
what differs between the backends: Lark grammars, the per-step bound of an ambiguous grammar, bytes
counted per compiled grammar, the setting's validation."""

import json
import random
import re
from types import SimpleNamespace

import pytest
import torch

import engine_support
from engine_support import make_engine, run_to_completion
from lora_runner import EngineConfig, SamplingParams, StructuredOutputsParams
from lora_runner.engine.structured import StructuredOutputError, StructuredOutputs
from structured_support import MODEL_VOCAB, save_byte_checkpoint

pytest.importorskip("llguidance")

# the exactness tests, collected again in this module (so with its fixtures: the engine on llguidance)
from test_structured_ignore_eos import (  # noqa: E402, F401
    test_a_constraint_that_allows_only_its_end_still_stops_under_ignore_eos,
    test_ignore_eos_keeps_a_constraint_that_could_end_going_to_max_tokens,
    test_min_tokens_alone_keeps_the_end_token_out_until_it_is_reached)
from test_structured_outputs import (  # noqa: E402, F401
    test_a_compilation_past_its_deadline_fails_its_request_alone,
    test_a_constraint_that_does_not_compile_fails_its_request_alone,
    test_compilations_stuck_past_their_deadline_do_not_starve_later_constraints,
    test_min_tokens_past_a_complete_constraint_ends_it_with_stop,
    test_parallel_samples_each_follow_the_constraint, test_preempted_constrained_requests_keep_their_matchers,
    test_random_json_schemas_parse_and_validate_greedy_and_sampled, test_regex_choice_and_grammar,
    test_unconstrained_requests_keep_their_tokens_and_logprobs_beside_constrained_ones)

AMBIGUOUS = 'root ::= s\ns ::= s s | "a" | "b"'  # issue 39 item 1: each token's work grows without bound
LARK = 'start: "(" num ("+" num)* ")"\nnum: /[1-9][0-9]?/'


@pytest.fixture(scope="module", autouse=True)
def guidance_engines():
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(engine_support.ENGINE_DEFAULTS, "structured_outputs_backend", "guidance")
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, guidance_engines):
    return save_byte_checkpoint(tmp_path_factory.mktemp("structured-guidance"))


@pytest.fixture(scope="module")
def engine(checkpoint):
    engine = make_engine(checkpoint[0], max_model_len=512, max_num_seqs=16)
    assert engine.structured.compiler.backend.name == "guidance"
    yield engine
    engine.close()


def _mask(engine, matcher) -> set[str]:
    """The texts of the tokens `matcher` allows next."""
    bitmask = torch.full((1, (MODEL_VOCAB + 31) // 32), 0, dtype=torch.int32)  # [1, W]: filled by the matcher
    matcher.fill(bitmask, 0)
    tokenizer = engine.tokenizer.get()
    return {tokenizer.decode([t]) for t in range(MODEL_VOCAB) if bitmask[0, t // 32] >> (t % 32) & 1}


def test_json_object_allows_an_object_only_and_bounded_whitespace(engine):
    compiler = engine.structured.compiler
    compiled = compiler.compile(StructuredOutputsParams(json_object=True)).result(timeout=60)
    allowed = _mask(engine, compiler.backend.matcher(compiled))
    assert "{" in allowed and "[" not in allowed and "1" not in allowed and max(allowed, key=len) != ""
    assert all(text.strip() in ("", "{") or text.lstrip().startswith("{") for text in allowed), allowed
    matcher = compiler.backend.matcher(compiled)
    space = engine.tokenizer.get().encode(" ", add_special_tokens=False)[0]
    assert matcher.accept_token(engine.tokenizer.get().encode("{", add_special_tokens=False)[0])
    assert sum(matcher.accept_token(space) for _ in range(12)) == 8  # xgrammar's MAX_JSON_WHITESPACE as well


@pytest.mark.parametrize("bounds", [dict(maxLength=4), dict(minLength=2)])
def test_length_bounded_json_strings_keep_out_control_characters(engine, bounds):
    schema = {"type": "object", "properties": {"c": {"type": "string", **bounds}}, "required": ["c"]}
    compiler = engine.structured.compiler
    matcher = compiler.backend.matcher(compiler.compile(StructuredOutputsParams(json=schema)).result(timeout=60))
    for token in engine.tokenizer.get().encode('{"c": "a', add_special_tokens=False):
        assert matcher.accept_token(token)
    assert not {text for text in _mask(engine, matcher) if any(ord(ch) < 32 for ch in text)}


def test_a_lark_grammar_runs_on_guidance(engine):
    outputs = run_to_completion(engine, [
        (f"lark-{t}", "sum", SamplingParams(structured_outputs=StructuredOutputsParams(grammar=LARK),
                                            temperature=t, seed=4, max_tokens=200)) for t in (0.0, 1.0)])
    for output in outputs.values():
        assert output.outputs[0].finish_reason == "stop", output.outputs[0]
        assert re.fullmatch(r"\([1-9]\d?(\+[1-9]\d?)*\)", output.outputs[0].text), output.outputs[0].text


def test_xgrammar_refuses_a_lark_grammar_naming_the_backend_that_reads_it(checkpoint):
    xgr_engine = make_engine(checkpoint[0], max_model_len=128, structured_outputs_backend="xgrammar")
    try:
        outputs = run_to_completion(xgr_engine, [
            ("lark", "x", SamplingParams(structured_outputs=StructuredOutputsParams(grammar=LARK), max_tokens=8)),
            ("plain", "x", SamplingParams(temperature=0.0, max_tokens=4))])
    finally:
        xgr_engine.close()
    assert outputs["lark"].outputs[0].finish_reason == "error"
    assert 'structured_outputs_backend="guidance"' in str(outputs["lark"].outputs[0].error)
    assert outputs["plain"].outputs[0].finish_reason == "length"


def _byte_tokenizer():
    from factories import make_byte_level_tokenizer

    return make_byte_level_tokenizer(300)


def test_the_ambiguous_grammar_is_stopped_by_llguidances_own_per_step_bound():
    """With a CPU clock that never advances the time budget never fires: only llguidance's parser limits
    (set from the same budget) can stop `s ::= s s | "a" | "b"`, and they do, at the same token on any host."""
    tokenizer = _byte_tokenizer()
    structured = StructuredOutputs(lambda: tokenizer, MODEL_VOCAB, lambda: {1}, timeout_s=60, mask_budget_s=0.005,
                                   clock=lambda: 0.0, backend="guidance")
    params = SamplingParams(structured_outputs=StructuredOutputsParams(grammar=AMBIGUOUS), max_tokens=1000)
    try:
        grammar = structured.request_grammar(params, "A")
        grammar._future.result(timeout=60)
        assert grammar.state() == "ready"
        request = SimpleNamespace(grammar=grammar, params=params, num_output_tokens=0)
        ab_tokens = [i for i in range(300) if tokenizer.decode([i]) and set(tokenizer.decode([i])) <= {"a", "b"}]
        rng = random.Random(0)
        with pytest.raises(StructuredOutputError, match="per-step limits"):
            for _ in range(1000):  # ~4 Earley items per character: 2_000 items after ~500 one-byte tokens
                rows, bitmask = structured.step_bitmask([request])
                assert bitmask[0].ne(0).any()  # a row over the limits bans nothing: the error ends it, alone
                grammar.accept(rng.choice(ab_tokens))
                request.num_output_tokens += 1
        assert request.num_output_tokens < 1000
    finally:
        structured.close()


def test_the_guidance_limits_follow_the_mask_budget():
    from lora_runner.engine.structured.guidance_backend import limits_for_budget

    default, tight = limits_for_budget(0.25), limits_for_budget(0.005)
    assert (default.step_max_items, default.step_lexer_fuel) == (50_000, 200_000)  # llguidance's defaults
    assert tight.step_max_items < default.step_max_items and tight.step_lexer_fuel < default.step_lexer_fuel


def test_guidance_grammars_count_their_bytes_in_the_tenant_caches(engine):
    compiler = engine.structured.compiler
    before = compiler.queue.bytes_of("bytes-tenant")
    compiled = compiler.compile(StructuredOutputsParams(regex="[a-z]{3}"), "bytes-tenant").result(timeout=60)
    assert compiler.queue.bytes_of("bytes-tenant") - before == compiler.backend.size_of(compiled) > 0
    compiler.compile(StructuredOutputsParams(regex="[a-z]{4}"), "bytes-tenant").result(timeout=60)
    assert compiler.queue.bytes_of("bytes-tenant") - before == 2 * compiler.backend.size_of(compiled)


@pytest.mark.parametrize("value", ["nope", "", None, "llguidance"])
def test_the_backend_is_a_checked_engine_setting(value):
    with pytest.raises(ValueError, match="structured_outputs_backend must be"):
        EngineConfig(model="m", structured_outputs_backend=value)
    assert EngineConfig(model="m").structured_outputs_backend == "auto"


def test_auto_is_guidance_where_llguidance_is_installed_and_xgrammar_elsewhere(monkeypatch):
    import importlib.util

    from lora_runner.engine.structured.backend import resolve_backend

    assert resolve_backend("auto") == "guidance" and resolve_backend("xgrammar") == "xgrammar"
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "llguidance" else find_spec(name, *args))
    assert resolve_backend("auto") == "xgrammar" and resolve_backend("guidance") == "guidance"


def test_a_tokenizer_llguidance_cannot_read_is_served_by_xgrammar_under_auto(tmp_path):
    """The engine tests' word-level tokenizer has no decoder llguidance knows: "auto" falls back to xgrammar,
    an explicit "guidance" says what to choose instead."""
    from factories import save_tiny_tokenizer

    from lora_runner.engine.structured.grammar_compiler import make_backend

    tokenizer = save_tiny_tokenizer(tmp_path, 64)
    assert make_backend("auto", tokenizer, 64, {2}).name == "xgrammar"
    with pytest.raises(StructuredOutputError, match='structured_outputs_backend="xgrammar"'):
        make_backend("guidance", tokenizer, 64, {2})


def test_json_schema_outputs_agree_in_shape_across_backends(engine, checkpoint):
    """Greedy JSON under both backends on one schema: both valid, and the same value (they mask the same
    tokens where whitespace is off)."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
                            temperature=0.0, max_tokens=60)
    guided = run_to_completion(engine, [("g", "json please", params)])["g"].outputs[0]
    xgr_engine = make_engine(checkpoint[0], max_model_len=512, max_num_seqs=16, structured_outputs_backend="xgrammar")
    try:
        plain = run_to_completion(xgr_engine, [("x", "json please", params)])["x"].outputs[0]
    finally:
        xgr_engine.close()
    assert json.loads(guided.text) == json.loads(plain.text)
    assert guided.token_ids == plain.token_ids


STRUCTURAL_TAG = {"type": "structural_tag", "triggers": ["<f="],
                  "structures": [{"begin": "<f=get>", "end": "</f>", "schema": {
                      "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}]}


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_a_structural_tag_leaves_free_text_free_and_holds_the_tagged_part_to_its_schema(backend):
    tokenizer = _byte_tokenizer()
    structured = StructuredOutputs(lambda: tokenizer, MODEL_VOCAB, lambda: {1}, timeout_s=60, backend=backend)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(structural_tag=json.dumps(STRUCTURAL_TAG)))
    try:
        grammar = structured.request_grammar(params)
        grammar._future.result(timeout=60)
        assert grammar.state() == "ready"

        def follows(text: str) -> bool:
            matcher = structured.compiler.backend.matcher(grammar._future.result())
            return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))

        assert follows("any text at all, then <f=get>") and follows('hi <f=get>{"a": 12}</f> and more text')
        assert not follows('hi <f=get>{"b": 1}') and not follows('<f=get>{"a": "x"}')
    finally:
        structured.close()


def test_the_guidance_backend_names_the_backend_for_xgrammars_structural_tag_format():
    tokenizer = _byte_tokenizer()
    structured = StructuredOutputs(lambda: tokenizer, MODEL_VOCAB, lambda: {1}, timeout_s=60, backend="guidance")
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f="], "tags": []}}
    try:
        future = structured.compiler.compile(StructuredOutputsParams(structural_tag=json.dumps(tag)))
        with pytest.raises(StructuredOutputError, match='structured_outputs_backend="xgrammar"'):
            future.result(timeout=60)
    finally:
        structured.close()


@pytest.fixture(scope="module")
def server_client(checkpoint):
    """An HTTP server on the guidance backend (the generated --structured-outputs-backend flag)."""
    import openai

    from serve_support import serve_args, start_server

    server, _ = start_server(serve_args(checkpoint[0], {}, extra=["--structured-outputs-backend", "guidance"]))
    yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    server.stop()


def test_structural_tags_and_lark_grammars_over_http(server_client):
    import openai

    tagged = server_client.completions.create(model="base", prompt="call:", max_tokens=24, temperature=0.0,
                                              extra_body={"response_format": STRUCTURAL_TAG})
    assert tagged.choices[0].finish_reason in ("stop", "length")
    text = tagged.choices[0].text
    if "<f=get>" in text:  # the random model rarely writes the trigger; when it does the body follows the schema
        assert re.match(r'\{"a": ?-?\d+\}', text.split("<f=get>", 1)[1])
    lark = server_client.completions.create(model="base", prompt="sum:", max_tokens=100, temperature=0.0,
                                            extra_body={"structured_outputs": {"grammar": LARK}})
    assert lark.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"\([1-9]\d?(\+[1-9]\d?)*\)", lark.choices[0].text)
    for body, message in (({"response_format": {"type": "structural_tag", "structures": []}}, "structural_tag"),
                          ({"structured_outputs": {"structural_tag": '{"structures": [], "triggers": []}'}},
                           "structural_tag")):
        with pytest.raises(openai.BadRequestError, match=message):
            server_client.completions.create(model="base", prompt="x", max_tokens=4, extra_body=body)
