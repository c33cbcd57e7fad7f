"""UniProcExecutor: the ModelRunner in the engine's own process (tensor_parallel_size=1)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from lora_runner.core.scheduler_output import GrammarOutput, SchedulerOutput
from lora_runner.executor.base import Executor
from lora_runner.sample.sampler import SamplerOutput
from lora_runner.worker.model_runner import ModelRunner


class UniProcExecutor(Executor):
    """Calls ``runner`` directly: the path of a one-device engine, CUDA graphs and the memory profile included
    (lora_runner.executor.startup builds and captures the runner; this only forwards). ``make_runner``
    (num_kv_blocks) -> another runner of the same sizes over the same model and slots (the start-up memory
    profile's throwaway one; tests), when start-up passed it."""

    def __init__(self, runner: ModelRunner, make_runner: Callable[[int], ModelRunner] | None = None) -> None:
        self.runner = runner
        self.make_runner = make_runner

    def execute(self, sched: SchedulerOutput, grammar: GrammarOutput | None = None) -> SamplerOutput:
        """ModelRunner.execute."""
        return self.runner.execute(sched, grammar)

    def forget(self, request_ids: Iterable[str]) -> None:
        """ModelRunner.forget."""
        self.runner.forget(request_ids)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The runner's end ids."""
        return self.runner.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:
        self.runner.eos_token_ids = ids

    def make_generator(self, seed: int) -> torch.Generator:
        """A generator on the runner's device."""
        return self.runner.make_generator(seed)
