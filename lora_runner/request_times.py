"""RequestTimes: when one request arrived, was first scheduled, got its first and last token, finished.

vLLM's ``RequestOutput.metrics`` (RequestMetrics) for this engine: monotonic timestamps
(``time.monotonic()``, seconds) taken by the engine's step loop, from which the server's latency
histograms are derived (queue, prefill and decode time). A preempted request keeps its first
scheduling time: its recomputation counts as prefill, not as queueing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class RequestTimes:
    """Timestamps of one request (None until the event happened). Written only by the step thread;
    outputs carry a copy."""

    arrival: float = field(default_factory=time.monotonic)  # add_request
    first_scheduled: float | None = None  # first step that computed any of its tokens
    first_token: float | None = None  # the step that sampled its first token ended
    last_token: float | None = None  # the step that sampled its latest token ended
    finished: float | None = None  # it finished (any finish reason)

    def scheduled(self, now: float) -> None:
        """The request is in this step's batch (only its first time counts)."""
        if self.first_scheduled is None:
            self.first_scheduled = now

    def tokens(self, num_output_tokens: int, now: float) -> None:
        """It holds `num_output_tokens` generated tokens after the step that ended at `now`."""
        if num_output_tokens and self.first_token is None:
            self.first_token = now
        if num_output_tokens:
            self.last_token = now

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival to the first step that scheduled it (adapter loading included)."""
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def prefill_time(self) -> float | None:
        """Seconds from its first scheduling to its first token."""
        if self.first_scheduled is None or self.first_token is None:
            return None
        return self.first_token - self.first_scheduled

    @property
    def decode_time(self) -> float | None:
        """Seconds from its first token to its last one."""
        if self.first_token is None or self.last_token is None:
            return None
        return self.last_token - self.first_token
