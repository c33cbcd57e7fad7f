"""The HTTP front of ``serve --num-replicas N``: one FastAPI ingress replica before the engine replicas.

The ``LoRAIngress`` deployment authenticates, reads ``model``, forwards the request to an engine
replica (lora_runner.entrypoints.ray.replica) with ``multiplexed_model_id`` set to the LoRA's name,
streams the answer back, adds the ``x-lora-runner-replica`` header, maps a replica that died or
timed out to its status, and serves ``/metrics`` summed over replicas (ray.metrics) to operator keys. Replicas
report their cumulative adapter-load counts with every answer, and the ingress keeps the latest
report per replica: counts of a replica that died stay in the sums (they are counters).
"""

# No `from __future__ import annotations`: Serve re-signs the ingress methods and FastAPI must see
# real annotation objects (a string "Request" becomes a query parameter).

import asyncio
import json
import logging
from collections import Counter
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.exceptions import RayActorError, RayError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

from lora_runner.entrypoints.launch import StartupAdapters
from lora_runner.entrypoints.openai.authentication import require_operator, require_tenant, single_header
from lora_runner.entrypoints.openai.errors import APIError, error_body, install_error_handlers
from lora_runner.entrypoints.openai.formatting import sse
from lora_runner.entrypoints.openai.metrics import OTHER_MODEL
from lora_runner.entrypoints.openai.send_timeout import TimedStreamingResponse
from lora_runner.entrypoints.openai.state import ServerConfig
from lora_runner.entrypoints.openai.tenants import KeyRing, Tenant
from lora_runner.entrypoints.ray.metrics import render_metrics

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-lora-runner-replica"
INGRESS_DEPLOYMENT = "LoRAIngress"
_FORWARDED_HEADERS = ("content-type", "cache-control", "retry-after", "www-authenticate")

ingress_app = FastAPI(title="lora-runner (Ray Serve)", docs_url=None, redoc_url=None, openapi_url=None)
install_error_handlers(ingress_app)


@ingress_app.middleware("http")
async def _name_the_replica(request: Request, call_next):
    """Answers made by the ingress itself (401, 413, a dead replica) say so in the replica header."""
    response = await call_next(request)
    response.headers.setdefault(REPLICA_HEADER, "ingress")
    return response


class Ingress:
    """The HTTP front: authenticates, picks the multiplexed id, forwards to an engine replica."""

    def __init__(self, engine, server_config: ServerConfig, adapters: StartupAdapters,
                 request_timeout: float = 600.0) -> None:
        self.engine, self.request_timeout = engine, request_timeout
        self.keys = KeyRing.from_options(list(server_config.api_keys), server_config.tenant_keys)
        self.max_body_bytes = server_config.max_body_bytes
        self.send_timeout = server_config.stream_send_timeout  # a client that stops reading is given up
        # the LoRA names the replicas serve (fixed at startup: no runtime loads on Ray): the multiplexed ids
        self.loras = frozenset(lora.name for lora in adapters.loras)
        # the request counter's model labels: served names only, anything else is "other" (a body may name
        # any string, 100 KB of it; each would be a series of the operator's /metrics forever)
        self.labelled = frozenset({server_config.served_model_name, *self.loras,
                                   *(adapter.name for adapter in adapters.prompt_adapters)})
        self.requests: Counter[tuple[str, str]] = Counter()  # (replica, model) -> generation requests
        self.reports: dict[str, dict] = {}  # replica -> its latest report

    def metrics(self, request: Request) -> Response:
        """/metrics: summed over replicas; for operator keys only (it names every tenant's adapters)."""
        require_operator(self._tenant(request))
        return Response(render_metrics(self.requests, self.reports), media_type=CONTENT_TYPE_LATEST)

    def _tenant(self, request: Request) -> Tenant:
        return require_tenant(self.keys, single_header(request.scope.get("headers") or [], b"authorization"))

    def no_runtime_updates(self, request: Request) -> Response:
        """The load/unload routes: one replica cannot change what all replicas serve."""
        self._tenant(request)
        raise APIError(403, "runtime adapter loading is not available on Ray Serve (--num-replicas > 1): "
                       "name the adapters with --lora-modules", "forbidden")

    async def generate(self, request: Request) -> Response:
        """/v1/completions and /v1/chat/completions: forwarded with the LoRA as multiplexed id."""
        tenant = self._tenant(request)
        body = await request.body()
        if len(body) > self.max_body_bytes:
            raise APIError(413, f"request body over {self.max_body_bytes} bytes", "request_too_large")
        model = _model_field(body)
        adapter = model if model in self.loras and tenant.may_use(model) else None
        return await self.forward(request, adapter, body=body, model=model)

    async def forward(self, request: Request, adapter: str | None, body: bytes | None = None,
                      model: str | None = None, authenticate: bool = True) -> Response:
        """Send the request to an engine replica (preferring one that holds `adapter`) and relay its answer."""
        if authenticate and body is None:
            self._tenant(request)
        body = await request.body() if body is None else body
        handle = self.engine.options(stream=True, multiplexed_model_id=adapter or "")
        stream = handle.handle.remote(request.method, _app_path(request), list(request.headers.items()), body)
        try:
            head = await asyncio.wait_for(stream.__anext__(), self.request_timeout)
        except BaseException as exc:
            stream.cancel()
            raise _replica_error(exc) from exc
        # merged: a report carries the replica's vllm:* series only now and then (ray.metrics.VllmSeries)
        self.reports[head["replica"]] = {**self.reports.get(head["replica"], {}), **head}
        if model is not None:
            self.requests[(head["replica"], model if model in self.labelled else OTHER_MODEL)] += 1
        headers = {k: v for k, v in head["headers"] if k.lower() in _FORWARDED_HEADERS}
        headers[REPLICA_HEADER] = head["replica"]
        if "text/event-stream" in headers.get("content-type", ""):
            # a stalled client: past the send timeout the relay closes, which cancels the replica's
            # stream, whose app sees a disconnect and aborts the requests (Ray buffers what it already sent)
            return TimedStreamingResponse(self._relay(stream), self.send_timeout, status_code=head["status"],
                                          headers=headers)
        try:
            content = b"".join([chunk async for chunk in _bounded(stream, self.request_timeout)])
        except BaseException as exc:
            stream.cancel()
            raise _replica_error(exc) from exc
        return Response(content, status_code=head["status"], headers=headers)

    async def _relay(self, stream) -> AsyncIterator[bytes]:
        """The replica's SSE bytes; a replica that dies mid-stream ends it with an error event."""
        try:
            async for chunk in _bounded(stream, self.request_timeout):
                yield chunk
        except Exception as exc:  # noqa: BLE001 - the status is sent: report it in the stream
            err = _replica_error(exc)
            yield sse(error_body(err.status, err.message, err.code)).encode()
        finally:
            stream.cancel()


@serve.ingress(ingress_app)
class IngressBase:
    """The routes; everything else lives in :class:`Ingress` (importable, so Serve need not pickle it)."""

    def __init__(self, engine, server_config: ServerConfig, adapters: StartupAdapters) -> None:
        self.front = Ingress(engine, server_config, adapters)

    @ingress_app.get("/health")
    async def health(self, request: Request) -> Response:
        return await self.front.forward(request, None, authenticate=False)

    @ingress_app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        return await self.front.forward(request, None)

    @ingress_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self.front.generate(request)

    @ingress_app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        return await self.front.generate(request)

    @ingress_app.post("/v1/load_lora_adapter")
    async def load(self, request: Request) -> Response:
        return self.front.no_runtime_updates(request)

    @ingress_app.post("/v1/unload_lora_adapter")
    async def unload(self, request: Request) -> Response:
        return self.front.no_runtime_updates(request)

    @ingress_app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        return self.front.metrics(request)


def ingress_deployment():
    """The ingress deployment class (one replica; no CPU reserved: it only relays bytes, and a
    machine with one core per engine replica must still place it)."""
    return serve.deployment(name=INGRESS_DEPLOYMENT, num_replicas=1, max_ongoing_requests=1000,
                            ray_actor_options={"num_cpus": 0})(IngressBase)


async def _bounded(stream, timeout: float) -> AsyncIterator:
    """Items of a Serve streaming response, each awaited at most `timeout` seconds."""
    while True:
        try:
            item = await asyncio.wait_for(stream.__anext__(), timeout)
        except StopAsyncIteration:
            return
        yield item


def _app_path(request: Request) -> str:
    """The path below the application's route prefix (the replica's app serves from /)."""
    path, prefix = request.url.path, request.scope.get("root_path", "")
    return path[len(prefix):] if prefix and path.startswith(prefix) else path


def _model_field(body: bytes) -> str | None:
    """The request's ``model`` (None when the body is not a JSON object with a string model: the
    replica's app then answers the validation error)."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    model = parsed.get("model") if isinstance(parsed, dict) else None
    return model if isinstance(model, str) else None


def _replica_error(exc: BaseException) -> APIError:
    """The status for a forwarded request that got no (complete) answer from its replica."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (RayActorError, ReplicaUnavailableError)):
        return APIError(503, f"the engine replica serving this request died: {type(exc).__name__}",
                        "replica_unavailable")
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return APIError(504, "the engine replica did not answer in time", "replica_timeout")
    if isinstance(exc, (BackPressureError, DeploymentUnavailableError)):
        return APIError(503, f"no engine replica can take the request now: {type(exc).__name__}", "server_busy")
    if isinstance(exc, RayError):  # the replica raised: a bug, not a capacity problem
        logger.error("engine replica failed", exc_info=exc)
        return APIError(500, f"the engine replica failed: {type(exc).__name__}", "replica_error")
    logger.error("forwarding failed", exc_info=exc)
    return APIError(500, "internal server error", "internal_error")
