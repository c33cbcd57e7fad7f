"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes and bodies).

Only with --allow-runtime-lora-updating, only for admin keys, only for adapter names the key may
use, and only for paths inside --adapter-root: anything else is a 403 decided before any file is
read. A load that fails answers 422 with the adapter's error.
"""

from __future__ import annotations

import logging

from starlette.concurrency import run_in_threadpool

from adapters import LoRARequest, UnknownAdapterError
from lora_runner.entrypoints.openai.adapter_root import PathNotAllowed, resolve_adapter_path
from lora_runner.entrypoints.openai.errors import APIError, api_error_from, model_not_found
from lora_runner.entrypoints.openai.protocol import LoadLoRARequest, UnloadLoRARequest
from lora_runner.entrypoints.openai.state import ServerState
from lora_runner.entrypoints.openai.tenants import Tenant

logger = logging.getLogger(__name__)


def _check_allowed(state: ServerState, tenant: Tenant, name: str) -> None:
    if not state.config.allow_runtime_lora_updating:
        raise APIError(403, "runtime adapter loading is disabled (start with --allow-runtime-lora-updating)",
                       "forbidden")
    if not tenant.admin:
        raise APIError(403, "this key may not load or unload adapters", "forbidden")
    if not tenant.may_use(name):
        raise APIError(403, "this key may not load or unload an adapter under that name", "forbidden")


async def load_lora_adapter(state: ServerState, tenant: Tenant, body: LoadLoRARequest) -> str:
    """Load, validate and serve an adapter from inside the adapter root."""
    _check_allowed(state, tenant, body.lora_name)
    try:
        path = resolve_adapter_path(state.config.adapter_root, body.lora_path, state.config.allow_hub_adapters)
    except PathNotAllowed as exc:
        raise APIError(403, str(exc), "forbidden") from None
    if body.lora_name == state.registry.base_name or state.registry.get(body.lora_name, tenant) is not None:
        raise APIError(400, f"an adapter named {body.lora_name!r} is already loaded", "invalid_value")
    try:
        await run_in_threadpool(state.add_lora, LoRARequest(body.lora_name, path))
    except Exception as exc:  # noqa: BLE001 - mapped to its status (422 for an adapter that fails)
        state.metrics.runtime_loads.labels("failed").inc()
        raise api_error_from(exc) from exc
    state.metrics.runtime_loads.labels("loaded").inc()
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


async def unload_lora_adapter(state: ServerState, tenant: Tenant, body: UnloadLoRARequest) -> str:
    """Stop serving an adapter; requests running on it finish on its weights."""
    _check_allowed(state, tenant, body.lora_name)
    served = state.registry.get(body.lora_name, tenant)
    if served is None or served.kind != "lora":
        raise model_not_found(body.lora_name)
    state.registry.remove(body.lora_name)
    try:
        state.engine.remove_lora(body.lora_name)
    except UnknownAdapterError:  # already evicted from the engine's CPU cache: nothing to free
        logger.debug("LoRA %r was not in the engine's cache", body.lora_name)
    logger.info("stopped serving LoRA %r", body.lora_name)
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
