"""The state of one request as it moves waiting -> running -> finished (and back, if preempted)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from lora_runner.outputs import SpecDecodingStats
from lora_runner.request_times import RequestTimes
from lora_runner.sampling_params import SamplingParams

PLACEHOLDER_TOKEN_ID = 0  # id of a soft-prompt placeholder; the model overwrites its embedding


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
    With a prompt adapter, `token_ids` starts with `num_virtual_tokens` placeholders (inserted once
    the adapter is loaded, before the request is first scheduled) at positions 0..n-1, exactly as
    PEFT prepends its soft prompt; `prompt_token_ids` and the outputs exclude them.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int  # admission order; lower = older = scheduled first, preempted last
    prompt: str | None = None
    lora_request: Any = None  # adapters.LoRARequest or None (base model)
    lora_ref: Any = None  # the manager's AdapterRef held from add_request until the request finishes
    prompt_adapter_request: Any = None  # adapters.PromptAdapterRequest or None
    prompt_adapter_ref: Any = None  # its AdapterRef, held like lora_ref
    # the AdapterRefs it ran with (LoRA, prompt adapter), kept after release: its outputs name them
    adapter_versions: tuple = (None, None)
    tenant: str | None = None  # who fair admission accounts it to; None: its adapter's name (fairness.tenant_of)
    generator: torch.Generator | None = None  # per-request, when params.seed is set
    token_ids: list[int] = field(init=False)
    logprobs: list[dict[int, float]] | None = field(init=False)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    error: BaseException | None = None
    num_preemptions: int = 0
    num_virtual_tokens: int = 0  # soft-prompt placeholders at the front of token_ids
    output_text: Any = None  # lora_runner.engine.detokenizer.OutputText, made by the OutputProcessor on first use
    stop_reason: int | str | None = None  # the stop token id or stop string that finished it
    cache_salt: str | None = None  # separates prefix-cache entries (tenants); part of every block key
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks so far
    cache_identity: bytes | None = None  # digest of (LoRA version, prompt-adapter version, salt), once hashed
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at its first admission
    # SamplingParams.prompt_logprobs: None for the first prompt token, then one dict per scored prompt token
    prompt_logprobs: list[dict[int, float] | None] | None = field(init=False)
    grammar: Any = None  # lora_runner.engine.structured.RequestGrammar of a constrained request, else None
    times: RequestTimes = field(default_factory=RequestTimes)  # arrival, scheduling, token times (metrics)
    spec: SpecDecodingStats = field(default_factory=SpecDecodingStats)  # its speculative decoding (all 0 when off)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.logprobs = [] if self.params.logprobs is not None else None
        self.prompt_logprobs = [None] if self.params.prompt_logprobs is not None else None

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True while some prompt token's logprobs are still to be computed (every prompt position must
        then run through the model: the prefix cache does not serve it)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the user's prompt (virtual tokens not counted)."""
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens so far."""
        return self.token_ids[self.num_virtual_tokens + len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        """How many tokens were generated so far."""
        return len(self.token_ids) - self.num_virtual_tokens - len(self.prompt_token_ids)

    @property
    def awaiting_virtual_tokens(self) -> bool:
        """True while the request has a prompt adapter whose placeholders are not inserted yet."""
        return self.prompt_adapter_ref is not None and self.num_virtual_tokens == 0

    @property
    def needs_prompt_adapter(self) -> bool:
        """True while some virtual token is still to be computed (the soft prompt must be resident)."""
        return self.prompt_adapter_ref is not None and (
            self.num_virtual_tokens == 0 or self.num_computed_tokens < self.num_virtual_tokens)

    def insert_virtual_tokens(self, num_virtual_tokens: int) -> None:
        """Put the prompt adapter's placeholders in front of the prompt (once, before any compute)."""
        assert self.awaiting_virtual_tokens and self.num_computed_tokens == 0 and num_virtual_tokens > 0, \
            f"request {self.request_id!r}: virtual tokens inserted twice, after compute, or without an adapter"
        self.token_ids[:0] = [PLACEHOLDER_TOKEN_ID] * num_virtual_tokens
        self.num_virtual_tokens = num_virtual_tokens

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
