"""The adapters the server offers, by served name: LoRAs and soft prompts in one namespace.

The engine's own lists hold only what is in its CPU cache (an LRU); this registry is what clients
may ask for, and each request carries the adapter's request object so the engine reloads it when
it was evicted.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from adapters import LoRARequest, PromptAdapterRequest
from lora_runner.entrypoints.openai.tenants import Tenant


@dataclass(frozen=True)
class ServedAdapter:
    """One adapter clients may select: kind "lora" or "prompt_adapter"."""

    name: str
    request: LoRARequest | PromptAdapterRequest
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def kind(self) -> str:
        """"lora" or "prompt_adapter"."""
        return "lora" if isinstance(self.request, LoRARequest) else "prompt_adapter"


class AdapterRegistry:
    """Served name -> ServedAdapter; thread-safe. base_name is reserved for the base model."""

    def __init__(self, base_name: str) -> None:
        self.base_name = base_name
        self._adapters: dict[str, ServedAdapter] = {}
        self._lock = threading.Lock()

    def add(self, request: LoRARequest | PromptAdapterRequest) -> ServedAdapter:
        """Register an adapter; ValueError when the name is taken (by the base model or an adapter)."""
        if request.name == self.base_name:
            raise ValueError(f"adapter name {request.name!r} is the base model's served name")
        with self._lock:
            if request.name in self._adapters:
                raise ValueError(f"an adapter named {request.name!r} is already loaded")
            served = self._adapters[request.name] = ServedAdapter(request.name, request)
            return served

    def replace(self, old: ServedAdapter, request: LoRARequest) -> ServedAdapter:
        """Serve `request` under old's name in place of `old` (an in-place reload); ValueError when the
        name no longer holds `old` (it was unloaded or replaced meanwhile)."""
        with self._lock:
            if self._adapters.get(old.name) is not old:
                raise ValueError(f"adapter {old.name!r} changed while its replacement loaded")
            served = self._adapters[old.name] = ServedAdapter(old.name, request)
            return served

    def remove(self, name: str) -> ServedAdapter | None:
        """Unregister `name`; the removed entry, or None when it was not registered."""
        with self._lock:
            return self._adapters.pop(name, None)

    def get(self, name: str, tenant: Tenant) -> ServedAdapter | None:
        """The adapter `name` when it exists and `tenant` may use it, else None (the two look alike)."""
        with self._lock:
            served = self._adapters.get(name)
        return served if served is not None and tenant.may_use(name) else None

    def visible(self, tenant: Tenant) -> list[ServedAdapter]:
        """The adapters `tenant` may see, in registration order."""
        with self._lock:
            adapters = list(self._adapters.values())
        return [a for a in adapters if tenant.may_use(a.name)]
