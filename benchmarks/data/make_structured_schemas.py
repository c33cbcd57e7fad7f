"""Writes benchmarks/data/structured_schemas.json (read by bench_structured_backends.py): JSON schemas spanning
JSONSchemaBench's features, each with one valid instance (checked with jsonschema). Run it after editing the list."""
import json, jsonschema

C = []
def add(name, schema, instance):
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER).validate(instance)
    C.append({"name": name, "features": name.split(":")[0], "schema": schema, "instance": instance})

# --- basic types and bounds
add("types:integer", {"type": "integer"}, 42)
add("types:number-range", {"type": "number", "minimum": -1.5, "maximum": 100}, 3.25)
add("types:exclusive", {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}, 7)
add("types:multipleOf", {"type": "integer", "multipleOf": 5}, 35)
add("types:boolean", {"type": "boolean"}, False)
add("types:null", {"type": "null"}, None)
add("types:nullable", {"type": ["string", "null"]}, None)
add("types:string-len", {"type": "string", "minLength": 3, "maxLength": 8}, "hello")
add("types:string-long", {"type": "string", "maxLength": 200}, "a sentence with several words in it.")
add("types:const", {"const": "fixed"}, "fixed")
add("enum:strings", {"enum": ["red", "green", "blue"]}, "green")
add("enum:mixed", {"enum": [1, "two", None, True]}, "two")
add("enum:many", {"enum": [f"item_{i:03d}" for i in range(200)]}, "item_123")
# --- objects
add("object:simple", {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                      "required": ["name", "age"]}, {"name": "Ada", "age": 36})
add("object:optional", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                        "required": ["a"]}, {"a": 1})
add("additionalProperties:false", {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                                   "required": ["x", "y"], "additionalProperties": False}, {"x": 1.5, "y": -2})
add("additionalProperties:schema", {"type": "object", "additionalProperties": {"type": "integer"}},
    {"k1": 1, "k2": 2})
add("additionalProperties:true", {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"],
                                  "additionalProperties": True}, {"id": 3, "extra": "yes"})
add("patternProperties", {"type": "object", "patternProperties": {"^x_[a-z]+$": {"type": "string"}},
                          "additionalProperties": False}, {"x_ab": "v"})
add("object:minProperties", {"type": "object", "additionalProperties": {"type": "boolean"}, "minProperties": 2,
                             "maxProperties": 3}, {"a": True, "b": False})
add("object:empty", {"type": "object"}, {})
add("object:any", {"type": "object"}, {"any": [1, {"nested": None}], "s": "t"})
add("object:wide", {"type": "object", "properties": {f"field_{i}": {"type": "integer"} for i in range(40)},
                    "required": [f"field_{i}" for i in range(40)]}, {f"field_{i}": i for i in range(40)})
add("object:deep", {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {
    "type": "object", "properties": {"c": {"type": "object", "properties": {"d": {"type": "string"}},
                                           "required": ["d"]}}, "required": ["c"]}}, "required": ["b"]}},
    "required": ["a"]}, {"a": {"b": {"c": {"d": "deep"}}}})
add("object:dependentRequired", {"type": "object", "properties": {"card": {"type": "string"}, "cvv": {"type": "string"}},
                                 "dependentRequired": {"card": ["cvv"]}}, {"card": "4111", "cvv": "123"})
# --- arrays
add("array:items", {"type": "array", "items": {"type": "integer"}}, [1, 2, 3])
add("minItems:maxItems", {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 4},
    ["a", "b", "c"])
add("minItems:exact", {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3},
    [True, False, True])
add("nested-arrays:matrix", {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
    [[1, 2], [3.5, 4]])
add("nested-arrays:bounded", {"type": "array", "items": {"type": "array", "items": {"type": "integer"},
                                                           "minItems": 1, "maxItems": 2}, "minItems": 1, "maxItems": 3},
    [[1], [2, 3]])
add("array:prefixItems", {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]}, ["x", 1])
add("array:uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2, 3])
add("array:contains", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}}, [1, 7])
add("array:objects", {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"},
                                                                                   "tag": {"enum": ["a", "b"]}},
                                                     "required": ["id", "tag"]}, "maxItems": 5},
    [{"id": 1, "tag": "a"}, {"id": 2, "tag": "b"}])
# --- patterns and formats
add("pattern:digits", {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}, "555-1234")
add("pattern:word", {"type": "string", "pattern": "^[A-Z][a-z]+$"}, "Hello")
add("pattern:unanchored", {"type": "string", "pattern": "ab+c"}, "xxabbcyy")
add("pattern:escapes", {"type": "string", "pattern": "^\\d+(\\.\\d{1,2})?$"}, "12.50")
add("pattern:alternation", {"type": "string", "pattern": "^(cat|dog|bird)s?$"}, "dogs")
add("pattern:hex", {"type": "string", "pattern": "^#[0-9a-fA-F]{6}$"}, "#1a2B3c")
add("pattern:with-length", {"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 5}, "abc")
for fmt, value in (("date", "2024-02-29"), ("date-time", "2024-02-29T12:30:00Z"), ("time", "12:30:00Z"),
                   ("email", "ada@example.com"), ("uuid", "123e4567-e89b-12d3-a456-426614174000"),
                   ("ipv4", "192.168.0.1"), ("ipv6", "2001:db8::1"), ("uri", "https://example.com/a?b=c"),
                   ("hostname", "example.com"), ("duration", "P3D")):
    add(f"format:{fmt}", {"type": "string", "format": fmt}, value)
add("format:in-object", {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"},
                                                          "who": {"type": "string", "format": "email"}},
                         "required": ["when", "who"]}, {"when": "2020-01-01T00:00:00Z", "who": "a@b.co"})
# --- composition
add("anyOf:types", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "s")
add("anyOf:objects", {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]},
    {"b": "x"})
add("oneOf:tagged", {"oneOf": [
    {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}}, "required": ["kind", "r"]},
    {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "number"}},
     "required": ["kind", "side"]}]}, {"kind": "square", "side": 2})
add("oneOf:scalars", {"oneOf": [{"type": "boolean"}, {"type": "null"}]}, True)
add("allOf:merge", {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                              {"type": "object", "properties": {"a": {"minimum": 0}}}]}, {"a": 5})
add("allOf:ref", {"$defs": {"base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}},
                  "allOf": [{"$ref": "#/$defs/base"}, {"type": "object", "properties": {"id": {"maximum": 100}}}]},
    {"id": 9})
add("not:type", {"not": {"type": "string"}}, 3)
add("if-then-else", {"type": "object", "properties": {"c": {"type": "string"}, "z": {"type": "string"}},
                     "if": {"properties": {"c": {"const": "US"}}}, "then": {"required": ["z"]}}, {"c": "US", "z": "9"})
# --- $ref / $defs
add("$ref:defs", {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                                   "required": ["x", "y"]}},
                  "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
                  "required": ["a", "b"]}, {"a": {"x": 1, "y": 2}, "b": {"x": 3, "y": 4}})
add("$ref:definitions", {"definitions": {"name": {"type": "string", "maxLength": 10}},
                         "type": "array", "items": {"$ref": "#/definitions/name"}}, ["ann", "bob"])
add("$ref:recursive-tree", {"$defs": {"node": {"type": "object", "properties": {
    "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v"]}},
    "$ref": "#/$defs/node"}, {"v": 1, "kids": [{"v": 2}, {"v": 3, "kids": []}]})
add("$ref:recursive-list", {"$defs": {"cell": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
    "head": {"type": "integer"}, "tail": {"$ref": "#/$defs/cell"}}, "required": ["head", "tail"]}]}},
    "$ref": "#/$defs/cell"}, {"head": 1, "tail": {"head": 2, "tail": None}})
add("$ref:chain", {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/c"}, "c": {"type": "integer"}},
                   "$ref": "#/$defs/a"}, 5)
add("$ref:pydantic", {"$defs": {"Address": {"properties": {"street": {"title": "Street", "type": "string"},
                                                           "city": {"title": "City", "type": "string"}},
                                            "required": ["street", "city"], "title": "Address", "type": "object"}},
                      "properties": {"name": {"title": "Name", "type": "string"},
                                     "address": {"$ref": "#/$defs/Address"},
                                     "tags": {"items": {"type": "string"}, "title": "Tags", "type": "array"}},
                      "required": ["name", "address", "tags"], "title": "Person", "type": "object"},
    {"name": "Ada", "address": {"street": "1 Main", "city": "X"}, "tags": ["a"]})
add("$ref:pydantic-optional", {"$defs": {"Item": {"properties": {"n": {"anyOf": [{"type": "integer"}, {"type": "null"}],
                                                                       "default": None, "title": "N"}},
                                                  "title": "Item", "type": "object"}},
                               "properties": {"items": {"items": {"$ref": "#/$defs/Item"}, "type": "array"}},
                               "required": ["items"], "type": "object"}, {"items": [{"n": 1}, {"n": None}]})
# --- realistic API-like schemas
add("api:tool-call", {"type": "object", "properties": {
    "name": {"enum": ["get_weather", "search"]},
    "arguments": {"type": "object", "properties": {"city": {"type": "string"},
                                                   "unit": {"enum": ["C", "F"]}}, "required": ["city"]}},
    "required": ["name", "arguments"], "additionalProperties": False},
    {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}})
add("api:github-issue", {"type": "object", "properties": {
    "title": {"type": "string", "minLength": 1, "maxLength": 80}, "labels": {"type": "array", "items": {
        "enum": ["bug", "feature", "docs"]}, "uniqueItems": True, "maxItems": 3},
    "assignee": {"type": ["string", "null"]}, "milestone": {"type": "integer", "minimum": 1}},
    "required": ["title", "labels"]}, {"title": "Crash on start", "labels": ["bug"], "assignee": None})
add("api:order", {"type": "object", "properties": {
    "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
    "lines": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number", "minimum": 0}},
        "required": ["sku", "qty", "price"], "additionalProperties": False}},
    "placed": {"type": "string", "format": "date"}}, "required": ["order_id", "lines"]},
    {"order_id": "ORD-123456", "lines": [{"sku": "A1", "qty": 2, "price": 9.99}], "placed": "2024-01-05"})
add("api:geojson-point", {"type": "object", "properties": {"type": {"const": "Point"}, "coordinates": {
    "type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 3}}, "required": ["type", "coordinates"]},
    {"type": "Point", "coordinates": [1.5, -2.25]})
add("api:k8s-like", {"type": "object", "properties": {
    "apiVersion": {"type": "string"}, "kind": {"enum": ["Pod", "Service"]},
    "metadata": {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z0-9-]+$"},
                                                  "labels": {"type": "object", "additionalProperties": {"type": "string"}}},
                 "required": ["name"]},
    "spec": {"type": "object", "properties": {"replicas": {"type": "integer", "minimum": 0, "maximum": 10}}}},
    "required": ["apiVersion", "kind", "metadata"]},
    {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web-1", "labels": {"app": "web"}}, "spec": {"replicas": 2}})
add("api:event", {"type": "object", "properties": {
    "id": {"type": "string", "format": "uuid"}, "at": {"type": "string", "format": "date-time"},
    "payload": {"oneOf": [{"type": "object", "properties": {"click": {"type": "integer"}}, "required": ["click"]},
                          {"type": "object", "properties": {"view": {"type": "string"}}, "required": ["view"]}]}},
    "required": ["id", "at", "payload"]},
    {"id": "123e4567-e89b-12d3-a456-426614174000", "at": "2024-01-01T00:00:00Z", "payload": {"view": "home"}})
add("api:nested-enum-arrays", {"type": "object", "properties": {"grid": {"type": "array", "items": {
    "type": "array", "items": {"enum": ["x", "o", "-"]}, "minItems": 3, "maxItems": 3}, "minItems": 3, "maxItems": 3}},
    "required": ["grid"]}, {"grid": [["x", "o", "-"], ["-", "x", "o"], ["o", "-", "x"]]})
add("api:unicode", {"type": "object", "properties": {"greeting": {"type": "string"}}, "required": ["greeting"]},
    {"greeting": "héllo 世界 🎉"})
add("api:escapes", {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]},
    {"s": "quote \" backslash \\ newline \n tab \t"})
add("api:numbers", {"type": "object", "properties": {"big": {"type": "integer"}, "neg": {"type": "number"},
                                                     "exp": {"type": "number"}}, "required": ["big", "neg", "exp"]},
    {"big": 12345678901234, "neg": -0.5, "exp": 1e-7})
# --- generated variations: wide objects of mixed types, and enums of objects
for n in (5, 10, 20):
    props = {f"p{i}": [{"type": "integer"}, {"type": "string", "maxLength": 12}, {"type": "boolean"},
                       {"enum": ["a", "b", "c"]}, {"type": "array", "items": {"type": "integer"}, "maxItems": 4}][i % 5]
             for i in range(n)}
    inst = {f"p{i}": [i, f"s{i}", i % 2 == 0, "b", [1, 2]][i % 5] for i in range(n)}
    add(f"object:mixed-{n}", {"type": "object", "properties": props, "required": list(props),
                              "additionalProperties": False}, inst)
for depth in (3, 6):
    schema = {"type": "integer"}
    inst = 1
    for _ in range(depth):
        schema = {"type": "array", "items": schema, "maxItems": 2}
        inst = [inst]
    add(f"nested-arrays:depth-{depth}", schema, inst)
for k in (3, 8):
    add(f"anyOf:wide-{k}", {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                                        "required": [f"k{i}"], "additionalProperties": False} for i in range(k)]},
        {f"k{k - 1}": 1})
add("pattern:email-like", {"type": "string", "pattern": "^[a-z0-9._%+-]+@[a-z0-9.-]+\\.[a-z]{2,}$"}, "a.b@c.io")
add("pattern:semver", {"type": "string", "pattern": "^(0|[1-9]\\d*)\\.(0|[1-9]\\d*)\\.(0|[1-9]\\d*)$"}, "1.12.0")
add("array:of-refs", {"$defs": {"money": {"type": "object", "properties": {"amount": {"type": "number"},
                                                                           "currency": {"enum": ["EUR", "USD"]}},
                                          "required": ["amount", "currency"]}},
                      "type": "array", "items": {"$ref": "#/$defs/money"}, "minItems": 1, "maxItems": 3},
    [{"amount": 1, "currency": "EUR"}])
add("string:enum-with-const", {"type": "object", "properties": {"v": {"const": 1}, "w": {"enum": [[1, 2], {"a": 1}]}},
                               "required": ["v", "w"]}, {"v": 1, "w": [1, 2]})
print(len(C))
json.dump(C, open(__file__.replace("make_structured_schemas.py", "structured_schemas.json"), "w"), indent=1, ensure_ascii=False)
