"""Tenant isolation, round three, leftovers (issue 39): what a tenant's constrained requests and scoring
responses may hold, and a step's guidance masks filled together.

- A live request's matcher counts in its tenant's structured-output bytes (both backends) from when it is made
  until its request ends: a tenant with many concurrent constrained requests gets StructuredOutputError naming
  structured_outputs_tenant_cache_bytes past its bound, another tenant is not touched, and the bytes come back
  at finish / abort.
- llguidance fills a step's constrained rows in one batch on its own threads (the same masks as one by one);
  its limits still fail an ambiguous grammar alone; a batch over the step budget makes the next step fill one
  by one, timed, which fails the slowest, and the batches resume.
- A whole response's reservation counts an echoed prompt's logprobs entries once for its n choices (they are
  built once and shared; the body is written a chunk at a time): what is held, not what is sent.

Counts and events only, no timing assertions (bench_tenant_isolation.py measures the latency).
"""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

from lora_runner import SamplingParams, StructuredOutputsParams
from lora_runner.engine.structured import StructuredOutputError, StructuredOutputs
from structured_support import MODEL_VOCAB

AMBIGUOUS = 'root ::= s\ns ::= s s | "a" | "b"'
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}, "required": ["n"]}


def _byte_tokenizer():
    from factories import make_byte_level_tokenizer

    return make_byte_level_tokenizer(300)


def _structured(backend: str, **kwargs) -> StructuredOutputs:
    tokenizer = _byte_tokenizer()
    return StructuredOutputs(lambda: tokenizer, MODEL_VOCAB, lambda: {1}, timeout_s=60, backend=backend, **kwargs)


def _request(structured: StructuredOutputs, tenant: str, **constraint) -> SimpleNamespace:
    """A request-like object (what step_bitmask reads) whose grammar is compiled (not yet asked for its state)."""
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint), max_tokens=1000)
    grammar = structured.request_grammar(params, tenant)
    grammar._future.result(timeout=60)
    return SimpleNamespace(grammar=grammar, params=params, num_output_tokens=0)


# -- item 2: matcher memory in the tenant's bytes ---------------------------------------------------------------

@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_a_tenants_live_matchers_count_in_its_bytes_until_their_requests_end(backend):
    if backend == "guidance":
        pytest.importorskip("llguidance")
    structured = _structured(backend, total_bytes=1 << 30)
    queue = structured.compiler.queue
    try:
        compiled = structured.compiler.compile(StructuredOutputsParams(json=SCHEMA), "A").result(timeout=60)
        grammar_bytes = structured.compiler.backend.size_of(compiled)
        matcher_bytes = structured.compiler.backend.matcher_bytes(compiled)
        assert queue.bytes_of("A") == grammar_bytes
        other = _request(structured, "B", json=SCHEMA)  # compiled now, its matcher made below
        # room for the compiled grammar and three matchers: the fourth live request is over the tenant's bound
        queue.tenant_bytes = grammar_bytes + 3 * matcher_bytes + matcher_bytes // 2
        first = [_request(structured, "A", json=SCHEMA) for _ in range(5)]  # one compilation, five matchers
        assert [r.grammar.state() for r in first[:4]] == ["ready"] * 3 + ["failed"]
        assert "structured_outputs_tenant_cache_bytes" in str(first[3].grammar.error)
        # to make room the tenant's cached grammar went first (its live requests keep their matchers)
        assert queue.bytes_of("A") == 3 * matcher_bytes
        assert other.grammar.state() == "ready"  # its own bound: A's matchers are not counted to it
        first[3].grammar.release()  # a failed one gives back nothing it did not hold
        first[0].grammar.release()  # finished or aborted: its matcher's bytes come back (once)
        first[0].grammar.release()
        assert queue.bytes_of("A") == 2 * matcher_bytes
        assert first[4].grammar.state() == "ready"
        for request in [*first[1:3], first[4], other]:
            request.grammar.release()
        assert queue.bytes_of("A") == 0 and queue.bytes_of("B") == grammar_bytes
    finally:
        structured.close()


def test_live_matchers_are_counted_in_the_servers_total_too():
    structured = _structured("xgrammar")
    queue = structured.compiler.queue
    try:
        held = _request(structured, "A", regex="[ab]+")
        compiled = held.grammar._future.result()
        size = structured.compiler.backend.size_of(compiled) + structured.compiler.backend.matcher_bytes(compiled)
        other, spare = _request(structured, "B", regex="[ab]+"), _request(structured, "B", regex="[ab]+")
        assert held.grammar.state() == "ready"
        queue.total_bytes = queue.bytes_of() + size // 2  # B's matcher no longer fits in the server's bytes
        assert other.grammar.state() == "failed" and "structured_outputs_cache_bytes" in str(other.grammar.error)
        held.grammar.release()
        assert spare.grammar.state() == "ready"
    finally:
        structured.close()


def test_many_concurrent_constrained_requests_of_one_tenant_fail_past_its_bound_and_a_bystander_runs(tmp_path):
    """Through the engine: tenant A's twelve constrained requests at once, its bound room for a few matchers:
    the rest fail with the error naming the setting, the ones that got a matcher follow the constraint, B's
    constrained and unconstrained requests are those it gets alone, and every byte comes back at the end."""
    from engine_support import make_engine
    from structured_support import save_byte_checkpoint

    from lora_runner.engine.structured.guidance_backend import MATCHER_BYTES

    pytest.importorskip("llguidance")
    model_dir, _ = save_byte_checkpoint(tmp_path)
    engine = make_engine(model_dir, max_model_len=128, max_num_seqs=16, structured_outputs_backend="guidance",
                         structured_outputs_tenant_cache_bytes=4 * MATCHER_BYTES + (256 << 10))
    constrained = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[ab]{6}"), temperature=0.0,
                                 max_tokens=12)
    plain = SamplingParams(temperature=0.0, max_tokens=8)
    try:
        alone = _run(engine, [("b-regex", "x", constrained, "B"), ("b-plain", "abc", plain, "B")])
        outputs = _run(engine, [(f"a{i}", "x", constrained, "A") for i in range(12)]
                       + [("b-regex", "x", constrained, "B"), ("b-plain", "abc", plain, "B")])
        queue = engine.structured.compiler.queue
        assert queue._held == {}  # every matcher's bytes came back
    finally:
        engine.close()
    failed = [o for name, o in outputs.items() if name.startswith("a") and o.finish_reason == "error"]
    served = [o for name, o in outputs.items() if name.startswith("a") and o.finish_reason != "error"]
    assert failed and all("structured_outputs_tenant_cache_bytes" in str(o.error) for o in failed)
    assert served and all(len(o.text) == 6 and set(o.text) <= {"a", "b"} for o in served)
    for name in ("b-regex", "b-plain"):
        assert outputs[name].token_ids == alone[name].token_ids, name


def _run(engine, requests) -> dict:
    """{request id: its CompletionOutput} once all of `requests` (id, prompt, params, tenant) finished."""
    for request_id, prompt, params, tenant in requests:
        engine.add_request(request_id, prompt, params, tenant=tenant)
    outputs = {}
    for _ in range(10_000):
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0]
        if not engine.has_unfinished_requests():
            return outputs
    raise AssertionError("the requests did not finish")


# -- item 3: a step's guidance masks filled together ------------------------------------------------------------

def _masks_one_by_one(structured, requests) -> torch.Tensor:
    structured.parallel_fill = False
    try:
        return structured.step_bitmask(requests)[1]
    finally:
        structured.parallel_fill = True


def test_a_steps_guidance_masks_are_filled_in_one_batch_with_the_masks_of_one_by_one(monkeypatch):
    pytest.importorskip("llguidance")
    from lora_runner.engine.structured.request_grammar import RequestGrammar

    tokenizer = _byte_tokenizer()
    structured = _structured("guidance")
    constraints = [dict(json=SCHEMA), dict(regex="[ab]{3,9}"), dict(choice=["yes", "no", "maybe"]),
                   dict(regex="[0-9]+"), dict(json=SCHEMA)]
    prefixes = ['{"n": 1', "ab", "ma", "", '{"']
    try:
        requests = [_request(structured, "A", **c) for c in constraints]
        for request, prefix in zip(requests, prefixes):
            assert request.grammar.state() == "ready"
            for token in tokenizer.encode(prefix, add_special_tokens=False):
                assert request.grammar.accept(token) is False
        batches, fills = [], []
        real_batch = structured.compiler.backend.fill_batch
        monkeypatch.setattr(structured.compiler.backend, "fill_batch",
                            lambda rows, bitmask: batches.append(len(rows)) or real_batch(rows, bitmask))
        real_fill = RequestGrammar.fill
        monkeypatch.setattr(RequestGrammar, "fill", lambda self, *a, **k: fills.append(1) or real_fill(self, *a, **k))
        rows, together = structured.step_bitmask(requests)
        assert rows == list(range(5)) and batches == [5] and not fills  # one batch, no fill one by one
        apart = _masks_one_by_one(structured, requests)
        assert len(fills) == 5
        assert torch.equal(together, apart)
        assert together.ne(-1).all(dim=1).any()  # the rows do ban tokens (not all left all-allowed)
    finally:
        structured.close()


def test_in_a_batch_the_ambiguous_grammar_is_stopped_by_llguidances_limits_alone():
    """Two bystanders' rows beside `s ::= s s | "a" | "b"` filled together, with a CPU clock that never moves:
    llguidance's limits stop the ambiguous one alone; the bystanders' rows are those they get alone."""
    pytest.importorskip("llguidance")
    tokenizer = _byte_tokenizer()
    structured = _structured("guidance", mask_budget_s=0.005, clock=lambda: 0.0)
    try:
        hostile = _request(structured, "A", grammar=AMBIGUOUS)
        bystanders = [_request(structured, "B", regex="[a-z]{1,2000}") for _ in range(2)]
        for request in [hostile, *bystanders]:
            assert request.grammar.state() == "ready"
        ab_tokens = [i for i in range(300) if tokenizer.decode([i]) and set(tokenizer.decode([i])) <= {"a", "b"}]
        rng = random.Random(0)
        with pytest.raises(StructuredOutputError, match="per-step limits"):
            for _ in range(1000):
                _, together = structured.step_bitmask([hostile, *bystanders])
                assert torch.equal(together[1:], _masks_one_by_one(structured, bystanders))
                token = rng.choice(ab_tokens)
                for request in bystanders:
                    assert request.grammar.accept(token) is False
                hostile.grammar.accept(token)
        assert bystanders[0].grammar.matcher.step_error() is None
    finally:
        structured.close()


def test_a_batch_over_the_step_budget_makes_the_next_step_find_its_slowest_one_by_one(monkeypatch):
    """Three rows whose batch 'takes' 600 ms of wall time (the step may take 500): nobody fails for it, the next
    step fills them one by one on the injected CPU clock (300, 200 and 200 ms: each under the 350 ms a request
    may, 700 together) and fails the slowest alone; the step after it is a batch again."""
    pytest.importorskip("llguidance")
    from lora_runner.engine.structured.request_grammar import RequestGrammar

    cpu, wall = [0.0], [0.0]
    structured = _structured("guidance", mask_budget_s=0.35, step_budget_s=0.5, clock=lambda: cpu[0],
                             batch_clock=lambda: wall[0])
    try:
        requests = [_request(structured, "A", regex="[ab]{1,50}") for _ in range(3)]
        assert all(r.grammar.state() == "ready" for r in requests)
        costs = {id(requests[0].grammar): 0.3, id(requests[1].grammar): 0.2, id(requests[2].grammar): 0.2}
        batches, real_batch, real_fill = [], structured.compiler.backend.fill_batch, RequestGrammar.fill

        def slow_batch(rows, bitmask):
            batches.append(len(rows))
            wall[0] += 0.6
            return real_batch(rows, bitmask)

        def slow_fill(self, bitmask, index, eos_allowed=True):
            cpu[0] += costs[id(self)]
            return real_fill(self, bitmask, index, eos_allowed)

        monkeypatch.setattr(structured.compiler.backend, "fill_batch", slow_batch)
        monkeypatch.setattr(RequestGrammar, "fill", slow_fill)
        token = _byte_tokenizer().encode("a", add_special_tokens=False)[0]
        structured.step_bitmask(requests)
        assert batches == [3]
        for request in requests:  # a slow batch fails nobody
            assert request.grammar.accept(token) is False
        structured.step_bitmask(requests)  # one by one, timed: 700 ms together, the 300 ms one fails
        assert batches == [3]
        with pytest.raises(StructuredOutputError, match="structured_outputs_step_mask_budget_ms"):
            requests[0].grammar.accept(token)
        for request in requests[1:]:
            assert request.grammar.accept(token) is False
        structured.step_bitmask(requests[1:])
        assert batches == [3, 2]  # batches again
    finally:
        structured.close()


# -- item 1: an echoed prompt's entries held once for its n choices ----------------------------------------------

def test_an_echoed_prompts_entries_count_once_in_the_reservation_and_n_times_in_what_is_sent():
    from lora_runner.entrypoints.openai.echo import (ENTRY_REFERENCE_BYTES, ChoiceExtras, logprob_entries,
                                                     response_bytes)
    from lora_runner.entrypoints.openai.response_body import ENTRY_JSON_BYTES

    extras = ChoiceExtras(["p", "q"], echo_logprobs=True)
    one, many = (response_bytes([500, 300], n, 0, 5, extras) for n in (1, 16))
    echoed = (500 + 300) * 6  # the prompts' entries, built once and shared by each prompt's n choices
    assert one == echoed * ENTRY_JSON_BYTES + 800 * ENTRY_REFERENCE_BYTES
    assert many == echoed * ENTRY_JSON_BYTES + 16 * 800 * ENTRY_REFERENCE_BYTES  # a reference per choice only
    assert logprob_entries([500, 300], 16, 0, 5, extras, True) == 16 * echoed  # the body sends each choice's
    scored = dataclasses.replace(extras, echo_logprobs=False, prompt_logprobs=3)
    generated = response_bytes([500], 16, 10, 5, scored)
    assert generated == (500 * 4 + 16 * 10 * 6) * ENTRY_JSON_BYTES  # vLLM's prompt_logprobs once too


def test_a_whole_echo_responses_reservation_holds_its_prompts_entries_once(tmp_path, monkeypatch):
    """Over HTTP: n=8 echoed with logprobs reserves the prompt's entries once (plus a reference per choice),
    what response_bytes says, not eight times; the reservation is refunded once the body was sent."""
    import httpx
    from serve_support import serve_args, start_server
    from structured_support import save_byte_checkpoint

    from lora_runner.entrypoints.openai.echo import ChoiceExtras, response_bytes
    from lora_runner.entrypoints.openai.state import ServerState

    reserved, real = [], ServerState.reserve_response
    monkeypatch.setattr(ServerState, "reserve_response",
                        lambda self, tenant, nbytes: reserved.append(nbytes) or real(self, tenant, nbytes))
    model_dir, _ = save_byte_checkpoint(tmp_path)
    server, state = start_server(serve_args(model_dir, {}))
    prompt = "the cat sat on the mat " * 8
    try:
        for n in (1, 8):
            body = {"model": "base", "prompt": prompt, "n": n, "max_tokens": 2, "echo": True, "logprobs": 3,
                    "temperature": 1.0, "seed": 0}
            response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            assert len(response.json()["choices"]) == n
        assert state.unsent_bytes == 0
        length = len(state.tokenizer.encode(prompt))
    finally:
        server.stop()
    extras = ChoiceExtras([prompt], echo_logprobs=True)
    assert reserved == [response_bytes([length], n, 2, 3, extras) for n in (1, 8)]
    echoed_once = response_bytes([length], 1, 0, 3, extras)
    assert reserved[1] - reserved[0] < echoed_once  # the 7 more choices do not hold the prompt's entries again
