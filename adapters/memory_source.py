"""LoRAs handed over in memory: a PEFT state dict and its config, validated exactly as a file load is.

A reinforcement-learning trainer updates its policy adapter every step; writing it to a folder and
re-reading it (vLLM's ``load_inplace``) costs a full serialization per step. Here the trainer hands
the engine the tensors (PEFT key names, as in ``adapter_model.safetensors``, e.g. from PEFT's
``get_peft_model_state_dict``) and the ``LoraConfig`` (or the ``adapter_config.json`` dict):

- :func:`memory_lora_request` checks what a file load checks before reading (the config's size, the
  tensors' bytes against ``max_adapter_bytes``), then takes a snapshot: the trainer goes on changing
  its parameters in place, and a version must never change under a running request;
- :class:`MemoryLoRARequest` is a ``LoRARequest`` whose source is that snapshot: its ``path`` is a
  ``memory:`` id never used before, so each update is a new source, hence a new adapter version (and
  new prefix-cache keys); its tensors take no part in equality or hashing;
- :func:`load_memory_lora` validates the snapshot with the very function the file loader ends in
  (:func:`adapters.lora.parse_lora`: config, targets, ranks against ``max_lora_rank``, shapes, dtypes,
  finite values, DoRA), so an update is refused for exactly what the same files would be refused for.

The snapshot lives as long as the request does (the served record keeps it): a version whose
weights the CPU cache evicted reloads from it, as a file adapter reloads from its folder, and keeps
its version (the weights are the same), so the version ``update_lora`` returned is the one outputs
name.
"""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

import torch

from adapters.dora import BaseWeight
from adapters.errors import AdapterTooLargeError, InvalidAdapterError
from adapters.lora import LoRAWeights, parse_lora
from adapters.request import LoRARequest
from adapters.spec import ModelSpec
from adapters.weights import MAX_CONFIG_BYTES

MEMORY_SCHEME = "memory:"
_ids = itertools.count(1)
_PROCESS = uuid.uuid4().hex[:8]  # memory ids never repeat across engines of one process either


@dataclass(frozen=True)
class MemoryLoRARequest(LoRARequest):
    """A LoRA whose weights were handed over in memory (build it with :func:`memory_lora_request`).

    ``path`` is a ``memory:`` id unique to this snapshot; ``tensors`` and ``config`` are the snapshot
    (CPU tensors nobody else holds, a JSON-like dict) and are left out of equality and hashing.
    """

    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    config: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # its source never changes: a reload after eviction keeps the version (adapters.versions)
    immutable: ClassVar[bool] = True


def memory_lora_request(name: str, state_dict: Mapping[str, torch.Tensor], config, *,
                        max_bytes: int | None) -> MemoryLoRARequest:
    """A snapshot of ``state_dict`` and ``config`` as a request for a new version of ``name``.

    ``config``: a PEFT ``LoraConfig`` or an ``adapter_config.json`` dict. Checked here, before any
    copy: the config's JSON size (at most ``MAX_CONFIG_BYTES``), every key a string and every value a
    dense tensor, their bytes at most ``max_bytes`` (the bound a file of them would meet).

    Raises:
        InvalidAdapterError: the config is not a JSON object, or the state dict is not str -> tensor.
        AdapterTooLargeError: the config or the tensors are over their bounds.
    """
    config_dict = _config_dict(name, config)
    if not isinstance(state_dict, Mapping):
        raise InvalidAdapterError(f"adapter {name!r}: the state dict must be a mapping of PEFT key names to "
                                  f"tensors, got {type(state_dict).__name__}")
    nbytes = 0
    for key, tensor in state_dict.items():
        if not isinstance(key, str) or not isinstance(tensor, torch.Tensor):
            raise InvalidAdapterError(f"adapter {name!r}: state dict entry {key!r} must map a string to a "
                                      f"torch.Tensor, got {type(tensor).__name__}")
        if tensor.layout != torch.strided or tensor.is_meta:
            raise InvalidAdapterError(f"adapter {name!r}: {key} must be a dense tensor with data "
                                      f"(layout {tensor.layout}, device {tensor.device})")
        nbytes += tensor.numel() * tensor.element_size()
    if max_bytes is not None and nbytes > max_bytes:
        raise AdapterTooLargeError(f"adapter {name!r}: its tensors hold {nbytes} bytes, over the limit "
                                   f"max_adapter_bytes={max_bytes}")
    # a snapshot the trainer cannot change: it goes on updating its parameters in place
    snapshot = {key: tensor.detach().to("cpu", copy=True) for key, tensor in state_dict.items()}
    return MemoryLoRARequest(name, f"{MEMORY_SCHEME}{name}/{_PROCESS}-{next(_ids)}", tensors=snapshot,
                             config=config_dict)


def load_memory_lora(request: MemoryLoRARequest, spec: ModelSpec, *, max_lora_rank: int,
                     dtype: torch.dtype = torch.float32, base_weight: BaseWeight | None = None) -> LoRAWeights:
    """Validate the snapshot as a file load validates what it read (:func:`adapters.lora.parse_lora`)."""
    return parse_lora(request.name, dict(request.config), dict(request.tensors), spec, max_lora_rank=max_lora_rank,
                      dtype=dtype, base_weight=base_weight)


def _config_dict(name: str, config) -> dict:
    """``config`` as ``adapter_config.json`` would hold it: PEFT's ``save_pretrained`` writes
    ``to_dict()`` with sets as lists and enums as their values; a dict goes through the same JSON
    round trip, so what is validated is what a file would have said."""
    if hasattr(config, "to_dict") and not isinstance(config, Mapping):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise InvalidAdapterError(f"adapter {name!r}: the config must be a LoraConfig or an adapter_config dict, "
                                  f"got {type(config).__name__}")
    try:
        text = json.dumps(dict(config), default=_json_value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidAdapterError(f"adapter {name!r}: the config cannot be written as adapter_config.json: "
                                  f"{exc}") from exc
    if len(text.encode()) > MAX_CONFIG_BYTES:
        raise AdapterTooLargeError(f"adapter {name!r}: the config takes {len(text.encode())} bytes as JSON, over "
                                   f"the limit MAX_CONFIG_BYTES={MAX_CONFIG_BYTES}")
    return json.loads(text)


def _json_value(value):
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, Enum):
        return value.value
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
