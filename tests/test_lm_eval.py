"""lm-evaluation-harness (`local-completions`) against a live server on the tiny checkpoint: a local
log-likelihood task (echo + logprobs) and a generate_until task (tests/data/lm_eval, no network), run
through lm_eval's Python API; the log-likelihoods it reports equal our own prompt_logprobs sums."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import math
import sys
import types
from pathlib import Path

import pytest
from serve_support import serve_args, start_server

from transformers import AutoTokenizer

from lora_runner import LLM, SamplingParams

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.tasks import TaskManager  # noqa: E402 - only once lm_eval is known to be there

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "tests" / "data" / "lm_eval"
TOLERANCE = 1e-4


def _one_attempt_tenacity() -> None:
    """lm_eval's API models import tenacity (lm-eval[api]) for retries; where only lm-eval is installed, a
    stand-in whose ``retry`` makes the one attempt max_retries=1 asks for, and lm_eval's API module
    imported again with it. A real tenacity is used whenever installed."""
    if importlib.util.find_spec("tenacity") is not None:
        return
    stand_in = types.ModuleType("tenacity")
    stand_in.__spec__ = importlib.machinery.ModuleSpec("tenacity", None)
    stand_in.RetryError = type("RetryError", (Exception,), {})
    stand_in.retry = lambda **options: (lambda fn: fn)
    stand_in.stop_after_attempt = stand_in.wait_exponential = lambda *args, **kwargs: None
    sys.modules["tenacity"] = stand_in
    importlib.reload(importlib.import_module("lm_eval.models.api_models"))


@pytest.fixture(scope="module")
def served(engine_checkpoint):
    model_dir, _, _ = engine_checkpoint
    server, state = start_server(serve_args(model_dir, {}))
    yield server, model_dir
    server.stop()


def evaluate(server, model_dir: str, tasks: list[str]) -> dict:
    """lm_eval's results for `tasks` (only ours indexed; no bootstrap: the figures are not the point)."""
    return lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": server.base_url + "/v1/completions", "model": "base",
                    "tokenizer_backend": "huggingface", "tokenizer": model_dir, "num_concurrent": 1,
                    "max_retries": 1, "tokenized_requests": True},
        tasks=tasks, task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
        log_samples=True, bootstrap_iters=0)


def test_lm_eval_loglikelihood_and_generation_against_the_server(served, monkeypatch):
    server, model_dir = served
    _one_attempt_tenacity()
    monkeypatch.chdir(REPO)  # the task YAMLs name their docs relative to the repository
    scored = generated = evaluate(server, model_dir, ["lora_runner_loglikelihood", "lora_runner_generate"])
    samples = scored["samples"]["lora_runner_loglikelihood"]
    gen_samples = generated["samples"]["lora_runner_generate"]
    assert "acc,none" in scored["results"]["lora_runner_loglikelihood"]
    assert "exact_match,none" in generated["results"]["lora_runner_generate"]

    llm = LLM(model_dir, device="cpu", dtype="float32", max_model_len=512)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)  # what lm_eval tokenized with
        pairs = [(s["doc"]["context"], " " + choice) for s in samples for choice in s["doc"]["choices"]]
        reported = [resp[0][0] for s in samples for resp in s["resps"]]
        assert len(reported) == len(pairs) == 8
        prompts, context_lens = [], []
        for context, continuation in pairs:  # lm_eval's split: the whole text's ids after the context's
            context_ids = tokenizer.encode(context)
            prompts.append(tokenizer.encode(context + continuation))
            context_lens.append(len(context_ids))
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
                               use_tqdm=False)
        for output, ids, start, want in zip(outputs, prompts, context_lens, reported):
            ours = sum(output.prompt_logprobs[j][ids[j]] for j in range(start, len(ids)))
            assert math.isclose(ours, want, abs_tol=TOLERANCE), (ids, ours, want)
        questions = [s["doc"]["question"] for s in gen_samples]
        greedy = llm.generate(questions, SamplingParams(temperature=0.0, max_tokens=4, stop=["yes"]), use_tqdm=False)
        assert [s["resps"][0][0] for s in gen_samples] == [o.outputs[0].text for o in greedy]
    finally:
        llm.close()
