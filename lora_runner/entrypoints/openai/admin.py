"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes and bodies).

Only with --allow-runtime-lora-updating, only for admin keys, only for adapter names the key may
use, and only for paths inside the key's own folder of --adapter-root or, given as absolute paths,
inside a directory of --allowed-adapter-paths (adapter_root): anything else is a 403 decided before
any file is read. A load runs on the server's LoadExecutor (its own threads,
a per-tenant cap that the operator's keys and a keyless server are not under, a deadline), never in the threadpool other routes share; one that fails answers
422 with the adapter's error, naming paths only relative to the caller's root.
"""

from __future__ import annotations

import logging
from functools import partial

from adapters import UnknownAdapterError
from adapters.versions import ServedAdapter
from lora_runner.entrypoints.openai.adapter_root import PathNotAllowed, runtime_lora_request, with_draft_adapter
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
    """Load, validate and serve an adapter from inside the caller's adapter root (or an allowed absolute
    directory). With load_inplace, replace the LoRA served under that name: the engine keeps serving its
    old version until the new one has loaded; a new version that fails leaves the old one serving. A
    load whose caller was answered 504 serves nothing (the engine asks the load executor's claim
    before the adapter becomes visible)."""
    _check_allowed(state, tenant, body.lora_name)
    if body.lora_name == state.base_name:
        raise APIError(400, f"{body.lora_name!r} is the base model's name", "invalid_value")
    old = state.adapter(body.lora_name, tenant)
    if old is not None and not body.load_inplace:
        raise APIError(400, f"an adapter named {body.lora_name!r} is already loaded (load_inplace: true "
                       "replaces it)", "invalid_value")
    if old is not None and old.kind != "lora":
        raise APIError(400, f"{body.lora_name!r} is a prompt adapter; load_inplace replaces LoRAs only",
                       "invalid_value")
    try:
        served = await state.loads.run(tenant.name, partial(_load_and_serve, state, tenant, body),
                                       capped=not tenant.operator)
    except PathNotAllowed as exc:
        raise APIError(403, str(exc), "forbidden") from None
    except Exception as exc:  # noqa: BLE001 - mapped to its status (422 for an adapter that fails)
        state.metrics.runtime_loads.labels("failed").inc()
        raise api_error_from(exc) from exc
    logger.info("serving LoRA %r from %s%s", served.name, served.request.path, " (in place)" if old else "")
    state.metrics.runtime_loads.labels("replaced" if old is not None else "loaded").inc()
    verb = "replaced" if old is not None else "added"
    return f"Success: LoRA adapter '{body.lora_name}' {verb} successfully."


def _load_and_serve(state: ServerState, tenant: Tenant, body: LoadLoRARequest, claim) -> ServedAdapter | None:
    """On a load thread: the confined request (PathNotAllowed), loaded, validated and served by the engine
    (None when ``claim`` said its caller gave up: then nothing changed)."""
    confine = partial(runtime_lora_request, state.config.adapter_root, tenant, body.lora_name,
                      allow_hub=state.config.allow_hub_adapters, allowed_paths=state.config.allowed_adapter_paths)
    request = confine(body.lora_path)
    if body.draft_path is not None:  # the draft model's adapter: confined alike, beneath the same directory
        request = with_draft_adapter(request, confine(body.draft_path))
    return state.engine.serve_adapter(request, owner=tenant.name, replace=body.load_inplace, claim=claim)


async def unload_lora_adapter(state: ServerState, tenant: Tenant, body: UnloadLoRARequest) -> str:
    """Stop serving an adapter; requests running on it finish on its weights."""
    _check_allowed(state, tenant, body.lora_name)
    served = state.adapter(body.lora_name, tenant)
    if served is None or served.kind != "lora":
        raise model_not_found(body.lora_name)
    try:
        state.engine.unserve_adapter(body.lora_name)
    except UnknownAdapterError:  # unloaded by another call meanwhile
        raise model_not_found(body.lora_name) from None
    logger.info("stopped serving LoRA %r", body.lora_name)
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
