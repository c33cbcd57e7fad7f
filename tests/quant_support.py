"""Quantized tiny checkpoints made by the libraries that make real ones, and their oracles.

``save_ct_fp8`` writes a compressed-tensors FP8 checkpoint the way llm-compressor does (apply the
scheme, observe each weight's min/max, ``ModelCompressor.compress_model``, ``save_pretrained``,
``update_config``); ``ct_decompressed`` is the oracle: a plain transformers model whose weights are
compressed-tensors' own decompression of the saved tensors. ``fp8_oracle`` is online FP8's
(``quantization="fp8"``): transformers with every weight the engine quantizes replaced by its FP8 value
(tests/test_moe_fp8.py, benchmarks/bench_moe.py).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from factories import build_tiny_model, save_tiny_tokenizer
from lora_runner.model.quant.fp8 import quantize_per_channel


def save_ct_fp8(path, strategy: str = "channel", seed: int = 0, activations: bool = True, **overrides):
    """A tiny Llama saved as a compressed-tensors FP8 checkpoint (weights per `strategy`: "channel" or
    "tensor"; dynamic per-token FP8 activations unless activations=False); returns the float model."""
    from compressed_tensors.quantization import QuantizationArgs

    weights = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False)
    acts = (QuantizationArgs(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True)
            if activations else None)
    dims = dict(dim=1, keepdim=True) if strategy == "channel" else {}
    return _save_ct(path, build_tiny_model("llama", seed, **overrides), weights, acts,
                    lambda weight: (weight.amin(**dims), weight.amax(**dims)))


def save_ct_w4a16(path, group_size: int = 32, seed: int = 0, **overrides):
    """A tiny Llama saved as a compressed-tensors W4A16 checkpoint (symmetric int4 weights by groups of
    `group_size` input columns, pack-quantized, as llm-compressor's W4A16 scheme); returns the float model."""
    from compressed_tensors.quantization import QuantizationArgs

    weights = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=group_size, symmetric=True,
                               dynamic=False)

    def group_min_max(weight):  # [N, K] -> min, max [N, K/G]
        grouped = weight.reshape(weight.shape[0], -1, group_size)  # [N, K/G, G]
        return grouped.amin(-1), grouped.amax(-1)

    return _save_ct(path, build_tiny_model("llama", seed, **overrides), weights, None, group_min_max)


def _save_ct(path, model, weights, input_activations, min_max, ignore=("lm_head",)):
    """Quantize `model`'s Linears (those `ignore` names excepted) by the scheme, observing each weight's
    `min_max(weight)`, compress and save it with its config and a tokenizer, as llm-compressor does; returns
    the model."""
    from compressed_tensors.compressors.model_compressors.model_compressor import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization import apply_quantization_config
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=input_activations)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore)),
                              show_progress=False)
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is None:
                continue
            scale, zero = calculate_qparams(*min_max(module.weight), module.quantization_scheme.weights)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(str(path))
    compressor.update_config(str(path))
    save_tiny_tokenizer(path, model.config.vocab_size)
    return model


def ct_decompressed(path):
    """The oracle of a compressed-tensors checkpoint (FP8 float-quantized or W4A16 pack-quantized):
    transformers with the weights compressed-tensors' own decompressors give for the saved tensors (fp32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(ct_decompressed_tensors(path), strict=True)
    return model.eval()


def ct_decompressed_tensors(path) -> dict[str, torch.Tensor]:
    """{checkpoint name: float32 tensor} of a compressed-tensors checkpoint, each quantized weight as
    compressed-tensors' own decompressors give it (the scales and shapes read with their weights)."""
    from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    raw = json.loads((Path(path) / "config.json").read_text())
    qcfg = QuantizationConfig.model_validate(raw["quantization_config"])
    (scheme,) = qcfg.config_groups.values()
    tensors = load_file(str(Path(path) / "model.safetensors"))
    state = {}
    for name, tensor in tensors.items():
        module, _, suffix = name.rpartition(".")
        if suffix in ("weight_scale", "weight_shape", "weight_zero_point"):
            continue  # read with their weight
        if suffix == "weight_packed":
            local = {key: tensors[f"{module}.{key}"] for key in ("weight_packed", "weight_scale", "weight_shape")}
            name, tensor = f"{module}.weight", PackedQuantizationCompressor.decompress(local, scheme)["weight"]
        elif suffix == "weight" and f"{module}.weight_scale" in tensors:
            local = {"weight": tensor, "weight_scale": tensors[f"{module}.weight_scale"]}
            tensor = NaiveQuantizationCompressor.decompress(local, scheme)["weight"]
        state[name] = tensor.float()
    return state


def edit_config(path, edit) -> None:
    """Rewrite config.json by ``edit(dict)`` (in place)."""
    config_path = Path(path) / "config.json"
    raw = json.loads(config_path.read_text())
    edit(raw)
    config_path.write_text(json.dumps(raw, indent=2))


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor (parameters and buffers, each storage once) the model holds."""
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor is None or tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total


FLOAT_LINEARS = ("mlp.gate", "shared_expert_gate")  # the router and the shared expert's gate: never quantized


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    """W [..., N, K] -> its FP8 value per output channel (each [N, K] matrix quantized on its own)."""
    rows = weight.reshape(-1, weight.shape[-1])  # [*, K]: per-row scales do not depend on the grouping
    quantized, scale = quantize_per_channel(rows)
    return (quantized.float() * scale[:, None]).reshape(weight.shape).to(weight.dtype)


def fp8_oracle(hf):
    """A copy of transformers model ``hf`` with every decoder weight quantization="fp8" quantizes (every linear
    but the router and the shared expert's gate, the fused experts) replaced by its dequantized FP8 value."""
    twin = copy.deepcopy(hf)
    with torch.no_grad():
        for name, module in twin.model.layers.named_modules():
            if isinstance(module, torch.nn.Linear) and not name.endswith(FLOAT_LINEARS):
                module.weight.copy_(dequantized(module.weight))
            elif name.endswith("experts") and hasattr(module, "gate_up_proj"):  # transformers 5's fused experts
                module.gate_up_proj.copy_(dequantized(module.gate_up_proj))  # [E, 2I, H]
                module.down_proj.copy_(dequantized(module.down_proj))  # [E, H, I]
    return twin.eval()
