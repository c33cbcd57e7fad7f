"""One step's message to the workers: pickled once, the same bytes handed to every rank.

It holds the ops queued since the previous message (slot writes and clears, freed rows, new end
ids; lora_runner.executor.slot_proxy), then the step itself: the runner's part of the SchedulerOutput
(its live ``scheduled`` / ``failed`` requests stay in the engine; its adapter slot maps travel) and the
step's structured-output mask.
A message without a step (``sched is None``) only delivers ops.
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass, field

from lora_runner.core.scheduler_output import GrammarOutput, SchedulerOutput
from lora_runner.executor.slot_proxy import SlotOp


@dataclass
class StepMessage:
    """What every rank applies, in order: ``ops``, then (unless None) ``sched`` under ``grammar``'s mask."""

    ops: list[SlotOp] = field(default_factory=list)
    sched: SchedulerOutput | None = None
    grammar: GrammarOutput | None = None


def runner_view(sched: SchedulerOutput) -> SchedulerOutput:
    """The SchedulerOutput without its live Request objects (the workers' rows read plain data only)."""
    return dataclasses.replace(sched, scheduled=[], failed=[])


def encode(ops: list[SlotOp], sched: SchedulerOutput | None, grammar: GrammarOutput | None = None) -> bytes:
    """The message's bytes: one pickle for all ranks."""
    message = StepMessage(ops, None if sched is None else runner_view(sched), grammar)
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(payload: bytes) -> StepMessage:
    """The worker's side of ``encode``."""
    message = pickle.loads(payload)
    assert isinstance(message, StepMessage), f"expected a StepMessage, got {type(message).__name__}"
    return message
