"""Running the Ray Serve application from the command line (``serve --num-replicas N``)."""

from __future__ import annotations

import argparse
import logging
import signal
import threading

logger = logging.getLogger(__name__)


def check_ray_options(args: argparse.Namespace) -> None:
    """ValueError for options Ray Serve mode cannot honour."""
    if args.num_replicas < 1:
        raise ValueError(f"--num-replicas must be >= 1, got {args.num_replicas}")
    if args.replica_cpus < 0 or args.replica_gpus < 0:
        raise ValueError("--replica-cpus and --replica-gpus must be >= 0")
    if args.max_adapters_per_replica is not None and args.max_adapters_per_replica < 1:
        raise ValueError(f"--max-adapters-per-replica must be >= 1, got {args.max_adapters_per_replica}")
    if args.allow_runtime_lora_updating:
        raise ValueError("--allow-runtime-lora-updating is not supported with --num-replicas > 1 "
                         "(every replica must know the adapters: name them with --lora-modules)")


def serve_on_ray(args: argparse.Namespace) -> None:
    """Start (or join) Ray, run the application on host:port until SIGINT/SIGTERM, then tear it down."""
    check_ray_options(args)
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise ValueError("--num-replicas > 1 needs Ray Serve: pip install 'lora-runner[ray]'") from exc
    from lora_runner.entrypoints.ray.deployments import build_application

    ray.init(address=args.ray_address, include_dashboard=False)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_application(args), name="lora-runner", route_prefix="/")
        logger.info("serving on http://%s:%d with %d engine replicas", args.host, args.port, args.num_replicas)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
