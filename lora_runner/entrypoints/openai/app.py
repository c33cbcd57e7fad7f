"""The FastAPI app: OpenAI-compatible routes over one EngineClient (an AsyncLLMEngine).

Every route but /health needs ``Authorization: Bearer KEY`` when keys are configured (401, decided
from the headers before the body is read: authentication.KeyCheckMiddleware); /metrics needs an
operator key (403 for a tenant's). No response shows an absolute server path (redact). On
shutdown (uvicorn's lifespan, after it stopped accepting and let in-flight requests finish or
cancelled them) the engine is shut down: what is still in flight is aborted, the engine closed.
"""

from __future__ import annotations

import importlib.metadata
import logging
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from lora_runner.entrypoints.openai import admin, completions, tokenize, uploads
from lora_runner.entrypoints.openai.authentication import (
    TENANT_SCOPE_KEY,
    KeyCheckMiddleware,
    require_operator,
    require_tenant,
)
from lora_runner.entrypoints.openai.bodies import parse_body
from lora_runner.entrypoints.openai.body_limit import BodyLimitMiddleware
from lora_runner.entrypoints.openai.errors import install_error_handlers
from lora_runner.entrypoints.openai.ignored_fields import IgnoredFieldsHeaderMiddleware
from lora_runner.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRARequest,
    TokenizeRequest,
    UnloadLoRARequest,
)
from lora_runner.entrypoints.openai.redact import public_path
from lora_runner.entrypoints.openai.state import ServerState
from lora_runner.entrypoints.openai.tenants import Tenant
from lora_runner.entrypoints.openai.uploads import UPLOAD_PREFIX

__all__ = ["build_app", "list_models", "require_tenant"]

logger = logging.getLogger(__name__)


def _state(request: Request) -> ServerState:
    return request.app.state.server


async def authenticate(request: Request) -> Tenant:
    """The caller's tenant, as KeyCheckMiddleware found it; 401 without a valid key. Async, so it
    never waits for a thread of the shared pool that adapter loads run in."""
    tenant = request.scope.get(TENANT_SCOPE_KEY)
    return tenant if tenant is not None else require_tenant(_state(request).keys,
                                                            request.headers.get("authorization"))


def build_app(state: ServerState) -> FastAPI:
    """The app serving `state`'s engine (its lifespan shuts the engine down)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        logger.info("shutting down: aborting what is still in flight and closing the engine")
        await run_in_threadpool(state.engine.shutdown, state.config.shutdown_timeout)
        state.close()

    app = FastAPI(title="lora-runner", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(IgnoredFieldsHeaderMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=state.config.max_body_bytes,
                       limit_for=lambda path: state.engine.max_adapter_bytes() if path.startswith(UPLOAD_PREFIX)
                       else None)
    app.add_middleware(KeyCheckMiddleware, keys=state.keys)  # added last: runs first, before the body is read
    _add_routes(app)
    return app


def _add_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> Response:
        ok = _state(request).engine.is_running
        return Response(status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models(request: Request, tenant: Tenant = Depends(authenticate)) -> JSONResponse:
        return JSONResponse(list_models(_state(request), tenant))

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping(request: Request, tenant: Tenant = Depends(authenticate)) -> Response:
        return await health(request)  # vLLM's /ping is its /health (behind the key, as every route but /health)

    @app.get("/version")
    async def version(tenant: Tenant = Depends(authenticate)) -> JSONResponse:
        return JSONResponse({"version": _version()})

    @app.post("/tokenize")
    async def tokenize_route(request: Request, tenant: Tenant = Depends(authenticate)) -> JSONResponse:
        body = await parse_body(_state(request), request, TokenizeRequest)
        return JSONResponse(await tokenize.tokenize(_state(request), tenant, body))

    @app.get("/tokenizer_info")
    async def tokenizer_info_route(request: Request, tenant: Tenant = Depends(authenticate)) -> JSONResponse:
        return JSONResponse(await tokenize.tokenizer_info(_state(request), tenant))

    @app.post("/detokenize")
    async def detokenize_route(request: Request, tenant: Tenant = Depends(authenticate)) -> JSONResponse:
        body = await parse_body(_state(request), request, DetokenizeRequest)
        return JSONResponse(await tokenize.detokenize(_state(request), tenant, body))

    @app.post("/v1/completions")
    async def create_completion(request: Request, tenant: Tenant = Depends(authenticate)):
        body = await parse_body(_state(request), request, CompletionRequest)  # off the loop, counts first
        return await completions.create_completion(_state(request), tenant, body, request)

    @app.post("/v1/chat/completions")
    async def create_chat(request: Request, tenant: Tenant = Depends(authenticate)):
        body = await parse_body(_state(request), request, ChatCompletionRequest)
        return await completions.create_chat_completion(_state(request), tenant, body, request)

    @app.post("/v1/load_lora_adapter")
    async def load(body: LoadLoRARequest, request: Request, tenant: Tenant = Depends(authenticate)):
        return PlainTextResponse(await admin.load_lora_adapter(_state(request), tenant, body))

    @app.post("/v1/unload_lora_adapter")
    async def unload(body: UnloadLoRARequest, request: Request, tenant: Tenant = Depends(authenticate)):
        return PlainTextResponse(await admin.unload_lora_adapter(_state(request), tenant, body))

    @app.post(uploads.UPLOAD_PREFIX + "{name}/versions")
    async def upload(name: str, request: Request, tenant: Tenant = Depends(authenticate)) -> JSONResponse:
        return JSONResponse(await uploads.upload_lora_version(_state(request), tenant, name, request))

    @app.get("/metrics")
    async def metrics(request: Request, tenant: Tenant = Depends(authenticate)) -> Response:
        require_operator(tenant)
        return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


def list_models(state: ServerState, tenant: Tenant) -> dict:
    """OpenAI's model list: the base model (when the tenant may use it) and the tenant's adapters.
    An admin sees each adapter's path relative to the folder it was loaded from (a runtime load: the
    loading tenant's folder of the adapter root; public_path), never a server path."""
    base = state.base_name
    entries = []
    if tenant.base:
        entries.append(_model_card(base, root=base, parent=None, max_model_len=state.max_model_len))
    for adapter in state.adapters(tenant):
        root = public_path(adapter.request.path, adapter.request.root or state.config.adapter_root,
                           adapter.name) if tenant.admin \
            else adapter.name
        entries.append(_model_card(adapter.name, root=root, parent=base, created=adapter.created, kind=adapter.kind,
                                   max_model_len=state.max_model_len))
    return {"object": "list", "data": entries}


def _model_card(name: str, root: str, parent: str | None, created: int = 0, kind: str = "base",
                max_model_len: int | None = None) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "lora-runner", "root": root,
            "parent": parent, "kind": kind, "max_model_len": max_model_len}


def _version() -> str:
    """The installed lora-runner's version ("unknown" when it runs from a source tree not installed)."""
    try:
        return importlib.metadata.version("lora-runner")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
