"""Checks of a request's ``tools`` beyond their pydantic shape (400 with an OpenAI-shaped body).

A tenant's tools are rendered into the prompt and, for forced choices, compiled into an output
constraint: their number, total size and nesting are bounded, names are OpenAI's (letters, digits,
``_`` and ``-``, at most 64) and unique, and ``parameters`` is a JSON schema of an object.
"""

from __future__ import annotations

import json
import re

from lora_runner.entrypoints.openai.errors import APIError
from lora_runner.entrypoints.openai.protocol import ChatTool

MAX_TOOLS = 128  # OpenAI's limit
MAX_TOOLS_CHARS = 64 * 1024  # all tool definitions as JSON text
MAX_SCHEMA_DEPTH = 32  # nesting of dicts and lists in one parameters schema
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SCHEMA_OBJECT_KEYS = ("properties", "$defs", "definitions", "patternProperties")  # values: dicts of schemas


def _invalid(message: str, code: str = "invalid_tools") -> APIError:
    return APIError(400, message, code)


def checked_tools(tools: list[ChatTool]) -> list[dict]:
    """The tools as the dicts chat templates read ({"type": "function", "function": {...}}); 400 for
    too many, too large, a bad or repeated name, or parameters that are no object schema."""
    if len(tools) > MAX_TOOLS:
        raise _invalid(f"{len(tools)} tools, more than the limit of {MAX_TOOLS}", "too_many_tools")
    dicts = [tool.model_dump(exclude_none=True) for tool in tools]
    size = len(json.dumps(dicts, ensure_ascii=False))
    if size > MAX_TOOLS_CHARS:
        raise _invalid(f"the tools take {size} characters as JSON, more than the limit of {MAX_TOOLS_CHARS}",
                       "tools_too_large")
    seen = set()
    for index, tool in enumerate(tools):
        name = tool.function.name
        if not NAME.fullmatch(name):
            raise _invalid(f"tools[{index}].function.name {name[:80]!r} must be 1 to 64 letters, digits, '_' or '-'")
        if name in seen:
            raise _invalid(f"tools[{index}].function.name {name!r} is used by another tool too")
        seen.add(name)
        if tool.function.parameters is not None:
            check_parameters(tool.function.parameters, f"tools[{index}].function.parameters")
    return dicts


def check_parameters(schema: dict, where: str) -> None:
    """400 unless `schema` is a JSON schema of an object, nested at most MAX_SCHEMA_DEPTH deep."""
    if schema.get("type", "object") != "object":
        raise _invalid(f"{where} must be a JSON schema of an object (\"type\": \"object\"), "
                       f"got type {schema.get('type')!r}")
    if _depth(schema) > MAX_SCHEMA_DEPTH:  # any value (defaults, enums, examples), before walking it
        raise _invalid(f"{where} is nested more than {MAX_SCHEMA_DEPTH} deep")
    _check_schema(schema, where)


def _depth(value) -> int:
    """How deep dicts and lists nest in `value` (iteratively: a deep value must not exhaust the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack += [(sub, depth + 1) for sub in (item.values() if isinstance(item, dict) else item)]
    return deepest


def _check_schema(schema, where: str) -> None:
    """The keywords that hold schemas, recursively (bounded: check_parameters checked the depth first)."""
    if isinstance(schema, bool):  # true / false are schemas too
        return
    if not isinstance(schema, dict):
        raise _invalid(f"{where} must be a JSON schema (an object), got {type(schema).__name__}")
    kind = schema.get("type")
    if kind is not None and not isinstance(kind, (str, list)):
        raise _invalid(f"{where}.type must be a string or a list of strings")
    required = schema.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise _invalid(f"{where}.required must be a list of property names")
    for key in _SCHEMA_OBJECT_KEYS:
        if key in schema:
            if not isinstance(schema[key], dict):
                raise _invalid(f"{where}.{key} must be an object of schemas")
            for name, sub in schema[key].items():
                _check_schema(sub, f"{where}.{key}.{name}")
    for key in ("items", "additionalProperties", "not"):
        if isinstance(schema.get(key), (dict, bool)):
            _check_schema(schema[key], f"{where}.{key}")
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if key in schema:
            if not isinstance(schema[key], list):
                raise _invalid(f"{where}.{key} must be a list of schemas")
            for position, sub in enumerate(schema[key]):
                _check_schema(sub, f"{where}.{key}[{position}]")


def embedded_schemas(parameters: dict[str, dict]) -> tuple[dict, dict]:
    """(root ``$defs``, {tool name: the schema to embed}) for embedding each tool's parameters schema
    inside a larger one. A schema with local ``$ref``s cannot be copied in as it is: its pointers are
    relative to its own root. It moves into the root's ``$defs`` under the tool's name, its own
    ``$defs`` / ``definitions`` beside it as "<tool>.<def>" (names hold no "." or "/", so nothing
    collides), every local ``$ref`` rewritten to match, and the embedded schema is a ``$ref`` to it."""
    defs, embedded = {}, {}
    for name, schema in parameters.items():
        if not _has_local_ref(schema):
            embedded[name] = schema
            continue
        root = {key: value for key, value in schema.items() if key not in ("$defs", "definitions")}
        defs[name] = _rewritten_refs(root, name)
        for key, separator in (("$defs", "."), ("definitions", ":")):
            for def_name, sub in (schema.get(key) or {}).items():
                defs[f"{name}{separator}{def_name}"] = _rewritten_refs(sub, name)
        embedded[name] = {"$ref": f"#/$defs/{name}"}
    return defs, embedded


def _has_local_ref(value) -> bool:
    if isinstance(value, dict):
        return any((key == "$ref" and isinstance(sub, str) and sub.startswith("#")) or _has_local_ref(sub)
                   for key, sub in value.items())
    return isinstance(value, list) and any(_has_local_ref(sub) for sub in value)


def _rewritten_refs(value, name: str):
    """`value` with each local ``$ref`` of tool `name`'s schema pointing where embedded_schemas moved it
    (recursion bounded: check_parameters bounded the depth)."""
    if isinstance(value, list):
        return [_rewritten_refs(sub, name) for sub in value]
    if not isinstance(value, dict):
        return value
    out = {key: _rewritten_refs(sub, name) for key, sub in value.items()}
    ref = value.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        if ref.startswith("#/$defs/"):
            out["$ref"] = f"#/$defs/{name}.{ref[len('#/$defs/'):]}"
        elif ref.startswith("#/definitions/"):
            out["$ref"] = f"#/$defs/{name}:{ref[len('#/definitions/'):]}"
        else:  # the schema's root or a pointer into it
            out["$ref"] = f"#/$defs/{name}{ref[1:]}"
    return out
