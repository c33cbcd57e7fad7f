"""lm-evaluation-harness (`local-completions`) against a live server on the tiny checkpoint: a local
log-likelihood task (echo + logprobs) and a generate_until task (tests/data/lm_eval, no network), run
through lm_eval's Python API; the log-likelihoods it reports equal our own prompt_logprobs sums."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest
from serve_support import serve_args, start_server

from transformers import AutoTokenizer

import lm_eval  # lm-eval[api] is in the [test] extra: its API models (local-completions) need tenacity
from lm_eval.tasks import TaskManager
from lora_runner import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "tests" / "data" / "lm_eval"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def served(engine_checkpoint):
    model_dir, _, _ = engine_checkpoint
    server, state = start_server(serve_args(model_dir, {}))
    yield server, model_dir
    server.stop()


def evaluate(server, model_dir: str | None, tasks: list[str]) -> dict:
    """lm_eval's results for `tasks` (only ours indexed; no bootstrap: the figures are not the point).
    model_dir None: no tokenizer argument, as a vLLM user runs it (lm_eval finds /tokenizer_info)."""
    tokenizer = {} if model_dir is None else {"tokenizer_backend": "huggingface", "tokenizer": model_dir}
    return lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": server.base_url + "/v1/completions", "model": "base", **tokenizer,
                    "num_concurrent": 1, "max_retries": 1, "tokenized_requests": True},
        tasks=tasks, task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
        log_samples=True, bootstrap_iters=0)


def test_lm_eval_loglikelihood_and_generation_against_the_server(served, monkeypatch):
    server, model_dir = served
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


def test_lm_eval_needs_no_tokenizer_argument(served, monkeypatch):
    """Without tokenizer=, lm_eval's local-completions detects the server's /tokenizer_info and tokenizes
    through /tokenize (no Hub lookup of the served name "base": offline here, so one would fail) and scores
    exactly as with the model's own tokenizer."""
    server, model_dir = served
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    remote = evaluate(server, None, ["lora_runner_loglikelihood"])["samples"]["lora_runner_loglikelihood"]
    local = evaluate(server, model_dir, ["lora_runner_loglikelihood"])["samples"]["lora_runner_loglikelihood"]
    assert [s["resps"] for s in remote] == [s["resps"] for s in local]
    info = httpx.get(server.base_url + "/tokenizer_info").json()  # what lm_eval read
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert (info["eos_token"], info["model_max_length"]) == (tokenizer.eos_token, 512)
    assert model_dir not in str(info)  # vLLM's name_or_path is left out: no response shows a server path
