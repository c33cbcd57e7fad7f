"""Hostile tenants against structured outputs (issue 39, items 1-3): compiled grammars bounded in bytes per
tenant and in total, compilations served fairly across tenants with per-tenant stuck budgets and dropped
when their requests are gone, and a per-step mask budget that fails a slow constraint alone. Fake
compilers and matchers gated by events: no timing assertions."""

import threading
from concurrent.futures import CancelledError

import pytest

from lora_runner.engine.structured.backend import StructuredOutputError
from lora_runner.engine.structured.compile_queue import CompileQueue


class FakeCompiler:
    """compile_fn whose compilations of texts starting with "slow" wait for `gate`; records the order."""

    def __init__(self, sizes=None):
        self.gate = threading.Event()
        self.order: list[str] = []
        self.started = threading.Semaphore(0)
        self.sizes = sizes or {}

    def __call__(self, kind, text):
        self.order.append(text)
        self.started.release()
        if text.startswith("slow"):
            assert self.gate.wait(30), "the test never let the slow compilation go"
        return text

    def size_of(self, compiled):
        return self.sizes.get(compiled, 100)


def _queue(compiler, **overrides):
    settings = dict(threads=1, timeout_s=None, tenant_bytes=1000, total_bytes=3000, max_stuck_per_tenant=2,
                    max_stuck=8, max_entries=128)
    return CompileQueue(compiler, compiler.size_of, lambda kind, text: 10, **{**settings, **overrides})


def test_a_flood_from_one_tenant_delays_another_by_one_compilation_at_most():
    compiler = FakeCompiler()
    queue = _queue(compiler, tenant_bytes=10_000, total_bytes=100_000)
    try:
        flood = [queue.submit(("json", f"slow{i}"), "A") for i in range(10)]
        assert compiler.started.acquire(timeout=30)  # A's first holds the one thread
        trivial = queue.submit(("json", "int"), "B")
        compiler.gate.set()
        assert trivial.result(timeout=30) == "int"
        assert compiler.order.index("int") == 1  # right after the compilation that was running
        assert [f.result(timeout=30) for f in flood] == [f"slow{i}" for i in range(10)]
    finally:
        compiler.gate.set()
        queue.close()


def test_compiled_grammars_are_bounded_per_tenant_evicting_the_tenants_own_first():
    compiler = FakeCompiler(sizes={f"a{i}": 400 for i in range(10)} | {"b0": 400})
    queue = _queue(compiler)
    try:
        queue.submit(("json", "b0"), "B").result(timeout=30)
        for i in range(10):  # 4 KB of grammars from A, whose bound is 1000 bytes
            queue.submit(("json", f"a{i}"), "A").result(timeout=30)
            assert queue.bytes_of("A") <= 1000
        assert queue.bytes_of("B") == 400  # B's grammar was not evicted for A's
        assert queue.bytes_of() <= 3000
        before = len(compiler.order)
        queue.submit(("json", "b0"), "B").result(timeout=30)
        assert len(compiler.order) == before  # still cached
    finally:
        queue.close()


def test_the_total_bound_evicts_the_least_recently_used_of_anyone():
    compiler = FakeCompiler(sizes={f"{t}{i}": 400 for t in "abcd" for i in range(3)})
    queue = _queue(compiler, total_bytes=2000)
    try:
        for tenant in "abcd":
            for i in range(2):
                queue.submit(("json", f"{tenant}{i}"), tenant).result(timeout=30)
                assert queue.bytes_of() <= 2000
    finally:
        queue.close()


def test_a_grammar_over_the_tenant_bound_is_refused_with_a_clear_error():
    compiler = FakeCompiler(sizes={"huge": 5000})
    queue = _queue(compiler)
    try:
        with pytest.raises(StructuredOutputError, match="compiles to 5000 bytes, more than the 1000 bytes"):
            queue.submit(("json", "huge"), "A").result(timeout=30)
        assert queue.bytes_of() == 0
    finally:
        queue.close()


def test_in_flight_compilations_count_against_the_tenant_bound():
    compiler = FakeCompiler()
    queue = _queue(compiler, tenant_bytes=25)  # two reservations of 10 bytes fit, a third does not
    try:
        queue.submit(("json", "slow0"), "A")
        queue.submit(("json", "slow1"), "A")
        with pytest.raises(StructuredOutputError, match="still compiling take its whole grammar memory"):
            queue.submit(("json", "slow2"), "A")
        assert queue.submit(("json", "b"), "B") is not None  # B is not refused for A's
    finally:
        compiler.gate.set()
        queue.close()


def test_stuck_compilations_are_budgeted_per_tenant():
    compiler = FakeCompiler()
    queue = _queue(compiler, timeout_s=0.05, max_stuck_per_tenant=1, max_stuck=8)
    try:
        stuck = queue.submit(("json", "slow0"), "A")
        with pytest.raises(StructuredOutputError, match="longer than"):
            stuck.result(timeout=30)
        assert queue.num_stuck == 1
        with pytest.raises(StructuredOutputError, match="still compiling past their deadline"):
            queue.submit(("json", "slow1"), "A")
        assert queue.submit(("json", "b"), "B").result(timeout=30) == "b"  # B compiles on the new thread
    finally:
        compiler.gate.set()
        queue.close()


def test_a_compilation_whose_requests_are_gone_never_starts():
    compiler = FakeCompiler()
    queue = _queue(compiler)
    try:
        queue.submit(("json", "slow0"), "A")
        assert compiler.started.acquire(timeout=30)
        abandoned = queue.submit(("json", "gone"), "A")
        shared = queue.submit(("json", "kept"), "A")
        assert queue.submit(("json", "kept"), "A") is shared  # two requests wait on it
        queue.release(abandoned)
        queue.release(shared)  # one of its two requests is gone: it still compiles
        assert abandoned.cancelled()
        compiler.gate.set()
        assert shared.result(timeout=30) == "kept"
        assert "gone" not in compiler.order
        with pytest.raises(CancelledError):
            abandoned.result(timeout=0)
    finally:
        compiler.gate.set()
        queue.close()


# ---------------------------------------------------------------------------------------- on the engine
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from structured_support import save_byte_checkpoint

    return save_byte_checkpoint(tmp_path_factory.mktemp("budgets"))


def _constrained(**constraint):
    from lora_runner import SamplingParams, StructuredOutputsParams

    return SamplingParams(structured_outputs=StructuredOutputsParams(**constraint), temperature=0.0, max_tokens=12)


def test_a_constraint_over_the_mask_budget_fails_alone_and_costs_its_bystander_one_step(checkpoint, monkeypatch):
    """An injected slow matcher (each fill 'takes' 10 s on the injected clock, the budget is 50 ms): its request
    fails with StructuredOutputError after one fill, instead of slowing every step; a bystander's tokens are
    those it gets alone."""
    from engine_support import make_engine, run_to_completion

    from lora_runner import SamplingParams
    from lora_runner.engine.structured.request_grammar import RequestGrammar

    bystander = ("bystander", "hello", SamplingParams(temperature=0.0, max_tokens=12))
    engine = make_engine(checkpoint[0], max_model_len=128, structured_outputs_mask_budget_ms=50)
    try:
        alone = run_to_completion(engine, [bystander])["bystander"].outputs[0].token_ids
        now, slow_fills, real_fill = [0.0], [], RequestGrammar.fill
        engine.structured._clock = lambda: now[0]

        def slow_fill(self, bitmask, index, eos_allowed=True):  # the only constrained request is the slow one
            slow_fills.append(index)
            now[0] += 10.0  # what an ambiguous grammar's fill costs
            return real_fill(self, bitmask, index, eos_allowed)

        monkeypatch.setattr(RequestGrammar, "fill", slow_fill)
        outputs = run_to_completion(engine, [("slow", "x", _constrained(regex="[ab]+")), bystander])
    finally:
        engine.close()
    assert outputs["slow"].outputs[0].finish_reason == "error"
    assert "over the 50 ms a request may take" in str(outputs["slow"].outputs[0].error)
    assert len(slow_fills) == 1  # it slowed one step, not every step
    assert outputs["bystander"].outputs[0].token_ids == alone


def test_an_aborted_request_drops_its_queued_compilation_and_tenants_compile_in_turn(checkpoint, monkeypatch):
    """Both compile threads busy with tenant A's slow schemas: once one thread is free, B's constraint runs
    before A's next one, and a request aborted while its constraint waits leaves nothing to compile."""
    from engine_support import make_engine, run_to_completion

    engine = make_engine(checkpoint[0], max_model_len=128)
    compiler = engine.structured.compiler
    real, order, started = compiler._compile_kind, [], threading.Semaphore(0)
    gates = {f"z{{{i + 1}}}": threading.Event() for i in range(4)}  # A's slow constraints, let go one by one

    def gated(kind, text):
        order.append(text)
        started.release()
        if text in gates:
            assert gates[text].wait(60)
        return real(kind, text)

    monkeypatch.setattr(compiler, "_compile_kind", gated)
    try:
        for i in range(4):
            engine.add_request(f"a{i}", "x", _constrained(regex=f"z{{{i + 1}}}"), tenant="A")
        assert started.acquire(timeout=30) and started.acquire(timeout=30)  # both threads hold A's
        engine.add_request("gone", "x", _constrained(regex="q+"), tenant="B")
        engine.add_request("b", "x", _constrained(choice=["yes", "no"]), tenant="B")
        engine.abort_request("gone")
        engine.step()  # the abort is taken: "q+" is dropped before it starts
        gates[order[0]].set()  # one thread free: B's turn
        assert started.acquire(timeout=30) and started.acquire(timeout=30)  # B's, then A's third
        for gate in gates.values():
            gate.set()
        outputs = run_to_completion(engine)
    finally:
        for gate in gates.values():
            gate.set()
        engine.close()
    assert "q+" not in order
    assert order[2] == '["yes", "no"]'  # B's before A's third and fourth
    assert outputs["b"].outputs[0].text in ("yes", "no")
    assert [outputs[f"a{i}"].outputs[0].text for i in range(4)] == ["z" * (i + 1) for i in range(4)]


def test_schema_handling_runs_off_the_event_loop(checkpoint, monkeypatch):
    """A body's constraint (validation, copies, JSON round trips of a big schema) is turned into SamplingParams on
    the prompt pool, never on the event loop that serves every tenant's streams and /health."""
    import openai
    from serve_support import serve_args, start_server

    from lora_runner.entrypoints.openai import completions

    threads, real = [], completions.sampling_params

    def recorded(*args):
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(completions, "sampling_params", recorded)
    server, _ = start_server(serve_args(checkpoint[0], {}))
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        completion = client.completions.create(model="base", prompt="n:", max_tokens=30, temperature=0.0, extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
    finally:
        server.stop()
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert threads and all(name.startswith("lora-runner-prompts") for name in threads), threads


def test_the_real_ambiguous_grammar_is_stopped_by_the_mask_budget():
    """xgrammar on `s ::= s s | "a" | "b"` with a 49k-token BPE vocabulary: each fill costs more than the last
    (0.2 ms at the first token, about 250 ms by the 130th on a 2-core CPU); with a 5 ms budget the request
    fails within a few dozen tokens instead of slowing every later step."""
    import glob
    import os
    import random
    from types import SimpleNamespace

    from transformers import PreTrainedTokenizerFast

    from lora_runner import SamplingParams, StructuredOutputsParams
    from lora_runner.engine.structured import StructuredOutputs

    files = glob.glob(os.path.expanduser("~/.cache/lora-runner/test/gguf/SmolLM2-*/tokenizer.json"))
    if not files:
        pytest.skip("no cached SmolLM2 tokenizer (the GGUF tests download it)")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=files[0])
    vocab = len(tokenizer)
    structured = StructuredOutputs(lambda: tokenizer, vocab, lambda: {0}, timeout_s=60, mask_budget_s=0.005,
                                   backend="xgrammar")
    params = SamplingParams(structured_outputs=StructuredOutputsParams(grammar='root ::= s\ns ::= s s | "a" | "b"'),
                            max_tokens=1000)
    try:
        grammar = structured.request_grammar(params, "A")
        grammar._future.result(timeout=60)
        assert grammar.state() == "ready"
        request = SimpleNamespace(grammar=grammar, params=params, num_output_tokens=0)
        ab_tokens = [i for i in range(vocab) if tokenizer.decode([i]) and set(tokenizer.decode([i])) <= {"a", "b"}]
        rng = random.Random(0)
        with pytest.raises(StructuredOutputError, match="over the 5 ms a request may take"):
            for _ in range(150):
                structured.step_bitmask([request])
                grammar.accept(rng.choice(ab_tokens))
                request.num_output_tokens += 1
        assert request.num_output_tokens < 150
    finally:
        structured.close()


@pytest.mark.parametrize("overrides, message", [
    (dict(structured_outputs_cache_bytes=0), "structured_outputs_cache_bytes must be a positive number of bytes"),
    (dict(structured_outputs_tenant_cache_bytes=True), "structured_outputs_tenant_cache_bytes must be a positive"),
    (dict(structured_outputs_cache_bytes=100, structured_outputs_tenant_cache_bytes=200), "must be at most"),
    (dict(structured_outputs_mask_budget_ms=0), "structured_outputs_mask_budget_ms must be a positive"),
])
def test_the_structured_output_bounds_are_checked_engine_settings(overrides, message):
    from lora_runner.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(model="unused", **overrides)


def test_stuck_compilations_never_grow_the_threads_past_the_bound():
    """Constraints queued before any got stuck all stall: at most threads + max_stuck compile threads run, and
    a stuck thread that ends serves the queue again."""
    compiler = FakeCompiler()
    queue = _queue(compiler, timeout_s=0.05, max_stuck_per_tenant=8, max_stuck=1, tenant_bytes=10_000)
    try:
        futures = [queue.submit(("json", f"slow{i}"), "A") for i in range(4)]
        for future in futures[:2]:
            with pytest.raises(StructuredOutputError, match="longer than"):
                future.result(timeout=30)
        assert compiler.started.acquire(timeout=30) and compiler.started.acquire(timeout=30)
        assert not compiler.started.acquire(timeout=1)  # 2 threads (1 + max_stuck), both stuck: slow2 waits
        assert compiler.order == ["slow0", "slow1"]
        compiler.gate.set()
        assert [f.result(timeout=30) for f in futures[2:]] == ["slow2", "slow3"]
    finally:
        compiler.gate.set()
        queue.close()
