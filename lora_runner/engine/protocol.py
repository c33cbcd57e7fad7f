"""EngineClient: everything the HTTP server needs from an engine, as one protocol (vLLM's
``vllm/engine/protocol.py``).

``AsyncLLMEngine`` implements it; the entrypoints (``lora_runner.entrypoints``) type their engine
with it and use nothing else, so the server never reaches into the engine's tokenizer, limits,
scheduler or block manager. Requests stream through ``generate``; adapter management (the served
adapters included: the engine's version table is the server's registry) and the tokenizer are plain
calls (the loading ones block while an adapter loads: call them from a thread pool on an event loop);
``get_stats`` is the snapshot the engine publishes after each step.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from adapters import LoRARequest, PromptAdapterRequest
from adapters.versions import ServedAdapter
from lora_runner.engine.stats import EngineStats
from lora_runner.outputs import RequestOutput
from lora_runner.sampling_params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    """The server's view of an engine (see the module docstring)."""

    # ---- the model and the limits requests are checked against
    @property
    def model_name(self) -> str:
        """The base model as configured (a local directory or a Hub repo id)."""

    @property
    def max_model_len(self) -> int:
        """Prompt plus generated tokens one request may hold."""

    @property
    def max_logprobs(self) -> int:
        """The most logprobs one request may ask for (EngineConfig.max_logprobs; -1: no cap)."""

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary: token ids lie in [0, vocab_size); logprobs=-1 asks for this many."""

    # ---- requests
    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                 lora_request: LoRARequest | None = None,
                 prompt_adapter_request: PromptAdapterRequest | None = None,
                 tenant: str | None = None, cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs, the last one finished; closing it early aborts it.
        cache_salt: requests with different salts never share prefix-cache blocks.

        Outputs the caller has not read yet are merged into one (each holds everything so far, or
        with ``params.output_kind`` DELTA only what is new); a caller that falls too far behind has
        its request aborted."""

    def abort(self, request_id: str) -> None:
        """Abort one request (unknown ids are ignored)."""

    def abort_all(self) -> None:
        """Abort every request with a live generate() iterator."""

    def num_in_flight(self) -> int:
        """Requests with a live generate() iterator."""

    async def drain(self, timeout: float) -> bool:
        """Wait up to `timeout` s for in-flight requests; True when none is left."""

    # ---- tokenizer
    def get_tokenizer(self) -> Any:
        """The model's transformers tokenizer, or None when the model directory has none."""

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (ValueError when the model has no tokenizer)."""

    def decode(self, token_ids: list[int]) -> str:
        """Text of `token_ids` without special tokens ("" when the model has no tokenizer)."""

    # ---- adapters (AdapterAPI, lora_runner.engine.adapter_api, implements these)
    def add_lora(self, lora_request: LoRARequest) -> Any:
        """Load and validate a LoRA now (adapters.AdapterError when it cannot serve)."""

    def remove_lora(self, name: str) -> None:
        """Free a LoRA's versions (adapters.UnknownAdapterError when the engine does not hold it); a
        served name stays served and the next request reloads it."""

    def list_loras(self) -> list[str]:
        """Names of the LoRAs the engine holds in its CPU cache, least recently used first."""

    def add_prompt_adapter(self, prompt_adapter_request: PromptAdapterRequest) -> Any:
        """Load and validate a soft prompt now (adapters.AdapterError, ValueError when disabled)."""

    # ---- served adapters: the one registry of the names clients may select (the server keeps no copy)
    def serve_adapter(self, request: LoRARequest | PromptAdapterRequest, owner: str | None = None,
                      replace: bool = False, load: bool = True,
                      claim: Callable[[], bool] | None = None) -> ServedAdapter | None:
        """Serve an adapter under its name, loaded and validated first unless ``load`` is False; visible
        only once loaded, and only if ``claim()`` (asked last) says yes, else None and nothing changed.
        ``replace`` serves it in place of the same name's adapter (which serves until this one loaded),
        always as a new version read from what its source holds now.
        Raises its AdapterError, or ValueError when the name is taken."""

    def update_lora(self, name: str, state_dict: Mapping[str, Any], config: Any, owner: str | None = None,
                    claim: Callable[[], bool] | None = None, tenant_share: float | None = None) -> ServedAdapter | None:
        """Serve a new version of the LoRA ``name`` from a PEFT state dict and its LoraConfig (or
        adapter_config dict), validated as a file load is; its ``version`` serves from the next step on.
        ``tenant_share``: the fraction of max_memory_adapter_bytes the adapter's owner may hold in snapshots."""

    def max_adapter_bytes(self) -> int:
        """The largest adapter (file, upload or in-memory tensors) accepted, in bytes."""

    def unserve_adapter(self, name: str) -> ServedAdapter:
        """Stop serving ``name`` (adapters.UnknownAdapterError when it is not served)."""

    def served_adapter(self, name: str) -> ServedAdapter | None:
        """The adapter served under ``name``: its request, kind, owner, created time and current version."""

    def served_adapters(self) -> list[ServedAdapter]:
        """Every served adapter: LoRAs, then prompt adapters, each in the order first served."""

    def num_virtual_tokens(self, name: str) -> int | None:
        """The virtual tokens of the prompt adapter served as ``name`` (None: none, or not loaded now)."""

    # ---- health, stats, shutdown
    @property
    def is_running(self) -> bool:
        """True while the engine serves requests."""

    def get_stats(self) -> EngineStats:
        """The engine after its latest step (safe to call from any thread)."""

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is in flight, stop stepping and close the engine (idempotent)."""
