"""What the end-to-end engine tests share: one engine builder, one run-to-completion loop, one
exactness check against the transformers/PEFT greedy oracle (conftest's ``greedy_oracle``)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable

import torch

from adapters import LoRARequest
from lora_runner import LLMEngine, RequestOutput, SamplingParams

# A small engine on the tiny checkpoints: 4 rows, 2 adapter slots, blocks of 4 tokens.
ENGINE_DEFAULTS = dict(device="cpu", max_num_seqs=4, max_model_len=64, max_loras=2, max_lora_rank=16,
                       max_cpu_loras=4, block_size=4)
HANG_GUARD_S = 120.0  # a deadline instead of a hang when requests never finish; a working engine takes seconds


def make_engine(path: str, *, poison: Iterable[str] = (), **overrides) -> LLMEngine:
    """An LLMEngine on ``path`` with ENGINE_DEFAULTS updated by ``overrides``.

    ``poison`` names buffers filled with NaN before the first step, so a read of a row nothing wrote
    shows in the logits: "kv_cache", "prompt_slots" (soft-prompt rows), "vocab_slots" (embed/lm_head
    LoRA rows).
    """
    engine = LLMEngine(path, **{**ENGINE_DEFAULTS, **overrides})
    buffers = {"kv_cache": lambda: [engine.runner.kv_cache],
               "prompt_slots": lambda: [engine.adapters.manager.prompt_slots.embeddings],
               "vocab_slots": lambda: engine.adapters.manager.vocab_slots._tensors()}  # noqa: SLF001
    for name in poison:
        assert name in buffers, f"unknown buffer {name!r}; poisonable: {sorted(buffers)}"
        for tensor in buffers[name]():
            tensor.fill_(float("nan"))
    return engine


def run_to_completion(engine: LLMEngine, requests: Iterable[tuple] = (), *, per_step: int | None = None,
                      on_step: Callable[[int, list[RequestOutput]], None] | None = None,
                      done: dict[str, RequestOutput] | None = None,
                      timeout: float = HANG_GUARD_S, wait_s: float | None = None) -> dict[str, RequestOutput]:
    """Add ``requests`` and step until nothing is unfinished; returns ``done``: {id: finished output}.

    requests: ``(id, prompt, params[, lora_request[, prompt_adapter_request]])``, all added before
    the first step, or ``per_step`` of them before each step. ``on_step(step, outputs)`` sees every
    step's outputs. A request reported finished twice (or already in ``done``) fails the test.
    The deadline bounds the wait (steps are instant while every request waits on a load). wait_s: wait
    up to that long for work before each step (LLMEngine.wait_for_work) instead of stepping at once.
    """
    pending, done, step = list(requests), {} if done is None else done, 0
    deadline = time.monotonic() + timeout
    while pending or engine.has_unfinished_requests():
        assert time.monotonic() < deadline, f"requests still unfinished: {unfinished(engine)}"
        for _ in range(len(pending) if per_step is None else per_step):
            if pending:
                request_id, prompt, params, *adapters = pending.pop(0)
                lora, prompt_adapter = (*adapters, None, None)[:2]
                engine.add_request(request_id, prompt, params, lora_request=lora,
                                   prompt_adapter_request=prompt_adapter)
        if wait_s is not None:
            engine.wait_for_work(timeout=wait_s)
        outputs = engine.step()
        if on_step is not None:
            on_step(step, outputs)
        step += 1
        for output in outputs:
            if output.finished:
                assert output.request_id not in done, f"{output.request_id} reported finished twice"
                done[output.request_id] = output
    return done



def churn_adapters(engine: LLMEngine, adapters: dict, max_prompt: int, max_tokens: int = 4,
                   seed: int = 0) -> tuple[dict, dict[str, RequestOutput]]:
    """Every adapter, the base model, then every adapter again, two requests added per step (more adapters
    than slots make the LRU page), greedy with logprobs. adapters: name -> (path, ...). Returns (requests:
    id -> (prompt, adapter name or None), done: id -> finished output)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    rng = random.Random(seed)
    names = [*adapters, None, *reversed(adapters)]
    requests = {f"q{i}": ([rng.randrange(3, 256) for _ in range(rng.randint(3, max_prompt))], name)
                for i, name in enumerate(names)}
    pending, done = list(requests.items()), {}
    while pending or engine.has_unfinished_requests():
        for _ in range(2):
            if pending:
                request_id, (prompt, name) = pending.pop(0)
                lora = LoRARequest(name, adapters[name][0]) if name else None
                engine.add_request(request_id, prompt, params, lora_request=lora)
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return requests, done


def assert_churn_exact(requests: dict, done: dict[str, RequestOutput], model_of: Callable, oracle,
                       tolerance: float, max_tokens: int = 4) -> None:
    """churn_adapters' outputs against the greedy oracle: the same tokens, logprobs within ``tolerance``.
    model_of(adapter name or None) -> the oracle model (PEFT's, or the base)."""
    for request_id, (prompt, name) in requests.items():
        tokens, logprobs = oracle(model_of(name), prompt, max_tokens)
        completion = done[request_id].outputs[0]
        assert completion.token_ids == tokens, (request_id, name)
        for step, (got, want) in enumerate(zip(completion.logprobs, logprobs)):
            assert abs(got[tokens[step]] - want) <= tolerance, (request_id, name, step)

def unfinished(engine: LLMEngine) -> list[tuple]:
    """(id, status, adapter ref) of every request the scheduler still holds: what a hang guard reports."""
    scheduler = engine.scheduler
    return [(r.request_id, r.status, r.lora_ref) for r in (*scheduler.running, *scheduler.waiting)]


def step_until(engine: LLMEngine, done: dict[str, RequestOutput], predicate: Callable[[], bool],
               timeout: float = HANG_GUARD_S) -> dict[str, RequestOutput]:
    """Step until ``predicate()`` holds, recording finished outputs in ``done`` (a deadline, not a hang)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "the condition never came true"
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done


def start_decoding(engine: LLMEngine, num_requests: int, lora_path: str, max_tokens: int = 30) -> dict:
    """Add ``num_requests`` greedy requests (every other one on the LoRA at ``lora_path``, named "r4") and step
    until one of them has generated a token: the moment a failure test breaks a worker. Returns ``done``."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_requests):
        lora = LoRARequest("r4", lora_path) if i % 2 else None
        engine.add_request(f"k{i}", [3 + i, 4, 5], params, lora_request=lora)
    return step_until(engine, {}, lambda: any(r.num_output_tokens > 0 for r in engine.scheduler.running), timeout=60)


@torch.inference_mode()
def greedy_decode(model, prompt_ids, max_tokens: int) -> tuple[list[int], list[float]]:
    """(tokens, logprobs of the chosen tokens) of greedy decoding by full forwards of a transformers model,
    in float64 logits: the oracle assert_exact compares with (conftest's greedy_oracle caches it)."""
    ids, tokens, logprobs = list(prompt_ids), [], []
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].double()  # [V]
        token = int(logits.argmax())
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
    return tokens, logprobs


def assert_exact(output: RequestOutput, model, prompt: list[int], oracle, max_tokens: int = 5, *,
                 finish_reason: str | None = "length", logprobs: bool = True, tolerance: float = 1e-4) -> None:
    """The output is what ``model`` (transformers/PEFT) gives greedily: the prompt as given (no
    placeholders), the same tokens, the finish reason (None: not checked) and, unless the request
    asked for none (``logprobs=False``), each chosen token's logprob within ``tolerance``."""
    tokens, want_logprobs = oracle(model, prompt, max_tokens)
    completion = output.outputs[0]
    assert output.prompt_token_ids == prompt, output.request_id
    assert completion.token_ids == tokens, (output.request_id, completion.token_ids, tokens, output.error)
    if finish_reason is not None:
        assert completion.finish_reason == finish_reason, (output.request_id, completion.finish_reason)
    if not logprobs:
        return
    assert completion.logprobs is not None and len(completion.logprobs) == len(tokens), output.request_id
    for step, want in enumerate(want_logprobs):
        assert abs(completion.logprobs[step][tokens[step]] - want) <= tolerance, (output.request_id, step)


def assert_idle(engine: LLMEngine) -> None:
    """Nothing unfinished and every KV block back on the free list, held by no one."""
    bm = engine.block_manager
    assert not engine.has_unfinished_requests(), "requests still unfinished"
    assert bm.num_free_blocks == bm.num_blocks and bm.holders() == [], (bm.num_free_blocks, bm.holders())
