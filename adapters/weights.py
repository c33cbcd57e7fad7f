"""Safe reading of an adapter directory: ``adapter_config.json`` plus safetensors weights.

A pickle ``adapter_model.bin`` is read only when the user opted in (``allow_pickle=True``), and then
with ``torch.load(weights_only=True)``, which refuses to build anything but tensors and plain
containers, so a malicious pickle raises instead of running code. File sizes are checked on disk
against ``max_bytes`` before anything is read; for a pickle, so is the size it unpacks to, because
torch.load allocates what the archive declares: only zip-format checkpoints with uncompressed
entries (what torch.save writes) are read, never compressed entries (a zip bomb) or the legacy
format (whose pickle declares storage sizes that are allocated before any data is read).

Safetensors weights are read whole into memory the process owns (one read of the size checked
against ``max_bytes``) and parsed from those bytes; nothing stays memory-mapped, so a file truncated
or rewritten during a load (``cp`` over a served adapter) gives a consistent read or an
:class:`InvalidAdapterError`, never a SIGBUS. A file that changes while it is read (its size,
or modification time differ before and after) is refused; replacing a file atomically
(write a temporary file, then rename it over) is always read consistently, old or new.

``adapter_config.json`` is capped at :data:`MAX_CONFIG_BYTES` (checked before reading), and its
JSON nesting by the parser's recursion limit.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import zipfile

import torch

from adapters.errors import (
    AdapterNotFoundError,
    AdapterTooLargeError,
    InvalidAdapterError,
    UnsafeAdapterError,
    UnsupportedAdapterError,
)
from adapters.hub import CONFIG_FILE, PICKLE_FILE, SAFETENSORS_FILE

logger = logging.getLogger(__name__)

MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json: a real one is a few KB


def _check_size(name: str, path: str, max_bytes: int | None, size: int | None = None,
                limit_name: str = "max_adapter_bytes") -> None:
    size = os.path.getsize(path) if size is None else size
    if max_bytes is not None and size > max_bytes:
        raise AdapterTooLargeError(f"adapter {name!r}: {os.path.basename(path)} is {size} bytes, over the "
                                   f"limit {limit_name}={max_bytes}")


def _file_version(stat: os.stat_result) -> tuple:
    """What changes when an open file's content is written or truncated (not its ctime: that also
    changes when the file is renamed over or unlinked, which leaves the open file's content intact)."""
    return stat.st_size, stat.st_mtime_ns


def _read_owned_bytes(name: str, path: str, max_bytes: int | None, limit_name: str = "max_adapter_bytes") -> bytes:
    """The file's bytes, in memory this process owns: its size is checked before one bounded read,
    and a file that changed during the read is refused."""
    try:
        with open(path, "rb") as f:
            before = os.fstat(f.fileno())
            _check_size(name, path, max_bytes, before.st_size, limit_name)
            data = f.read(before.st_size + 1)  # one byte more: a file that grew shows as a longer read
            after = os.fstat(f.fileno())
    except OSError as exc:
        raise InvalidAdapterError(f"adapter {name!r}: cannot read {path}: {exc}") from exc
    if len(data) != before.st_size or _file_version(after) != _file_version(before):
        raise InvalidAdapterError(f"adapter {name!r}: {path} changed while it was read ({before.st_size} bytes "
                                  f"before, {len(data)} read); replace adapter files atomically (rename)")
    return data


def read_adapter_config(name: str, local_dir: str, max_bytes: int | None = None) -> dict:
    """Parse ``adapter_config.json`` of the adapter in ``local_dir``.

    Raises:
        AdapterNotFoundError: the file is missing.
        AdapterTooLargeError: it is larger than ``max_bytes`` or :data:`MAX_CONFIG_BYTES` (checked
            before reading).
        InvalidAdapterError: it is not a JSON object (or is nested too deeply to parse).
    """
    path = os.path.join(local_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        raise AdapterNotFoundError(f"adapter {name!r}: {CONFIG_FILE} not found in {local_dir}")
    limit, limit_name = MAX_CONFIG_BYTES, "MAX_CONFIG_BYTES"
    if max_bytes is not None and max_bytes < limit:
        limit, limit_name = max_bytes, "max_adapter_bytes"
    data = _read_owned_bytes(name, path, limit, limit_name)
    try:
        config = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise InvalidAdapterError(f"adapter {name!r}: cannot parse {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise InvalidAdapterError(f"adapter {name!r}: {path} must hold a JSON object, got {type(config).__name__}")
    return config


def check_peft_type(name: str, config: dict, expected: str, kind: str, supported: str) -> None:
    """Refuse a config without peft_type (invalid) or of another PEFT method than `expected`."""
    peft_type = config.get("peft_type")
    if peft_type is None:
        raise InvalidAdapterError(f"adapter {name!r}: adapter_config.json has no peft_type")
    if str(peft_type).upper() != expected:
        raise UnsupportedAdapterError(f"adapter {name!r}: peft_type={peft_type!r} is not supported as {kind}; "
                                      f"supported: {supported}")


def _read_safetensors(name: str, path: str, max_bytes: int | None) -> dict[str, torch.Tensor]:
    """Parse the safetensors file from bytes read into memory (see module docstring); each tensor is
    copied into its own torch-owned storage, so none aliases the read buffer."""
    import safetensors.torch
    from safetensors import SafetensorError

    data = _read_owned_bytes(name, path, max_bytes)
    try:
        loaded = safetensors.torch.load(data)
    except (SafetensorError, ValueError, RuntimeError, TypeError) as exc:
        raise InvalidAdapterError(f"adapter {name!r}: corrupt safetensors file {path}: {exc}") from exc
    del data  # the per-tensor buffers below are their own copies; free the file's bytes first
    return {key: loaded.pop(key).clone() for key in list(loaded)}  # one read-only buffer freed per clone


def _check_pickle_archive(name: str, path: str, max_bytes: int | None) -> None:
    """Refuse a pickle checkpoint whose memory use its file size does not bound (see module docstring)."""
    if not zipfile.is_zipfile(path):
        raise UnsafeAdapterError(f"adapter {name!r}: {path} is not a zip-format torch checkpoint; legacy and raw "
                                 "pickles declare tensor sizes that would be allocated before reading, so they are "
                                 f"refused (re-save it with torch >= 1.6, or convert it to {SAFETENSORS_FILE})")
    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise InvalidAdapterError(f"adapter {name!r}: corrupt pickle file {path}: {exc}") from exc
    compressed = [e.filename for e in entries if e.compress_type != zipfile.ZIP_STORED]
    if compressed:
        raise UnsafeAdapterError(f"adapter {name!r}: {path} has compressed entries ({compressed[0]!r}), which "
                                 "torch.save never writes: refused, it could unpack to far more than its size")
    unpacked = sum(e.file_size for e in entries)
    if max_bytes is not None and unpacked > max_bytes:
        raise AdapterTooLargeError(f"adapter {name!r}: {os.path.basename(path)} unpacks to {unpacked} bytes, "
                                   f"over the limit max_adapter_bytes={max_bytes}")


def _read_pickle(name: str, path: str, max_bytes: int | None = None) -> dict[str, torch.Tensor]:
    _check_pickle_archive(name, path, max_bytes)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # raised before any disallowed object is built
        reason = next((line.split(" Please use")[0].strip() for line in str(exc).splitlines()
                       if "Unsupported" in line), "")
        raise UnsafeAdapterError(f"adapter {name!r}: refused to unpickle {path}: only tensors are allowed "
                                 f"(torch.load(weights_only=True)). {reason}") from exc
    except (OSError, EOFError, RuntimeError, ValueError) as exc:
        raise InvalidAdapterError(f"adapter {name!r}: corrupt pickle file {path}: {exc}") from exc
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise InvalidAdapterError(f"adapter {name!r}: {path} must hold a dict of name -> tensor")
    return state


def read_adapter_tensors(name: str, local_dir: str, *, allow_pickle: bool = False,
                         max_bytes: int | None = None) -> dict[str, torch.Tensor]:
    """Read the weights of the adapter in ``local_dir`` (safetensors preferred) as CPU tensors.

    Raises:
        AdapterNotFoundError: neither weights file exists.
        UnsafeAdapterError: only a pickle ``.bin`` exists and ``allow_pickle`` is False, or the
            pickle holds anything but tensors, is compressed or is in the legacy format.
        AdapterTooLargeError: the file (or what a pickle unpacks to) is larger than ``max_bytes``
            (checked before reading).
        InvalidAdapterError: the file is corrupt, unreadable, or changed while it was read.
    """
    st_path, bin_path = os.path.join(local_dir, SAFETENSORS_FILE), os.path.join(local_dir, PICKLE_FILE)
    if os.path.isfile(st_path):
        return _read_safetensors(name, st_path, max_bytes)
    if os.path.isfile(bin_path):
        if not allow_pickle:
            raise UnsafeAdapterError(f"adapter {name!r}: only a pickle checkpoint ({PICKLE_FILE}) was found in "
                                     f"{local_dir}; loading pickles is refused unless allow_pickle=True "
                                     f"(convert the adapter to {SAFETENSORS_FILE} to avoid this)")
        _check_size(name, bin_path, max_bytes)
        logger.info("adapter %r: reading pickle checkpoint %s with weights_only=True", name, bin_path)
        return _read_pickle(name, bin_path, max_bytes)
    raise AdapterNotFoundError(f"adapter {name!r}: no {SAFETENSORS_FILE} (or {PICKLE_FILE}) in {local_dir}")
