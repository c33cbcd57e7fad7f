"""The llguidance backend: a lazy lexer and an Earley parser whose work per token is bounded by its limits.

Compiling builds the grammar and the lexer's first states only (milliseconds even for large schemas); the
token mask of each step is computed then, walking the tokenizer's trie. Every mask computation is bounded
by llguidance's parser limits (``LLParserLimits``: Earley items and lexer fuel per step): a grammar that
needs more (``s: s s | "a" | "b"``, whose items grow by ~4 per character: ~45 tokens of a 49k BPE vocabulary at
a 5 ms budget) stops computing, and its matcher's error fails that request alone at its next token, at the
same token wherever the step thread runs. The limits follow the operator's mask budget (``limits_for_budget``),
so the one setting bounds both backends (xgrammar's fills are timed after the fact: the engine's budget).

A compiled grammar is a matcher at the start of its grammar; each request gets a deep copy. llguidance
reports no sizes, so a compiled grammar counts an upper estimate (``GuidanceBackend.size_of``) measured by
benchmarks/bench_structured_backends.py, and each live request's copy ``MATCHER_BYTES`` (its lexer states grow
as it matches, to MAX_LEXER_STATES at most). Lark grammars are read natively, EBNF / GBNF converted to Lark.

A step's masks are filled together (``fill_batch``: llguidance's LLExecutor, its own threads, the GIL
released), so many constrained rows cost the step about the slowest of them per fill thread, not their sum.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Collection
from dataclasses import dataclass

import torch

from lora_runner.engine.structured.backend import (Backend, Matcher, StructuredOutputError, import_backend,
                                                   looks_like_lark)

# llguidance's speed on one x86 core of a loaded host: ~200 Earley items and ~800 lexer fuel per ms; at the
# default 250 ms budget this gives llguidance's own defaults (50_000 items, 200_000 fuel)
ITEMS_PER_MS, LEXER_FUEL_PER_MS = 200, 800
# floors for a tight budget: below them ordinary constraints fail (a "uri" format's lexer needs ~20_000 fuel
# for one step); an ambiguous grammar still stops within a few dozen tokens at 2_000 items
MIN_STEP_ITEMS, MIN_STEP_LEXER_FUEL = 2_000, 50_000
MAX_LEXER_STATES = 10_000  # lexer states one matcher may build (1-2 KiB each): bounds its growth to ~20 MiB
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{1,8}"  # at most 8 between JSON tokens (xgrammar_backend.MAX_JSON_WHITESPACE)
BYTES_PER_GRAMMAR_CHAR = 64  # size_of's estimate: llguidance's grammar, parser tables and first lexer states
MIN_GRAMMAR_BYTES = 64 << 10
# what a request's deep copy holds as it matches (its own parser state and the lexer states it builds): the
# corpus measures <= ~100 KiB of RSS per fed matcher (bench_structured_backends.py); the worst case is bounded
# apart, by MAX_LEXER_STATES (~20 MiB)
MATCHER_BYTES = 256 << 10
# fill_batch's threads: the step thread waits for the batch, so it may take most cores; a fifth is left to the
# event loop and the prompt pool (llguidance's own default: 80% of the cores, up to 32)
FILL_THREADS = min(16, max(2, (os.cpu_count() or 2) * 4 // 5))


def limits_for_budget(mask_budget_s: float):
    """llguidance's parser limits for a per-request mask budget of `mask_budget_s` (LLParserLimits)."""
    budget_ms = mask_budget_s * 1000
    return import_backend("llguidance").LLParserLimits(
        step_max_items=max(MIN_STEP_ITEMS, int(budget_ms * ITEMS_PER_MS)),
        step_lexer_fuel=max(MIN_STEP_LEXER_FUEL, int(budget_ms * LEXER_FUEL_PER_MS)),
        max_lexer_states=MAX_LEXER_STATES, verbose_errors=False)  # errors carry no parser state (tenant text) to logs


@dataclass(frozen=True)
class CompiledGuidance:
    """A compiled constraint: a matcher at its grammar's start (requests get deep copies) and the grammar's size."""
    start: object  # llguidance.LLMatcher, never advanced
    grammar_chars: int  # characters of llguidance's grammar text (size_of's estimate)


class GuidanceMatcher(Matcher):
    """An llguidance LLMatcher behind the Matcher interface."""

    def __init__(self, matcher, stop_token_ids: Collection[int]) -> None:
        self._matcher = matcher
        self.native = matcher  # the llguidance.LLMatcher (GuidanceBackend.fill_batch hands it to the executor)
        self.stop_token_ids = list(stop_token_ids)
        self._terminated = False
        self._end_unconsumed = False  # an end token accepted after llguidance stopped by itself

    def fill(self, bitmask: torch.Tensor, index: int) -> None:
        row = bitmask[index]  # [ceil(V / 32)] int32, written in place by llguidance (the GIL released)
        assert row.is_contiguous() and not row.is_cuda, "llguidance writes the mask into CPU memory"
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        if self._matcher.is_error():  # over its limits: the row says nothing, the request fails at its token
            row.fill_(-1)

    def step_error(self) -> str | None:
        if not self._matcher.is_error():
            return None
        return self._matcher.get_error() or "llguidance stopped"

    def accept_token(self, token_id: int) -> bool:
        if self._matcher.is_stopped():  # complete (llguidance stops by itself): only an end token continues it
            self._terminated = self._end_unconsumed = token_id in self.stop_token_ids and not self._matcher.is_error()
            return self._terminated
        # try_consume_tokens, not consume_token: a refused token leaves the matcher as it was (no error
        # state), as xgrammar's accept_token does; speculative decoding probes drafts this way
        if self._matcher.try_consume_tokens([token_id]) != 1:
            return False
        self._terminated = token_id in self.stop_token_ids
        return True

    def is_terminated(self) -> bool:
        return self._terminated

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._end_unconsumed:  # the end token accepted above without llguidance consuming it
            num_tokens, self._end_unconsumed = num_tokens - 1, False
        if num_tokens:
            self._matcher.rollback(num_tokens)
        # only an end token terminates, and nothing is accepted after it: any rollback undoes it
        self._terminated = self._terminated and num_tokens == 0

    def only_end_allowed(self) -> bool:
        # stopped: no token but an end token is accepted now (and the grammar is complete)
        return self._matcher.is_stopped() and not self._matcher.is_error()


class GuidanceBackend(Backend):
    """Constraints compiled by llguidance (see the module docstring); ``mask_budget_s`` sets its limits."""

    name = "guidance"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Collection[int], *,
                 mask_budget_s: float = 0.25) -> None:
        llg = import_backend("llguidance")  # StructuredOutputError when it is not installed
        from llguidance.hf import from_tokenizer

        self.stop_token_ids = sorted(stop_token_ids)
        try:
            self.tokenizer = from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=self.stop_token_ids or None)
        except ValueError as exc:  # a slow (Python) tokenizer, or one whose decoder it does not know
            raise StructuredOutputError(f"the guidance backend cannot read this model's tokenizer ({exc}); "
                                        'serve with structured_outputs_backend="xgrammar"') from exc
        self._llg = llg
        self.limits = limits_for_budget(mask_budget_s)
        self.fill_threads = FILL_THREADS
        self._executor = None  # llguidance.LLExecutor, made on the first batch
        self._executor_lock = threading.Lock()

    def compile(self, kind: str, text: str) -> CompiledGuidance:
        grammar = self._grammar(kind, text)
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            reason = matcher.get_error().strip().splitlines()
            raise StructuredOutputError(f"structured_outputs.{kind.removesuffix('_compact')} cannot be compiled: "
                                        f"{reason[0] if reason else 'llguidance refused it'}")
        return CompiledGuidance(matcher, len(grammar))

    def _grammar(self, kind: str, text: str) -> str:
        """llguidance's grammar (its JSON text) for constraint (kind, text)."""
        LLMatcher = self._llg.LLMatcher
        if kind in ("json", "json_compact", "json_object"):
            schema = '{"type": "object"}' if kind == "json_object" else json.dumps(
                closed_like_xgrammar(json.loads(text)))
            # compact: one space after "," and ":", as xgrammar writes JSON without any_whitespace; lenient: a
            # keyword llguidance does not enforce (uniqueItems, not, if/then, contains) is ignored, as xgrammar does
            options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "} \
                if kind == "json_compact" else {"whitespace_pattern": JSON_WHITESPACE}
            options["lenient"] = True
            return LLMatcher.grammar_from_json_schema(schema, overrides=options)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(ascii_classes(text))
        if kind == "grammar":
            return LLMatcher.grammar_from_lark(text) if looks_like_lark(text) else self._llg.grammar_from("gbnf", text)
        if kind == "choice":
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(text)))
        if kind == "structural_tag":
            return structural_tag_grammar(self._llg, json.loads(text))
        raise StructuredOutputError(f"unknown structured_outputs kind {kind!r}")

    def size_of(self, compiled: CompiledGuidance) -> int:
        """An upper estimate (llguidance reports no size): BYTES_PER_GRAMMAR_CHAR per character of the
        grammar, at least MIN_GRAMMAR_BYTES (benchmarks/bench_structured_backends.py checks it against RSS)."""
        return max(MIN_GRAMMAR_BYTES, BYTES_PER_GRAMMAR_CHAR * compiled.grammar_chars)

    def matcher(self, compiled: CompiledGuidance) -> GuidanceMatcher:
        return GuidanceMatcher(compiled.start.deep_copy(), self.stop_token_ids)

    def matcher_bytes(self, compiled: CompiledGuidance) -> int:
        return MATCHER_BYTES

    def fill_batch(self, rows: list[tuple[Matcher, int]], bitmask: torch.Tensor) -> bool:
        """All rows' masks by llguidance's executor at once; a matcher over its limits leaves its row all-allowed
        (it fails at its token, as in GuidanceMatcher.fill)."""
        if not all(isinstance(matcher, GuidanceMatcher) for matcher, _ in rows):
            return False
        with self._executor_lock:
            if self._executor is None:
                self._executor = self._llg.LLExecutor(self.fill_threads)
        # what llguidance.torch.fill_next_token_bitmask_par does; that module is not imported: it pulls in
        # torch._dynamo (~5 s on a loaded host, on the step thread at the first batch)
        assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and not bitmask.is_cuda, \
            "llguidance writes the masks into contiguous int32 CPU memory"
        batch, width = bitmask.shape  # [C, ceil(V / 32)]
        self._executor.unsafe_compute_mask_ptr([(matcher.native, index) for matcher, index in rows],
                                               bitmask.data_ptr(), width * bitmask.element_size(), batch)
        for matcher, index in rows:
            if matcher.native.is_error():
                bitmask[index].fill_(-1)
        return True


_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})  # their values are data, not schemas
# their values map names to schemas (a map is no schema itself, even with a key named "properties")
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def closed_like_xgrammar(schema):
    """A copy of `schema` (parsed JSON) closed as xgrammar's strict mode reads it, so that one schema allows the
    same outputs on both backends: an object schema with ``properties`` and no word on others has
    ``"additionalProperties": false``; an array schema with ``prefixItems`` and no ``items`` has ``"items": false``."""
    if isinstance(schema, list):
        return [closed_like_xgrammar(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            closed[key] = {name: closed_like_xgrammar(sub) for name, sub in value.items()}
        else:
            closed[key] = value if key in _DATA_KEYWORDS else closed_like_xgrammar(value)
    if isinstance(schema.get("properties"), dict) and not {"additionalProperties", "unevaluatedProperties",
                                                           "patternProperties"} & schema.keys():
        closed["additionalProperties"] = False
    if isinstance(schema.get("prefixItems"), list) and not {"items", "unevaluatedItems"} & schema.keys():
        closed["items"] = False
    return closed


_ASCII_IN_CLASS = {"d": "0-9", "w": "0-9A-Za-z_"}


def ascii_classes(regex: str) -> str:
    """`regex` with ``\\d`` and ``\\w`` (and ``\\D``, ``\\W`` outside brackets) meaning ASCII, as xgrammar and
    JSON Schema (ECMA-262) read them: llguidance's Rust syntax reads them as Unicode (a Unicode 16 digit for
    ``\\d``), so one constraint would allow other outputs on the two backends."""
    out, i, in_class = [], 0, False
    while i < len(regex):
        char = regex[i]
        if char == "\\" and i + 1 < len(regex):
            escaped = regex[i + 1]
            if in_class and escaped in _ASCII_IN_CLASS:
                out.append(_ASCII_IN_CLASS[escaped])
            elif not in_class and escaped in "dDwW":
                out.append(f"(?-u:\\{escaped})")
            else:
                out.append(char + escaped)
            i += 2
            continue
        if char == "[" and not in_class:
            in_class = True
            head = "[^" if regex.startswith("[^", i) else "["
            i += len(head)
            out.append(head)
            if regex.startswith("]", i):  # a "]" first in brackets is a member, not their end
                out.append("]")
                i += 1
            continue
        elif char == "]" and in_class:
            in_class = False
        out.append(char)
        i += 1
    return "".join(out)


def structural_tag_grammar(llg, tag: dict) -> str:
    """llguidance's grammar for vLLM's structural tag ``{"structures": [{"begin", "schema", "end"}],
    "triggers": [...]}``: free text in which each trigger opens its structure, whose body follows its schema."""
    if "format" in tag:
        raise StructuredOutputError('structured_outputs.structural_tag in xgrammar\'s "format" form needs '
                                    'structured_outputs_backend="xgrammar"; the guidance backend reads vLLM\'s '
                                    '{"structures": [...], "triggers": [...]}')
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list):
        raise StructuredOutputError("structured_outputs.structural_tag needs at least one structure and a list of "
                                    "triggers")
    tags = []
    for structure in structures:
        begin = structure.get("begin", "")
        trigger = next((t for t in triggers if isinstance(t, str) and t and begin.startswith(t)), None)
        if trigger is None:
            raise StructuredOutputError(f"structured_outputs.structural_tag: the structure beginning {begin!r} starts "
                                        "with none of its triggers")
        tags.append(llg.StructTag(trigger=trigger, begin=begin, grammar=structure.get("schema", {}),
                                  end=structure.get("end", "")))
    return llg.StructTag.to_grammar(tags)
