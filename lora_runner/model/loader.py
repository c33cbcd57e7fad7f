"""Find a base model (local dir or Hub repo id), read its safetensors, build the decoder."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open

from lora_runner.device import resolve_device, resolve_dtype
from lora_runner.distributed import SINGLE, TensorParallel
from lora_runner.model.config import ModelConfig
from lora_runner.model.gemma2 import model_class
from lora_runner.model.gguf import gguf_model_dir, is_gguf_file
from lora_runner.model.moe import split_fused_experts
from lora_runner.model.tp_shards import TensorShard, check_int4_split, checkpoint_shard, read_shard

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
# Files fetched from the Hub: config, safetensors weights, tokenizer (never pickled .bin weights)
HUB_ALLOW_PATTERNS = [
    "config.json", "generation_config.json", "*.safetensors", WEIGHTS_INDEX_FILE,
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
]
def _looks_like_path(model: str) -> bool:
    return (model.startswith(("/", "./", "../", "~", "\\")) or os.path.isabs(model)
            or model.count("/") > 1 or os.path.exists(model))


def resolve_model_dir(model: str, revision: str | None = None, local_files_only: bool | None = None,
                      cache_dir: str | os.PathLike | None = None) -> Path:
    """Local directory for `model`: an existing dir as is, a ``.gguf`` file as its converted dir
    (dequantized once and cached, see lora_runner.model.gguf), else a Hub repo id via snapshot_download.

    local_files_only None follows HF_HUB_OFFLINE. Raises FileNotFoundError naming what is missing.
    """
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a non-empty string (local dir or Hub repo id), got {model!r}")
    path = Path(model).expanduser()
    if is_gguf_file(path):  # converted once to a cached safetensors dir (lora_runner.model.gguf)
        return gguf_model_dir(path)
    if path.is_dir():
        if revision is not None:
            logger.warning("revision %r ignored: %s is a local directory", revision, path)
        return path
    if _looks_like_path(model):
        raise FileNotFoundError(f"model dir {model!r} does not exist (or is not a directory)")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import EntryNotFoundError, HFValidationError, HfHubHTTPError

    if local_files_only is None:
        local_files_only = bool(constants.HF_HUB_OFFLINE)
    where = f"Hub repo {model!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        snapshot = snapshot_download(model, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS,
                                     local_files_only=local_files_only, cache_dir=cache_dir)
    except HFValidationError as err:
        raise FileNotFoundError(f"{model!r} is neither a local directory nor a valid Hub repo id") from err
    except (EntryNotFoundError, HfHubHTTPError, OSError) as err:
        offline = " (offline: only the local Hub cache was searched)" if local_files_only else ""
        raise FileNotFoundError(f"cannot get {where}{offline}: {err}") from err
    logger.info("resolved %s to %s", where, snapshot)
    return Path(snapshot)


def weight_files(model_dir: str | os.PathLike) -> list[Path]:
    """The safetensors files of a model dir: the shards its index names, or model.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / WEIGHTS_INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        if not files:
            raise ValueError(f"{index} has an empty weight_map")
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"weight shard(s) {', '.join(missing)} listed in {WEIGHTS_INDEX_FILE} "
                                    f"are missing from {str(model_dir)!r}")
        return files
    if (model_dir / WEIGHTS_FILE).is_file():
        return [model_dir / WEIGHTS_FILE]
    others = sorted(model_dir.glob("*.safetensors"))
    if others:
        return others
    found = sorted(p.name for p in model_dir.glob("*.bin"))
    hint = f" (found {', '.join(found)}: pickled weights are not loaded; convert to safetensors)" if found else ""
    raise FileNotFoundError(f"no {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE} in model dir {str(model_dir)!r}{hint}")


ShardOf = Callable[[str, tuple[int, ...]], TensorShard | None]  # (name, full shape) -> the part to read


def iter_weights(model_dir: str | os.PathLike, shard_of: ShardOf | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor in the model's safetensors files, one at a time;
    ``shard_of`` (a tensor-parallel rank): only the part of each tensor it names is read from disk."""
    for file in weight_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                if shard_of is None:
                    yield name, handle.get_tensor(name)
                    continue
                shape = tuple(handle.get_slice(name).get_shape())
                yield name, read_shard(handle, name, shard_of(name, shape))


def load_model(model: str, revision: str | None = None, dtype: torch.dtype | str = torch.float32,
               device: torch.device | str = "cpu", local_files_only: bool | None = None,
               quantization: str | None = None, tp: TensorParallel = SINGLE):
    """Build the decoder for `model` (local dir or Hub repo id) with its weights loaded.

    ``tp``: this process's rank of a tensor-parallel group: the decoder is then that rank's shard
    (LlamaForCausalLM, adapters.sharding) and only that shard is read from the checkpoint. A split
    the sizes do not allow (heads, KV heads, intermediate size; a 4-bit layout's packed words and
    groups, act-order GPTQ: lora_runner.model.tp_shards) is a ValueError before any weight is read.

    A checkpoint's ``quantization_config`` (compressed-tensors FP8 / W4A16, GPTQ, AWQ) or
    ``quantization="fp8"`` (a float checkpoint quantized at load) keeps the decoder linears quantized
    (lora_runner.model.quant); anything this code does not implement is refused before any weight is
    allocated.

    A mixture-of-experts checkpoint (Mixtral, Qwen3-MoE, Qwen2-MoE) may hold its experts per expert (as
    Hub checkpoints and transformers' save_pretrained write them) or fused per layer (transformers 5's
    in-memory ``mlp.experts.gate_up_proj`` / ``down_proj``): lora_runner.model.moe.split_fused_experts.

    Returns (LlamaForCausalLM or a subclass, ModelConfig, model_dir). Raises FileNotFoundError for a missing
    dir/repo/config/weights and ValueError for an unsupported architecture or option.
    """
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    model_dir = resolve_model_dir(model, revision=revision, local_files_only=local_files_only)
    config = ModelConfig.from_dir(model_dir, name_or_path=model, quantization=quantization)
    weight_files(model_dir)  # fail on missing weights before allocating the model
    check_int4_split(config, tp)  # before any weight is read, as the model's own split checks
    net = model_class(config)(config, dtype=dtype, device=device, tp=tp)
    weights = iter_weights(model_dir, partial(checkpoint_shard, net) if tp.is_parallel else None)
    net.load_weights(split_fused_experts(weights, config) if config.num_experts else weights)
    net.after_loading()
    quant = config.quantization
    logger.info("loaded %s (%s, %d layers) as %s on %s%s%s", model, config.architecture, config.num_layers, dtype,
                device, f", {quant.kind} linears ({quant.source})" if quant else "",
                f", shard {tp.rank} of {tp.world_size}" if tp.is_parallel else "")
    return net.eval(), config, model_dir
