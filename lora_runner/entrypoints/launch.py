"""From frozen configs to a running server's state: the engine, the keys and the startup adapters.

Both entry points use it: ``cli`` (one process) and the Ray Serve engine replicas
(lora_runner.entrypoints.ray.replica), each handing over the configs ``cli`` built once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from adapters import LoRARequest, PromptAdapterRequest
from lora_runner.config import EngineConfig
from lora_runner.engine.async_llm_engine import AsyncLLMEngine
from lora_runner.engine.llm_engine import LLMEngine
from lora_runner.entrypoints.openai.generation_defaults import sampling_defaults
from lora_runner.entrypoints.openai.state import ServerConfig, ServerState
from lora_runner.entrypoints.openai.tenants import KeyRing

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StartupAdapters:
    """The adapters served from the start (``--lora-modules``, ``--prompt-adapters``)."""

    loras: tuple[LoRARequest, ...] = ()
    prompt_adapters: tuple[PromptAdapterRequest, ...] = ()


def build_state(engine_config: EngineConfig, server_config: ServerConfig, adapters: StartupAdapters) -> ServerState:
    """Engine, keys and the startup adapters (each loaded and validated now: a bad one fails startup,
    with the engine shut down). Raises ValueError for bad settings or keys, adapters.AdapterError."""
    keys = KeyRing.from_options(list(server_config.api_keys), server_config.tenant_keys)
    if server_config.allow_runtime_lora_updating and not keys.enabled:
        logger.warning("runtime adapter loading is enabled without API keys: any caller may load adapters")
    if server_config.allow_runtime_lora_updating and not (server_config.adapter_root
                                                          or server_config.allowed_adapter_paths):
        logger.warning("runtime adapter loading is enabled, but every load will be refused: give --adapter-root "
                       "(loads by relative path) or --allowed-adapter-paths (loads by absolute path)")
    llm_engine = LLMEngine(engine_config)
    state = ServerState(AsyncLLMEngine(llm_engine), server_config, keys)
    try:
        state.sampling_defaults = sampling_defaults(server_config.generation_config, str(llm_engine.model_dir))
        for adapter in (*adapters.loras, *adapters.prompt_adapters):
            state.serve(adapter)
    except BaseException:
        state.engine.shutdown()
        raise
    return state
