"""Confine runtime adapter loads to one directory tree (--adapter-root).

A client's ``lora_path`` must be relative; it is joined to the root and resolved with every
symlink followed (os.path.realpath), and must still lie inside the resolved root
(os.path.commonpath). Hub repo ids are allowed only when the server was started with
--allow-hub-adapters, and only for names that are not a directory under the root.
"""

from __future__ import annotations

import os
import re

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


class PathNotAllowed(Exception):
    """The path is outside the adapter root (or runtime loading has no root)."""


def resolve_adapter_path(root: str | None, path: str, allow_hub: bool = False) -> str:
    """The local directory (or Hub repo id) to load for a client's `path`; PathNotAllowed otherwise."""
    if not root:
        raise PathNotAllowed("runtime adapter loading needs --adapter-root")
    if os.path.isabs(path) or path.startswith("~") or "\x00" in path:
        raise PathNotAllowed("lora_path must be relative to the adapter root")
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, path))
    inside = real != real_root and os.path.commonpath([real_root, real]) == real_root
    if inside and os.path.isdir(real):
        return real
    if allow_hub and _HUB_ID.match(path) and ".." not in path:
        return path
    if inside:
        return real  # missing inside the root: the engine answers "not found" (422)
    raise PathNotAllowed("lora_path must stay inside the adapter root")
