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

The snapshot lives while the engine may read it: while its name is served from it (a version whose
weights the CPU cache evicted reloads from it, as a file adapter reloads from its folder, and keeps
its version: the weights are the same, so the version ``update_lora`` returned is the one outputs
name) or a live version (held by running requests, or staged) was made from it. Then it is released:
emptied, so a reference a caller kept (an old ``ServedAdapter``) holds no tensors, and a request
naming it is refused (adapters.tier's ``SupersededAdapterError``, or an ``InvalidAdapterError`` here).

:class:`MemorySnapshots` counts the bytes every live snapshot holds (each storage once,
adapters.cache_memory) and bounds their total by ``max_memory_adapter_bytes``: an update that would
pass it is refused (:class:`MemoryAdapterBoundError`, naming the setting) before its snapshot is
taken, and the version serving before keeps serving. Each snapshot is charged to its adapter's owner
(the tenant that loaded the name; None: the operator): an update may also name the owner's share of the
bound (``share``, a fraction: the server passes ``--max-tenant-share`` for a tenant's update when its keys
name several tenants), and one that would make that owner's snapshots pass it is refused
(:class:`MemoryAdapterShareError`), so one tenant filling its share leaves the rest of the bound to the
others. The operator (the Python API, an operator key) has no share: only the whole bound applies.

The cached weights of a version are its snapshot's very tensors when these are already in the
engine's dtype (``parse_lora(share_storage=True)``; the snapshot never changes), so an in-memory
adapter is held once: counted both here and in the LoRA CPU cache, which each bound what they
reference. In another dtype (a float32 trainer, a bfloat16 engine) the weights are a conversion,
and on CUDA a pinned copy.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, ClassVar

import torch

from adapters.cache_memory import held_bytes
from adapters.dora import BaseWeight
from adapters.errors import AdapterTooLargeError, InvalidAdapterError
from adapters.lora import LoRAWeights, parse_lora
from adapters.request import LoRARequest
from adapters.spec import ModelSpec
from adapters.weights import MAX_CONFIG_BYTES

logger = logging.getLogger(__name__)

MEMORY_SCHEME = "memory:"
_ids = itertools.count(1)
_PROCESS = uuid.uuid4().hex[:8]  # memory ids never repeat across engines of one process either


@dataclass(frozen=True)
class MemoryLoRARequest(LoRARequest):
    """A LoRA whose weights were handed over in memory (build it with :func:`memory_lora_request`).

    ``path`` is a ``memory:`` id unique to this snapshot; ``tensors`` and ``config`` are the snapshot
    (CPU tensors nobody changes, a JSON-like dict) and are left out of equality and hashing.
    """

    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    config: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # its source never changes: a reload after eviction keeps the version (adapters.versions)
    immutable: ClassVar[bool] = True


class _Snapshot(dict):
    """A snapshot's tensors by PEFT key; ``released`` once MemorySnapshots emptied it."""

    released = False


class MemoryAdapterBoundError(AdapterTooLargeError):
    """An in-memory update would make the live snapshots hold more than ``max_memory_adapter_bytes``.

    Nothing was copied; the version serving the name keeps serving."""


class MemoryAdapterShareError(MemoryAdapterBoundError):
    """An in-memory update would make its owner's live snapshots hold more than the owner's share of
    ``max_memory_adapter_bytes``. Nothing was copied; the version serving the name keeps serving."""


class MemorySnapshots:
    """The live snapshots of in-memory adapters and the bytes they hold, bounded by ``max_bytes``.

    ``reserve`` counts an update's bytes, charged to its owner, before its snapshot is taken (refusing
    one that would pass the bound, or its owner's share of it) and holds it as pending; ``settle``
    ends the update (published or not); the owning tier calls ``release_unused`` whenever a version or
    a served record may have let go of one, and a snapshot no longer pending nor in use is released
    (emptied) and no longer counted. Thread-safe.

    Args:
        max_bytes: the bound on the bytes all live snapshots hold together.
        setting: the name of the setting ``max_bytes`` comes from, for messages.
    """

    def __init__(self, max_bytes: int, setting: str = "max_memory_adapter_bytes"):
        self.max_bytes, self.setting = max_bytes, setting
        self._lock = threading.Lock()
        # memory id -> (request, bytes held, owner: the tenant charged, None for the operator)
        self._held: dict[str, tuple[MemoryLoRARequest | None, int, str | None]] = {}
        self._pending: set[str] = set()  # memory ids of updates still being served

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    @property
    def nbytes(self) -> int:
        """Bytes the live snapshots hold now (reservations included)."""
        with self._lock:
            return sum(nbytes for _, nbytes, _ in self._held.values())

    def owner_bytes(self, owner: str | None) -> int:
        """Bytes the live snapshots charged to ``owner`` hold now (reservations included)."""
        with self._lock:
            return sum(nbytes for _, nbytes, charged in self._held.values() if charged == owner)

    def share_bytes(self, share: float) -> int:
        """An owner's share of ``max_bytes`` in bytes: ``share`` (a fraction in (0, 1]) of it, at least one byte."""
        if not 0 < share <= 1:
            raise ValueError(f"a tenant's share of {self.setting} must be in (0, 1], got {share!r}")
        return max(1, math.floor(share * self.max_bytes))

    def reserve(self, name: str, path: str, nbytes: int, owner: str | None = None,
                share: float | None = None) -> None:
        """Count ``nbytes`` for the snapshot ``path`` about to be taken, charged to ``owner`` (pending
        until ``settle``). MemoryAdapterShareError when ``share`` is given and the owner's live snapshots
        would then hold more than that fraction of ``max_bytes``; MemoryAdapterBoundError when all the
        live snapshots would hold more than ``max_bytes``."""
        with self._lock:
            if share is not None:
                limit = self.share_bytes(share)
                mine = sum(b for _, b, charged in self._held.values() if charged == owner)
                if mine + nbytes > limit:
                    raise MemoryAdapterShareError(
                        f"adapter {name!r}: its tensors hold {nbytes} bytes and this tenant's live in-memory "
                        f"adapters' snapshots {mine}, over its share {limit} of {self.setting}={self.max_bytes} "
                        f"(x {share:g}, --max-tenant-share); wait for running requests on older versions to "
                        "finish or withdraw one of its in-memory adapters")
            held = sum(b for _, b, _ in self._held.values())
            if held + nbytes > self.max_bytes:
                raise MemoryAdapterBoundError(
                    f"adapter {name!r}: its tensors hold {nbytes} bytes and the live in-memory adapters' snapshots "
                    f"{held}, over the limit {self.setting}={self.max_bytes}; wait for running requests on older "
                    f"versions to finish, withdraw an in-memory adapter, or raise {self.setting}")
            self._held[path] = (None, nbytes, owner)
            self._pending.add(path)

    def hold(self, request: MemoryLoRARequest) -> None:
        """The snapshot reserved under ``request.path`` was taken: count the bytes it really holds."""
        with self._lock:
            owner = self._held[request.path][2]
            self._held[request.path] = (request, held_bytes(request.tensors.values()), owner)

    def cancel(self, path: str) -> None:
        """The snapshot reserved under ``path`` was never taken: no longer counted."""
        with self._lock:
            self._held.pop(path, None)
            self._pending.discard(path)

    def settle(self, path: str) -> None:
        """The update of snapshot ``path`` ended: from now on it is released once no longer in use."""
        with self._lock:
            self._pending.discard(path)

    def release_unused(self, in_use: Callable[[MemoryLoRARequest], bool]) -> None:
        """Release every snapshot neither pending nor ``in_use`` (call it under the owning tier's lock)."""
        with self._lock:
            unused = [path for path, (request, _, _) in self._held.items()
                      if path not in self._pending and (request is None or not in_use(request))]
            for path in unused:
                request, nbytes, _ = self._held.pop(path)
                if request is not None:  # the bytes go even if a caller still holds the request
                    request.tensors.released = True
                    request.tensors.clear()
                logger.debug("in-memory adapter snapshot %s released (%d bytes)", path, nbytes)


def default_memory_adapter_bytes(cache_bytes: int, max_adapter_bytes: int) -> int:
    """The default bound on the bytes in-memory LoRA snapshots hold together: what the LoRA CPU cache may
    hold (``cache_bytes``), and at least four of the largest adapters (``max_adapter_bytes``: the version
    serving, the one being pushed, two that running streams still finish on), so that an RL loop that
    ran before the bound existed is not refused."""
    return max(cache_bytes, 4 * max_adapter_bytes)


def memory_lora_request(name: str, state_dict: Mapping[str, torch.Tensor], config, *,
                        max_bytes: int | None, snapshots: MemorySnapshots | None = None, owner: str | None = None,
                        share: float | None = None) -> MemoryLoRARequest:
    """A snapshot of ``state_dict`` and ``config`` as a request for a new version of ``name``.

    ``config``: a PEFT ``LoraConfig`` or an ``adapter_config.json`` dict. Checked here, before any
    copy: the config's JSON size (at most ``MAX_CONFIG_BYTES``), every key a string and every value a
    dense tensor, their bytes at most ``max_bytes`` (the bound a file of them would meet), and with
    ``snapshots`` at most what the live snapshots leave under their bound, and under ``owner``'s
    ``share`` of it when given (the snapshot is then counted there, charged to ``owner`` and pending: the
    caller settles it, ``MemorySnapshots.settle``, once the update ended).

    Raises:
        InvalidAdapterError: the config is not a JSON object, or the state dict is not str -> tensor.
        AdapterTooLargeError: the config or the tensors are over their bounds (MemoryAdapterBoundError:
            over ``snapshots``' bound; MemoryAdapterShareError: over the owner's share of it).
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
    path = f"{MEMORY_SCHEME}{name}/{_PROCESS}-{next(_ids)}"
    if snapshots is not None:
        # before the copy: an update over the bound (or its owner's share) allocates nothing
        snapshots.reserve(name, path, nbytes, owner, share)
    try:
        # a snapshot the trainer cannot change: it goes on updating its parameters in place
        snapshot = {key: tensor.detach().to("cpu", copy=True) for key, tensor in state_dict.items()}
    except BaseException:
        if snapshots is not None:
            snapshots.cancel(path)
        raise
    request = MemoryLoRARequest(name, path, tensors=_Snapshot(snapshot), config=config_dict)
    if snapshots is not None:
        snapshots.hold(request)
    return request


def load_memory_lora(request: MemoryLoRARequest, spec: ModelSpec, *, max_lora_rank: int,
                     dtype: torch.dtype = torch.float32, base_weight: BaseWeight | None = None) -> LoRAWeights:
    """Validate the snapshot as a file load validates what it read (:func:`adapters.lora.parse_lora`);
    InvalidAdapterError when the snapshot was released (a later update replaced it)."""
    if getattr(request.tensors, "released", False):
        raise InvalidAdapterError(f"adapter {request.name!r}: this in-memory version ({request.path}) was released: "
                                  "a later update replaced it")
    # the snapshot never changes, so the cached weights may be its very tensors (when already in ``dtype``)
    return parse_lora(request.name, dict(request.config), dict(request.tensors), spec, max_lora_rank=max_lora_rank,
                      dtype=dtype, base_weight=base_weight, share_storage=True)


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
