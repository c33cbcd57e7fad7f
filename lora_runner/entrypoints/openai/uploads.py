"""POST /v1/lora_adapters/{name}/versions: a new version of a LoRA from uploaded weights (issue 36).

An RL trainer pushes its policy adapter after every step without sharing a folder with the server:
the body is the ``adapter_model.safetensors`` bytes (``Content-Type: application/octet-stream``) and
the ``X-Adapter-Config`` header the ``adapter_config.json`` object (compact JSON, on one line; the
server's header limit bounds it, 16 KiB with uvicorn's defaults). The answer names
the new version: ``{"object": "lora_adapter_version", "name": ..., "version": ...}``.

Who may: with --allow-runtime-lora-updating only, a key that may use the name, and either the
adapter's owner (the tenant that loaded it) or an operator key; a name nobody serves yet takes an
admin key, as a load does. Another tenant's adapter is a 403, checked again right before the version
becomes visible (under the registry's lock), so a name taken meanwhile is not overwritten.

Bounds: the body is refused with 413 over ``max_adapter_bytes`` before it is read
(body_limit.BodyLimitMiddleware, which gives this route that bound instead of --max-body-bytes).
The upload is then read exactly as an adapter folder is (adapters.weights: header checks, size
bounds) from a private temporary folder, and validated as any load is (shapes, ranks, finite
values); an update that fails answers 422 and the version serving before keeps serving. That includes
one whose snapshot would make the live in-memory snapshots pass ``--max-memory-adapter-bytes``
(adapters.memory_source.MemoryAdapterBoundError, refused before the upload is copied into a snapshot).
When the keys name several tenants, a tenant's update is also held to its share of that bound
(--max-tenant-share, charged to the adapter's owner): over it is a 429, so one tenant's snapshots
never refuse another's update; operator keys keep the whole bound.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from functools import partial

from fastapi import Request

from adapters.files import AdapterDir
from adapters.hub import CONFIG_FILE, SAFETENSORS_FILE
from adapters.memory_source import MemoryAdapterShareError
from adapters.versions import ServedAdapter
from adapters.weights import read_adapter_config, read_adapter_tensors
from lora_runner.entrypoints.openai.errors import APIError, api_error_from
from lora_runner.entrypoints.openai.state import ServerState
from lora_runner.entrypoints.openai.tenants import Tenant

logger = logging.getLogger(__name__)

UPLOAD_PREFIX = "/v1/lora_adapters/"  # the routes BodyLimitMiddleware bounds by max_adapter_bytes
CONFIG_HEADER = "x-adapter-config"
_UPLOAD_DIR = "upload"  # the folder's name in messages: no server path shows


async def upload_lora_version(state: ServerState, tenant: Tenant, name: str, request: Request) -> dict:
    """Serve a new version of the LoRA ``name`` from the request's body and config header (module docstring)."""
    _check_may_update(state, tenant, name)
    config = _config_from_header(request.headers.get(CONFIG_HEADER))
    weights = await request.body()  # bounded by BodyLimitMiddleware before it was read
    existed = state.engine.served_adapter(name) is not None
    try:
        served = await state.loads.run(tenant.name, partial(_update, state, tenant, name, weights, config))
    except MemoryAdapterShareError as exc:  # the tenant's own snapshots fill its share: retry when they went
        state.metrics.runtime_loads.labels("failed").inc()
        raise APIError(429, str(exc), "tenant_share_exceeded") from exc
    except Exception as exc:  # noqa: BLE001 - mapped to its status (422 for an update that fails)
        state.metrics.runtime_loads.labels("failed").inc()
        raise api_error_from(exc) from exc
    state.metrics.runtime_loads.labels("replaced" if existed else "loaded").inc()
    logger.info("serving LoRA %r version %d (uploaded by %s)", name, served.version.version, tenant.name)
    return {"object": "lora_adapter_version", "name": name, "version": served.version.version}


def _check_may_update(state: ServerState, tenant: Tenant, name: str) -> None:
    """403 unless the tenant may replace ``name``'s weights (module docstring); 400 for a name that is
    no LoRA (the base model, a prompt adapter)."""
    if not state.config.allow_runtime_lora_updating:
        raise APIError(403, "runtime adapter updates are disabled (start with --allow-runtime-lora-updating)",
                       "forbidden")
    if name == state.base_name:
        raise APIError(400, f"{name!r} is the base model's name", "invalid_value")
    if not tenant.may_use(name):
        raise APIError(403, "this key may not update an adapter under that name", "forbidden")
    served = state.engine.served_adapter(name)
    if served is not None and served.kind != "lora":
        raise APIError(400, f"{name!r} is a prompt adapter; uploads replace LoRAs only", "invalid_value")
    if not _may_update(tenant, served):
        raise APIError(403, "this key may not update that adapter (it belongs to another tenant)"
                       if served is not None else "this key may not load adapters", "forbidden")


def _may_update(tenant: Tenant, served: ServedAdapter | None) -> bool:
    if served is None:
        return tenant.admin
    return tenant.operator or served.owner == tenant.name


def _config_from_header(header: str | None) -> dict:
    if header is None:
        raise APIError(400, f"the {CONFIG_HEADER} header must hold the adapter_config.json object", "invalid_value")
    try:
        config = json.loads(header)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"the {CONFIG_HEADER} header is not valid JSON: {exc}", "invalid_value") from None
    if not isinstance(config, dict):
        raise APIError(400, f"the {CONFIG_HEADER} header must hold a JSON object", "invalid_value")
    return config


def _update(state: ServerState, tenant: Tenant, name: str, weights: bytes, config: dict, claim) -> ServedAdapter:
    """On a load thread: read the upload as a folder is read, then hand it to the engine, whose claim
    also asks, under the registry's lock, that the name is still the tenant's to update."""
    max_bytes = state.engine.max_adapter_bytes()
    with tempfile.TemporaryDirectory(prefix="lora-upload-") as root:
        os.mkdir(os.path.join(root, _UPLOAD_DIR), 0o700)
        for file, data in ((CONFIG_FILE, json.dumps(config).encode()), (SAFETENSORS_FILE, weights)):
            with open(os.path.join(root, _UPLOAD_DIR, file), "wb") as f:
                f.write(data)
        with AdapterDir.confined(root, _UPLOAD_DIR) as folder:
            config = read_adapter_config(name, folder, max_bytes)
            tensors = read_adapter_tensors(name, folder, max_bytes=max_bytes)

    def still_allowed() -> bool:
        if not _may_update(tenant, state.engine.served_adapter(name)):
            raise APIError(403, "this key may not update that adapter (it belongs to another tenant)", "forbidden")
        return claim()

    old = state.engine.served_adapter(name)
    owner = tenant.name if old is None else None  # None keeps the served record's owner
    # a tenant's share of max_memory_adapter_bytes, as of every shared budget (ServerState.tenant_seats)
    share = state.config.max_tenant_share if state.tenant_seats is not None and not tenant.operator else None
    return state.engine.update_lora(name, tensors, config, owner=owner, claim=still_allowed, tenant_share=share)
