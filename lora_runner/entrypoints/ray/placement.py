"""Placement of a tensor-parallel engine replica on Ray Serve (``serve --num-replicas N -tp T``).

A replica whose engine runs more than one rank uses the "ray" executor backend, and Serve reserves the
replica's placement group with its deployment: T bundles, one per rank (lora_runner.executor.ray_executor.
rank_bundles), the first also holding the replica's own ``--replica-cpus`` / ``--replica-gpus``, packed on
one node (the ranks share adapter weights through /dev/shm). ``--num-replicas 2 -tp 2`` thus asks for 4
bundles in 2 groups; a replica starts only when its whole group fits. The "mp" backend is refused there:
its worker processes would run outside Ray's resource accounting.
"""

from __future__ import annotations

import dataclasses

from lora_runner.config import EngineConfig
from lora_runner.executor.ray_executor import rank_bundles
from lora_runner.entrypoints.ray.config import RayConfig


def replica_engine_config(engine_config: EngineConfig) -> EngineConfig:
    """The engine config a replica runs: at tensor_parallel_size > 1 the "ray" backend (the default there);
    ValueError for "mp"."""
    if engine_config.tensor_parallel_size == 1:
        return engine_config
    if engine_config.distributed_executor_backend == "mp":
        raise ValueError('--num-replicas > 1 with --tensor-parallel-size > 1 runs each replica\'s ranks as Ray '
                         'actors in the replica\'s placement group: use --distributed-executor-backend ray (or '
                         'leave it unset), not "mp"')
    return dataclasses.replace(engine_config, distributed_executor_backend="ray")


def replica_options(engine_config: EngineConfig, ray_config: RayConfig) -> dict:
    """The engine deployment's Serve options: replicas, the replica actor's resources and, at
    tensor_parallel_size > 1, its placement group (one bundle per rank, the replica in the first)."""
    actor = {"num_cpus": ray_config.replica_cpus, "num_gpus": ray_config.replica_gpus}
    options = {"num_replicas": ray_config.num_replicas, "ray_actor_options": actor}
    size = engine_config.tensor_parallel_size
    if size > 1:
        bundles = rank_bundles(size, engine_config.torch_device().type)
        bundles[0]["CPU"] += ray_config.replica_cpus
        if ray_config.replica_gpus:
            bundles[0]["GPU"] = bundles[0].get("GPU", 0.0) + ray_config.replica_gpus
        options.update(placement_group_bundles=bundles, placement_group_strategy="STRICT_PACK")
    return options
