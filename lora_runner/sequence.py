"""The state of one request as it moves waiting -> running -> finished (and back, if preempted)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from lora_runner.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"  # not admitted yet, or preempted (its KV cache was dropped)
    RUNNING = "running"  # holds KV blocks; scheduled every step the budget allows
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation request: its tokens so far, how far its KV cache is computed, and its adapter.

    `token_ids` is the prompt followed by the generated tokens. `num_computed_tokens` counts the
    leading tokens whose K/V are in the cache; a preempted request drops to 0 and recomputes them.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int  # admission order; lower = older = scheduled first, preempted last
    prompt: str | None = None
    lora_request: Any = None  # adapters.LoRARequest or None (base model)
    lora_ref: Any = None  # the manager's AdapterRef held from add_request until the request finishes
    prompt_adapter_request: Any = None  # reserved for prompt adapters
    generator: torch.Generator | None = None  # per-request, when params.seed is set
    token_ids: list[int] = field(init=False)
    logprobs: list[dict[int, float]] | None = field(init=False)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    error: BaseException | None = None
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.logprobs = [] if self.params.logprobs is not None else None

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens so far."""
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        """How many tokens were generated so far."""
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        """True once the request has a finish reason."""
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: str, error: BaseException | None = None) -> None:
        """Mark finished with `reason` ("stop", "length", "abort" or "error")."""
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error

    def preempt(self) -> None:
        """Drop the KV progress: the request goes back to waiting and recomputes all its tokens."""
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions += 1
