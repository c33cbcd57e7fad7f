"""Tensor parallelism: which rank of how many this process is, and the collectives the sharded model calls."""

from lora_runner.distributed.parallel_state import SINGLE, CommCounts, TensorParallel

__all__ = ["SINGLE", "CommCounts", "TensorParallel"]
