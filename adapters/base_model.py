"""Whether an adapter was trained on the served base model: the warning when its adapter_config.json names
another one, said once per adapter and process (a startup check and the load, or a reload after eviction,
read the same config again).

``base_model_name_or_path`` is whatever the trainer's model was called: a Hub repo id, or a folder on the
trainer's machine, which never matches the path the model is served from elsewhere. So two names mean
the same model when they are equal, or when their model names are: the last path or repo-id component,
case-insensitive, without what a GGUF copy adds to it (the ``.gguf`` suffix, a quantization tag such as
``.Q4_1`` or ``-Q4_K_M``, and the ``-<16 hex digits>`` content key of lora_runner.model.gguf's converted
folder). The demo's converted ``SmolLM2-135M-Instruct.Q4_1-b179c9523d0e6a0f`` folder is thus
``HuggingFaceTB/SmolLM2-135M-Instruct``. The check is a hint (the adapter still loads), and a lenient one.
"""

from __future__ import annotations

import logging
import re
import threading

logger = logging.getLogger(__name__)

_CONTENT_KEY = re.compile(r"-[0-9a-f]{16}$")  # lora_runner.model.gguf's converted-folder suffix
_QUANT_TAG = re.compile(r"[.-](?:i?q\d\w*|f16|f32|bf16)$", re.IGNORECASE)  # GGUF file names' quantization tag
_warned: set[tuple[str, str, str]] = set()
_lock = threading.Lock()


def model_name(name_or_path: str) -> str:
    """The model's name in a Hub id or path, as compared (see the module docstring)."""
    last = re.split(r"[/\\]", name_or_path.rstrip("/\\"))[-1]
    last = _CONTENT_KEY.sub("", last)
    if last.lower().endswith(".gguf"):
        last = last[:-len(".gguf")]
    return _QUANT_TAG.sub("", last).lower()


def same_base_model(recorded: str, served: str) -> bool:
    """Whether an adapter's recorded base and the served model name the same model."""
    return recorded == served or bool(model_name(recorded)) and model_name(recorded) == model_name(served)


def warn_if_other_base(kind: str, name: str, recorded, served: str | None) -> None:
    """Warn (once per `kind` and adapter `name` and recorded base, in this process) that adapter `name`
    records another base model than the served one; nothing when either is unknown or they match."""
    if not isinstance(recorded, str) or not recorded or not served or same_base_model(recorded, served):
        return
    with _lock:
        if (kind, name, recorded) in _warned:
            return
        _warned.add((kind, name, recorded))
    logger.warning("%s %r was trained on base model %r, but the served model is %r", kind, name, recorded, served)
