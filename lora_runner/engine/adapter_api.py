"""The adapter API (vLLM's ``add_lora`` / ``remove_lora`` / ``pin_lora`` / ``list_loras`` and the
prompt-adapter twins, plus the served-adapter registry), written once.

``LLMEngine``, ``LLM`` and ``AsyncLLMEngine`` inherit :class:`AdapterAPI` and say only where their
engine's one adapter seam is (``_adapter_seam``: ``EngineAdapters``, lora_runner.engine.adapters),
so no layer forwards these calls by hand to the next.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from adapters import AdapterRef, LoRARequest, PromptAdapterRequest
from adapters.versions import ServedAdapter

if TYPE_CHECKING:
    from lora_runner.engine.adapters import EngineAdapters


class AdapterAPI:
    """Adapter operations of an engine; each is one call on its EngineAdapters (which documents it).

    Every call but ``list_*`` and ``served_*`` raises EngineClosedError after the engine was closed.
    """

    def _adapter_seam(self, check_open: bool = True) -> EngineAdapters:
        """The engine's EngineAdapters; with ``check_open``, EngineClosedError once it was closed."""
        raise NotImplementedError

    def add_lora(self, lora_request: LoRARequest, load_inplace: bool = False) -> AdapterRef:
        """Load and validate a LoRA now (hot-load or replace); raises its adapters.AdapterError.
        ``load_inplace``: always a new version, read from what the folder holds now (retrained files
        under the same path), serving the name from the next step on."""
        return self._adapter_seam().add("lora", lora_request, load_inplace=load_inplace)

    def update_lora(self, name: str, state_dict: Mapping[str, Any], config: Any, owner: str | None = None,
                    claim: Callable[[], bool] | None = None, tenant_share: float | None = None) -> ServedAdapter | None:
        """Serve a new version of the LoRA ``name`` from tensors in memory: a PEFT state dict (key names
        as in adapter_model.safetensors) and its LoraConfig or adapter_config dict, validated as a file
        load is (adapters.memory_source). Returns the served adapter: ``version`` is the new version,
        ``request`` what later requests for it pass as ``lora_request`` (None when ``claim``, asked as in
        serve_adapter, said no). ``tenant_share``: the fraction of max_memory_adapter_bytes the adapter's
        owner's snapshots may hold together (None: the whole bound, as for the operator). Raises its
        AdapterError; the version serving before keeps serving then."""
        return self._adapter_seam().update(name, state_dict, config, owner=owner, claim=claim,
                                           tenant_share=tenant_share)

    def max_adapter_bytes(self) -> int:
        """The largest adapter (file, upload or in-memory tensors) accepted, in bytes."""
        return self._adapter_seam(check_open=False).manager.max_adapter_bytes

    def remove_lora(self, name: str) -> None:
        """Forget a LoRA and its pin; deferred while running requests use it (a served name stays served)."""
        self._adapter_seam().remove("lora", name)

    def pin_lora(self, name: str) -> None:
        """Keep a LoRA cached and, once resident, in its device slot (at most max_loras - 1 pins)."""
        self._adapter_seam().pin("lora", name)

    def unpin_lora(self, name: str) -> None:
        """Make a pinned LoRA evictable again."""
        self._adapter_seam().unpin("lora", name)

    def list_loras(self) -> list[str]:
        """Names of the LoRAs in the CPU cache, least recently used first."""
        return self._adapter_seam(check_open=False).list("lora")

    def add_prompt_adapter(self, prompt_adapter_request: PromptAdapterRequest) -> AdapterRef:
        """Load and validate a prompt adapter now, like add_lora (ValueError when they are disabled)."""
        return self._adapter_seam().add("prompt", prompt_adapter_request)

    def remove_prompt_adapter(self, name: str) -> None:
        """Forget a prompt adapter and its pin; deferred while running requests use it."""
        self._adapter_seam().remove("prompt", name)

    def pin_prompt_adapter(self, name: str) -> None:
        """Keep a prompt adapter cached and resident (at most max_prompt_adapters - 1 pins)."""
        self._adapter_seam().pin("prompt", name)

    def unpin_prompt_adapter(self, name: str) -> None:
        """Make a pinned prompt adapter evictable again."""
        self._adapter_seam().unpin("prompt", name)

    def list_prompt_adapters(self) -> list[str]:
        """Names of the prompt adapters in the CPU cache, least recently used first."""
        return self._adapter_seam(check_open=False).list("prompt")

    # ---- served adapters: the one registry of names clients may select (adapters.versions)
    def serve_adapter(self, request: LoRARequest | PromptAdapterRequest, owner: str | None = None,
                      replace: bool = False, load: bool = True,
                      claim: Callable[[], bool] | None = None) -> ServedAdapter | None:
        """Serve an adapter under its name, loaded and validated first (EngineAdapters.serve)."""
        return self._adapter_seam().serve(request, owner=owner, replace=replace, load=load, claim=claim)

    def unserve_adapter(self, name: str) -> ServedAdapter:
        """Stop serving ``name`` (UnknownAdapterError when not served); running requests finish on it."""
        return self._adapter_seam().withdraw(name)

    def served_adapter(self, name: str) -> ServedAdapter | None:
        """The adapter served under ``name`` (with the version serving it now), or None."""
        return self._adapter_seam(check_open=False).served(name)

    def num_virtual_tokens(self, name: str) -> int | None:
        """The virtual tokens of the prompt adapter served as ``name`` (None: none, or not loaded now)."""
        return self._adapter_seam(check_open=False).num_virtual_tokens(name)

    def served_adapters(self) -> list[ServedAdapter]:
        """Every served adapter: LoRAs, then prompt adapters, each in the order first served."""
        return self._adapter_seam(check_open=False).served_all()
