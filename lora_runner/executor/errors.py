"""The error an executor raises when its workers can no longer serve (re-exported by lora_runner.engine.errors)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine can serve no request any more: its step thread stopped (an exception in step(), or
    shutdown()), or a tensor-parallel worker died or did not answer a step in time."""
