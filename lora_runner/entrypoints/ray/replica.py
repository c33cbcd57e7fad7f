"""The engine replica of ``serve --num-replicas N``: one AsyncLLMEngine and the single-process app.

Each ``LoRAEngine`` replica runs the app of :func:`lora_runner.entrypoints.openai.app.build_app`
(same routes, request models, errors, tenant keys) in process on the requests the ingress forwards
(lora_runner.entrypoints.ray.ingress). Its ``@serve.multiplexed`` loader registers a LoRA with the
replica's engine the first time a request for it is routed there and removes it when Serve evicts
it from the replica's LRU, so Serve routes a request for adapter X to a replica that already holds
X when it can. Every answer's head carries the replica's report: its id, cumulative adapter
loads/evictions, the LoRAs its engine holds and its ``vllm:*`` series (the ingress's /metrics).
"""

# No `from __future__ import annotations`: Serve re-signs the deployment methods.

import json
import logging
from collections import Counter
from collections.abc import AsyncIterator

from ray import serve
from starlette.concurrency import run_in_threadpool

from adapters import UnknownAdapterError
from lora_runner.config import EngineConfig
from lora_runner.entrypoints.launch import StartupAdapters, build_state
from lora_runner.entrypoints.openai.app import build_app
from lora_runner.entrypoints.openai.errors import APIError, api_error_from, error_body
from lora_runner.entrypoints.openai.state import ServerConfig, ServerState
from lora_runner.entrypoints.ray.asgi_call import call_asgi
from lora_runner.entrypoints.ray.drain import watch_for_drain
from lora_runner.entrypoints.ray.metrics import VllmSeries

logger = logging.getLogger(__name__)

ENGINE_DEPLOYMENT = "LoRAEngine"


def replica_name() -> str:
    """This Serve replica's unique id (the suffix of its actor's name)."""
    return serve.get_replica_context().replica_id.unique_id


class _LoadedAdapter:
    """What the multiplex LRU holds for one adapter; Serve calls ``__del__`` when it evicts it."""

    def __init__(self, replica: "EngineReplicaBase", name: str) -> None:
        self.replica, self.name, self.removed = replica, name, False

    def __del__(self) -> None:
        if not self.removed:  # idempotent: Serve calls it on eviction, the GC may call it again
            self.removed = True
            self.replica.unload_adapter(self.name)


def lazy_state(engine_config: EngineConfig, server_config: ServerConfig, adapters: StartupAdapters) -> ServerState:
    """A replica's ServerState: prompt adapters loaded now, LoRAs only registered (loaded on demand)."""
    state = build_state(engine_config, server_config, StartupAdapters(prompt_adapters=adapters.prompt_adapters))
    for lora in adapters.loras:
        state.serve(lora, load=False)
    return state


class EngineReplicaBase:
    """One engine replica; :func:`engine_deployment` adds the multiplexed loader and the Serve wrapper."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig, adapters: StartupAdapters) -> None:
        self.state = lazy_state(engine_config, server_config, adapters)
        self.app = build_app(self.state)
        watch_for_drain(self.state)  # SIGTERM of `serve`: drain like the single process (ray.drain)
        self.replica = replica_name()
        self.loads: Counter[str] = Counter()
        self.unloads: Counter[str] = Counter()
        self.vllm = VllmSeries(self.state.metrics)

    async def _load(self, name: str) -> _LoadedAdapter:
        served = self.state.engine.served_adapter(name)  # any served name: the ingress checked the tenant
        if served is None or served.kind != "lora":
            raise APIError(404, f"The model `{name}` does not exist.", "model_not_found")
        await run_in_threadpool(self.state.engine.add_lora, served.request)
        self.loads[name] += 1
        logger.info("replica %s loaded LoRA %r", self.replica, name)
        return _LoadedAdapter(self, name)

    def unload_adapter(self, name: str) -> None:
        """Remove an evicted adapter from the engine (running requests on it finish first)."""
        self.unloads[name] += 1
        try:
            self.state.engine.remove_lora(name)
        except (UnknownAdapterError, RuntimeError) as exc:  # already gone from the cache, or engine closed
            logger.debug("replica %s: removing %r: %s", self.replica, name, exc)
        logger.info("replica %s evicted LoRA %r", self.replica, name)

    def report(self) -> dict:
        """The replica's id, cumulative adapter loads/evictions, the LoRAs its engine holds now and, at most
        once a second, its ``vllm:*`` series (ray.metrics.VllmSeries)."""
        return {"replica": self.replica, "loads": dict(self.loads), "unloads": dict(self.unloads),
                "resident": self.state.engine.list_loras(), **self.vllm.report()}

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
