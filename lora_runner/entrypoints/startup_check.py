"""Check, before any engine exists, that the model and the adapters named at start-up can be served.

Ray mode (``serve --num-replicas N``) builds its engines inside replicas, where a wrong model path
or a bad ``--lora-modules`` adapter would surface only as a replica that keeps failing to start (or,
for LoRAs, which replicas load lazily, as a 422 on the first request for it). ``serve`` runs this
first, so both end the command with one line and exit status 2, as in one process: the model is
resolved (local dir, .gguf, Hub id; offline: the cache) and its config read; each adapter is resolved
and read and validated against the model's shape and the engine's limits (max_lora_rank, soft-prompt
size, pickles, byte bound), on CPU. A DoRA adapter needs the base weights for its norms, so only its
config and files are checked here (its replica validates the rest when it loads it).
"""

from __future__ import annotations

import logging

from adapters import AdapterError
from adapters.hub import adapter_file_patterns, resolve
from adapters.lora import load_lora
from adapters.prompt import load_prompt_adapter
from adapters.weights import read_adapter_config, read_adapter_tensors
from lora_runner.config import EngineConfig
from lora_runner.entrypoints.launch import StartupAdapters
from lora_runner.model.config import ModelConfig
from lora_runner.model.loader import resolve_model_dir

logger = logging.getLogger(__name__)


def check_startup(engine_config: EngineConfig, adapters: StartupAdapters) -> None:
    """Raise FileNotFoundError / ValueError for a model that cannot be found or read, and the
    adapter's AdapterError (naming it) for a startup adapter that would fail to load."""
    model_dir = resolve_model_dir(engine_config.model, engine_config.revision)
    spec = ModelConfig.from_dir(model_dir, engine_config.model, quantization=engine_config.quantization).spec()
    patterns = adapter_file_patterns(engine_config.allow_pickle)
    limits = dict(allow_pickle=engine_config.allow_pickle, max_bytes=engine_config.max_adapter_bytes)
    for lora in adapters.loras:
        local = _resolved(lora, patterns)
        if read_adapter_config(lora.name, local, limits["max_bytes"]).get("use_dora") is True:
            read_adapter_tensors(lora.name, local, **limits)  # the norms need the base weights: the replica checks
            continue
        load_lora(lora.name, local, spec, max_lora_rank=engine_config.max_lora_rank, **limits)
    for prompt in adapters.prompt_adapters:
        load_prompt_adapter(prompt.name, _resolved(prompt, patterns), spec,
                            max_prompt_adapter_tokens=engine_config.max_prompt_adapter_tokens, **limits)
    logger.info("checked the model and %d startup adapters", len(adapters.loras) + len(adapters.prompt_adapters))


def _resolved(request, patterns: list[str]) -> str:
    try:
        return resolve(request.path, request.revision, patterns)
    except AdapterError as exc:  # resolve names the path; name the adapter too, as the engine does
        raise type(exc)(f"adapter {request.name!r}: {exc}") from exc
