"""lora_runner: serve many LoRA fine-tunes of one Llama-family base model in one batch.

The names below load on first use (PEP 562), so that ``lora-runner serve --help`` and a command line's
errors answer without importing torch and the engine."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LoRARequest": "adapters", "PromptAdapterRequest": "adapters", "EngineConfig": "lora_runner.config",
    "AsyncLLMEngine": "lora_runner.engine.async_llm_engine", "EngineClosedError": "lora_runner.engine.errors",
    "LLMEngine": "lora_runner.engine.llm_engine", "LLM": "lora_runner.entrypoints.llm",
    "CompletionOutput": "lora_runner.outputs", "RequestOutput": "lora_runner.outputs",
    "GuidedDecodingParams": "lora_runner.sampling_params", "SamplingParams": "lora_runner.sampling_params",
    "StructuredOutputsParams": "lora_runner.structured_outputs_params",
}

__all__ = ["LLM", "LLMEngine", "AsyncLLMEngine", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput", "EngineConfig", "EngineClosedError", "LoRARequest", "PromptAdapterRequest",
           "GuidedDecodingParams"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lora_runner' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
