"""Corpus of JSON schemas that gateway.structured.constraints must accept AND enforce
(tests/gateway/test_constraints.py).

Each entry is (name, schema). Every schema is sampled by a model-free sampler; every finished sample must
parse and validate with jsonschema (formats checked). Together they cover every keyword in SUPPORTED_KEYWORDS,
every format in SUPPORTED_FORMATS and the annotation keywords.
"""

from __future__ import annotations

ANNOTATED = {"title": "t", "description": "d", "$comment": "c", "examples": ["x"], "default": "x",
             "deprecated": False, "readOnly": False, "writeOnly": False}

CORPUS: list[tuple[str, object]] = [
    # --- enum / const ---------------------------------------------------------------------------------------
    ("enum_strings", {"type": "string", "enum": ["red", "green", "blue"]}),
    ("enum_mixed", {"enum": [1, "a", None, True, 2.5, [1, "x"], {"k": [None]}]}),
    ("enum_special_chars", {"enum": ["say \"hi\"", "line\nbreak", "tab\there", "é😀", "back\\slash"]}),
    ("const_string", {"const": "exactly this"}),
    ("const_object", {"const": {"a": [1, 2, {"b": None}], "c": "d", "e": False}}),
    ("const_in_object", {"type": "object", "properties": {"v": {"const": 3}, "n": {"const": None},
                                                           "b": {"const": True}}, "required": ["v", "n", "b"],
                         "additionalProperties": False}),
    # --- anyOf / oneOf / allOf ------------------------------------------------------------------------------
    ("anyOf_scalar", {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "integer", "minimum": 0}]}),
    ("oneOf_types", {"oneOf": [{"type": "string"}, {"type": "boolean"}, {"type": "null"}]}),
    ("oneOf_tagged", {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number", "minimum": 0}},
         "required": ["kind", "r"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "rect"}, "w": {"type": "integer"},
                                          "h": {"type": "integer"}},
         "required": ["kind", "w", "h"], "additionalProperties": False}]}),
    ("allOf_merge", {"allOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {"type": "string", "maxLength": 4}}, "required": ["b"]}]}),
    ("allOf_numbers", {"allOf": [{"type": "integer", "minimum": -5}, {"maximum": 5},
                                 {"exclusiveMaximum": 4}]}),
    # --- $ref / $defs ---------------------------------------------------------------------------------------
    ("ref_defs", {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"},
                                                                      "y": {"type": "number"}},
                                      "required": ["x", "y"], "additionalProperties": False}},
                  "type": "object", "properties": {"from": {"$ref": "#/$defs/point"},
                                                   "to": {"$ref": "#/$defs/point"}},
                  "required": ["from", "to"], "additionalProperties": False}),
    ("ref_recursive_list", {"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
        "required": ["value", "next"], "additionalProperties": False}}, "$ref": "#/$defs/node"}),
    ("ref_recursive_tree", {"$defs": {"tree": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "children": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/tree"}}},
        "required": ["name", "children"], "additionalProperties": False}}, "$ref": "#/$defs/tree"}),
    ("ref_anchor", {"$defs": {"id": {"$anchor": "ident", "type": "string", "pattern": "^[a-z]{1,6}$"}},
                    "type": "array", "items": {"$ref": "#ident"}, "maxItems": 4}),
    ("ref_nullable", {"$defs": {"s": {"type": "string", "minLength": 1, "maxLength": 3}},
                      "anyOf": [{"$ref": "#/$defs/s"}, {"type": "null"}]}),
    # --- objects --------------------------------------------------------------------------------------------
    ("nested_objects", {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"], "additionalProperties": False}},
            "required": ["name", "address"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False}),
    ("required_closed", {"type": "object",
                         "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
                         "required": ["id", "ok"], "additionalProperties": False}),
    ("optional_closed", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"},
                                                          "c": {"type": "null"}},
                         "required": ["b"], "additionalProperties": False}),
    ("empty_closed", {"type": "object", "properties": {}, "additionalProperties": False}),
    ("open_object", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
    ("map_of_ints", {"type": "object",
                     "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 99},
                     "maxProperties": 3}),
    ("pattern_properties", {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}},
                            "patternProperties": {"^x_[a-z]+$": {"type": "integer"}},
                            "additionalProperties": False, "maxProperties": 3, "required": ["name"]}),
    ("true_false_subschemas", {"type": "object", "properties": {"any": True, "never": False},
                               "required": ["any"], "additionalProperties": False}),
    # --- arrays ---------------------------------------------------------------------------------------------
    ("array_min_max", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                       "minItems": 2, "maxItems": 3}),
    ("array_of_objects", {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 20}},
        "required": ["sku", "qty"], "additionalProperties": False}}),
    ("prefix_items_tuple", {"type": "array", "prefixItems": [{"type": "string", "format": "date"},
                                                             {"type": "number"}, {"enum": ["a", "b"]}],
                            "items": False, "minItems": 3}),
    ("prefix_then_items", {"type": "array", "prefixItems": [{"const": "head"}],
                           "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4}),
    ("draft7_tuple", {"$schema": "http://json-schema.org/draft-07/schema#",
                      "definitions": {"small": {"type": "integer", "minimum": 0, "maximum": 3}},
                      "type": "array", "items": [{"$ref": "#/definitions/small"}, {"type": "string",
                                                                                    "maxLength": 3}],
                      "additionalItems": False}),
    ("empty_array", {"type": "array", "maxItems": 0}),
    ("deep_nesting", {"type": "object", "properties": {"rows": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"cells": {"type": "array", "maxItems": 3,
                                                   "items": {"type": ["integer", "null"]}}},
        "required": ["cells"], "additionalProperties": False}}}, "required": ["rows"],
        "additionalProperties": False}),
    # --- strings --------------------------------------------------------------------------------------------
    ("string_lengths", {"type": "string", "minLength": 2, "maxLength": 5}),
    ("string_empty_only", {"type": "string", "maxLength": 0}),
    ("string_pattern_anchored", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"}),
    ("string_pattern_unanchored", {"type": "string", "pattern": "ab+c", "maxLength": 12}),
    ("string_pattern_digits", {"type": "string", "pattern": "^\\d+(\\.\\d{1,2})?$", "maxLength": 8}),
    ("format_date", {"type": "string", "format": "date"}),
    ("format_date_time", {"type": "string", "format": "date-time"}),
    ("format_time", {"type": "string", "format": "time"}),
    ("format_email", {"type": "string", "format": "email", "maxLength": 40}),
    ("format_uuid", {"type": "string", "format": "uuid"}),
    ("format_ipv4", {"type": "string", "format": "ipv4"}),
    ("format_ipv6", {"type": "string", "format": "ipv6"}),
    ("format_and_pattern", {"type": "string", "format": "date", "pattern": "^20"}),
    # --- numbers --------------------------------------------------------------------------------------------
    ("number_bounds", {"type": "number", "minimum": -1.5, "maximum": 2.25}),
    ("number_exclusive", {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}),
    ("number_free", {"type": "number"}),
    ("integer_bounds", {"type": "integer", "minimum": -20, "maximum": -3}),
    ("integer_exclusive", {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 15}),
    ("integer_multiple", {"type": "integer", "multipleOf": 7, "minimum": -100, "maximum": 100}),
    ("number_multiple", {"type": "number", "multipleOf": 5, "maximum": 1000}),
    ("integer_large_bounds", {"type": "integer", "minimum": 1000000000000, "maximum": 1000000000100}),
    # --- booleans, null, unions -----------------------------------------------------------------------------
    ("boolean", {"type": "boolean"}),
    ("null", {"type": "null"}),
    ("nullable_string", {"type": ["string", "null"], "maxLength": 6}),
    ("type_list", {"type": ["integer", "boolean", "null"]}),
    ("annotations", {**ANNOTATED, "$schema": "https://json-schema.org/draft/2020-12/schema",
                     "$id": "https://example.com/annotated.json", "type": "object",
                     "properties": {"a": {**ANNOTATED, "type": "string", "maxLength": 3}},
                     "required": ["a"], "additionalProperties": False}),
    # --- an OpenAI structured-outputs style schema ----------------------------------------------------------
    ("openai_event", {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "date": {"type": "string", "format": "date"},
        "start": {"type": "string", "format": "time"},
        "participants": {"type": "array", "items": {"type": "string", "format": "email", "maxLength": 24},
                         "maxItems": 2},
        "priority": {"enum": ["low", "normal", "high"]},
        "location": {"type": ["string", "null"], "maxLength": 10}},
        "required": ["name", "date", "start", "participants", "priority", "location"],
        "additionalProperties": False}),
]
