"""DoRA's base weights read from the checkpoint, for a process that holds no (whole) model.

DoRA's column scale is ``m / ||W + s * B @ A||`` per output row over the whole row of W
(adapters.dora): with tensor parallelism no rank holds a row-parallel layer's whole rows, so the
process that validates an adapter once (the engine) reads the W it needs from the checkpoint, and
every rank writes its shard of the resulting full CPU copy (adapters.sharding.shard_lora_weights).

The reader is the served model's (lora_runner.model.lora_linear.base_weight_reader); only the source
differs: here each asked-for module is built whole on the CPU from its declared LoRAModule and filled
from its own checkpoint tensors (``LoRALinear.load_checkpoint``: quantized ones loaded by their
linear method and dequantized, exactly as the served model's ``base_weight()``).
"""

from __future__ import annotations

import os

import torch
from safetensors import safe_open

from adapters.dora import BaseWeight
from lora_runner.model.config import ModelConfig
from lora_runner.model.loader import weight_files
from lora_runner.model.lora_linear import LoRALinear, base_weight_reader
from lora_runner.model.moe_fp8 import FLOAT_MODULES
from lora_runner.model.quant.linear import UNQUANTIZED, linear_method


def checkpoint_base_weights(model_dir: str | os.PathLike, config: ModelConfig,
                            dtype: torch.dtype = torch.float32) -> BaseWeight:
    """(layer, name) -> the whole base weight W [N, K] of that module in ``dtype`` (dequantized for a
    quantized checkpoint), read from ``model_dir``'s safetensors when asked (adapters.lora's base_weight)."""
    files = {}
    for file in weight_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            files.update(dict.fromkeys(handle.keys(), file))
    modules = {module.key: module for module in config.spec().modules}
    method = linear_method(config.quantization)

    def read(name: str) -> torch.Tensor | None:
        if name not in files:
            return None
        with safe_open(str(files[name]), framework="pt", device="cpu") as handle:
            return handle.get_tensor(name)

    def linear(layer: int, name: str) -> LoRALinear:
        # an MoE block's router and shared expert gate stay float under quantization, as served (moe_fp8)
        module = LoRALinear(modules[(layer, name)], False, dtype, "cpu",
                            UNQUANTIZED if name in FLOAT_MODULES else method)
        module.load_checkpoint(read)
        return module

    return base_weight_reader(linear)
