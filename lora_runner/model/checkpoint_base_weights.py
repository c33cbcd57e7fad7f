"""DoRA's base weights read from the checkpoint, for a process that holds no (whole) model.

DoRA's column scale is ``m / ||W + s * B @ A||`` per output row over the whole row of W
(adapters.dora): with tensor parallelism no rank holds a row-parallel layer's whole rows, so the
process that validates an adapter once (the engine) reads the W it needs from the checkpoint here,
one packed module at a time, and every rank writes its shard of the resulting full CPU copy
(adapters.sharding.shard_lora_weights). Quantized linears are loaded by their linear method and
dequantized, exactly as the served model's ``base_weight()``.
"""

from __future__ import annotations

import os

import torch
from safetensors import safe_open

from adapters.dora import BaseWeight
from adapters.spec import FUSED_TO_PACKED, PEFT_PARENT, PEFT_TO_PACKED
from lora_runner.model.config import ModelConfig
from lora_runner.model.layers import LoRALinear
from lora_runner.model.loader import weight_files
from lora_runner.model.quant.linear import linear_method


def _projections(config: ModelConfig, packed: str) -> list[str]:
    """The checkpoint's projection names of a packed module, in slice order."""
    if config.fused_projections and packed in FUSED_TO_PACKED.values():
        return [name for name, target in FUSED_TO_PACKED.items() if target == packed]
    return [name for name, (target, _) in sorted(PEFT_TO_PACKED.items(), key=lambda kv: kv[1][1])
            if target == packed]


def checkpoint_base_weights(model_dir: str | os.PathLike, config: ModelConfig,
                            dtype: torch.dtype = torch.float32) -> BaseWeight:
    """(layer, packed) -> the whole base weight W [N, K] of that module in ``dtype`` (dequantized for a
    quantized checkpoint), read from ``model_dir``'s safetensors when asked (adapters.lora's base_weight)."""
    files = {}
    for file in weight_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            files.update(dict.fromkeys(handle.keys(), file))
    spec, method = config.spec(), linear_method(config.quantization)
    suffixes = (*method.suffixes, *getattr(method, "optional_suffixes", ()))

    def read(name: str) -> torch.Tensor:
        with safe_open(str(files[name]), framework="pt", device="cpu") as handle:
            return handle.get_tensor(name)

    def base_weight(layer: int, packed: str) -> torch.Tensor:
        module = LoRALinear(spec.in_features(packed), spec.slice_sizes(packed), False, layer, packed, dtype, "cpu",
                            method)
        projections = _projections(config, packed)
        sizes = spec.slice_sizes(packed) if len(projections) > 1 else (module.out_features,)
        prefixes = [f"model.layers.{layer}.{PEFT_PARENT[p]}.{p}" for p in projections]
        if not method.quantized:
            return torch.cat([read(f"{prefix}.weight") for prefix in prefixes]).to(dtype)  # [N, K]
        parts = [(prefix, {s: read(f"{prefix}.{s}") for s in suffixes if f"{prefix}.{s}" in files}, size)
                 for prefix, size in zip(prefixes, sizes)]
        method.load(module, parts)
        return module.base_weight()  # [N, K]

    return base_weight
