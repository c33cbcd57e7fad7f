"""RankedExecutor: what the executors with one worker per tensor-parallel rank share ("mp" and "ray").

The engine-side slot ops queue (lora_runner.executor.slot_proxy), the adapter weights in shared memory
(lora_runner.executor.shared_weights), one encoded message per step (lora_runner.executor.step_message),
rank 0's SamplerOutput with the other ranks' tokens checked, and the dead state: once a rank died, every
call raises the same EngineDeadError. Subclasses say how the bytes reach the ranks (``_deliver``) and how
the ranks are stopped (``close``).
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections import Counter
from collections.abc import Iterable

import torch

from lora_runner.core.scheduler_output import GrammarOutput, SchedulerOutput
from lora_runner.executor.base import Executor
from lora_runner.executor.errors import EngineDeadError
from lora_runner.executor.shared_weights import SharedWeights
from lora_runner.executor.slot_proxy import SlotOp, SlotOps, SlotProxy
from lora_runner.executor.step_message import encode
from lora_runner.executor.worker_spec import WorkerSpec
from lora_runner.sample.sampler import SamplerOutput

logger = logging.getLogger(__name__)


class RankedExecutor(Executor):
    """``world_size`` ranks built from ``spec``; ``counts`` (Counter: "messages" sent steps, "pickles" payloads
    encoded, "sends" deliveries to a rank), ``rank_messages`` (messages each rank reports it applied),
    ``shared`` (SharedWeights) and ``slot_nbytes`` (device bytes per slot kind, set by the subclass)."""

    def __init__(self, spec: WorkerSpec, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"{type(self).__name__} needs world_size >= 1, got {world_size}")
        self.spec, self.world_size = spec, world_size
        self.ops, self.shared = SlotOps(), SharedWeights()
        self.counts: Counter = Counter()
        self.rank_messages = [0] * world_size
        self.slot_nbytes = {"lora": 0, "prompt": 0}
        self._eos = frozenset(spec.eos_token_ids)
        self._dead: EngineDeadError | None = None

    @abstractmethod
    def _deliver(self, payload: bytes) -> list:
        """Hand ``payload`` to every rank and return their replies in rank order (``_die`` on a dead rank)."""

    # ------------------------------------------------------------------------- Executor
    def execute(self, sched: SchedulerOutput, grammar: GrammarOutput | None = None) -> SamplerOutput:
        """Send the step to every rank (one encoding, the same bytes) and return rank 0's SamplerOutput."""
        self.counts["messages"] += 1
        return self._send(sched, grammar)

    def flush(self) -> None:
        """Deliver the queued ops now, without a step (tests; a step delivers them otherwise)."""
        self._send(None, None)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Queue: every rank frees these rows before the next step."""
        ids = tuple(request_ids)
        if ids:
            self.ops.put(SlotOp("forget", request_ids=ids))

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The end ids the ranks' rows ban until min_tokens."""
        return self._eos

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:
        self._eos = frozenset(ids)
        self.ops.put(SlotOp("eos", eos_token_ids=self._eos))

    def make_generator(self, seed: int) -> torch.Generator:
        """A CPU generator seeded ``seed``; each rank rebuilds it on its device from the seed."""
        return torch.Generator().manual_seed(seed)

    def slot_proxy(self, kind: str) -> SlotProxy:
        """The engine-side slots of ``kind`` ("lora": LoRA and vocabulary slots as one, "prompt")."""
        num_slots = self.spec.max_loras if kind == "lora" else self.spec.max_prompt_adapters
        return SlotProxy(kind, num_slots, self.ops, self.shared, nbytes=self.slot_nbytes[kind])

    # ------------------------------------------------------------------------- one message
    def _send(self, sched: SchedulerOutput | None, grammar: GrammarOutput | None) -> SamplerOutput | None:
        if self._dead is not None:
            raise self._dead
        ops, keep = self.ops.take()
        payload = encode(ops, sched, grammar)
        self.counts["pickles"] += 1
        replies = self._deliver(payload)
        del keep  # every rank has written the files these ops name into its slots
        if sched is not None:
            self._check_agree(replies)
        return replies[0]

    def _check_agree(self, results: list[SamplerOutput]) -> None:
        """Every rank must have sampled the same tokens: each commits its own into its rows, and ranks whose
        rows differ can never be brought back in step."""
        for rank, result in enumerate(results[1:], start=1):
            if result.sampled_token_ids != results[0].sampled_token_ids:
                self._die(f"tensor-parallel rank {rank} sampled {result.sampled_token_ids}, "
                          f"rank 0 {results[0].sampled_token_ids}: "
                          "the ranks are out of step")

    def _die(self, reason: str):
        """Stop every rank and raise EngineDeadError(reason), now and on every later call."""
        logger.error("tensor-parallel executor dead: %s", reason)
        self._dead = EngineDeadError(reason)
        self.close()
        raise self._dead
