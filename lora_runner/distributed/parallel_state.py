"""TensorParallel: one process's place in a tensor-parallel group and the collectives over it.

The sharded model (lora_runner.model) reads ``rank`` / ``world_size`` to pick its shard and calls
``all_reduce`` / ``all_gather`` where Megatron-style sharding needs them; with ``world_size == 1``
(``SINGLE``, the default everywhere) both are no-ops and the model is the unsharded one. Every
collective is counted in ``counts`` (tests check the communication per step; counting costs a dict
increment).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


@dataclass
class CommCounts:
    """How many collectives of each kind this process issued (all_reduce, all_gather)."""

    calls: Counter = field(default_factory=Counter)

    def reset(self) -> None:
        """Start counting from zero."""
        self.calls.clear()


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``world_size`` in ``group`` (a torch.distributed ProcessGroup; None: the default
    group, or no group at all when world_size is 1)."""

    rank: int = 0
    world_size: int = 1
    group: object | None = None
    counts: CommCounts = field(default_factory=CommCounts, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"tensor parallel world_size must be a positive integer, got {self.world_size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"tensor parallel rank must lie in [0, {self.world_size}), got {self.rank!r}")

    @property
    def is_parallel(self) -> bool:
        """True when the model is split over more than one rank."""
        return self.world_size > 1

    def shard_range(self, size: int, what: str = "size") -> tuple[int, int]:
        """[start, end) of this rank's even share of `size` items; ValueError when size is not divisible."""
        if size % self.world_size:
            raise ValueError(f"{what} ({size}) is not divisible by tensor_parallel_size ({self.world_size})")
        share = size // self.world_size
        return self.rank * share, (self.rank + 1) * share

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Sum (op "sum") or maximum (op "max": online FP8 scales at load) of `tensor` over the ranks,
        in place; returns it (no-op for one rank)."""
        if op not in _REDUCE_OPS:
            raise ValueError(f"all_reduce op must be one of {', '.join(_REDUCE_OPS)}, got {op!r}")
        if self.world_size == 1:
            return tensor
        self.counts.calls["all_reduce"] += 1
        dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' tensors concatenated along `dim` in rank order (the tensor itself for one rank)."""
        if self.world_size == 1:
            return tensor
        self.counts.calls["all_gather"] += 1
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


SINGLE = TensorParallel()  # the one-process default: no sharding, no collectives
