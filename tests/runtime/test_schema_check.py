"""The meta-schema check of the JSON schemas requests bring: each draft by its own meta-schema,
the offending value's path and the reason, and never a fetch of an unknown `$schema`."""

from __future__ import annotations

import pytest
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for
from kvfleet.runtime.engine.schema_check import SchemaProblem, schema_problem

DRAFT7 = "http://json-schema.org/draft-07/schema#"

VALID = [
    {},
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    {"$defs": {"c": {"type": "string"}}, "prefixItems": [{"$ref": "#/$defs/c"}]},
    {"$schema": DRAFT7, "definitions": {"c": {"type": "string"}}, "items": [{"type": "string"}]},
    {"$schema": "http://json-schema.org/draft-04/schema#", "minimum": 0, "exclusiveMinimum": True},
    {"$ref": "#/$defs/missing"},  # a reference's target is the grammar's business, not this
]

INVALID = [
    ({"type": "text"}, ("type",)),
    ({"type": "object", "properties": {"a": {"type": "text"}}}, ("properties", "a", "type")),
    ({"type": "object", "required": "city"}, ("required",)),
    ({"enum": "x"}, ("enum",)),
    ({"items": {"minItems": -1}}, ("items", "minItems")),
    ({"$schema": DRAFT7, "exclusiveMinimum": True}, ("exclusiveMinimum",)),  # draft-04 syntax
]


@pytest.mark.parametrize("schema", VALID)
def test_valid_schemas_pass_as_the_python_validator_says(schema):
    validator_for(schema, default=Draft202012Validator).check_schema(schema)  # the reference
    assert schema_problem(schema) is None


@pytest.mark.parametrize(("schema", "path"), INVALID)
def test_an_invalid_schema_names_where_and_why(schema, path):
    with pytest.raises(SchemaError):  # the reference agrees that it is invalid
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    problem = schema_problem(schema)
    assert problem is not None
    assert problem.path == path
    assert problem.message


def test_a_meta_schema_name_that_is_no_string_is_the_problem():
    # (The Python validator cannot even read it: it takes $schema for a string.)
    assert schema_problem({"$schema": 3}) == SchemaProblem(
        ("$schema",), '3 is not of type "string"'
    )


def test_an_unknown_meta_schema_is_checked_as_the_default_draft_not_fetched():
    # jsonschema-rs would fetch an unknown $schema over the network (a server must not): from
    # this port the fetch fails, and the check would raise its error.
    unknown = {"$schema": "http://127.0.0.1:9/my-schema", "type": "object"}
    assert schema_problem(unknown) is None
    problem = schema_problem({**unknown, "type": "text"})
    assert problem is not None and problem.path == ("type",)


def test_a_problem_is_located_by_a_json_pointer():
    problem = schema_problem({"properties": {"a/b": {"items": [{"type": 1}]}}})
    assert problem is not None and problem.pointer == "#/properties/a~1b/items"
    assert SchemaProblem((), "x").pointer == "#"
