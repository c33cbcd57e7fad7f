"""Sampling defaults from a generation_config.json, as vLLM's ``--generation-config`` takes them.

vLLM's default (``auto``) reads the model's generation_config.json and uses its temperature, top_p,
top_k, min_p, repetition_penalty and max_new_tokens (as max_tokens) for every request that leaves
that field out; ``vllm`` ignores the file; a folder reads that folder's file instead. A request's own
value always wins. (The EOS ids come from the model's generation_config.json either way.) The server
(``serve --generation-config``) and ``LLM(generation_config=...)`` read the file here, the same way.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lora_runner.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_FILE = "generation_config.json"


@dataclass(frozen=True)
class SamplingDefaults:
    """A request's sampling values where its body leaves them out (None: SamplingParams' own default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # generation_config.json's max_new_tokens

    def sampling_params(self) -> SamplingParams:
        """SamplingParams with these defaults and SamplingParams' own for the rest (``LLM``'s params when a
        call passes none, as vLLM's get_default_sampling_params)."""
        from lora_runner.sampling_params import SamplingParams

        return SamplingParams(**{f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None})

    def describe(self) -> str:
        """The defaults that are set, for the start-up log ("" when none)."""
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name) is not None)


def sampling_defaults(setting: str, model_dir: str) -> SamplingDefaults:
    """The defaults of ``--generation-config`` / ``LLM(generation_config=)`` `setting` ("auto": `model_dir`'s
    file, "vllm": none, else a folder's file). A missing file gives none (ValueError for a folder without
    one); a file that is not a JSON object is a ValueError."""
    if not isinstance(setting, str):
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {setting!r}")
    if setting == "vllm":
        return SamplingDefaults()
    folder = model_dir if setting == "auto" else os.path.expanduser(setting)
    path = os.path.join(folder, _FILE)
    if not os.path.isfile(path):
        if setting != "auto":
            raise ValueError(f"generation config {setting}: no {_FILE} in that folder (expected auto, vllm or "
                             f"a folder holding {_FILE})")
        return SamplingDefaults()
    with open(path, encoding="utf-8") as file:
        config = json.load(file)
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object")
    values = {f.name: config.get(f.name) for f in fields(SamplingDefaults) if f.name != "max_tokens"}
    values["max_tokens"] = config.get("max_new_tokens")
    defaults = SamplingDefaults(**{name: value for name, value in values.items()
                                   if isinstance(value, (int, float)) and not isinstance(value, bool)})
    if defaults.describe():
        logger.info("sampling defaults from %s (generation config %s): %s", path, setting, defaults.describe())
    return defaults
