"""Per-request sampling settings, validated when built."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick each generated token of one request.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it before sampling.
    top_k: keep the k most likely tokens (-1 or None: off). top_p: nucleus mass in (0, 1].
    seed: per-request seed; the same seed and prompt give the same tokens whatever else is batched.
    max_tokens: most tokens to generate. stop_token_ids: extra ids that end generation (kept in the
    output). ignore_eos: keep going past the model's EOS ids. logprobs: k >= 0 to return, per
    generated token, a dict token_id -> logprob of the k most likely tokens plus the chosen one
    (raw model log-probabilities: log_softmax of the float32 logits, before temperature/top-k/top-p).

    Raises ValueError for out-of-range values.
    """

    temperature: float = 1.0
    top_k: int | None = -1
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k is None:
            self.top_k = -1
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 or None (off) or an integer >= 1, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an integer >= 0, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        """True when tokens are picked by argmax."""
        return self.temperature == 0.0
