"""DoRA's base weights read from the checkpoint, for an engine process that holds no model (tp > 1).

DoRA's column scale needs the whole base weight of a module (adapters.dora); at tensor_parallel_size > 1
each worker holds only its shard, so the engine process reads the (layer, packed) weight from the
checkpoint's safetensors instead: lazily, one packed weight at a time (the last one is kept, so the
q, k, v slices of one adapter load read the files once). A quantized checkpoint would need its
dequantization here: DoRA over one is refused at tp > 1 with UnsupportedAdapterError.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from adapters.errors import UnsupportedAdapterError
from adapters.spec import FUSED_TO_PACKED, PEFT_PARENT, PEFT_TO_PACKED
from lora_runner.model.config import ModelConfig
from lora_runner.model.loader import WEIGHTS_INDEX_FILE, weight_files


def checkpoint_base_weight(model_dir: str | Path, config: ModelConfig,
                           dtype: torch.dtype) -> Callable[[int, str], torch.Tensor]:
    """(layer, packed) -> the base weight [N, K] in ``dtype`` on the CPU, read from ``model_dir``'s files.

    Raises UnsupportedAdapterError (when called: a DoRA adapter loads) for a quantized checkpoint."""
    last: dict[tuple[int, str], torch.Tensor] = {}
    files: dict[str, Path] = {}

    def base_weight(layer: int, packed: str) -> torch.Tensor:
        if config.quantization is not None:
            raise UnsupportedAdapterError(
                "DoRA over a quantized checkpoint is not served at tensor_parallel_size > 1 (its norms need the "
                "dequantized base weight, which the engine process does not hold)")
        key = (layer, packed)
        if key not in last:
            if not files:
                files.update(_tensor_files(Path(model_dir)))
            last.clear()
            last[key] = torch.cat([_read(files, name) for name in _tensor_names(config, layer, packed)]).to(dtype)
        return last[key]

    return base_weight


def _tensor_names(config: ModelConfig, layer: int, packed: str) -> list[str]:
    """The checkpoint tensors whose rows make up (layer, packed), in slice order."""
    if config.fused_projections:
        fused = [proj for proj, target in FUSED_TO_PACKED.items() if target == packed]
        if fused:
            return [f"model.layers.{layer}.{PEFT_PARENT[fused[0]]}.{fused[0]}.weight"]
    projections = sorted((index, proj) for proj, (target, index) in PEFT_TO_PACKED.items() if target == packed)
    return [f"model.layers.{layer}.{PEFT_PARENT[proj]}.{proj}.weight" for _, proj in projections]


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index = model_dir / WEIGHTS_INDEX_FILE
    if index.is_file():
        return {name: model_dir / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    names = {}
    for file in weight_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            names.update({name: file for name in handle.keys()})
    return names


def _read(files: dict[str, Path], name: str) -> torch.Tensor:
    with safe_open(str(files[name]), framework="pt", device="cpu") as handle:
        return handle.get_tensor(name)
