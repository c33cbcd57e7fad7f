"""Round three of hostile tenants, second part (issue 39 items 11, 6, 12).

Item 11: a quantized checkpoint whose scales hold NaN or inf is refused when it loads, naming the
tensor (before, it started and every completion failed as "non-finite logits"), in each format
whose scales the loader reads (GPTQ, AWQ, compressed-tensors int4 and fp8).
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
