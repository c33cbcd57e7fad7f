"""Executor: the engine's one seam to whatever runs the model (a runner here, or worker processes)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch

from lora_runner.core.scheduler_output import GrammarOutput, SchedulerOutput
from lora_runner.sample.sampler import SamplerOutput


class Executor(ABC):
    """Runs the engine's steps: ``execute`` one SchedulerOutput, ``forget`` rows of requests that left,
    ``eos_token_ids`` (the ids rows ban until min_tokens), ``make_generator``, ``is_alive``, ``close``.

    ``execute`` raises EngineDeadError when the executor can serve no more steps (a worker died or
    hung); the engine then fails every request. Anything else it raises is the step's own failure.
    """

    @abstractmethod
    def execute(self, sched: SchedulerOutput, grammar: GrammarOutput | None = None) -> SamplerOutput:
        """Forward the step and sample (under ``grammar``'s mask, if any); the rows are updated from
        ``sched`` (see ModelRunner.execute)."""

    @abstractmethod
    def forget(self, request_ids: Iterable[str]) -> None:
        """Free the rows of requests that left the running set."""

    @property
    @abstractmethod
    def eos_token_ids(self) -> frozenset[int]:
        """The model's end ids, banned with each request's stop ids until its min_tokens."""

    @eos_token_ids.setter
    @abstractmethod
    def eos_token_ids(self, ids) -> None:
        """New end ids; running requests ban them from their next step on."""

    @abstractmethod
    def make_generator(self, seed: int) -> torch.Generator:
        """A per-request generator the step's sampler can use (it travels in SchedulerOutput.new_requests)."""

    def is_alive(self) -> bool:
        """False once the executor can serve no more steps (cheap: the server's /health asks it)."""
        return True

    def close(self) -> None:
        """Release what the executor holds (worker processes); idempotent."""
