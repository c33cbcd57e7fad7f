"""Where an adapter's files live: a local directory, or a Hugging Face Hub repo at a revision.

``resolve`` turns (path, revision) into a local directory holding ``adapter_config.json`` and the
weights. Local directories are used as they are; anything else is a Hub repo id fetched (or found
in the cache) with ``huggingface_hub.snapshot_download``, limited to the adapter files. Offline
mode is honored: ``local_files_only=True``, or ``HF_HUB_OFFLINE=1`` when it is left as None.
Every failure becomes an :class:`adapters.AdapterNotFoundError` naming the path and revision.
"""

from __future__ import annotations

import logging
import os

from adapters.errors import AdapterNotFoundError

logger = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"


def adapter_file_patterns(allow_pickle: bool = False) -> list[str]:
    """The files a PEFT adapter needs; the pickle ``.bin`` only when the user opted in."""
    patterns = [CONFIG_FILE, SAFETENSORS_FILE]
    if allow_pickle:
        patterns.append(PICKLE_FILE)
    return patterns


def _hub_errors() -> tuple[type[BaseException], ...]:
    """The exception types huggingface_hub raises for a missing repo/revision/file or no network."""
    try:
        from huggingface_hub import errors as hub_errors
    except ImportError:  # huggingface_hub < 0.24 keeps them in utils
        from huggingface_hub import utils as hub_errors
    names = ("HfHubHTTPError", "RepositoryNotFoundError", "RevisionNotFoundError", "EntryNotFoundError",
             "LocalEntryNotFoundError", "HFValidationError", "RevisionResolutionError", "HTTPError",
             "XetDownloadError")
    found = tuple(getattr(hub_errors, n) for n in names if isinstance(getattr(hub_errors, n, None), type))
    # OSError covers connection failures and missing cache entries; ValueError a malformed repo id.
    return found + (OSError, ValueError)


def _offline_from_env() -> bool:
    """HF_HUB_OFFLINE, read now (huggingface_hub reads it once at import time)."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE")
    if env is not None:
        return env.strip().upper() in ("1", "ON", "YES", "TRUE")
    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


def _looks_like_local_path(path: str) -> bool:
    """True for paths no Hub repo id can be ("/x", "./x", "~/x", "a/b/c")."""
    return (os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1
            or os.sep != "/" and os.sep in path)


def resolve(path: str, revision: str | None = None, allow_patterns: list[str] | None = None,
            local_files_only: bool | None = None, cache_dir: str | os.PathLike | None = None) -> str:
    """Return a local directory holding the adapter at ``path`` (local dir or Hub repo id).

    Args:
        path: an existing local directory (used as is), or a Hub repo id ("org/name").
        revision: branch, tag or full commit hash (Hub only; ignored with a warning for local dirs).
        allow_patterns: files to fetch; default :func:`adapter_file_patterns` without pickle.
        local_files_only: True: never touch the network (use the cache); None: follow HF_HUB_OFFLINE.
        cache_dir: Hub cache directory (default: huggingface_hub's, i.e. HF_HUB_CACHE).

    Raises:
        AdapterNotFoundError: the directory, repo, revision or cache entry does not exist, or the
            Hub could not be reached.
    """
    if os.path.isdir(os.path.expanduser(path)):
        if revision is not None:
            logger.warning("adapter path %r is a local directory; revision %r is ignored", path, revision)
        return os.path.expanduser(path)
    where = f"{path!r}" + (f" at revision {revision!r}" if revision else "")
    if _looks_like_local_path(path):
        raise AdapterNotFoundError(f"adapter path {where}: local directory does not exist "
                                   "(and it is not a Hub repo id of the form 'org/name')")
    if allow_patterns is None:
        allow_patterns = adapter_file_patterns()
    offline = _offline_from_env() if local_files_only is None else bool(local_files_only)
    from huggingface_hub import snapshot_download

    try:
        local_dir = snapshot_download(path, revision=revision, allow_patterns=list(allow_patterns),
                                      local_files_only=offline,
                                      cache_dir=None if cache_dir is None else str(cache_dir))
    except _hub_errors() as exc:
        mode = " (offline: only the local Hub cache was searched)" if offline else ""
        raise AdapterNotFoundError(f"adapter path {where}: could not be resolved on the Hugging Face Hub"
                                   f"{mode}: {type(exc).__name__}: {exc}") from exc
    logger.debug("adapter %s resolved to %s", where, local_dir)
    return str(local_dir)
