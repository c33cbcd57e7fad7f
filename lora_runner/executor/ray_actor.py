"""RankActor: one tensor-parallel rank as a Ray actor (the "ray" backend, lora_runner.executor.ray_executor).

The actor's process does what a "mp" worker process does (lora_runner.executor.worker_main): it joins the
torch.distributed group (gloo on CPU, nccl on CUDA) at the address rank 0's actor picked, builds its
RankWorker, and applies one StepMessage per ``step`` call. Errors propagate as Ray task errors, which
the executor treats as a dead rank. A non-detached actor dies with the process that created it, so no
rank outlives its engine.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import ray
import torch
import torch.distributed as dist

from lora_runner.distributed import TensorParallel
from lora_runner.executor.rank_worker import RankWorker
from lora_runner.executor.step_message import decode
from lora_runner.executor.worker_spec import WorkerSpec


class RankActor:
    """Rank ``rank`` of ``world_size``, built from ``spec`` when ``start`` is called (on every rank at once:
    joining the group is collective)."""

    def __init__(self, rank: int, world_size: int, spec: WorkerSpec) -> None:
        self.rank, self.world_size, self.spec = rank, world_size, spec
        self.worker: RankWorker | None = None
        torch.set_num_threads(spec.threads_per_rank)

    def pick_address(self) -> tuple[str, int]:
        """(this node's IP, a TCP port nothing listens on now): where rank 0's store will bind."""
        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            return host, sock.getsockname()[1]

    def start(self, host: str, port: int) -> dict[str, int]:
        """Join the group at host:port and build the rank; its slots' device bytes per kind."""
        backend = "gloo" if self.spec.device_type == "cpu" else "nccl"
        if self.spec.device_type == "cuda":
            torch.cuda.set_device(self.spec.rank_device(self.rank))
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank,
                                world_size=self.world_size, timeout=timedelta(seconds=self.spec.step_timeout_s))
        self.worker = RankWorker(self.spec, TensorParallel(self.rank, self.world_size))
        return self.worker.slot_nbytes

    def step(self, payload: bytes):
        """Apply one message (the same bytes every rank got); (rank's SamplerOutput or None, messages applied)."""
        assert self.worker is not None, "step() before start()"
        return self.worker.apply(decode(payload)), self.worker.messages

    def ping(self) -> int:
        """This rank (tests: an answer means the actor is alive)."""
        return self.rank
