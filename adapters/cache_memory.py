"""The real bytes an adapter's CPU tensors hold: what the CPU cache counts against ``max_cpu_lora_bytes``.

Each storage is counted once, at its whole size: a fused module's A is shared by its slices (Phi-3's
qkv_proj: one A, three slices) and a view keeps its whole storage alive, so summing ``numel *
element_size`` per tensor would count the shared A three times and a view at less than it holds.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def held_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of memory ``tensors`` hold together: each distinct storage once, whole (None is skipped)."""
    storages: dict[int, int] = {}  # data pointer -> storage bytes
    for tensor in tensors:
        if tensor is None or tensor.numel() == 0:
            continue
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
