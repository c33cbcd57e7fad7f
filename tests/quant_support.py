"""Quantized tiny checkpoints made by the libraries that make real ones, and their oracles.

``save_ct_fp8`` writes a compressed-tensors FP8 checkpoint the way llm-compressor does (apply the
scheme, observe each weight's min/max, ``ModelCompressor.compress_model``, ``save_pretrained``,
``update_config``); ``ct_decompressed`` is the oracle: a plain transformers model whose weights are
compressed-tensors' own decompression of the saved tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from factories import build_tiny_model, save_tiny_tokenizer


def save_ct_fp8(path, strategy: str = "channel", seed: int = 0, activations: bool = True, **overrides):
    """A tiny Llama saved as a compressed-tensors FP8 checkpoint (weights per `strategy`: "channel" or
    "tensor"; dynamic per-token FP8 activations unless activations=False); returns the float model."""
    from compressed_tensors.compressors.model_compressors.model_compressor import ModelCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization import apply_quantization_config
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    model = build_tiny_model("llama", seed, **overrides)
    weights = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False)
    acts = (QuantizationArgs(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True)
            if activations else None)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]),
                              show_progress=False)
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is None:
                continue
            weight = module.weight  # [N, K]
            dims = dict(dim=1, keepdim=True) if strategy == "channel" else {}
            args = module.quantization_scheme.weights
            scale, zero = calculate_qparams(weight.amin(**dims), weight.amax(**dims), args)
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
    """The oracle of a compressed-tensors checkpoint: transformers with the weights compressed-tensors'
    own decompressor gives for the saved tensors (fp32)."""
    from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads((Path(path) / "config.json").read_text())
    qcfg = QuantizationConfig.model_validate(raw["quantization_config"])
    (scheme,) = qcfg.config_groups.values()
    tensors = load_file(str(Path(path) / "model.safetensors"))
    state = {}
    for name, tensor in tensors.items():
        if name.endswith(".weight_scale"):
            continue
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{module}.weight_scale" in tensors:
            local = {"weight": tensor, "weight_scale": tensors[f"{module}.weight_scale"]}
            tensor = NaiveQuantizationCompressor.decompress(local, scheme)["weight"].float()
        state[name] = tensor
    config = AutoConfig.from_pretrained(str(path))
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state, strict=True)
    return model.eval()


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


@torch.inference_mode()
def greedy(model, prompt_ids, max_tokens):
    """(tokens, logprobs of the chosen tokens) of greedy decoding by full forwards of a transformers
    model; uncached (conftest's greedy_oracle caches by id(model), which a function-local model that
    was freed can share with a later one)."""
    ids, tokens, logprobs = list(prompt_ids), [], []
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].double()  # [V]
        token = int(logits.argmax())
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
    return tokens, logprobs


def save_ct_w4a16(path, group_size: int = 32, seed: int = 0, **overrides):
    """A tiny Llama saved as a compressed-tensors W4A16 checkpoint (symmetric int4 weights by groups of
    `group_size` input columns, pack-quantized, as llm-compressor's W4A16 scheme); returns the float model."""
    from compressed_tensors.compressors.model_compressors.model_compressor import ModelCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization import apply_quantization_config
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    model = build_tiny_model("llama", seed, **overrides)
    weights = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=group_size, symmetric=True,
                               dynamic=False)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]),
                              show_progress=False)
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is None:
                continue
            n, k = module.weight.shape
            grouped = module.weight.reshape(n, k // group_size, group_size)  # [N, K/G, G]
            scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), module.quantization_scheme.weights)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(str(path))
    compressor.update_config(str(path))
    save_tiny_tokenizer(path, model.config.vocab_size)
    return model


def ct_w4a16_decompressed(path):
    """The oracle of a compressed-tensors W4A16 checkpoint: transformers with the weights the library's
    own PackedQuantizationCompressor gives for the saved tensors (fp32)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads((Path(path) / "config.json").read_text())
    qcfg = QuantizationConfig.model_validate(raw["quantization_config"])
    (scheme,) = qcfg.config_groups.values()
    tensors = load_file(str(Path(path) / "model.safetensors"))
    state = {}
    for name, tensor in tensors.items():
        module, _, suffix = name.rpartition(".")
        if suffix in ("weight_scale", "weight_shape", "weight_zero_point"):
            continue
        if suffix == "weight_packed":
            local = {key: tensors[f"{module}.{key}"] for key in ("weight_packed", "weight_scale", "weight_shape")
                     if f"{module}.{key}" in tensors}
            name, tensor = f"{module}.weight", PackedQuantizationCompressor.decompress(local, scheme)["weight"].float()
        state[name] = tensor
    config = AutoConfig.from_pretrained(str(path))
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state, strict=True)
    return model.eval()
