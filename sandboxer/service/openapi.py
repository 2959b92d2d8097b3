"""An OpenAPI 3.1 document made from a table of routes (the service's: routes/) and the schemas
of the result types they answer with (sandboxer.api.results), so that it describes what the service
answers and nothing else: what a route is (`Route`, its `Body` and `Raw` bodies), and the
document of a table (`document`).

Each result type's schema is `components/schemas/<its class>`, with the types it holds beside
it. A route's error statuses, and `default` for every other, answer the error envelope (`Error`;
teardown's 409 `ResidueError`, with its receipt, and its 400 `UnexportedWorkError`, with what
would be lost); an exec's last frame is `ExecEnd`, each line of its NDJSON answer an `ExecLine`.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from sandboxer.api.results import JsonResult, Receipt

Schema = Mapping[str, Any]  # a JSON Schema (2020-12, as OpenAPI 3.1 has it)
STRING: Schema = {"type": "string"}  # a field that is any string
BINARY = "application/octet-stream"  # a body of bytes: an exec's stdin, an export


def _nothing() -> Mapping[Any, Any]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True, kw_only=True)
class Body:
    """A JSON object as a request's body: these fields (name -> schema) and no others."""

    fields: Mapping[str, Schema]
    required: frozenset[str] = frozenset()

    @property
    def names(self) -> set[str]:
        """The fields a body may have: what the route's handler allows."""
        return set(self.fields)

    def schema(self) -> dict[str, Any]:
        """The body's JSON Schema."""
        return {
            "type": "object",
            "additionalProperties": False,
            "required": sorted(self.required),
            "properties": {name: dict(schema) for name, schema in self.fields.items()},
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Raw:
    """A body that is no result type's document: bytes of `media_type` (streamed, or a file's), or
    a JSON document `schema` describes (this API's own description)."""

    media_type: str
    description: str
    schema: Schema | None = None
    # An OpenAPI header object for each header it comes with.
    headers: Mapping[str, Schema] = field(default_factory=_nothing)
    options: Body | None = None  # exec's: the body's first line is this JSON object
    holds: tuple[type[JsonResult], ...] = ()  # the result types its headers hold
    # The other media types it may come as (exec's: chosen by Accept or a query), each with its
    # OpenAPI media type object (NDJSON's: `x-itemSchema`, each line's schema, as OpenAPI 3.2's itemSchema).
    more_media: Mapping[str, Schema] = field(default_factory=_nothing)


@dataclass(frozen=True, slots=True, kw_only=True)
class Route:
    """One route of the API."""

    method: Literal["GET", "POST", "DELETE"]
    path: str  # aiohttp's and OpenAPI's alike: `{name}` is a path parameter
    name: str  # aiohttp's name of the route, the audit log's verb
    summary: str
    answer: type[JsonResult] | Raw
    status: int = 200  # the answer's status
    body: Body | Raw | None = None
    # An OpenAPI parameter object (less its name and `in`) for each query parameter.
    query: Mapping[str, Schema] = field(default_factory=_nothing)
    errors: Mapping[int, str] = field(default_factory=_nothing)  # error statuses worth a word -> when
    # Error statuses whose envelope carries more than `Error` -> that envelope's name in ENVELOPES
    # (teardown's: 409 the `receipt` of what was removed, 400 what work would be lost).
    envelopes: Mapping[int, str] = field(default_factory=_nothing)


INFO = {
    "title": "sandboxer broker service",
    "version": "v1",
    "description": "HTTP/1.1 + JSON on the service's Unix socket. The caller is identified by the socket's peer "
    "credentials (SO_PEERCRED), never by anything in a request. Every error, on any path (an unknown one: "
    '404), is the envelope {"error": {kind, message, hint, status}} where status is the CLI\'s exit status '
    "(docs/service.md).",
}
_REF = "#/components/schemas/{}"
_JSON = "application/json"

_ERROR_DETAIL = {
    "type": "object",
    "additionalProperties": False,
    "required": ["kind", "message", "hint", "status"],
    "properties": {
        "kind": {"type": "string", "description": "the error's class (sandboxer.errors)"},
        "message": {"type": "string"},
        "hint": {"type": ["string", "null"]},
        "status": {"type": "integer", "description": "the CLI's exit status for it"},
    },
}
ENVELOPES: dict[str, dict[str, Any]] = {
    "ErrorDetail": _ERROR_DETAIL,
    "Error": {
        "type": "object",
        "description": "The error envelope: what every refusal and failure answers.",
        "additionalProperties": False,
        "required": ["error"],
        "properties": {"error": {"$ref": _REF.format("ErrorDetail")}},
    },
    "ResidueError": {
        "type": "object",
        "description": "A teardown that left something behind: the envelope and what it did remove.",
        "additionalProperties": False,
        "required": ["error", "receipt"],
        "properties": {
            "error": {"$ref": _REF.format("ErrorDetail")},
            "receipt": {"anyOf": [{"$ref": _REF.format("Receipt")}, {"type": "null"}]},
        },
    },
    "UnexportedWorkError": {
        "type": "object",
        "description": "A teardown refused (400): the envelope; for work no export took out (kind "
        "UnexportedWorkError) also what would be lost, and the requests that keep it (export, one per format "
        "needed; absent when the work cannot be checked) or lose it (discard).",
        "additionalProperties": False,
        "required": ["error"],
        "properties": {
            "error": {"$ref": _REF.format("ErrorDetail")},
            "unexported": {
                "type": "array",
                "items": {"type": "string"},
                "description": "each thing that would be lost, as the message names it: e.g. '2 new commits on "
                "main (made from main)', 'changes not committed'",
            },
            "export": {"type": "array", "items": {"$ref": _REF.format("HttpRequest")}},
            "discard": {"$ref": _REF.format("HttpRequest")},
        },
    },
    "HttpRequest": {
        "type": "object",
        "description": "A request of this API that a client may send next.",
        "additionalProperties": False,
        "required": ["method", "path"],
        "properties": {
            "method": {"type": "string"},
            "path": {"type": "string", "description": "with its query"},
            "body": {"type": "object", "description": "its JSON body"},
        },
    },
    "ExecLine": {
        "description": "One line of an exec's NDJSON answer (application/x-ndjson): output as it comes — "
        "`data` is its text, or base64 with `encoding` when it is not UTF-8 — then, last, its exit status "
        "(with the error when the broker could not run it: exit_status is then the error's status).",
        "oneOf": [
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["stream", "data"],
                "properties": {
                    "stream": {"type": "string", "enum": ["stdout", "stderr"]},
                    "data": {"type": "string"},
                    "encoding": {"type": "string", "enum": ["base64"]},
                },
            },
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["exit_status"],
                "properties": {
                    "exit_status": {"type": "integer"},
                    "error": {"$ref": _REF.format("ErrorDetail")},
                },
            },
        ],
    },
    "ExecEnd": {
        "description": "An exec's last frame: its exit status, or the error that ended it.",
        "oneOf": [
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["status"],
                "properties": {"status": {"type": "integer"}},
            },
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["error"],
                "properties": {"error": {"$ref": _REF.format("ErrorDetail")}},
            },
        ],
    },
}
DEFAULT_ERROR = (
    "any other refusal or failure, as the envelope: e.g. 403 a caller the service does not admit, 405 a method "
    "the route does not answer, 429 too many of the caller's requests under way, 500 a failure"
)


def document(routes: Sequence[Route], path_parameters: Mapping[str, Schema]) -> dict[str, Any]:
    """The OpenAPI document of `routes`, whose paths' parameters are `path_parameters` (name ->
    an OpenAPI parameter object, less its name and `in`)."""
    schemas: dict[str, Any] = dict(ENVELOPES)
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        item = paths.setdefault(route.path, {})
        parameters = [
            {"name": name, "in": "path", "required": True, **path_parameters[name]}
            for name in re.findall(r"\{(\w+)\}", route.path)
        ]
        if parameters:
            item["parameters"] = parameters
        item[route.method.lower()] = _operation(route, schemas)
    schema_ref(Receipt, schemas)  # ResidueError's
    made = {"openapi": "3.1.0", "info": INFO, "paths": paths, "components": {"schemas": schemas}}
    return copy.deepcopy(made)  # nothing in it shared with the table or another call's


def _operation(route: Route, schemas: dict[str, Any]) -> dict[str, Any]:
    """The route's OpenAPI operation; the schemas it names are added to `schemas`."""
    operation: dict[str, Any] = {"operationId": route.name, "summary": route.summary}
    if route.query:
        operation["parameters"] = [
            {"name": name, "in": "query", "required": False, **parameter} for name, parameter in route.query.items()
        ]
    if isinstance(route.body, Body):
        operation["requestBody"] = {"required": True, "content": {_JSON: {"schema": route.body.schema()}}}
    elif isinstance(route.body, Raw):
        if route.body.options is not None:
            schemas[_camel(route.name) + "Options"] = route.body.options.schema()
        operation["requestBody"] = {
            "required": True,
            "description": route.body.description,
            "content": {route.body.media_type: {}},
        }
    answer = route.answer
    if isinstance(answer, Raw):
        media = {} if answer.schema is None else {"schema": dict(answer.schema)}
        content = {answer.media_type: media, **{name: dict(more) for name, more in answer.more_media.items()}}
        success: dict[str, Any] = {"description": answer.description, "content": content}
        if answer.headers:
            success["headers"] = {name: dict(header) for name, header in answer.headers.items()}
        for result in answer.holds:
            schema_ref(result, schemas)
    else:
        success = {"description": _described(answer), "content": {_JSON: {"schema": schema_ref(answer, schemas)}}}
    responses: dict[str, Any] = {str(route.status): success}
    for status, when in sorted(route.errors.items()):
        envelope = route.envelopes.get(status, "Error")
        responses[str(status)] = {"description": when, "content": {_JSON: {"schema": {"$ref": _REF.format(envelope)}}}}
    responses["default"] = {
        "description": DEFAULT_ERROR,
        "content": {_JSON: {"schema": {"$ref": _REF.format("Error")}}},
    }
    operation["responses"] = responses
    return operation


def schema_ref(result: type[JsonResult], schemas: dict[str, Any]) -> dict[str, str]:
    """A reference to the result type's schema, which is added to `schemas` with the schemas it
    refers to (pydantic's `$defs`, lifted)."""
    schema = result.json_schema()
    for name, definition in {**schema.pop("$defs", {}), result.__name__: schema}.items():
        if schemas.setdefault(name, definition) != definition:
            raise ValueError(f"two different schemas are named {name}")
    return {"$ref": _REF.format(result.__name__)}


def _described(result: type[JsonResult]) -> str:
    """The result type's description: its docstring, on one line."""
    return " ".join((result.__doc__ or result.__name__).split())


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("-"))
