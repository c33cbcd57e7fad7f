"""What a request says about its adapter: a name plus where the weights live."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class _AdapterRequest:
    name: str  # identifies the adapter; same name + other path/revision = replacement
    path: str  # local directory or Hugging Face Hub repo id
    revision: str | None = None  # branch, tag or commit (Hub only)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"adapter name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"adapter {self.name!r}: path must be a non-empty string, got {self.path!r}")
        if self.revision is not None and (not isinstance(self.revision, str) or not self.revision):
            raise ValueError(f"adapter {self.name!r}: revision must be a non-empty string or None")

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
