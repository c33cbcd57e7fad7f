"""Confine runtime adapter loads to the caller's own directory tree under --adapter-root.

Each tenant loads from its own sub-root (``Tenant.adapter_root``, from the keys file; by default the
tenant's name; ``--api-key`` keys and a keyless server use the whole root). A client's ``lora_path``
must be a plain relative path (no ``..``, ``.``, ``~`` or absolute path: decided on the string, so the
answer says nothing about what exists outside the sub-root). The folder is then opened component by
component beneath the sub-root without following any symlink (adapters.files.AdapterDir.confined),
at this check and again at every read, so a symlink or a folder swapped for one is refused, never
followed. Hub repo ids are allowed only when the server was started with --allow-hub-adapters,
and only for names that are not a folder under the sub-root.

An absolute ``lora_path`` is refused unless the operator listed a directory holding it with
``--allowed-adapter-paths`` (vLLM users load by absolute path): then it is opened beneath that
directory with the same rules (no ``..``/``.`` component, no symlink followed below it, the
directory held open), and any admin key the name is allowed for may load it.
"""

from __future__ import annotations

import os
import re

from adapters import AdapterNotFoundError, LoRARequest
from adapters.files import AdapterDir, PathEscapeError, confined_parts
from lora_runner.entrypoints.openai.tenants import Tenant

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


class PathNotAllowed(Exception):
    """The path is outside the caller's adapter root (or runtime loading has no root)."""


def tenant_root(root: str, tenant: Tenant) -> str:
    """The directory `tenant` loads from: its sub-root of the server's adapter root."""
    return os.path.join(root, tenant.adapter_root) if tenant.adapter_root else root


def runtime_lora_request(root: str | None, tenant: Tenant, name: str, path: str,
                         allow_hub: bool = False, allowed_paths: tuple[str, ...] = ()) -> LoRARequest:
    """The request loading `path` for `tenant` (confined to its root, an absolute path beneath one of
    `allowed_paths`, or a Hub repo id); PathNotAllowed otherwise. Opens directories (never files): run
    it off the event loop."""
    if os.path.isabs(path) and allowed_paths:
        return _allowed_absolute_request(allowed_paths, name, path)
    if os.path.isabs(path) and not allowed_paths:
        raise PathNotAllowed("an absolute lora_path needs the server started with --allowed-adapter-paths naming "
                             "a directory that holds it (or --adapter-root and a relative lora_path)")
    if not root:
        raise PathNotAllowed("runtime adapter loading needs the server started with --adapter-root (relative "
                             "lora_path) or --allowed-adapter-paths (absolute lora_path)")
    try:
        parts = confined_parts(path)
    except PathEscapeError:
        raise PathNotAllowed("lora_path must be a relative path inside your adapter root") from None
    base = tenant_root(root, tenant)
    try:
        AdapterDir.confined(base, path).close()
    except PathEscapeError:
        raise PathNotAllowed("lora_path must stay inside your adapter root (symbolic links are not "
                             "followed)") from None
    except AdapterNotFoundError:
        if allow_hub and _HUB_ID.match(path):
            return LoRARequest(name, path)
        # missing inside the root: the engine answers "not found" (422), naming only `path`
    return LoRARequest(name, os.path.join(base, *parts), root=base)


def with_draft_adapter(request: LoRARequest, draft: LoRARequest) -> LoRARequest:
    """`request` naming `draft` (runtime_lora_request's answer for the draft_path) as its draft adapter; both
    must lie beneath the same directory (the draft is read beneath the request's root), else PathNotAllowed."""
    if draft.root != request.root:
        raise PathNotAllowed("draft_path must lie in the same adapter directory as lora_path")
    return LoRARequest(request.name, request.path, request.revision, request.root, draft_lora_path=draft.path)


def _allowed_absolute_request(allowed_paths: tuple[str, ...], name: str, path: str) -> LoRARequest:
    """An absolute `path` confined to the allowed directory holding it (decided on the string first, then
    opened beneath that directory without following symlinks); PathNotAllowed otherwise."""
    for allowed in allowed_paths:
        prefix = allowed.rstrip("/") + "/"
        if not path.startswith(prefix):
            continue
        relative = path[len(prefix):]
        try:
            parts = confined_parts(relative)
            AdapterDir.confined(allowed, relative).close()
        except PathEscapeError:
            raise PathNotAllowed("lora_path must stay inside an allowed adapter directory (no '.' or '..', "
                                 "symbolic links are not followed)") from None
        except AdapterNotFoundError:
            pass  # missing: the engine answers "not found" (422), naming only the path relative to `allowed`
        return LoRARequest(name, os.path.join(allowed, *parts), root=allowed)
    raise PathNotAllowed("lora_path is not inside a directory this server allows (--allowed-adapter-paths)")
