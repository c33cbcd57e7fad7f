"""What Scheduler.postprocess reads of a step's result and calls to turn it into output, as Protocols.

The sampler's rows (lora_runner.sample.sampler.SamplerOutput) and the engine's output processor
(lora_runner.engine.output_processor.OutputProcessor) live in higher layers; the scheduler names only
the few members it uses, so core imports neither (tests/test_import_graph.py counts type-only imports).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from lora_runner.core.request import Request


class SampledRows(Protocol):
    """A step's sampled rows, one per scheduled chunk that samples, in order."""

    sampled_token_ids: Sequence[Sequence[int]]  # per row, its sampled tokens in order ([] for a failed row)
    sampled_logprobs: Sequence[Sequence[Any]]  # per row, a logprob dict per token (None where not asked)
    errors: Sequence[BaseException | None]  # what kept the row from being sampled, None when it was
    prompt_logprobs: Mapping[str, Any]  # request id -> its chunk's prompt logprobs this step


class OutputSink(Protocol):
    """Turns a request's sampled tokens into its output (detokenizing, stop rules)."""

    def append(self, request: Request, token_ids: Sequence[int], logprobs: Sequence[Any] | None = None) -> str | None:
        """Append the row's tokens in order; returns the finish reason, or None to go on."""

    def append_prompt_logprobs(self, request: Request, chunk: Any) -> None:
        """Add a step's prompt logprobs to the request's."""

    def finish(self, request: Request, reason: str) -> str:
        """The request ends with ``reason``; returns the final reason."""
