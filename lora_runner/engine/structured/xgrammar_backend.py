"""The xgrammar backend: constraints compiled ahead into token masks per grammar state (CompiledGrammar).

Parsing a JSON schema into a grammar and compiling its token masks can take seconds for a large schema
(xgrammar releases the GIL meanwhile: the compile queue runs it off the step thread). A compiled grammar
counts xgrammar's own ``memory_size_bytes``; xgrammar's compiler cache is bounded in bytes as well. Its
matching work per token is not bounded by xgrammar itself (an ambiguous grammar grows it token by token):
the engine's per-request mask budget is what stops it. Lark grammars are not read (xgrammar takes EBNF):
such a constraint is refused, naming the backend that reads them.
"""

from __future__ import annotations

import json
from collections.abc import Collection

import torch

from lora_runner.engine.structured.backend import Backend, Matcher, StructuredOutputError, looks_like_lark, xgrammar
from lora_runner.engine.structured.string_lengths import bounded_strings_as_patterns

XGRAMMAR_CACHE_BYTES = 64 << 20  # bound of xgrammar's own compiler cache
# what one request's GrammarMatcher holds: its persistent stack and rollback history (the token masks stay the
# compiled grammar's, shared); benchmarks/bench_structured_backends.py measures <= ~26 KiB of RSS per matcher
MATCHER_BYTES = 64 << 10
# longest whitespace run between JSON tokens: unbounded, a model can stay in whitespace until max_tokens
MAX_JSON_WHITESPACE = 8


class XGrammarMatcher(Matcher):
    """An xgrammar GrammarMatcher behind the Matcher interface."""

    def __init__(self, compiled) -> None:
        self._matcher = xgrammar().GrammarMatcher(compiled)
        self._vocab_size = compiled.tokenizer_info.vocab_size
        self.stop_token_ids = list(self._matcher.stop_token_ids)

    def fill(self, bitmask: torch.Tensor, index: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, index)

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def only_end_allowed(self) -> bool:
        from lora_runner.sample.token_masks import unpack_bitmask

        if not self._matcher.is_completed():  # cheap, and false for most states: no bitmask then
            return False
        bitmask = xgrammar().allocate_token_bitmask(1, self._vocab_size)  # [1, ceil(V / 32)] int32
        self._matcher.fill_next_token_bitmask(bitmask)
        allowed = unpack_bitmask(bitmask, self._vocab_size)[0]  # [V] bool
        allowed[self.stop_token_ids] = False
        return not bool(allowed.any())


class XGrammarBackend(Backend):
    """Constraints compiled by xgrammar (see the module docstring)."""

    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Collection[int]) -> None:
        xgr = xgrammar()  # StructuredOutputError when it is not installed
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                 stop_token_ids=sorted(stop_token_ids) or None)
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=True,
                                             cache_limit_bytes=XGRAMMAR_CACHE_BYTES)

    def compile(self, kind: str, text: str):  # -> xgrammar.CompiledGrammar
        compiler = self._compiler
        if kind in ("json", "json_compact"):
            text = json.dumps(bounded_strings_as_patterns(json.loads(text)))  # xgrammar's control characters
            return compiler.compile_json_schema(text, any_whitespace=kind == "json",
                                                max_whitespace_cnt=MAX_JSON_WHITESPACE if kind == "json" else None)
        if kind == "json_object":  # any JSON object (xgrammar's builtin JSON grammar takes any value)
            return compiler.compile_json_schema('{"type": "object"}', max_whitespace_cnt=MAX_JSON_WHITESPACE)
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "grammar":
            if looks_like_lark(text):
                raise StructuredOutputError(
                    "structured_outputs.grammar is a Lark grammar, which the xgrammar backend does not read: write "
                    'it in EBNF (rules as `name ::= ...`) or serve with structured_outputs_backend="guidance"')
            return compiler.compile_grammar(text)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(json.loads(text)))
        if kind == "structural_tag":
            return compiler.compile_structural_tag(json.dumps(xgrammar_structural_tag(json.loads(text))))
        raise StructuredOutputError(f"unknown structured_outputs kind {kind!r}")

    def size_of(self, compiled) -> int:
        """xgrammar's ``memory_size_bytes`` (an older xgrammar without it: the length of its serialized form,
        which holds the same grammar and token masks)."""
        size = getattr(compiled, "memory_size_bytes", None)
        return int(size) if size is not None else len(compiled.serialize_json())

    def matcher(self, compiled) -> XGrammarMatcher:
        return XGrammarMatcher(compiled)

    def matcher_bytes(self, compiled) -> int:
        return MATCHER_BYTES


def xgrammar_structural_tag(tag: dict) -> dict:
    """xgrammar's structural tag (``{"type": "structural_tag", "format": ...}``) for `tag`: one already in that
    form, or vLLM's ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`` as triggered tags."""
    if "format" in tag:
        return tag
    tags = [{"type": "tag", "begin": structure["begin"], "end": structure["end"],
             "content": {"type": "json_schema", "json_schema": structure.get("schema", {})}}
            for structure in tag["structures"]]
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": tag["triggers"], "tags": tags}}


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices` (JSON string literals are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)
