"""The Ray Serve application of ``serve --num-replicas N``: engine replicas behind one ingress.

:func:`build_application` binds the deployments (lora_runner.entrypoints.ray.replica, .ingress) to
the frozen configs ``cli`` built once; :func:`serve_on_ray` starts (or joins) Ray and runs it on
host:port until SIGINT/SIGTERM. Details: docs/scaling-out.md.
"""

from __future__ import annotations

import logging
import signal
import threading

import ray
from ray import serve

from lora_runner.config import EngineConfig
from lora_runner.entrypoints.launch import StartupAdapters
from lora_runner.entrypoints.openai.state import ServerConfig
from lora_runner.entrypoints.openai.shutdown import ABORT_GRACE_S
from lora_runner.entrypoints.ray.config import RayConfig, check_ray_serving
from lora_runner.entrypoints.ray.drain import create_drain_signal, drain_replicas
from lora_runner.entrypoints.ray.ingress import ingress_deployment
from lora_runner.entrypoints.ray.placement import replica_engine_config, replica_options
from lora_runner.entrypoints.ray.replica import engine_deployment

logger = logging.getLogger(__name__)


def build_application(engine_config: EngineConfig, server_config: ServerConfig, adapters: StartupAdapters,
                      ray_config: RayConfig):
    """The Serve application (engine replicas + ingress) of the given configs; at tensor_parallel_size > 1
    each replica's ranks are Ray actors in the replica's placement group (ray.placement; ValueError for "mp")."""
    engine_config = replica_engine_config(engine_config)
    max_adapters = ray_config.max_adapters_per_replica or engine_config.max_cpu_loras or engine_config.max_loras
    options = replica_options(engine_config, ray_config)
    engine = engine_deployment(max_adapters, engine_config.max_num_seqs).options(**options).bind(
        engine_config, server_config, adapters)
    return ingress_deployment().bind(engine, server_config, adapters)


def serve_on_ray(engine_config: EngineConfig, server_config: ServerConfig, adapters: StartupAdapters,
                 ray_config: RayConfig) -> None:
    """Start (or join) Ray, run the application on host:port until SIGINT/SIGTERM, then drain every
    replica (in-flight streams finish or end with an abort event and [DONE], see ray.drain) and tear
    it down.

    ValueError for settings Ray Serve mode cannot honour (check_ray_serving)."""
    check_ray_serving(server_config)
    ray.init(address=ray_config.address, include_dashboard=False)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        drain = create_drain_signal()  # before the replicas, which look it up when they start
        serve.start(http_options={"host": ray_config.host, "port": ray_config.port})
        serve.run(build_application(engine_config, server_config, adapters, ray_config), name="lora-runner",
                  route_prefix="/")
        logger.info("serving on http://%s:%d with %d engine replicas", ray_config.host, ray_config.port,
                    ray_config.num_replicas)
        stop.wait()
        logger.info("draining %d replicas (up to %.0f s)", ray_config.num_replicas, server_config.shutdown_timeout)
        drain_replicas(drain, ray_config.num_replicas, server_config.shutdown_timeout + ABORT_GRACE_S + 5.0)
    finally:
        serve.shutdown()
        ray.shutdown()
