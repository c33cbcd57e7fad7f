"""A JSON schema's length-bounded strings as patterns, before xgrammar compiles it.

xgrammar 0.2.9 compiles a ``{"type": "string", "minLength": a, "maxLength": b}`` into a character class
that lets raw control characters (U+0000..U+001F) into the string: the output is then no JSON (RFC 8259
forbids them unescaped; ``json.loads`` refuses it). Its unbounded strings exclude them. Here each such
schema becomes the same bounds as a ``pattern`` that excludes them (and, as xgrammar's bounded class
does, quotes and backslashes: no escapes), which xgrammar compiles correctly.
"""

from __future__ import annotations

# what the value of these keywords holds is data, not schemas: never rewritten
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
_OTHER_STRING_RULES = ("pattern", "format", "enum", "const")  # xgrammar takes these instead of the lengths


def bounded_strings_as_patterns(schema):
    """A copy of `schema` (parsed JSON) with every length-bounded string schema written as a pattern."""
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in _DATA_KEYWORDS else bounded_strings_as_patterns(value)
           for key, value in schema.items()}
    low, high = out.get("minLength", 0), out.get("maxLength")
    bounded = ("minLength" in out or "maxLength" in out) and _count(low) and (high is None or _count(high))
    if out.get("type") == "string" and bounded and not any(rule in out for rule in _OTHER_STRING_RULES):
        out.pop("minLength", None)
        out.pop("maxLength", None)
        out["pattern"] = '^[^"\\\\\\x00-\\x1f]{%d,%s}$' % (low, "" if high is None else high)
    return out  # malformed bounds stay: xgrammar refuses them


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
