"""Adapters: what an adapter is and where it lives (PEFT formats, Hub resolution, LRU manager)."""

from adapters.errors import (
    AdapterCapacityError,
    AdapterError,
    AdapterNotFoundError,
    AdapterTooLargeError,
    CPUCacheBoundError,
    InvalidAdapterError,
    UnknownAdapterError,
    UnsafeAdapterError,
    UnsupportedAdapterError,
)
from adapters.hub import resolve
from adapters.lora import LoRAPair, LoRAWeights, load_lora, parse_lora
from adapters.manager import AdapterManager, AdapterStats
from adapters.prompt import PromptWeights, load_prompt_adapter, parse_prompt_adapter
from adapters.request import LoRARequest, PromptAdapterRequest
from adapters.slots import LoRASlots, PromptSlots
from adapters.spec import ModelSpec
from adapters.tier import AdapterRef, AdapterTier
from adapters.versions import ServedAdapter

__all__ = [
    "AdapterCapacityError", "AdapterError", "AdapterNotFoundError", "AdapterTooLargeError", "CPUCacheBoundError",
    "InvalidAdapterError", "UnknownAdapterError", "UnsafeAdapterError", "UnsupportedAdapterError",
    "LoRARequest", "PromptAdapterRequest", "ModelSpec",
    "AdapterManager", "AdapterRef", "AdapterStats", "AdapterTier", "LoRAPair", "LoRASlots", "LoRAWeights", "PromptSlots",
    "PromptWeights", "ServedAdapter", "load_lora", "load_prompt_adapter", "parse_lora", "parse_prompt_adapter", "resolve",
]
