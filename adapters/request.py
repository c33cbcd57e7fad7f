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
        """vLLM's positional form ``PromptAdapterRequest(name, int_id, path)``: the int id is checked
        (vLLM requires it >= 1) and not kept; adapters are identified by name here."""
        _check_int_id(self.name, self.path)
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


@dataclass(frozen=True, init=False)
class LoRARequest(_AdapterRequest):
    """A PEFT LoRA adapter, by name, from a local dir or a Hub repo id (optionally at a revision).

    ``LoRARequest(name, path, revision=None, root=None)``; vLLM's spellings are the same request:
    ``LoRARequest(lora_name, lora_int_id, lora_path)`` positionally, or with the keywords ``lora_name``,
    ``lora_int_id``, ``lora_path`` (``lora_local_path``: its deprecated name) and ``base_model_name``.
    The integer id must be >= 1 (as in vLLM) and is not kept: adapters are identified by name here, so
    two requests that differ only in their id are equal. ``base_model_name`` is accepted and not used (the
    adapter is checked against the engine's model when it loads). ValueError for a name or path given twice
    (positionally and by keyword), an id without a path, and vLLM's ``long_lora_max_len`` and
    ``tensorizer_config_dict`` (long-context LoRA and tensorizer loading are not implemented).

    ``draft_lora_path`` (ours): a PEFT LoRA trained for the speculative draft model ("draft_model" method,
    lora_runner.spec_decode.draft_adapters), loaded, validated and refused as any adapter, against the draft
    model; None: the draft runs without an adapter for this request. Beneath ``root`` too when one is given.
    """

    draft_lora_path: str | None = None

    def __init__(self, name: str | None = None, path: str | int | None = None, revision: str | None = None,
                 root: str | None = None, *, lora_name: str | None = None, lora_int_id: int | None = None,
                 lora_path: str | None = None, lora_local_path: str | None = None,
                 base_model_name: str | None = None, long_lora_max_len: int | None = None,
                 tensorizer_config_dict: dict | None = None, draft_lora_path: str | None = None) -> None:
        for option, value in (("long_lora_max_len", long_lora_max_len),
                              ("tensorizer_config_dict", tensorizer_config_dict)):
            if value is not None:
                raise ValueError(f"LoRARequest({option}=...) is not supported: long-context LoRA and tensorizer "
                                 "loading are not implemented")
        if isinstance(path, int) and not isinstance(path, bool) and root is None:
            # vLLM's positional form (name, int_id, path): the int is the id, never a path
            if lora_int_id is not None:
                raise ValueError(f"LoRARequest got the integer id twice ({path} and lora_int_id={lora_int_id})")
            path, revision, lora_int_id = revision, None, path
        name = _one_of("name", name, ("lora_name", lora_name))
        path = _one_of("path", path, ("lora_path", lora_path), ("lora_local_path", lora_local_path))
        if lora_int_id is not None:
            _check_int_id(name, lora_int_id)
            if path is None:
                raise ValueError(f"adapter {name!r}: vLLM's form needs the adapter's path: "
                                 "LoRARequest(lora_name, lora_int_id, lora_path)")
        if base_model_name is not None and not isinstance(base_model_name, str):
            raise ValueError(f"adapter {name!r}: base_model_name must be a string or None, got {base_model_name!r}")
        for field_name, value in (("name", name), ("path", path), ("revision", revision), ("root", root),
                                  ("draft_lora_path", draft_lora_path)):
            object.__setattr__(self, field_name, value)
        self.__post_init__()
        if draft_lora_path is not None:
            self.draft_request  # noqa: B018 - checks the draft path now (a non-empty string, beneath root)

    @property
    def draft_request(self) -> LoRARequest | None:
        """The draft model's adapter as a request of its own (the same name, its draft_lora_path, the same
        root; no revision: a Hub draft adapter is read at its default branch); None without one."""
        if self.draft_lora_path is None:
            return None
        if not isinstance(self.draft_lora_path, str) or not self.draft_lora_path:
            raise ValueError(f"adapter {self.name!r}: draft_lora_path must be a non-empty string or None, "
                             f"got {self.draft_lora_path!r}")
        return LoRARequest(self.name, self.draft_lora_path, root=self.root)


@dataclass(frozen=True)
class PromptAdapterRequest(_AdapterRequest):
    """A PEFT prompt-tuning adapter (soft prompt), by name, from a local dir or a Hub repo id."""


def _check_int_id(name, int_id) -> None:
    """vLLM's integer adapter id: checked as vLLM does (an int >= 1), then dropped."""
    if not isinstance(int_id, int) or isinstance(int_id, bool) or int_id < 1:
        raise ValueError(f"adapter {name!r}: the integer id of LoRARequest(name, int_id, path) must be "
                         f">= 1, got {int_id!r}")


def _one_of(what: str, value, *aliases: tuple[str, object]):
    """`value`, or the one alias given instead; ValueError when two of them are given."""
    given = [(what, value)] if value is not None else []
    given += [(alias, alias_value) for alias, alias_value in aliases if alias_value is not None]
    if len(given) > 1:
        raise ValueError(f"LoRARequest got its {what} twice: {', '.join(f'{n}={v!r}' for n, v in given)}")
    return given[0][1] if given else None
