"""Adapter weights in shared memory: written once per adapter version, mapped by every rank, never pickled.

The engine process places a version's tensors in one file under /dev/shm (a memory-backed
filesystem) and ships a small ``SharedHandle`` (the file, the byte layout and a pickle of the weights'
structure without tensor data) in the step message; each worker maps the file (``torch.from_file``,
no copy) and rebuilds the weights as views into it, then writes its shard into its slots. The file of
a version lives as long as the engine keeps the version's weights (its CPU cache entry): a version
evicted from a slot and made resident again reuses the file. Files are removed when the weights are
freed and when the executor closes.
"""

from __future__ import annotations

import io
import itertools
import logging
import os
import pickle
import tempfile
import threading
import weakref
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

_ALIGN = 64  # every tensor starts on a 64-byte boundary, so a uint8 view can be viewed as any dtype
_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


@dataclass(frozen=True)
class SharedHandle:
    """Where one adapter version's tensors live: ``path`` (nbytes long) and ``skeleton``, a pickle of the
    weights whose tensors are references (index, offset, dtype, shape) into the file."""

    path: str
    nbytes: int
    skeleton: bytes


class _SkeletonPickler(pickle.Pickler):
    """Pickles the weights' structure; each tensor becomes a persistent reference and is collected."""

    def __init__(self, file, layout: list) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.layout, self.offset = layout, 0

    def persistent_id(self, obj):
        if not isinstance(obj, torch.Tensor):
            return None
        tensor = obj.detach().contiguous().cpu()
        nbytes = tensor.numel() * tensor.element_size()
        reference = (self.offset, tensor.dtype, tuple(tensor.shape))
        self.layout.append((self.offset, tensor))
        self.offset += -(-nbytes // _ALIGN) * _ALIGN
        return reference


class _SkeletonUnpickler(pickle.Unpickler):
    """Rebuilds the weights with each tensor a view into the mapped file."""

    def __init__(self, file, buffer: torch.Tensor) -> None:
        super().__init__(file)
        self.buffer = buffer  # uint8 [nbytes], mapped

    def persistent_load(self, reference):
        offset, dtype, shape = reference
        count = 1
        for size in shape:
            count *= size
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        return self.buffer[offset:offset + nbytes].view(dtype).view(shape)


class SharedWeights:
    """The engine side: ``share(weights) -> SharedHandle``, one file per live weights object.

    ``files_created`` counts files written (one per adapter version made resident, however many ranks
    and slot writes); thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: dict[int, SharedHandle] = {}  # id(weights) -> its file, while the weights live
        self._names = itertools.count()
        self.files_created = 0

    def share(self, weights) -> SharedHandle:
        """The handle of ``weights``' file, written now unless it exists already."""
        with self._lock:
            handle = self._handles.get(id(weights))
            if handle is not None:
                return handle
            handle = self._write(weights)
            self._handles[id(weights)] = handle
            self.files_created += 1
        weakref.finalize(weights, self._drop, id(weights), handle.path)
        return handle

    def _write(self, weights) -> SharedHandle:
        layout: list = []
        skeleton = io.BytesIO()
        pickler = _SkeletonPickler(skeleton, layout)
        pickler.dump(weights)
        nbytes = max(pickler.offset, _ALIGN)
        path = os.path.join(_SHM_DIR, f"lora-runner-{os.getpid()}-{id(self)}-{next(self._names)}.weights")
        with open(path, "wb") as file:
            file.truncate(nbytes)
        buffer = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)  # [nbytes], mapped
        for offset, tensor in layout:
            nbytes_t = tensor.numel() * tensor.element_size()
            buffer[offset:offset + nbytes_t].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        return SharedHandle(path, nbytes, skeleton.getvalue())

    def _drop(self, key: int, path: str) -> None:
        with self._lock:
            if self._handles.get(key) is not None and self._handles[key].path == path:
                del self._handles[key]
        _unlink(path)

    def close(self) -> None:
        """Remove every file (workers that mapped one keep their mapping until they let go of it)."""
        with self._lock:
            handles, self._handles = list(self._handles.values()), {}
        for handle in handles:
            _unlink(handle.path)


def open_shared(handle: SharedHandle):
    """The worker side: the weights of ``handle``, their tensors views into the mapped file (no copy)."""
    buffer = torch.from_file(handle.path, shared=False, size=handle.nbytes, dtype=torch.uint8)
    return _SkeletonUnpickler(io.BytesIO(handle.skeleton), buffer).load()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
