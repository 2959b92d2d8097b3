"""The OpenAPI document the service serves is made from the routes it answers: every route the
application has is in it with its method, each answer's schema is a result type's, and every
schema in it is a valid JSON Schema whose references resolve."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from referencing.exceptions import Unresolvable

from sandboxer.api.results import Created, Evidence, JsonResult
from sandboxer.commands.services import Services
from sandboxer.dirs import Dirs
from sandboxer.service.admission import CallerSlots
from sandboxer.service.app import CREATE_FIELDS, HANDLERS, make_app
from sandboxer.service.exec_route import EXEC_FIELDS, SIGNAL_NAMES
from sandboxer.service.openapi import Body, Raw
from sandboxer.service.routes import BY_NAME, ROUTES, body_fields, document_bytes
from tests.openapi_schemas import DOCUMENT_URI, registry, validator

DOCUMENT: dict[str, Any] = json.loads(document_bytes())


def test_every_route_the_service_answers_is_in_the_document(tmp_path: Path) -> None:
    with ThreadPoolExecutor(max_workers=1) as workers:
        dirs = Dirs(config=str(tmp_path), state=str(tmp_path))
        app = make_app(dirs, services=Services.of(), workers=workers, slots=CallerSlots())
        answered = {
            (route.method.lower(), route.resource.canonical, route.name)
            for route in app.router.routes()
            if route.resource is not None
        }
    documented = {
        (method, path, operation["operationId"])
        for path, item in DOCUMENT["paths"].items()
        for method, operation in item.items()
        if method != "parameters"
    }
    assert answered == documented
    assert set(HANDLERS) == set(BY_NAME)  # no handler without its route
    assert len(BY_NAME) == len(ROUTES)  # names are unique: the audit log tells routes apart by them


def test_the_document_is_made_once() -> None:
    assert document_bytes() is document_bytes()


def test_every_schema_is_valid_and_every_reference_resolves() -> None:
    def references(value: Any) -> list[str]:
        if isinstance(value, dict):
            own = [value["$ref"]] if isinstance(value.get("$ref"), str) else []
            return own + [ref for item in value.values() for ref in references(item)]
        if isinstance(value, list):
            return [ref for item in value for ref in references(item)]
        return []

    for name, schema in DOCUMENT["components"]["schemas"].items():
        Draft202012Validator.check_schema(schema)
        assert name == "ExecOptions" or schema.get("title", name) == name
    found = references(DOCUMENT)
    assert found
    resolver = registry(DOCUMENT).resolver(DOCUMENT_URI)
    for reference in found:
        assert reference.startswith("#/components/schemas/"), reference
        try:
            resolver.lookup(reference)
        except Unresolvable:
            pytest.fail(f"{reference} does not resolve")


def test_a_json_answer_is_its_result_types_schema() -> None:
    for route in ROUTES:
        operation = DOCUMENT["paths"][route.path][route.method.lower()]
        success = operation["responses"][str(route.status)]
        if isinstance(route.answer, Raw):
            assert route.answer.media_type in success["content"]
            continue
        assert issubclass(route.answer, JsonResult)
        schema = success["content"]["application/json"]["schema"]
        assert schema == {"$ref": f"#/components/schemas/{route.answer.__name__}"}
        lifted = DOCUMENT["components"]["schemas"][route.answer.__name__]
        assert lifted == {key: value for key, value in route.answer.json_schema().items() if key != "$defs"}
        assert set(operation["responses"]) >= {"default"}


def test_a_created_and_an_inspected_document_validate() -> None:
    create = DOCUMENT["paths"]["/v1/sandboxes"]["post"]["responses"]["201"]["content"]["application/json"]
    created = Created(
        id="0" * 24, profile="p", backend="bwrap", runtime_sha256="f" * 64, workspace="/workspace", limits=None
    )
    assert list(validator(DOCUMENT, create["schema"]).iter_errors(created.to_json())) == []
    document = created.to_json()
    del document["workspace"]
    assert not validator(DOCUMENT, create["schema"]).is_valid(document)
    inspect = DOCUMENT["paths"]["/v1/sandboxes/{id}"]["get"]["responses"]["200"]["content"]["application/json"]
    evidence = Evidence.json_schema()
    assert evidence["additionalProperties"] is True  # a backend's own sections are top-level keys
    assert not validator(DOCUMENT, inspect["schema"]).is_valid({"id": "x"})


def test_the_request_bodies_are_the_handlers() -> None:
    create = BY_NAME["create"].body
    assert isinstance(create, Body)
    assert CREATE_FIELDS == create.names == {"profile", "ttl", "manifest", "bootstrap", "ref", "branch"}
    exec_body = BY_NAME["exec"].body
    assert isinstance(exec_body, Raw)
    assert exec_body.options is not None
    assert exec_body.options.names == EXEC_FIELDS
    assert body_fields("exec-signal") == {"signal"}
    signal = DOCUMENT["paths"]["/v1/sandboxes/{id}/exec/{exec}/signal"]["post"]["requestBody"]
    assert signal["content"]["application/json"]["schema"]["properties"]["signal"]["enum"] == list(SIGNAL_NAMES)
    with pytest.raises(TypeError):
        body_fields("exec")


def test_teardowns_residue_carries_its_receipt() -> None:
    responses = DOCUMENT["paths"]["/v1/sandboxes/{id}"]["delete"]["responses"]
    assert responses["409"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ResidueError"}
    envelope = {
        "error": {"kind": "ResidueError", "message": "m", "hint": None, "status": 6},
        "receipt": {"id": "a", "removed": ["x"], "residue": ["y"]},
    }
    assert validator(DOCUMENT, responses["409"]["content"]["application/json"]["schema"]).is_valid(envelope)
    default = responses["default"]["content"]["application/json"]["schema"]
    assert not validator(DOCUMENT, default).is_valid(envelope)  # only teardown's 409 has a receipt
    del envelope["receipt"]
    assert validator(DOCUMENT, default).is_valid(envelope)
