"""StructuredOutputsParams: the constraint a request's output must satisfy (vLLM's names and fields).

Exactly one of ``json`` (a JSON schema, as a dict or its JSON text), ``json_object`` (any JSON
object), ``regex``, ``choice`` (one of these strings) or ``grammar`` (an EBNF / GBNF grammar) is set.
This module only checks the shape of the request (sizes, nesting depth); the grammar engine that
compiles and enforces the constraint is lora_runner.engine.structured (xgrammar). GuidedDecodingParams
is vLLM's older spelling (``SamplingParams(guided_decoding=...)``), translated to StructuredOutputsParams.
"""

from __future__ import annotations

import copy as _copy
import json as _json
from collections.abc import Mapping
from dataclasses import dataclass

MAX_CONSTRAINT_CHARS = 64 * 1024  # longest schema / regex / grammar text one request may send
MAX_CHOICES = 1024  # most alternatives of a `choice` constraint
MAX_SCHEMA_DEPTH = 64  # deepest nesting of a JSON schema's dicts and lists (its converter recurses per level)

_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")

# vLLM's names of the structured-output backends -> EngineConfig.structured_outputs_backend's ("llguidance" is
# the package the guidance backend runs); the others vLLM names (outlines, lm-format-enforcer) are not here
BACKEND_NAMES = {"auto": "auto", "xgrammar": "xgrammar", "guidance": "guidance", "llguidance": "guidance"}


def backend_name(value, where: str) -> str:
    """EngineConfig.structured_outputs_backend's name of vLLM's backend `value` (ValueError naming `where`
    for a backend this engine does not have)."""
    if isinstance(value, str) and value in BACKEND_NAMES:
        return BACKEND_NAMES[value]
    raise ValueError(f"{where}={value!r} is not supported: structured outputs are compiled by xgrammar or "
                     "llguidance only (auto, xgrammar, guidance, llguidance)")


@dataclass
class StructuredOutputsParams:
    """One output constraint of a request (``SamplingParams.structured_outputs``).

    json: a JSON schema (dict or JSON text). json_object: True for "any JSON object". regex: a
    regular expression the whole output matches. choice: the output is exactly one of these
    strings. grammar: an EBNF grammar (GBNF dialect, as llama.cpp and xgrammar read it), or a Lark grammar
    (structured_outputs_backend "guidance"). structural_tag (vLLM): the JSON text of a structural tag, free
    text in which each trigger opens a tagged part that follows its schema
    (``{"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}`` or
    xgrammar's ``{"type": "structural_tag", "format": {...}}``).
    disable_any_whitespace (vLLM): a JSON output has no whitespace between its tokens (default: any).
    backend: the backend the request expects (vLLM's GuidedDecodingParams.backend, "llguidance" for
    "guidance"); None or "auto": the server's. As in vLLM V1 a request cannot choose: the engine refuses one
    that differs from its own with ValueError (HTTP 400). Not part of ``key()``.

    Raises ValueError when none or more than one kind is set, or a value has the wrong type or size.
    """

    json: str | dict | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    structural_tag: str | None = None
    backend: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None and isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        self.validate()

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "json_object", "regex", "choice" or "grammar"."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def validate(self) -> None:
        """Check that exactly one kind is set and its value is well formed; ValueError otherwise."""
        set_kinds = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError("structured_outputs needs exactly one of json, json_object, regex, choice, grammar, "
                             "structural_tag; "
                             f"got {set_kinds or 'none'}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs.disable_any_whitespace must be True or False, "
                             f"got {self.disable_any_whitespace!r}")
        if self.backend is not None:
            self.backend = backend_name(self.backend, "structured_outputs.backend")
        if self.json_object not in (None, False, True):
            raise ValueError(f"structured_outputs.json_object must be True or False, got {self.json_object!r}")
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else None
            if text is None:
                if not isinstance(self.json, dict):
                    raise ValueError(f"structured_outputs.json must be a JSON schema (dict or JSON text), "
                                     f"got {type(self.json).__name__}")
                try:
                    text = _json.dumps(self.json)
                except (TypeError, ValueError, RecursionError) as exc:
                    raise ValueError(f"structured_outputs.json is not JSON-serializable: {exc}") from None
            _check_text("json", text)
            _check_schema_depth(text)
        if self.structural_tag is not None:
            _check_structural_tag(self.structural_tag)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, str):
                    raise ValueError(f"structured_outputs.{name} must be a string, got {type(value).__name__}")
                _check_text(name, value)
        if self.choice is not None:
            choice = self.choice
            if not isinstance(choice, list) or not 0 < len(choice) <= MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice must be a list of 1..{MAX_CHOICES} strings")
            if not all(isinstance(c, str) for c in choice):
                raise ValueError("structured_outputs.choice must hold strings only")
            _check_text("choice", "".join(choice))

    def copy(self) -> StructuredOutputsParams:
        """A deep copy (a schema dict included): later changes of this object never reach the copy."""
        return _copy.deepcopy(self)

    def key(self) -> tuple[str, str]:
        """(kind, text): what identifies the compiled grammar (the grammar compiler's cache key); kind
        "json_compact" is a schema without whitespace (disable_any_whitespace)."""
        kind = self.kind
        if kind == "json":
            return "json_compact" if self.disable_any_whitespace else kind, self.json_schema_text()
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, _json.dumps(self.choice)
        return kind, getattr(self, kind)

    def json_schema_text(self) -> str | None:
        """The JSON schema as text (None unless ``json`` is set)."""
        if self.json is None:
            return None
        return self.json if isinstance(self.json, str) else _json.dumps(self.json)


# GuidedDecodingParams fields with no StructuredOutputsParams counterpart: the values that change nothing here,
# and why any other value is refused
_GUIDED_ONLY = {
    "backend_was_auto": ((None, False, True), "it must be True or False"),
    "disable_fallback": ((None, False, True), "it must be True or False"),  # there is no backend to fall back to
    # True is what both backends do: an object schema with properties takes no others unless it says so
    # (guidance_backend.closed_like_xgrammar); False, vLLM's default, leaves that as it is
    "disable_additional_properties": ((None, False, True), "it must be True or False"),
    "whitespace_pattern": ((None,), "JSON whitespace is any whitespace or none (disable_any_whitespace)"),
}


@dataclass
class GuidedDecodingParams:
    """vLLM's older constraint type (``vllm.sampling_params.GuidedDecodingParams``), read by
    ``SamplingParams(guided_decoding=...)`` as the StructuredOutputsParams it stands for.

    json, regex, choice, grammar, json_object and disable_any_whitespace mean what they mean in
    StructuredOutputsParams. backend may be None, "auto", "xgrammar", "guidance" or "llguidance" (the engine
    refuses one that differs from its own, as vLLM V1); disable_fallback and backend_was_auto change nothing (a
    constraint never falls back to another backend); disable_additional_properties=True is what both backends
    do anyway (object schemas with properties take no others unless they say so). ValueError, naming the field,
    for whitespace_pattern or a backend this engine does not have.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    backend: str | None = None
    backend_was_auto: bool = False
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        self.to_structured_outputs()  # refuses what cannot be honoured now, not when the request runs

    def to_structured_outputs(self) -> StructuredOutputsParams:
        """The StructuredOutputsParams of this constraint (ValueError naming a field this engine lacks)."""
        for name, (honoured, reason) in _GUIDED_ONLY.items():
            value = getattr(self, name)
            if not any(value is v or isinstance(v, str) and value == v for v in honoured):
                raise ValueError(f"guided_decoding.{name}={value!r} is not supported: {reason}")
        backend = None if self.backend is None else backend_name(self.backend, "guided_decoding.backend")
        return StructuredOutputsParams(json=self.json, json_object=self.json_object, regex=self.regex,
                                       choice=self.choice, grammar=self.grammar, structural_tag=self.structural_tag,
                                       disable_any_whitespace=self.disable_any_whitespace, backend=backend)


def as_structured_outputs(guided_decoding) -> StructuredOutputsParams:
    """``SamplingParams(guided_decoding=...)``: a GuidedDecodingParams, a StructuredOutputsParams, or a dict of
    GuidedDecodingParams' fields, as a StructuredOutputsParams of its own (ValueError otherwise)."""
    if isinstance(guided_decoding, StructuredOutputsParams):
        return guided_decoding.copy()
    if isinstance(guided_decoding, Mapping):
        unknown = sorted(set(guided_decoding) - set(GuidedDecodingParams.__dataclass_fields__))
        if unknown:
            raise ValueError(f"guided_decoding has unknown fields {unknown}")
        guided_decoding = GuidedDecodingParams(**guided_decoding)
    if not isinstance(guided_decoding, GuidedDecodingParams):
        raise ValueError("guided_decoding must be a GuidedDecodingParams, a StructuredOutputsParams or a dict, "
                         f"got {type(guided_decoding).__name__}")
    return guided_decoding.to_structured_outputs()


def _check_structural_tag(text) -> None:
    """ValueError unless `text` is a string holding a JSON object (and within the size limit)."""
    if not isinstance(text, str):
        raise ValueError(f"structured_outputs.structural_tag must be a string (JSON text), got {type(text).__name__}")
    _check_text("structural_tag", text)
    _check_schema_depth(text, "structural_tag")
    tag = _json.loads(text)
    if not isinstance(tag, dict) or not ({"structures", "triggers"} <= tag.keys() or "format" in tag):
        raise ValueError('structured_outputs.structural_tag must be a JSON object with "structures" and "triggers" '
                         '(vLLM\'s structural tag) or a "format" (xgrammar\'s)')


def _check_text(name: str, text: str) -> None:
    if not text:
        raise ValueError(f"structured_outputs.{name} must not be empty")
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"structured_outputs.{name} has {len(text)} characters, more than the limit of "
                         f"{MAX_CONSTRAINT_CHARS}")


def _check_schema_depth(text: str, name: str = "json") -> None:
    """ValueError when the schema nests deeper than MAX_SCHEMA_DEPTH (or is no JSON at all)."""
    try:
        schema = _json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"structured_outputs.{name} is not valid JSON: {exc}") from None
    stack = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"structured_outputs.{name} nests deeper than {MAX_SCHEMA_DEPTH} levels")
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
