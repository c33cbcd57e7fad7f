"""What a response may say about server paths: never an absolute one.

Adapter errors name the files they failed on (``/srv/adapters/acme/adapter_config.json``); a client
sees at most the last component (``.../adapter_config.json``). Model cards show an adapter's path
relative to the adapter root, or only its name.
"""

from __future__ import annotations

import os
import re

# an absolute POSIX path: a "/" at the start or after a space, quote, bracket, "=" or ","
# (not after ":" or "/", so URLs such as https://huggingface.co/... stay whole)
_ABSOLUTE_PATH = re.compile(r"""(?<![^\s'"(\[=,])/[^\s'"()\[\],;]*""")


def redact_paths(text: str) -> str:
    """`text` with every absolute path cut to its last component."""
    return _ABSOLUTE_PATH.sub(_last_component, text)


def _last_component(match: re.Match) -> str:
    name = os.path.basename(match.group(0).rstrip("/"))
    return f".../{name}" if name else "..."


def public_model_name(model: str) -> str:
    """The base model's name in model cards when --served-model-name is not given: a local folder's
    last component (its path is the server's), a Hub repo id as it is."""
    if os.path.isabs(model) or os.path.isdir(model):
        return os.path.basename(os.path.normpath(model)) or model
    return model


def public_path(path: str, root: str | None, name: str) -> str:
    """What a client may see of an adapter's `path`: relative to `root` when it lies inside it, a
    relative path (a Hub repo id) as it is, else only the adapter's `name`."""
    if not os.path.isabs(path):
        return path
    if root:
        real_root, real = os.path.realpath(root), os.path.realpath(path)
        if real != real_root and os.path.commonpath([real_root, real]) == real_root:
            return os.path.relpath(real, real_root)
    return name
