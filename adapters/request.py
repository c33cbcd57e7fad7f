"""What a request says about its adapter: a name plus where the weights live."""

from __future__ import annotations

import os
from dataclasses import dataclass

from adapters.files import PathEscapeError, confined_parts


@dataclass(frozen=True)
class _AdapterRequest:
    name: str  # identifies the adapter; same name + other path/revision = replacement
    path: str  # local directory or Hugging Face Hub repo id
    revision: str | None = None  # branch, tag or commit (Hub only)
    # a directory the adapter must stay beneath (a tenant's runtime load): path is then root joined
    # with a plain relative path, walked from root without following symlinks (adapters.files), never the Hub
    root: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.path, int) and not isinstance(self.path, bool) and isinstance(self.revision, str) \
                and self.root is None:
            self._from_vllm_positional()
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"adapter name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"adapter {self.name!r}: path must be a non-empty string, got {self.path!r}")
        if self.revision is not None and (not isinstance(self.revision, str) or not self.revision):
            raise ValueError(f"adapter {self.name!r}: revision must be a non-empty string or None")
        if self.root is not None:
            if not isinstance(self.root, str) or not self.root:
                raise ValueError(f"adapter {self.name!r}: root must be a non-empty string or None")
            try:
                confined_parts(self.relative_path)
            except PathEscapeError as exc:
                raise ValueError(f"adapter {self.name!r}: path must lie beneath root: {exc}") from None

    def _from_vllm_positional(self) -> None:
        """vLLM's positional form ``LoRARequest(lora_name, lora_int_id, lora_path)``: the int id is checked
        (vLLM requires it >= 1) and not kept; adapters are identified by name here."""
        if self.path < 1:
            raise ValueError(f"adapter {self.name!r}: the integer id of LoRARequest(name, int_id, path) must be "
                             f">= 1, got {self.path}")
        object.__setattr__(self, "path", self.revision)
        object.__setattr__(self, "revision", None)

    @property
    def lora_name(self) -> str:
        """vLLM's spelling of ``name``."""
        return self.name

    @property
    def lora_path(self) -> str:
        """vLLM's spelling of ``path``."""
        return self.path

    @property
    def relative_path(self) -> str:
        """path relative to root (lexically: nothing on disk is resolved); path itself without a root."""
        return self.path if self.root is None else os.path.relpath(self.path, self.root)

    @property
    def source(self) -> tuple[str, str | None]:
        """(path, revision): two requests with the same name but another source are a replacement."""
        return (self.path, self.revision)


@dataclass(frozen=True)
class LoRARequest(_AdapterRequest):
    """A PEFT LoRA adapter, by name, from a local dir or a Hub repo id (optionally at a revision)."""


@dataclass(frozen=True)
class PromptAdapterRequest(_AdapterRequest):
    """A PEFT prompt-tuning adapter (soft prompt), by name, from a local dir or a Hub repo id."""
