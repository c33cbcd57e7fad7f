"""``lora-runner serve --num-replicas N``: the OpenAI server on Ray Serve, adapters multiplexed.

Two deployments. Each ``LoRAEngine`` replica holds one AsyncLLMEngine and runs the single-process
app (:func:`lora_runner.entrypoints.openai.app.build_app`: same routes, request models, errors, tenant
keys) in process; its ``@serve.multiplexed`` loader registers a LoRA with the replica's engine the
first time a request for it is routed there and removes it when Serve evicts it from the replica's
LRU, so Serve routes a request for adapter X to a replica that already holds X when it can. The
``LoRAIngress`` deployment (one replica, FastAPI) authenticates, reads ``model``, forwards the
request with ``multiplexed_model_id`` set to the LoRA's name, streams the answer back, adds the
``x-lora-runner-replica`` header and serves ``/metrics`` summed over replicas.

Replicas report their cumulative adapter-load counts with every answer, and the ingress keeps the
latest report per replica: counts of a replica that died stay in the sums (they are counters).
"""

# No `from __future__ import annotations`: Serve re-signs the ingress methods and FastAPI must see
# real annotation objects (a string "Request" becomes a query parameter).

import argparse
import asyncio
import json
import logging
from collections import Counter
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from ray import serve
from ray.exceptions import RayActorError, RayError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from starlette.concurrency import run_in_threadpool

from adapters import LoRARequest, PromptAdapterRequest, UnknownAdapterError
from lora_runner.entrypoints.ray.asgi_call import call_asgi
from lora_runner.entrypoints.openai.errors import APIError, api_error_from, error_body, install_error_handlers
from lora_runner.entrypoints.openai.formatting import sse
from lora_runner.entrypoints.openai.registry import AdapterRegistry
from lora_runner.entrypoints.openai.tenants import KeyRing

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-lora-runner-replica"
ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT = "LoRAEngine", "LoRAIngress"
_FORWARDED_HEADERS = ("content-type", "cache-control", "retry-after", "www-authenticate")


def replica_name() -> str:
    """This Serve replica's unique id (the suffix of its actor's name)."""
    return serve.get_replica_context().replica_id.unique_id


def _lazy_state(args: argparse.Namespace):
    """A replica's ServerState: prompt adapters loaded now, LoRAs only registered (loaded on demand)."""
    from lora_runner.entrypoints.cli import build_state

    state = build_state(argparse.Namespace(**{**vars(args), "lora_modules": []}))
    for name, path, revision in args.lora_modules:
        state.registry.add(LoRARequest(name, path, revision))
    return state


class _LoadedAdapter:
    """What the multiplex LRU holds for one adapter; Serve calls ``__del__`` when it evicts it."""

    def __init__(self, replica: "EngineReplicaBase", name: str) -> None:
        self.replica, self.name, self.removed = replica, name, False

    def __del__(self) -> None:
        if not self.removed:  # idempotent: Serve calls it on eviction, the GC may call it again
            self.removed = True
            self.replica.unload_adapter(self.name)


class EngineReplicaBase:
    """One engine replica; :func:`engine_deployment` adds the multiplexed loader and the Serve wrapper."""

    def __init__(self, args: argparse.Namespace) -> None:
        from lora_runner.entrypoints.openai.app import build_app

        self.state = _lazy_state(args)
        self.app = build_app(self.state)
        self.replica = replica_name()
        self.loads: Counter[str] = Counter()
        self.unloads: Counter[str] = Counter()

    async def _load(self, name: str) -> _LoadedAdapter:
        served = self.state.registry.get(name, _ADMIN)
        if served is None or served.kind != "lora":
            raise APIError(404, f"The model `{name}` does not exist.", "model_not_found")
        await run_in_threadpool(self.state.engine.engine.add_lora, served.request)
        self.loads[name] += 1
        logger.info("replica %s loaded LoRA %r", self.replica, name)
        return _LoadedAdapter(self, name)

    def unload_adapter(self, name: str) -> None:
        """Remove an evicted adapter from the engine (running requests on it finish first)."""
        self.unloads[name] += 1
        try:
            self.state.engine.engine.remove_lora(name)
        except (UnknownAdapterError, RuntimeError) as exc:  # already gone from the cache, or engine closed
            logger.debug("replica %s: removing %r: %s", self.replica, name, exc)
        logger.info("replica %s evicted LoRA %r", self.replica, name)

    def report(self) -> dict:
        """The replica's id, cumulative adapter loads/evictions and the LoRAs its engine holds now."""
        return {"replica": self.replica, "loads": dict(self.loads), "unloads": dict(self.unloads),
                "resident": self.state.engine.engine.list_loras()}

    async def handle(self, method: str, path: str, headers: list[tuple[str, str]],
                     body: bytes) -> AsyncIterator[dict | bytes]:
        """Run one HTTP request through the app: a head dict (status, headers, report), then body bytes."""
        adapter = serve.get_multiplexed_model_id()
        if adapter:
            try:
                await self.get_adapter(adapter)
            except Exception as exc:  # noqa: BLE001 - a bad adapter: its status, as the single-process app
                err = api_error_from(exc)
                headers = [("content-type", "application/json"), *err.headers.items()]
                yield {"status": err.status, "headers": headers, **self.report()}
                yield json.dumps(error_body(err.status, err.message, err.code)).encode()
                return
        async for item in call_asgi(self.app, method, path, headers, body):
            yield {**item, **self.report()} if isinstance(item, dict) else item

    def __del__(self) -> None:
        state = getattr(self, "state", None)
        if state is not None:
            state.engine.shutdown(state.config.shutdown_timeout)


def engine_deployment(max_adapters: int, max_ongoing_requests: int):
    """The engine deployment class with a multiplex LRU of `max_adapters` adapters per replica."""

    class LoRAEngine(EngineReplicaBase):
        @serve.multiplexed(max_num_models_per_replica=max_adapters)
        async def get_adapter(self, name: str) -> _LoadedAdapter:
            return await self._load(name)

    return serve.deployment(name=ENGINE_DEPLOYMENT, max_ongoing_requests=max_ongoing_requests)(LoRAEngine)


class _Admin:
    """The registry lookups of a replica see every adapter (the ingress checked the tenant)."""

    base = admin = True

    @staticmethod
    def may_use(name: str) -> bool:
        return True


_ADMIN = _Admin()

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

    def __init__(self, engine, args: argparse.Namespace, request_timeout: float = 600.0) -> None:
        self.engine, self.request_timeout = engine, request_timeout
        self.keys = KeyRing.from_options(args.api_key, args.tenant_keys)
        self.max_body_bytes = args.max_body_bytes
        self.registry = AdapterRegistry(args.served_model_name or args.model)
        for name, path, revision in args.lora_modules:
            self.registry.add(LoRARequest(name, path, revision))
        for name, path, revision in args.prompt_adapters:
            self.registry.add(PromptAdapterRequest(name, path, revision))
        self.requests: Counter[tuple[str, str]] = Counter()  # (replica, model) -> generation requests
        self.reports: dict[str, dict] = {}  # replica -> its latest report

    def metrics(self, request: Request) -> Response:
        """/metrics: summed over replicas."""
        self._tenant(request)
        return Response(render_metrics(self.requests, self.reports), media_type=CONTENT_TYPE_LATEST)

    def _tenant(self, request: Request):
        from lora_runner.entrypoints.openai.app import require_tenant

        return require_tenant(self.keys, request.headers.get("authorization"))

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
        served = self.registry.get(model, tenant) if model else None
        adapter = served.name if served is not None and served.kind == "lora" else None
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
        self.reports[head["replica"]] = head
        if model is not None:
            self.requests[(head["replica"], model)] += 1
        headers = {k: v for k, v in head["headers"] if k.lower() in _FORWARDED_HEADERS}
        headers[REPLICA_HEADER] = head["replica"]
        if "text/event-stream" in headers.get("content-type", ""):
            return StreamingResponse(self._relay(stream), status_code=head["status"], headers=headers)
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

    def __init__(self, engine, args: argparse.Namespace) -> None:
        self.front = Ingress(engine, args)

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


def render_metrics(requests: Counter, reports: dict[str, dict]) -> bytes:
    """Prometheus text: generation requests and adapter loads/evictions, per replica and summed."""
    registry = CollectorRegistry()
    registry.register(_ReplicaCollector(requests, reports))
    return generate_latest(registry)


class _ReplicaCollector:
    def __init__(self, requests: Counter, reports: dict[str, dict]) -> None:
        self.requests, self.reports = requests, reports

    def collect(self):
        per_model = CounterMetricFamily("lora_runner_requests", "Generation requests, per served model "
                                        "(all replicas)", labels=["model"])
        for model, count in _sum_by(self.requests, 1).items():
            per_model.add_metric([model], count)
        yield per_model
        per_replica = CounterMetricFamily("lora_runner_replica_requests", "Generation requests per replica",
                                          labels=["replica"])
        for replica, count in _sum_by(self.requests, 0).items():
            per_replica.add_metric([replica], count)
        yield per_replica
        for kind in ("loads", "unloads"):
            yield from self._adapter_counters(kind)
        resident = GaugeMetricFamily("lora_runner_replica_adapters_resident", "1 for each LoRA in a replica's "
                                     "engine cache (as of the replica's latest answer)", labels=["replica", "adapter"])
        for replica, report in sorted(self.reports.items()):
            for adapter in report["resident"]:
                resident.add_metric([replica, adapter], 1)
        yield resident

    def _adapter_counters(self, kind: str):
        verb = "registered with" if kind == "loads" else "evicted from"
        total = sum(sum(r[kind].values()) for r in self.reports.values())
        yield CounterMetricFamily(f"lora_runner_adapter_{kind}", f"Adapters {verb} a replica's engine "
                                  "(all replicas)", value=total)
        per = CounterMetricFamily(f"lora_runner_replica_adapter_{kind}", f"Adapters {verb} the replica's "
                                  "engine, per replica and adapter", labels=["replica", "adapter"])
        for replica, report in sorted(self.reports.items()):
            for adapter, count in sorted(report[kind].items()):
                per.add_metric([replica, adapter], count)
        yield per

    def describe(self):
        return []


def _sum_by(counter: Counter, position: int) -> Counter:
    sums: Counter = Counter()
    for key, count in counter.items():
        sums[key[position]] += count
    return sums


def build_application(args: argparse.Namespace):
    """The Serve application for the parsed `serve` options (engine replicas + ingress)."""
    max_adapters = args.max_adapters_per_replica or args.max_cpu_loras or args.max_loras
    options = {"num_replicas": args.num_replicas,
               "ray_actor_options": {"num_cpus": args.replica_cpus, "num_gpus": args.replica_gpus}}
    engine = engine_deployment(max_adapters, args.max_num_seqs).options(**options).bind(args)
    return ingress_deployment().bind(engine, args)
