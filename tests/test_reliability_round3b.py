"""Round three of hostile tenants, second part (issue 39 items 11, 6, 12).

Item 11: a quantized checkpoint whose scales hold NaN or inf is refused when it loads, naming the
tensor (before, it started and every completion failed as "non-finite logits"), in each format
whose scales the loader reads (GPTQ, AWQ, compressed-tensors int4 and fp8). A served LoRA whose
finite but huge weights overflow the activations fails its own requests with 422 naming it in the
OpenAI error shape (before, 500 "internal server error"), streamed or not; a bystander LoRA's greedy
tokens stay exact.
"""

import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_runner.model import load_model

from factories import save_tiny_model
from quant_support import save_ct_fp8, save_ct_w4a16
from test_quant_int4_formats import write_int4_checkpoint

LAYER = "model.layers.1.self_attn.k_proj"


def _poison(path, tensor: str, value: float) -> None:
    """Set one element of checkpoint tensor `tensor` in path/model.safetensors to `value`."""
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    poisoned = tensors[tensor].clone()
    poisoned.view(-1)[poisoned.numel() // 2] = value
    tensors[tensor] = poisoned
    save_file(tensors, str(file), metadata={"format": "pt"})


def _write(kind: str, path):
    """A tiny checkpoint of quantization `kind` at `path`; returns the name of LAYER's scales tensor."""
    if kind in ("gptq", "awq"):
        hf = save_tiny_model(path / "float", "llama", seed=3)
        write_int4_checkpoint(hf, path / "model", kind, group_size=32)
        return f"{LAYER}.scales"
    if kind == "ct-int4":
        save_ct_w4a16(path / "model")
    else:
        save_ct_fp8(path / "model")
    return f"{LAYER}.weight_scale"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("kind", ["gptq", "awq", "ct-int4", "fp8"])
def test_a_checkpoint_with_non_finite_scales_is_refused_naming_the_tensor(tmp_path, kind, value):
    tensor = _write(kind, tmp_path)
    load_model(str(tmp_path / "model"))  # the untouched checkpoint loads
    _poison(tmp_path / "model", tensor, value)
    with pytest.raises(ValueError, match=re.escape(tensor) + ".*(NaN|non-finite)"):
        load_model(str(tmp_path / "model"))


# -- 11: a tenant's adapter that overflows fails its own requests, named, never as a 5xx ---------------------

@pytest.fixture(scope="module")
def served(engine_checkpoint, tmp_path_factory):
    """(server, state, model dir, {lora name: path}) with a bystander LoRA and one whose logits overflow."""
    from factories import save_huge_lora
    from serve_support import model_with_chat_template, serve_args, start_server

    checkpoint, hf, adapters = engine_checkpoint
    work = tmp_path_factory.mktemp("round3b")
    model_dir = model_with_chat_template(checkpoint, work / "model")
    save_huge_lora(hf, work / "huge")
    loras = {"r8-qv": adapters["r8-qv"][0], "huge": str(work / "huge")}
    server, state = start_server(serve_args(model_dir, loras))
    yield server, state, model_dir, loras
    server.stop()


def _bystander_is_exact(served) -> None:
    """A greedy completion on the bystander LoRA equals LLM.generate's tokens."""
    import openai
    from serve_support import PROMPTS, offline_greedy, token_ids

    client = openai.OpenAI(base_url=served[0].base_url + "/v1", api_key="none", max_retries=0, timeout=60)
    response = client.completions.create(model="r8-qv", prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=0)
    got = token_ids(served[1].tokenizer, response.choices[0].logprobs.tokens)
    assert got == offline_greedy(served[2], [(PROMPTS[0], "r8-qv", None)], 6, served[3])[0]


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "the cat sat", "max_tokens": 4}),
    ("/v1/completions", {"prompt": ["the cat sat", "hello world"], "max_tokens": 4, "n": 2, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
])
def test_an_adapter_whose_logits_overflow_is_named_in_a_4xx(served, route, body):
    import httpx

    response = httpx.post(served[0].base_url + route, json={"model": "huge", **body}, timeout=60)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "code"} and error["code"] == "non_finite_logits", error
    assert "`huge`" in error["message"] and "NaN or infinite" in error["message"], error
    _bystander_is_exact(served)
