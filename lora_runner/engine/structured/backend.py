"""The structured-output backends (xgrammar, llguidance): the interface the engine uses, and the errors.

A backend turns a constraint ``(kind, text)`` (StructuredOutputsParams.key()) into a compiled grammar, counts
its bytes, and makes one Matcher per request from it; everything else (compile queue, caches, budgets,
min_tokens and ignore_eos) is shared and lives beside it in this package. Two implementations:
``xgrammar_backend`` (precomputed token masks per grammar state) and ``guidance_backend`` (llguidance:
lazy lexer, Earley parser, work per token bounded by its parser limits). Each is imported when the first
constraint needs it, so an engine that never sees a constraint imports neither; a backend that is not
installed fails the request with StructuredOutputError (a ValueError: HTTP 400) naming the package.
"""

from __future__ import annotations

import importlib
import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Collection

import torch

BACKENDS = ("auto", "xgrammar", "guidance")  # EngineConfig.structured_outputs_backend
AUTO_BACKEND = "guidance"  # what "auto" means: the measurements in benchmarks/bench_structured_backends.py
_PACKAGES = {"xgrammar": "xgrammar", "guidance": "llguidance"}  # backend -> the package it imports
REQUIREMENTS = {"xgrammar": "xgrammar>=0.1.20", "llguidance": "llguidance>=1.9"}  # as pyproject.toml's


class StructuredOutputError(ValueError):
    """A request's structured-output constraint cannot be used: its schema, regex or grammar does not
    compile, compiling it took longer than the engine allows, its matching went over a per-step bound, or
    the backend is not installed or cannot read it. The request alone fails (a 400 over HTTP)."""


def compile_timeout_error(timeout_s: float) -> StructuredOutputError:
    """What a request gets when its constraint is still compiling past ``timeout_s``."""
    return StructuredOutputError(f"structured_outputs took longer than {timeout_s:g} s to compile; simplify the "
                                 "constraint")


def import_backend(package: str):
    """The module `package` ("xgrammar", "llguidance"), imported once, then from sys.modules.

    Raises:
        StructuredOutputError: the package (or one of its dependencies) cannot be imported.
    """
    try:
        return importlib.import_module(package)
    except ImportError as exc:
        raise StructuredOutputError(
            f"structured_outputs needs the {package!r} package, which this server cannot import ({exc}); "
            f"install it (pip install '{REQUIREMENTS[package]}') or send the request without a constraint") from exc


def xgrammar():
    """The xgrammar module (StructuredOutputError when it cannot be imported)."""
    return import_backend("xgrammar")


def resolve_backend(name: str) -> str:
    """"xgrammar" or "guidance" for EngineConfig.structured_outputs_backend `name`; "auto": AUTO_BACKEND where
    its package is installed, else the other one (an install without llguidance keeps serving with xgrammar)."""
    assert name in BACKENDS, f"unknown structured-output backend {name!r}"
    if name != "auto":
        return name
    return AUTO_BACKEND if importlib.util.find_spec(_PACKAGES[AUTO_BACKEND]) is not None else "xgrammar"


def looks_like_lark(grammar: str) -> bool:
    """True when `grammar` reads as Lark (rules ``name: ...``) rather than EBNF / GBNF (``name ::= ...``)."""
    return "::=" not in grammar


class Matcher(ABC):
    """One request's position in its grammar (made per request from a compiled grammar)."""

    stop_token_ids: Collection[int]  # the ids that end the output once the grammar is complete

    @abstractmethod
    def fill(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the ids allowed next into row `index` of `bitmask` [C, ceil(V / 32)] int32 (bit set: allowed)."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by `token_id`; False when the grammar does not allow it (the matcher is then unusable)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once an end token was accepted."""

    @abstractmethod
    def only_end_allowed(self) -> bool:
        """True when the grammar is complete and nothing but an end token may follow."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding's rejected drafts)."""

    def step_error(self) -> str | None:
        """Why the last ``fill`` went over the backend's own per-step bound (None: it did not)."""
        return None


class Backend(ABC):
    """Compiles constraints for one tokenizer and vocabulary and makes the matchers of their requests.

    Implementations take (tokenizer, vocab_size, stop_token_ids): the model's transformers tokenizer, its
    (padded) vocabulary (ids past the tokenizer's stay banned) and the ids that end a request.
    """

    name: str

    @abstractmethod
    def compile(self, kind: str, text: str):
        """The compiled grammar of constraint (kind, text); StructuredOutputError when it cannot be compiled."""

    @abstractmethod
    def size_of(self, compiled) -> int:
        """Bytes a compiled grammar holds (what the tenant caches count)."""

    def reserve_bytes(self, kind: str, text: str) -> int:
        """What a compilation counts until its real size is known: 256 bytes per character of the constraint,
        at least 1 MiB (what it bounds is the per-tenant count of compilations in flight)."""
        return max(1 << 20, 256 * len(text))

    @abstractmethod
    def matcher(self, compiled) -> Matcher:
        """A fresh Matcher at the start of `compiled`."""

    @abstractmethod
    def matcher_bytes(self, compiled) -> int:
        """An estimate of what one request's matcher of `compiled` holds while its request lives (counted in its
        tenant's grammar bytes: CompileQueue.hold)."""

    def fill_batch(self, rows: list[tuple[Matcher, int]], bitmask: torch.Tensor) -> bool:
        """Fill row `index` of `bitmask` for each (matcher, index) of `rows` at once, in parallel (the backend's
        own threads, off the GIL); False when this backend cannot (the caller fills them one by one)."""
        return False
