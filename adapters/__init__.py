"""Adapters: what an adapter is and where it lives (PEFT formats, Hub resolution, LRU manager)."""

from adapters.errors import (
    AdapterCapacityError,
    AdapterError,
    AdapterNotFoundError,
    AdapterTooLargeError,
    InvalidAdapterError,
    UnknownAdapterError,
    UnsafeAdapterError,
    UnsupportedAdapterError,
)
from adapters.request import LoRARequest, PromptAdapterRequest
from adapters.spec import ModelSpec

__all__ = [
    "AdapterCapacityError", "AdapterError", "AdapterNotFoundError", "AdapterTooLargeError",
    "InvalidAdapterError", "UnknownAdapterError", "UnsafeAdapterError", "UnsupportedAdapterError",
    "LoRARequest", "PromptAdapterRequest", "ModelSpec",
]
