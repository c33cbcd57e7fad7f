"""vLLM's ``qwen3_xml`` and ``qwen3_coder`` tool-call parsers (``--tool-call-parser``; one format, two
names): the Qwen3-Coder chat template asks for calls as XML-like markup inside the Hermes tags,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Each parameter's text (one newline on each side dropped) becomes a JSON value by the type the offered
function's schema gives that parameter, as vLLM converts it: ``null`` is null; string types stay text;
integer and number types are read as numbers (a number without a fraction as an integer); boolean is
``true``/``false``; objects, arrays and other types are read as JSON, else as a Python literal, else kept as
text (a parameter the schema does not name is text too). A ``</parameter>`` the model left out ends at the
next ``<parameter=`` or ``</function>``, as in vLLM.

Text around the markup is content, split as the Hermes parser splits it (hermes_parser: the same tags).
Unlike vLLM, a call goes out whole once its ``</tool_call>`` arrives (its arguments are typed values that
are only known when each parameter closes), and markup that is not one well-formed ``<function=...>``
block of an offered function, or repeats a parameter, stays content, as Hermes calls do.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Collection, Mapping

from lora_runner.entrypoints.openai.tool_calls.hermes_parser import HermesToolParser

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INTEGER_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_NUMBER_PREFIXES = ("num", "float", "double")
_BOOLEAN_TYPES = ("boolean", "bool", "binary")


class Qwen3XmlToolParser(HermesToolParser):
    """``--tool-call-parser qwen3_xml`` / ``qwen3_coder`` (module docstring). offered: the offered functions'
    names, or a mapping of each name to its parameters schema (the types the arguments are read as)."""

    def __init__(self, offered: Collection[str] | Mapping[str, dict]) -> None:
        super().__init__(offered)
        self.schemas = dict(offered) if isinstance(offered, Mapping) else {}

    def _stream_arguments(self, out, body: str) -> None:
        """Nothing before the call closes: each call is sent whole (module docstring)."""

    def _parsed(self, body: str) -> tuple[str, str] | None:
        match = _FUNCTION.fullmatch(body)
        if match is None or match.group(1).strip() not in self.offered:
            return None
        name = match.group(1).strip()
        properties = (self.schemas.get(name) or {}).get("properties") or {}
        arguments, position, inner = {}, 0, match.group(2)
        while inner[position:].strip():
            parameter = _PARAMETER.match(inner, position)
            if parameter is None or parameter.end() == position:
                return None
            key = parameter.group(1).strip()
            if key in arguments:  # which value counts would be a guess: shown as content instead
                return None
            arguments[key] = typed_value(_unwrapped(parameter.group(2)), properties.get(key))
            position = parameter.end()
        try:
            return name, json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        except (ValueError, TypeError):  # a literal that is no JSON value (nan, a set)
            return None


def _unwrapped(text: str) -> str:
    """A parameter's text without the one newline the template puts on each side of it."""
    text = text[1:] if text.startswith("\n") else text
    return text[:-1] if text.endswith("\n") else text


def schema_type(schema: dict | None) -> str | None:
    """The JSON-schema type a parameter is read as (lowercase): its ``type``, or the first non-null one of a
    type list or of ``anyOf`` / ``oneOf`` (pydantic's Optional[T]); None when the schema gives none."""
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if isinstance(kind, str):
        return kind.lower()
    if isinstance(kind, list):
        return next((k.lower() for k in kind if isinstance(k, str) and k.lower() != "null"), None)
    for branch in (*schema.get("anyOf", ()), *schema.get("oneOf", ())):
        found = schema_type(branch)
        if found not in (None, "null"):
            return found
    return None


def typed_value(text: str, schema: dict | None):
    """The JSON value of a parameter's `text` by its `schema`'s type (the module docstring's rules)."""
    if text.lower() == "null":
        return None
    kind = schema_type(schema)
    if kind is None or kind in _STRING_TYPES:
        return text
    if kind.startswith(_INTEGER_PREFIXES):
        try:
            return int(text.strip())
        except ValueError:
            return text
    if kind.startswith(_NUMBER_PREFIXES):
        try:
            number = float(text.strip())
        except ValueError:
            return text
        return int(number) if math.isfinite(number) and number == int(number) else number
    if kind in _BOOLEAN_TYPES:
        return text.strip().lower() == "true"
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:  # literals only: nothing of the model's text is ever run
        return ast.literal_eval(text.strip())
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return text
