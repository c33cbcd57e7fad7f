import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist each worker gets one thread: two workers with two threads each thrash 2 cores.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---------------------------------------------------------------- engine / LLM end-to-end fixtures
# A tiny Llama checkpoint with a tokenizer, PEFT adapters of varied kinds saved by PEFT, and an
# oracle: greedy decoding by repeated full forwards (model(ids).logits[:, -1]) of transformers/PEFT.

ENGINE_ADAPTERS = {  # name -> save_lora kwargs
    "r4": dict(seed=1, r=4, lora_alpha=8),
    "r8-rslora": dict(seed=2, r=8, lora_alpha=16, use_rslora=True),
    "r16-patterns": dict(seed=3, r=16, lora_alpha=16, alpha_pattern={"q_proj": 64}, rank_pattern={"down_proj": 4}),
    "r8-qv": dict(seed=4, r=8, lora_alpha=16, target_modules=("q_proj", "v_proj")),
    "r16-mlp": dict(seed=5, r=16, lora_alpha=32, target_modules=("gate_proj", "up_proj", "down_proj")),
}


@pytest.fixture(scope="session")
def engine_checkpoint(tmp_path_factory):
    """(model dir, transformers model, {name: (adapter dir, PeftModel)}) of a tiny Llama."""
    from factories import save_lora, save_tiny_model

    root = tmp_path_factory.mktemp("engine")
    hf = save_tiny_model(root / "model", "llama", seed=0)
    adapters = {}
    for name, kwargs in ENGINE_ADAPTERS.items():
        path = root / name
        adapters[name] = (str(path), save_lora(hf, path, scale=0.15, **kwargs))
    return str(root / "model"), hf, adapters


@pytest.fixture(scope="session")
def greedy_oracle():
    """oracle(model, prompt_ids, max_tokens) -> (tokens, logprobs of the chosen tokens), cached. The cache
    holds each model it answered for: keyed by id(model), a freed model's id could otherwise be reused by a
    later model, which would then get the freed one's answers."""
    from engine_support import greedy_decode

    cache = {}

    def oracle(model, prompt_ids, max_tokens):
        key = (id(model), tuple(prompt_ids), max_tokens)
        if key not in cache:
            cache[key] = (model, greedy_decode(model, prompt_ids, max_tokens))  # the model kept alive: its id
        return cache[key][1]                                                  # stays its own

    return oracle
