"""Validating JSON against schemas of the service's OpenAPI document (jsonschema, draft 2020-12),
whose references (`#/components/schemas/...`) resolve in the document through a Registry."""

from __future__ import annotations

from typing import Any

from jsonschema import Draft202012Validator
from referencing import Registry
from referencing.jsonschema import DRAFT202012

DOCUMENT_URI = "urn:sandboxer:openapi"


def registry(document: dict[str, Any]) -> Registry[Any]:
    """The document as the resource its references resolve in."""
    return Registry().with_resource(DOCUMENT_URI, DRAFT202012.create_resource(document))


def validator(document: dict[str, Any], schema: dict[str, Any]) -> Draft202012Validator:
    """A validator of `schema`, a schema of `document` (its references point into the document)."""
    return Draft202012Validator(_anchored(schema), registry=registry(document))


def errors(document: dict[str, Any], schema: dict[str, Any], instance: object) -> list[str]:
    """What in `instance` breaks `schema` (nothing: it is valid), each with where it is."""
    found = validator(document, schema).iter_errors(instance)
    return [f"{'/'.join(map(str, error.absolute_path)) or '(the document)'}: {error.message}" for error in found]


def _anchored(value: Any) -> Any:
    """`value` with its references into the document made absolute (the document's URI)."""
    if isinstance(value, dict):
        return {
            key: DOCUMENT_URI + item if key == "$ref" and item.startswith("#") else _anchored(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [_anchored(item) for item in value]
    return value
