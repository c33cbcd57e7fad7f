"""RayConfig: how ``serve --num-replicas N`` lays the server out on Ray Serve (frozen, picklable)."""

from __future__ import annotations

from dataclasses import dataclass

from lora_runner.entrypoints.openai.state import ServerConfig


@dataclass(frozen=True)
class RayConfig:
    """The Ray Serve layout; validated on construction (ValueError).

    num_replicas: engine replicas (> 1 serves on Ray Serve). address: the Ray cluster to join (None:
    start a local Ray instance). replica_cpus / replica_gpus: resources reserved per engine replica.
    max_adapters_per_replica: LoRAs a replica keeps registered (Serve's multiplex LRU; None: the
    engine's max_cpu_loras or max_loras). host / port: where the Serve HTTP proxy listens.
    """

    num_replicas: int = 1
    address: str | None = None
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    max_adapters_per_replica: int | None = None
    host: str = "127.0.0.1"
    port: int = 8000

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"--num-replicas must be >= 1, got {self.num_replicas}")
        if self.replica_cpus < 0 or self.replica_gpus < 0:
            raise ValueError("--replica-cpus and --replica-gpus must be >= 0")
        if self.max_adapters_per_replica is not None and self.max_adapters_per_replica < 1:
            raise ValueError(f"--max-adapters-per-replica must be >= 1, got {self.max_adapters_per_replica}")

    @property
    def enabled(self) -> bool:
        """True when the server runs on Ray Serve (more than one replica)."""
        return self.num_replicas > 1


def check_ray_serving(server_config: ServerConfig) -> None:
    """ValueError for server settings Ray Serve mode cannot honour."""
    if server_config.allow_runtime_lora_updating:
        raise ValueError("--allow-runtime-lora-updating is not supported with --num-replicas > 1 "
                         "(every replica must know the adapters: name them with --lora-modules)")
