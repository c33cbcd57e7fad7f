"""Shared by tests/test_serve_*.py: a copy of the engine test model with a chat template and a soft
prompt, a real server on it (CLI options -> frozen configs -> state -> app -> uvicorn in a thread), and the offline
LLM.generate oracle."""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

# A template in the tiny word-level vocabulary ("you"/"we" mark the speakers, "i" the reply).
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}you {% else %}we {% endif %}"
                 "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}i{% endif %}")
WAIT_S = 120  # a bound on how long the server may take, not a timing assertion
PROMPTS = ["the cat sat on the mat", "hello world", "a red dog and a blue cat", "we say yes",
           "one two three", "the green tenant says no", "you and i", "is the dog red"]


def model_with_chat_template(src: str, dst: Path) -> str:
    """Copy the model dir and add CHAT_TEMPLATE to the copy's tokenizer."""
    from transformers import AutoTokenizer

    shutil.copytree(src, dst)
    tokenizer = AutoTokenizer.from_pretrained(str(dst))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(dst))
    return str(dst)


def serve_args(model_dir: str, loras: dict[str, str], prompt_adapters: dict[str, str] | None = None,
               extra: list[str] | None = None) -> argparse.Namespace:
    """The parsed `serve` command line for the test model (CPU, fp32)."""
    from lora_runner.entrypoints.cli import add_serve_arguments

    argv = [model_dir, "--device", "cpu", "--dtype", "float32", "--served-model-name", "base",
            "--max-model-len", "512", "--max-num-seqs", "16", "--max-loras", "2", "--max-lora-rank", "16"]
    if loras:
        argv += ["--lora-modules", *[f"{name}={path}" for name, path in loras.items()]]
    if prompt_adapters:
        argv += ["--prompt-adapters", *[f"{name}={path}" for name, path in prompt_adapters.items()],
                 "--max-prompt-adapter-token", "8"]
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(argv + list(extra or []))


def serve_configs(args: argparse.Namespace) -> tuple:
    """(EngineConfig, ServerConfig, StartupAdapters) of the parsed options, as `serve` builds them."""
    from lora_runner.entrypoints.cli import engine_config, server_config, startup_adapters

    return engine_config(args), server_config(args), startup_adapters(args)


def start_server(args: argparse.Namespace):
    """(BackgroundServer started on a free port, its ServerState)."""
    from lora_runner.entrypoints.launch import build_state
    from lora_runner.entrypoints.openai.app import build_app
    from lora_runner.entrypoints.openai.background import BackgroundServer

    state = build_state(*serve_configs(args))
    return BackgroundServer(build_app(state)).start(), state


def offline_greedy(model_dir: str, jobs: list[tuple[str | list[int], str | None, str | None]], max_tokens: int,
                   loras: dict[str, str], prompt_adapters: dict[str, str] | None = None) -> list[list[int]]:
    """Greedy token ids of LLM.generate for (prompt, lora name, prompt adapter name) jobs."""
    from adapters import LoRARequest, PromptAdapterRequest
    from lora_runner import LLM, SamplingParams

    kwargs = dict(device="cpu", dtype="float32", max_model_len=512, max_loras=2, max_lora_rank=16)
    if prompt_adapters:
        kwargs.update(max_prompt_adapters=1, max_prompt_adapter_tokens=8)
    llm = LLM(model_dir, **kwargs)
    try:
        outputs = llm.generate([p for p, _, _ in jobs], SamplingParams(temperature=0.0, max_tokens=max_tokens),
                               lora_request=[LoRARequest(n, loras[n]) if n else None for _, n, _ in jobs],
                               prompt_adapter_request=[PromptAdapterRequest(s, prompt_adapters[s]) if s else None
                                                       for _, _, s in jobs], use_tqdm=False)
    finally:
        llm.close()
    return [list(o.outputs[0].token_ids) for o in outputs]


def token_ids(tokenizer, tokens: list[str]) -> list[int]:
    """Token strings of a logprobs answer back to ids (the test vocabulary maps words one to one)."""
    vocab = tokenizer.get_vocab()
    return [vocab[t] for t in tokens]


def wait_until(predicate, what: str) -> None:
    """Poll `predicate` until it holds; fail naming `what` once WAIT_S seconds have passed."""
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
