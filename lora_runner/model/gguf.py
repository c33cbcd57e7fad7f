"""GGUF checkpoints (llama.cpp's single-file format) as ordinary model dirs.

A ``.gguf`` file is dequantized once with transformers' GGUF reader (which needs the ``gguf``
package) and written next to its config and tokenizer as a float32 safetensors model dir, cached
under a key of the file's content; later loads read the cached dir like any other checkpoint.
Transformers' reader maps llama.cpp's metadata to a transformers config (tied embeddings, rope
theta, GQA) and llama.cpp's permuted q/k weights back to the Hugging Face layout, so the dir
serves exactly what ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)`` computes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
_HASH_CHUNK = 1 << 22
_DONE_MARKER = "converted-from-gguf.txt"  # written last: a dir without it is an interrupted conversion


def is_gguf_file(path: str | os.PathLike) -> bool:
    """Whether `path` names an existing GGUF file (by suffix)."""
    path = Path(path).expanduser()
    return path.suffix.lower() == GGUF_SUFFIX and path.is_file()


def default_cache_dir() -> Path:
    """Where converted GGUF checkpoints are kept: $LORA_RUNNER_CACHE/gguf, else
    $XDG_CACHE_HOME/lora-runner/gguf, else ~/.cache/lora-runner/gguf."""
    root = os.environ.get("LORA_RUNNER_CACHE")
    if root:
        return Path(root).expanduser() / "gguf"
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "lora-runner" / "gguf"


def file_digest(path: Path) -> str:
    """sha256 of the file's bytes (hex)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def gguf_model_dir(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """The safetensors model dir of a GGUF file, converting it on first use (then cached).

    The converted dir is ``<cache_dir>/<file stem>-<content key>``; without `cache_dir`, one that an earlier
    call converted into the file's own folder (the demo's cache does: its .gguf and the converted model sit
    side by side) is used first, so serving the demo's file does not convert it a second time, into
    default_cache_dir().

    Raises FileNotFoundError for a missing file, ImportError (naming the package) without
    ``gguf``, and ValueError when transformers cannot read the file's architecture.
    """
    path = Path(gguf_path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    key = f"{path.stem}-{file_digest(path)[:16]}"
    places = [Path(cache_dir).expanduser()] if cache_dir else [path.parent, default_cache_dir()]
    for place in places:
        if (place / key / _DONE_MARKER).is_file():
            logger.info("using the converted GGUF checkpoint %s", place / key)
            return place / key
    out = places[-1] / key
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        convert_gguf(path, tmp)
        (tmp / _DONE_MARKER).write_text(f"{path.name}\n")
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _publish(tmp: Path, out: Path) -> None:
    """Move a finished conversion into place, unless another process (a parallel test worker)
    finished first: its dir may already be in use, so it is kept and ours dropped."""
    if (out / _DONE_MARKER).is_file():
        return
    shutil.rmtree(out, ignore_errors=True)  # an interrupted earlier conversion
    try:
        os.replace(tmp, out)
    except OSError:
        if not (out / _DONE_MARKER).is_file():  # not a lost race: a real failure
            raise


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize `gguf_path` to float32 and write config.json, generation_config.json,
    model.safetensors (the tied lm_head left out, as transformers saves it) and the tokenizer
    (with its chat template) into `out_dir`."""
    try:
        import gguf  # noqa: F401 - transformers imports it lazily; fail early with a clear message
    except ImportError as err:
        raise ImportError("loading a .gguf checkpoint needs the 'gguf' package: pip install gguf") from err
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to float32 safetensors (once; about 30 s for a 135M model)", gguf_path)
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):  # describes the GGUF file, not the float weights
        del config.quantization_config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    tensors = {key: value.detach().contiguous() for key, value in model.state_dict().items()
               if not (tied and key == "lm_head.weight")}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(out_dir))
    model.generation_config.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
