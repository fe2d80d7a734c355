"""The satisfiability check run before a JSON schema is compiled (issue 40): a schema no finite
document satisfies is refused with its reason; anything that may have one goes through."""

from __future__ import annotations

import time

import jsonschema
import pytest

from workers.engine.schema_check import MAX_VISITS, unsatisfiable

SELF = {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}


def test_the_issue_schema_is_refused_naming_the_cycle():
    why = unsatisfiable(SELF)
    assert why is not None
    assert why.startswith("it recurses without end")
    assert "# -> #/properties/n -> #" in why and "required" in why


@pytest.mark.parametrize(("schema", "chain"), [
    # through $defs, two definitions requiring each other
    ({"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}},
                      "required": ["b"]},
                "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}},
                      "required": ["a"]}},
      "$ref": "#/$defs/a"},
     "#/$defs/a -> #/$defs/a/properties/b -> #/$defs/b -> #/$defs/b/properties/a -> #/$defs/a"),
    # an array that needs at least one item of itself
    ({"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"},
                                                "minItems": 1}}, "required": ["kids"]},
     "#/properties/kids/items -> #"),
    ({"type": "array", "prefixItems": [{"$ref": "#"}], "minItems": 1}, "#/prefixItems/0 -> #"),
    ({"type": "array", "items": [{"$ref": "#"}], "minItems": 2}, "#/items/0 -> #"),  # draft 7
    ({"type": "array", "contains": {"$ref": "#"}}, "#/contains -> #"),
    # every branch of oneOf/anyOf recurses too
    ({"type": "object", "properties": {"x": {"oneOf": [{"$ref": "#"},
                                                       {"$ref": "#/properties/x"}]}},
      "required": ["x"]}, "#/properties/x/oneOf/0 -> #"),
    # the recursion is a required property's additionalProperties / patternProperties
    ({"type": "object", "additionalProperties": {"$ref": "#"}, "required": ["z"]},
     "#/additionalProperties -> #"),
    ({"type": "object", "patternProperties": {"^z": {"$ref": "#"}}, "required": ["zz"]},
     "#/patternProperties/^z -> #"),
    # allOf does not escape: both parts must hold
    ({"type": "object", "allOf": [{"properties": {"n": {"$ref": "#"}}, "required": ["n"]},
                                  {"properties": {"m": {"type": "string"}}}]},
     "#/allOf/0/properties/n -> #"),
    # percent-encoded and ~-escaped pointers resolve
    ({"$defs": {"a/b": {"type": "object", "properties": {"n": {"$ref": "#/$defs/a~1b"}},
                        "required": ["n"]}}, "$ref": "#/$defs/a%7E1b"},
     "'#/$defs/a%7E1b' requires itself"),
])
def test_required_recursion_without_a_way_out_is_refused(schema, chain):
    why = unsatisfiable(schema)
    assert why is not None and why.startswith("it recurses without end"), why
    assert chain in why


@pytest.mark.parametrize(("schema", "instance"), [
    # a linked list: `next` is optional
    ({"type": "object", "properties": {"value": {"type": "integer"}, "next": {"$ref": "#"}},
      "required": ["value"]}, {"value": 1, "next": {"value": 2}}),
    # required, but an anyOf branch ends it
    ({"type": "object", "properties": {"n": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
      "required": ["n"]}, {"n": {"n": None}}),
    ({"$defs": {"node": {"type": "object", "properties": {
        "next": {"oneOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
        "required": ["next"]}}, "$ref": "#/$defs/node"}, {"next": None}),
    # a tree whose children may be none
    ({"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
      "required": ["kids"]}, {"kids": [{"kids": []}]}),
    # the recursion is required, but the root may be something other than an object
    ({"type": ["object", "string"], "properties": {"n": {"$ref": "#"}}, "required": ["n"]},
     {"n": "leaf"}),
    ({"properties": {"n": {"$ref": "#"}}, "required": ["n"]}, {"n": 3}),
    # mutual recursion with an escape in the second definition
    ({"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}},
                      "required": ["b"]},
                "b": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "string"}]}},
      "$ref": "#/$defs/a"}, {"b": "x"}),
    # enum values are not checked against the other keywords: no verdict
    ({"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"],
      "enum": [{"n": {"n": 1}}]}, None),
    # unresolvable references are the compiler's business, not refused here
    ({"type": "object", "properties": {"n": {"$ref": "other.json#"}}, "required": ["n"]},
     None),
])
def test_schemas_with_a_finite_instance_pass(schema, instance):
    assert unsatisfiable(schema) is None
    if instance is not None:
        jsonschema.validate(instance, schema)  # the test's own witness


@pytest.mark.parametrize(("schema", "words"), [
    (False, "'#' is `false`"),
    ({"enum": []}, "empty `enum`"),
    ({"type": "integer", "enum": ["a", 1.5]}, "admit no value"),
    ({"type": "string", "const": 3}, "admit no value"),
    ({"type": "array", "minItems": 3, "maxItems": 1}, "minItems 3 > maxItems 1"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength 5 > maxLength 2"),
    ({"type": "integer", "minimum": 5, "maximum": 2}, "no integer between"),
    ({"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2}, "no integer between"),
    ({"type": "integer", "minimum": 1.2, "maximum": 1.8}, "no integer between"),
    ({"type": "number", "exclusiveMinimum": 1, "maximum": 1}, "no number between"),
    ({"type": "number", "minimum": 1, "exclusiveMaximum": True, "maximum": 1},
     "no number between"),  # draft 4's flag
    ({"allOf": [{"type": "string"}, {"type": "integer"}]},
     "'#/allOf/1' admits no value of the types the schema around it allows"),
    ({"type": "string", "anyOf": [{"type": "integer"}, {"type": "boolean"}]},
     "no branch of '#/anyOf' can be satisfied ('#/anyOf/0' admits no value of the types"),
    ({"anyOf": []}, "'#/anyOf' is empty"),
    ({"oneOf": [False, {"enum": []}]}, "no branch of '#/oneOf'"),
    ({"not": {}}, "rules out every value"),
    ({"type": "object", "properties": {"a": False}, "required": ["a"]},
     "required property 'a': '#/properties/a' is `false`"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": False,
      "required": ["b"]}, "requires property 'b' but does not allow it"),
    ({"type": "object", "required": ["a", "b"], "maxProperties": 1}, "maxProperties 1"),
    ({"type": "object", "minProperties": 2, "maxProperties": 1}, "minProperties 2"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": False,
      "minProperties": 2}, "allows only 1"),
    ({"type": "array", "items": False, "minItems": 1}, "needs at least 1 items"),
    ({"type": "array", "contains": {"type": "string"}, "minContains": 2, "maxItems": 1},
     "minContains 2 > maxItems 1"),
    # deep inside: the path names where
    ({"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "array", "minItems": 2, "maxItems": 0}}, "required": ["b"]}},
      "required": ["a"]}, "'#/properties/a/properties/b' has minItems 2 > maxItems 0"),
    ({"$defs": {"e": {"enum": []}}, "type": "object", "properties": {"x": {"$ref": "#/$defs/e"}},
      "required": ["x"]}, "'#/$defs/e' has an empty `enum`"),
])
def test_unsatisfiable_constraints_are_named(schema, words):
    why = unsatisfiable(schema)
    assert why is not None and words in why, why


@pytest.mark.parametrize("schema", [
    True, {}, {"type": "object"},
    {"minItems": 3, "maxItems": 1},  # no type: any non-array satisfies it
    {"type": ["array", "null"], "minItems": 3, "maxItems": 1},
    {"type": "number", "minimum": 1.2, "maximum": 1.8},
    {"type": "integer", "minimum": 1, "maximum": 1},
    {"type": "number", "exclusiveMinimum": 1, "maximum": 1.5},
    {"type": "object", "properties": {"a": False}},  # optional: just never written
    {"type": "object", "required": ["1"], "patternProperties": {r"\p{L}": False}},
    # what is not judged here passes: patterns, formats, not, if/then/else, uniqueItems
    {"type": "string", "pattern": "^$", "minLength": 3},
    {"not": {"type": "string"}}, {"if": {"type": "string"}, "then": False},
    {"type": "array", "items": {"enum": [1]}, "minItems": 2, "uniqueItems": True},
])
def test_what_may_be_satisfiable_passes(schema):
    assert unsatisfiable(schema) is None


def test_big_and_deep_schemas_are_judged_quickly_or_not_at_all():
    n = 2000
    chain = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}},
                       "required": ["x"]} for i in range(n)}
    chain[f"d{n}"] = {"type": "string"}
    wide = {"$defs": {f"d{i}": {"type": "object", "properties": {"up": {"$ref": "#"}},
                                "required": []} for i in range(3000)},
            "type": "object", "properties": {f"p{i}": {"$ref": f"#/$defs/d{i}"}
                                             for i in range(3000)},
            "required": [f"p{i}" for i in range(3000)]}
    started = time.perf_counter()
    assert unsatisfiable({"$defs": chain, "$ref": "#/$defs/d0"}) is None
    assert unsatisfiable(wide) is None
    chain[f"d{n}"] = {"$ref": "#/$defs/d0"}  # now a cycle of 2001 definitions
    assert unsatisfiable({"$defs": chain, "$ref": "#/$defs/d0"}) is not None
    deep: dict = {"enum": []}
    for _ in range(MAX_VISITS // 10):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    assert unsatisfiable(deep) is None  # too deep to judge: left to the compiler
    assert time.perf_counter() - started < 5
