"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes and bodies).

Only with --allow-runtime-lora-updating, only for admin keys, only for adapter names the key may
use, and only for paths inside the key's own folder of --adapter-root or, given as absolute paths,
inside a directory of --allowed-adapter-paths (adapter_root): anything else is a 403 decided before
any file is read. A load runs on the server's LoadExecutor (its own threads,
a per-tenant cap, a deadline), never in the threadpool other routes share; one that fails answers
422 with the adapter's error, naming paths only relative to the caller's root.
"""

from __future__ import annotations

import logging
from functools import partial

from adapters import LoRARequest, UnknownAdapterError
from lora_runner.entrypoints.openai.adapter_root import PathNotAllowed, runtime_lora_request
from lora_runner.entrypoints.openai.errors import APIError, api_error_from, model_not_found
from lora_runner.entrypoints.openai.protocol import LoadLoRARequest, UnloadLoRARequest
from lora_runner.entrypoints.openai.registry import ServedAdapter
from lora_runner.entrypoints.openai.state import ServerState
from lora_runner.entrypoints.openai.tenants import Tenant

_ANYONE = Tenant("registry-lookup", None)  # sees every registered name

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
    """Load, validate and serve an adapter from inside the caller's adapter root (or an allowed absolute
    directory). With load_inplace, replace the LoRA served under that name: the engine keeps serving its
    old version until the new one has loaded; a new version that fails leaves the old one serving."""
    _check_allowed(state, tenant, body.lora_name)
    if body.lora_name == state.registry.base_name:
        raise APIError(400, f"{body.lora_name!r} is the base model's name", "invalid_value")
    old = state.registry.get(body.lora_name, tenant)
    if old is not None and not body.load_inplace:
        raise APIError(400, f"an adapter named {body.lora_name!r} is already loaded (load_inplace: true "
                       "replaces it)", "invalid_value")
    if old is not None and old.kind != "lora":
        raise APIError(400, f"{body.lora_name!r} is a prompt adapter; load_inplace replaces LoRAs only",
                       "invalid_value")
    try:
        request = await state.loads.run(tenant.name, partial(_load_in_engine, state, tenant, body),
                                        abandon=partial(_undo_abandoned, state, old))
    except PathNotAllowed as exc:
        raise APIError(403, str(exc), "forbidden") from None
    except Exception as exc:  # noqa: BLE001 - mapped to its status (422 for an adapter that fails)
        state.metrics.runtime_loads.labels("failed").inc()
        raise api_error_from(exc) from exc
    _serve_loaded(state, old, request)
    state.metrics.runtime_loads.labels("replaced" if old is not None else "loaded").inc()
    verb = "replaced" if old is not None else "added"
    return f"Success: LoRA adapter '{body.lora_name}' {verb} successfully."


def _serve_loaded(state: ServerState, old: ServedAdapter | None, request: LoRARequest) -> None:
    """Register a loaded LoRA (in old's place for an in-place load; 409 when old was unloaded or
    replaced by someone else while this one loaded)."""
    try:
        if old is not None:
            state.registry.replace(old, request)
        else:
            state.registry.add(request)
    except ValueError as exc:
        raise APIError(409, str(exc), "conflict") from None
    logger.info("serving LoRA %r from %s%s", request.name, request.path, " (in place)" if old is not None else "")


def _load_in_engine(state: ServerState, tenant: Tenant, body: LoadLoRARequest) -> LoRARequest:
    """On a load thread: the confined request (PathNotAllowed), loaded and validated in the engine."""
    request = runtime_lora_request(state.config.adapter_root, tenant, body.lora_name, body.lora_path,
                                   state.config.allow_hub_adapters, state.config.allowed_adapter_paths)
    state.engine.add_lora(request)
    return request


def _undo_abandoned(state: ServerState, old: ServedAdapter | None, request: LoRARequest) -> None:
    """A load that succeeded after its client got 504: forget it, unless the name is served by now; an
    in-place load puts the version the registry still serves back in the engine."""
    served = state.registry.get(request.name, _ANYONE)
    if old is not None:
        if served is old:
            state.engine.add_lora(old.request)
        return
    if served is None:
        try:
            state.engine.remove_lora(request.name)
        except UnknownAdapterError:
            logger.debug("abandoned LoRA %r was not in the engine's cache", request.name)


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
