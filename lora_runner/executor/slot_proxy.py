"""Adapter slots of the engine process at tensor_parallel_size > 1: proxies that queue, in order, what the
workers' real slots must do.

The adapter tiers (adapters.tier) keep their LRU and slot choice in the engine process and call
``write`` / ``clear`` on these as they would on device slots; each call becomes an op in the executor's
``SlotOps`` queue, shipped in order at the start of the next step's message, before its rows are
updated. A write carries a SharedHandle (lora_runner.executor.shared_weights), and the op keeps the
weights object alive until the message is sent, so its shared file outlives the CPU cache entry.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from lora_runner.executor.shared_weights import SharedHandle, SharedWeights


@dataclass(frozen=True)
class SlotOp:
    """One queued action on every rank: "write" (kind, slot, handle), "clear" (kind, slot), "forget"
    (request_ids: free their rows) or "eos" (eos_token_ids)."""

    action: str
    kind: str = ""
    slot: int = -1
    handle: SharedHandle | None = None
    request_ids: tuple[str, ...] = ()
    eos_token_ids: frozenset[int] = frozenset()


class SlotOps:
    """The ordered, thread-safe queue of ops for the next step (slot clears may come from any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ops: list[SlotOp] = []
        self._keep: list = []  # weights whose files the queued writes name

    def put(self, op: SlotOp, keep=None) -> None:
        """Queue ``op``; ``keep`` (its weights) stays referenced until the op is taken."""
        with self._lock:
            self._ops.append(op)
            if keep is not None:
                self._keep.append(keep)

    def take(self) -> tuple[list[SlotOp], list]:
        """(the queued ops in order, the objects to keep alive until they are delivered); empties the queue."""
        with self._lock:
            ops, keep, self._ops, self._keep = self._ops, self._keep, [], []
        return ops, keep


class SlotProxy:
    """Stands for one kind's slots in the engine process (``num_slots``, ``write``, ``clear``, ``nbytes``)."""

    def __init__(self, kind: str, num_slots: int, ops: SlotOps, shared: SharedWeights, nbytes: int = 0) -> None:
        self.kind, self.num_slots, self.nbytes = kind, num_slots, nbytes
        self._ops, self._shared = ops, shared

    def write(self, slot: int, adapter) -> None:
        """Queue: every rank writes its shard of ``adapter`` into ``slot`` (weights shared once per version)."""
        assert 0 <= slot < self.num_slots, f"slot {slot} out of range [0, {self.num_slots})"
        self._ops.put(SlotOp("write", self.kind, slot, self._shared.share(adapter)), keep=adapter)

    def clear(self, slot: int) -> None:
        """Queue: every rank clears ``slot``."""
        assert 0 <= slot < self.num_slots, f"slot {slot} out of range [0, {self.num_slots})"
        self._ops.put(SlotOp("clear", self.kind, slot))
