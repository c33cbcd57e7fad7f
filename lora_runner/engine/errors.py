"""The errors the engine raises to its callers (adapter problems are adapters.AdapterError)."""

from __future__ import annotations

from adapters.manager import TierClosedError
from lora_runner.executor.errors import EngineDeadError

__all__ = ["EngineClosedError", "EngineDeadError"]


class EngineClosedError(TierClosedError):
    """The engine was closed: add_request, add_lora, add_prompt_adapter, pin/unpin/remove and
    generate raise this (a RuntimeError) before touching any state."""

