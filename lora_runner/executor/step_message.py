"""One step's message to the workers: pickled once, the same bytes handed to every rank.

It holds the ops queued since the previous message (slot writes and clears, freed rows, new end
ids; lora_runner.executor.slot_proxy), then the step itself: the runner's part of the SchedulerOutput
(its live ``scheduled`` / ``failed`` requests stay in the engine) and the step's adapter slot maps.
A message without a step (``sched is None``) only delivers ops.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

from lora_runner.core.scheduler_output import SchedulerOutput
from lora_runner.executor.slot_proxy import SlotOp


@dataclass
class StepMessage:
    """What every rank applies, in order: ``ops``, then (unless None) ``sched`` with the slot maps."""

    ops: list[SlotOp] = field(default_factory=list)
    sched: SchedulerOutput | None = None
    lora_slot_of: dict[Hashable, int] = field(default_factory=dict)
    prompt_slot_of: dict[Hashable, int] = field(default_factory=dict)


def runner_view(sched: SchedulerOutput) -> SchedulerOutput:
    """The SchedulerOutput without its live Request objects (the workers' rows read plain data only)."""
    return dataclasses.replace(sched, scheduled=[], failed=[])


def encode(ops: list[SlotOp], sched: SchedulerOutput | None, lora_slot_of: Mapping[Hashable, int],
           prompt_slot_of: Mapping[Hashable, int]) -> bytes:
    """The message's bytes: one pickle for all ranks."""
    message = StepMessage(ops, None if sched is None else runner_view(sched), dict(lora_slot_of),
                          dict(prompt_slot_of))
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(payload: bytes) -> StepMessage:
    """The worker's side of ``encode``."""
    message = pickle.loads(payload)
    assert isinstance(message, StepMessage), f"expected a StepMessage, got {type(message).__name__}"
    return message
