"""Safe reading of an adapter directory: ``adapter_config.json`` plus safetensors weights.

Every file is opened beneath the directory held open by :class:`adapters.files.AdapterDir` (never
by re-resolving a path string), without blocking (a FIFO is refused, not waited on) and checked to
be a regular file on its descriptor; a confined directory (a tenant's runtime load) follows no
symlink. Callers pass a path (opened as a local directory for the duration of the call) or an
``AdapterDir`` they hold.

A pickle ``adapter_model.bin`` is read only when the user opted in (``allow_pickle=True``), and then
with ``torch.load(weights_only=True)``, which refuses to build anything but tensors and plain
containers, so a malicious pickle raises instead of running code. File sizes are checked on disk
against ``max_bytes`` before anything is read; for a pickle, so is the size it unpacks to, because
torch.load allocates what the archive declares: only zip-format checkpoints with uncompressed
entries (what torch.save writes) are read, never compressed entries (a zip bomb) or the legacy
format (whose pickle declares storage sizes that are allocated before any data is read).

Safetensors weights: the file's size is checked against ``max_bytes`` on its descriptor, then its
header alone is read and checked (length, JSON, every tensor's dtype, shape and byte range, which
must tile the rest of the file exactly) before any tensor data is read: a header claiming terabytes,
or a sparse file of zeros, is refused having read a few bytes. Then the file is read whole into
memory the process owns (one read of the size checked) and parsed from those bytes; nothing stays
memory-mapped, so a file truncated or rewritten during a load (``cp`` over a served adapter) gives
a consistent read or an :class:`InvalidAdapterError`, never a SIGBUS. A file that changes while it
is read (its size, or modification time differ before and after) is refused; replacing a file atomically
(write a temporary file, then rename it over) is always read consistently, old or new.

``adapter_config.json`` is capped at :data:`MAX_CONFIG_BYTES` (checked before reading), and its
JSON nesting by the parser's recursion limit.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import pickle
import struct
import zipfile
from collections.abc import Iterator

import torch

from adapters.errors import (
    AdapterError,
    AdapterNotFoundError,
    AdapterTooLargeError,
    InvalidAdapterError,
    UnsafeAdapterError,
    UnsupportedAdapterError,
)
from adapters.files import AdapterDir, file_version, read_exactly
from adapters.hub import CONFIG_FILE, PICKLE_FILE, SAFETENSORS_FILE

logger = logging.getLogger(__name__)

MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json: a real one is a few KB
MAX_SAFETENSORS_HEADER_BYTES = 100 << 20  # what the safetensors library itself accepts at most
# bytes per element of every safetensors dtype (sub-byte float types are not adapter weights)
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _check_size(name: str, path: str, max_bytes: int | None, size: int,
                limit_name: str = "max_adapter_bytes") -> None:
    if max_bytes is not None and size > max_bytes:
        raise AdapterTooLargeError(f"adapter {name!r}: {os.path.basename(path)} is {size} bytes, over the "
                                   f"limit {limit_name}={max_bytes}")


@contextlib.contextmanager
def held_dir(local_dir: str | AdapterDir) -> Iterator[AdapterDir]:
    """``local_dir`` itself when it is an open AdapterDir (the caller closes it), else the local
    directory at that path, opened for the block."""
    if isinstance(local_dir, AdapterDir):
        yield local_dir
        return
    with AdapterDir.local(local_dir) as directory:
        yield directory


def _read_owned_bytes(name: str, directory: AdapterDir, file: str, max_bytes: int | None,
                      limit_name: str = "max_adapter_bytes") -> bytes:
    """The file's bytes, in memory this process owns: its size is checked on the open descriptor
    before one bounded read, and a file that changed during the read is refused."""
    path = directory.path_of(file)
    fd, before = _open(name, directory, file)
    try:
        _check_size(name, path, max_bytes, before.st_size, limit_name)
        return _read_rest(name, fd, before, path)
    finally:
        os.close(fd)


def _open(name: str, directory: AdapterDir, file: str) -> tuple[int, os.stat_result]:
    try:
        return directory.open_file(file)
    except AdapterError as exc:  # name the adapter too
        raise type(exc)(f"adapter {name!r}: {exc}") from exc


def _read_rest(name: str, fd: int, before: os.stat_result, path: str, offset: int = 0) -> bytes:
    try:
        return read_exactly(fd, before, path, offset)
    except InvalidAdapterError as exc:
        raise InvalidAdapterError(f"adapter {name!r}: {exc}") from exc


def read_adapter_config(name: str, local_dir: str | AdapterDir, max_bytes: int | None = None) -> dict:
    """Parse ``adapter_config.json`` of the adapter in ``local_dir``.

    Raises:
        AdapterNotFoundError: the file is missing (or not a regular file).
        AdapterTooLargeError: it is larger than ``max_bytes`` or :data:`MAX_CONFIG_BYTES` (checked
            before reading).
        InvalidAdapterError: it is not a JSON object (or is nested too deeply to parse).
        UnsafeAdapterError: it is a symlink in a confined directory.
    """
    limit, limit_name = MAX_CONFIG_BYTES, "MAX_CONFIG_BYTES"
    if max_bytes is not None and max_bytes < limit:
        limit, limit_name = max_bytes, "max_adapter_bytes"
    with held_dir(local_dir) as directory:
        path = directory.path_of(CONFIG_FILE)
        data = _read_owned_bytes(name, directory, CONFIG_FILE, limit, limit_name)
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


def _read_safetensors(name: str, directory: AdapterDir, max_bytes: int | None) -> dict[str, torch.Tensor]:
    """Parse the safetensors file from bytes read into memory (see module docstring), its header
    checked first; each tensor is copied into its own torch-owned storage, so none aliases the read buffer."""
    import safetensors.torch
    from safetensors import SafetensorError

    path = directory.path_of(SAFETENSORS_FILE)
    fd, before = _open(name, directory, SAFETENSORS_FILE)
    try:
        _check_size(name, path, max_bytes, before.st_size)
        try:
            header = _read_safetensors_header(name, fd, before.st_size, path)
        except InvalidAdapterError:
            if file_version(os.fstat(fd)) != file_version(before):  # rewritten after fstat: say so
                _read_rest(name, fd, before, path, offset=before.st_size)
            raise
        data = _read_rest(name, fd, before, path)
    finally:
        os.close(fd)
    if data[:len(header)] != header:
        raise InvalidAdapterError(f"adapter {name!r}: {path} changed while it was read (its header differs); "
                                  "replace adapter files atomically (rename)")
    try:
        loaded = safetensors.torch.load(data)
    except (SafetensorError, ValueError, RuntimeError, TypeError) as exc:
        raise InvalidAdapterError(f"adapter {name!r}: corrupt safetensors file {path}: {exc}") from exc
    del data  # the per-tensor buffers below are their own copies; free the file's bytes first
    return {key: loaded.pop(key).clone() for key in list(loaded)}  # one read-only buffer freed per clone


def _read_safetensors_header(name: str, fd: int, size: int, path: str) -> bytes:
    """The file's first 8 + N bytes (length prefix and JSON header), checked to describe tensors that
    tile the remaining ``size - 8 - N`` bytes exactly; InvalidAdapterError before any tensor data is read."""
    def corrupt(why: str) -> InvalidAdapterError:
        return InvalidAdapterError(f"adapter {name!r}: corrupt safetensors file {path}: {why}")

    prefix = os.pread(fd, 8, 0)
    if len(prefix) < 8:
        raise corrupt(f"{size} bytes, too short for a header")
    (length,) = struct.unpack("<Q", prefix)
    if length > min(size - 8, MAX_SAFETENSORS_HEADER_BYTES):
        raise corrupt(f"the header claims {length} bytes in a file of {size}")
    raw = os.pread(fd, length, 8)
    if len(raw) != length:
        raise corrupt("the file is shorter than its header")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise corrupt(f"the header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise corrupt("the header is not a JSON object")
    spans = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        spans.append(_tensor_span(key, entry, corrupt))
    end = 0
    for begin, stop, key in sorted(spans):
        if begin != end:
            raise corrupt(f"tensor {key!r} starts at byte {begin}, not {end} (overlap or hole)")
        end = stop
    if end != size - 8 - length:
        raise corrupt(f"the header describes {end} bytes of tensor data, the file holds {size - 8 - length}")
    return prefix + raw


def _tensor_span(key: str, entry, corrupt) -> tuple[int, int, str]:
    """(begin, end, key) of one header entry, checked: known dtype, int shape, end - begin = its bytes."""
    if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPE_BYTES:
        raise corrupt(f"tensor {key!r}: unknown dtype {entry.get('dtype') if isinstance(entry, dict) else entry!r}")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise corrupt(f"tensor {key!r}: bad shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)):
        raise corrupt(f"tensor {key!r}: bad data_offsets {offsets!r}")
    begin, end = offsets
    if end - begin != math.prod(shape) * _DTYPE_BYTES[entry["dtype"]]:
        raise corrupt(f"tensor {key!r}: {entry['dtype']} {shape} does not fill bytes {begin}..{end}")
    return begin, end, key


def _check_pickle_archive(name: str, file, path: str, max_bytes: int | None) -> None:
    """Refuse a pickle checkpoint whose memory use its file size does not bound (see module docstring)."""
    if not zipfile.is_zipfile(file):
        raise UnsafeAdapterError(f"adapter {name!r}: {path} is not a zip-format torch checkpoint; legacy and raw "
                                 "pickles declare tensor sizes that would be allocated before reading, so they are "
                                 f"refused (re-save it with torch >= 1.6, or convert it to {SAFETENSORS_FILE})")
    try:
        with zipfile.ZipFile(file) as archive:
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


def _read_pickle(name: str, directory: AdapterDir, max_bytes: int | None = None) -> dict[str, torch.Tensor]:
    """The checked archive (see module docstring), read from one open descriptor of ``adapter_model.bin``."""
    path = directory.path_of(PICKLE_FILE)
    fd, st = _open(name, directory, PICKLE_FILE)
    with os.fdopen(fd, "rb") as file:
        _check_size(name, path, max_bytes, st.st_size)
        logger.info("adapter %r: reading pickle checkpoint %s with weights_only=True", name, path)
        _check_pickle_archive(name, file, path, max_bytes)
        file.seek(0)
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
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


def read_adapter_tensors(name: str, local_dir: str | AdapterDir, *, allow_pickle: bool = False,
                         max_bytes: int | None = None) -> dict[str, torch.Tensor]:
    """Read the weights of the adapter in ``local_dir`` (safetensors preferred) as CPU tensors.

    Raises:
        AdapterNotFoundError: neither weights file exists (or is a regular file).
        UnsafeAdapterError: only a pickle ``.bin`` exists and ``allow_pickle`` is False, or the
            pickle holds anything but tensors, is compressed or is in the legacy format; a symlink
            in a confined directory.
        AdapterTooLargeError: the file (or what a pickle unpacks to) is larger than ``max_bytes``
            (checked before reading).
        InvalidAdapterError: the file is corrupt, unreadable, or changed while it was read.
    """
    with held_dir(local_dir) as directory:
        if directory.has_file(SAFETENSORS_FILE):
            return _read_safetensors(name, directory, max_bytes)
        if directory.has_file(PICKLE_FILE):
            if not allow_pickle:
                raise UnsafeAdapterError(f"adapter {name!r}: only a pickle checkpoint ({PICKLE_FILE}) was found in "
                                         f"{directory.display}; loading pickles is refused unless allow_pickle=True "
                                         f"(convert the adapter to {SAFETENSORS_FILE} to avoid this)")
            return _read_pickle(name, directory, max_bytes)
        raise AdapterNotFoundError(f"adapter {name!r}: no {SAFETENSORS_FILE} (or {PICKLE_FILE}) in "
                                   f"{directory.display}")
