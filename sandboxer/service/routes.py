"""The service's routes, one table: each route's method, path, name (the audit log's verb), its
request and its answer (openapi.Route). app.py answers exactly these (a handler per name), and
the OpenAPI document the service serves is made of them, so no route is answered that the
document does not describe. `python -m sandboxer.service.routes` prints that document.

A JSON answer is a result type (sandboxer.api.results), whose schema is the document's; a body that
is bytes (exec's frames, an export) is `Raw`. Any route may also answer the error envelope
`{"error": {kind, message, hint, status}}`; `errors` lists the statuses worth a word.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Mapping
from types import MappingProxyType

from sandboxer.api.results import (
    Approval,
    CallerView,
    Created,
    Dispatched,
    Evidence,
    Exported,
    ExportNoted,
    GcReport,
    KeptExportRemoved,
    KeptExports,
    NetworkLog,
    OwnerListing,
    Receipt,
    RuntimeDigest,
    SandboxList,
    Signalled,
    Version,
)
from sandboxer.api.usage_results import Lifetime, Usage, WorkSummary
from sandboxer.commands.create import MAX_TTL, MIN_TTL
from sandboxer.commands.dispatch import MAX_WAIT
from sandboxer.commands.usage import MAX_EXTEND
from sandboxer.execio.stdio import FORWARDED
from sandboxer.host.registry import ID_PATTERN
from sandboxer.service import exec_answers, frames
from sandboxer.service.openapi import Body, Raw, Route, Schema, document

_PATH = f"^{ID_PATTERN.pattern}$"
PATH_PARAMETERS: Mapping[str, Schema] = {
    "id": {
        "description": "a sandbox's id (a kept export's: its sandbox's)",
        "schema": {"type": "string", "pattern": _PATH},
    },
    "exec": {
        "description": "the exec's name, from its answer's Sandboxer-Exec header",
        "schema": {"type": "string"},
    },
    "format": {"description": "which file it kept", "schema": {"type": "string", "enum": ["bundle", "tar"]}},
}

_STRING = {"type": "string"}
_NAME = Body(
    fields={"name": {"type": "string", "description": "an owner file's name (ext.NAME, a profile's)"}},
    required=frozenset({"name"}),
)
_BINARY = "application/octet-stream"
_EXPORT_HEADER = {
    "description": "export --json, with `token`: POST it to /v1/sandboxes/{id}/export/confirm once all of "
    "the body is written (no `token` with ?confirm=1: the export is noted before the body's end is sent)",
    "schema": {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {
            "allOf": [
                {"$ref": "#/components/schemas/Exported"},
                {"type": "object", "properties": {"token": _STRING}},
            ]
        },
    },
}
_EXEC_ANSWER = (
    "The command's output, streamed as it writes, in the shape ?format= or else the Accept header "
    "chooses (anything else: frames). "
    f"{frames.CONTENT_TYPE} (frames, the default): frames of one kind byte (1 stdout, 2 stderr, 3 end), a "
    "4-byte big-endian length and the payload; the end frame is JSON (ExecEnd): {status} or {error}. "
    f"{exec_answers.MEDIA_TYPES['ndjson']} (ndjson): one JSON object a line (ExecLine): "
    '{"stream", "data"[, "encoding": "base64"]} for output, then {"exit_status"[, "error"]} last. '
    f"{exec_answers.MEDIA_TYPES['text']} (text): stdout and stderr bytes as they come, then the last line "
    "'sandboxer: exit status N' (': MESSAGE' after it when the broker could not run it), after a newline "
    "of its own when the output did not end with one."
)

ROUTES: tuple[Route, ...] = (
    Route(method="GET", path="/v1/version", name="version", summary="The service's version", answer=Version),
    Route(
        method="GET",
        path="/v1/openapi.json",
        name="openapi",
        summary="This document",
        answer=Raw(
            media_type="application/json",
            description="OpenAPI 3.1, made from the service's routes",
            schema={"type": "object", "required": ["openapi", "info", "paths", "components"]},
        ),
    ),
    Route(
        method="GET",
        path="/v1/me",
        name="whoami",
        summary="whoami: what the calling account may do (owner, or its granted profiles with their limits and "
        "approval status)",
        answer=CallerView,
        errors={403: "the account is not granted this broker (3)"},
    ),
    Route(
        method="GET",
        path="/v1/sandboxes",
        name="list",
        summary="list: every sandbox the caller may name, with its status, caller, age, time left and work",
        answer=SandboxList,
        query={
            "work": {
                "description": "0 (or false): leave out each sandbox's work (its git is asked by a command in "
                "each running sandbox); 1 (or true, the default): include it",
                "schema": {"type": "string", "enum": ["1", "true", "0", "false"], "default": "1"},
            }
        },
        errors={400: "usage (2)"},
    ),
    Route(
        method="POST",
        path="/v1/sandboxes",
        name="create",
        summary="create a sandbox from an approved profile",
        answer=Created,
        status=201,
        body=Body(
            fields={
                "profile": _STRING,
                "ttl": {"type": "number", "minimum": MIN_TTL, "maximum": MAX_TTL, "description": "seconds"},
                "ref": {
                    "type": "string",
                    "description": "check out this ref instead of the profile's (one workspace.refs allows)",
                },
                "branch": {"type": "string", "description": "on a new branch of this name"},
                "manifest": {
                    "type": "string",
                    "description": "a lease manifest by absolute path: from the "
                    "service's own account only (403 otherwise)",
                },
                "bootstrap": {
                    "type": "object",
                    "description": "a runtime bootstrap file as its caller read it",
                    "additionalProperties": False,
                    "required": ["path", "content"],
                    "properties": {
                        "path": {"type": "string", "description": "the absolute path it was read from (for messages)"},
                        "content": {"type": "string", "contentEncoding": "base64"},
                    },
                },
            },
            required=frozenset({"profile"}),
        ),
        errors={400: "usage (2)", 403: "policy (3)", 500: "backend (5)"},
    ),
    Route(
        method="GET",
        path="/v1/sandboxes/{id}",
        name="inspect",
        summary="inspect: the live sandbox against its plan",
        answer=Evidence,
        errors={404: "no such sandbox (4)"},
    ),
    Route(
        method="GET",
        path="/v1/sandboxes/{id}/usage",
        name="usage",
        summary="usage: what the running sandbox uses now (memory, processes, CPU time, disk)",
        answer=Usage,
        errors={404: "no such sandbox (4)", 500: "not running (5)"},
    ),
    Route(
        method="GET",
        path="/v1/sandboxes/{id}/work",
        name="work",
        summary="work: the running sandbox's work as its git reports it, and what no export took out",
        answer=WorkSummary,
        errors={400: "not ready (2)", 404: "no such sandbox (4)", 500: "its git failed (5)"},
    ),
    Route(
        method="POST",
        path="/v1/sandboxes/{id}/extend",
        name="extend",
        summary="extend: the sandbox's lifetime ends `seconds` from now (never earlier than it did), within the "
        "profile's lifetime.max_seconds and the grant's max_ttl_seconds, from its create",
        answer=Lifetime,
        body=Body(
            fields={"seconds": {"type": "integer", "minimum": 1, "maximum": MAX_EXTEND}},
            required=frozenset({"seconds"}),
        ),
        errors={
            400: "usage (2): made without --ttl, not ready",
            403: "past its latest end (3)",
            404: "no such sandbox (4)",
        },
    ),
    Route(
        method="GET",
        path="/v1/sandboxes/{id}/logs/network",
        name="logs-network",
        summary="logs --network: each connection through the sandbox's egress proxy (query: last=N)",
        answer=NetworkLog,
        errors={400: "usage (2)", 404: "no such sandbox (4)"},
    ),
    Route(
        method="DELETE",
        path="/v1/sandboxes/{id}",
        name="teardown",
        summary="teardown",
        answer=Receipt,
        query={
            "discard": {
                "description": "true: remove work no export took out too; false: refuse such a sandbox "
                "(UnexportedWorkError, 2)",
                "schema": {"type": "string", "enum": ["true", "false"], "default": "false"},
            }
        },
        errors={
            400: "usage (2); UnexportedWorkError: the message, and `unexported`, say what work would be lost; "
            "`export` and `discard` are the requests that keep it or lose it",
            404: "no such sandbox (4)",
            409: "residue (6): the envelope has the `receipt` of what was removed",
        },
        envelopes={400: "UnexportedWorkError", 409: "ResidueError"},
    ),
    Route(
        method="POST",
        path="/v1/sandboxes/{id}/exec",
        name="exec",
        summary="exec: run a command in the sandbox",
        body=Raw(
            media_type=_BINARY,
            description="One line of JSON options (ExecOptions), a newline, then the command's stdin, streamed.",
            options=Body(
                fields={
                    "argv": {"type": "array", "items": _STRING, "minItems": 1},
                    "cwd": _STRING,
                    "timeout": {"type": "number", "description": "seconds"},
                    "consumer": _STRING,
                    "executable": _STRING,
                    "env": {
                        "type": "object",
                        "additionalProperties": _STRING,
                        "description": "names in the profile's exec.caller_env only",
                    },
                },
                required=frozenset({"argv"}),
            ),
        ),
        query={
            "format": {
                "description": "the answer's shape (default: what Accept prefers of the three, else frames); any "
                "other value is refused (400)",
                "schema": {"type": "string", "enum": list(exec_answers.MEDIA_TYPES)},
            }
        },
        answer=Raw(
            media_type=frames.CONTENT_TYPE,
            more_media={
                exec_answers.MEDIA_TYPES["ndjson"]: {"x-itemSchema": {"$ref": "#/components/schemas/ExecLine"}},
                exec_answers.MEDIA_TYPES["text"]: {},
            },
            description=_EXEC_ANSWER,
            headers={
                frames.EXEC_HEADER: {
                    "description": "the exec's name, for its signals while it runs",
                    "schema": {"type": "string", "pattern": "^[0-9a-f]{32}$"},
                }
            },
        ),
        errors={
            400: "usage (2): the options line, an unknown format",
            500: "no such sandbox, or it could not run: ExecError (125)",
        },
    ),
    Route(
        method="POST",
        path="/v1/sandboxes/{id}/exec/{exec}/signal",
        name="exec-signal",
        summary="exec signal: send a running exec's command a signal (bwrap: to its session; Docker: the exec is "
        "killed, status 128+N), for the exec's own caller only",
        answer=Signalled,
        body=Body(
            fields={"signal": {"type": "string", "enum": [signum.name for signum in FORWARDED]}},
            required=frozenset({"signal"}),
        ),
        errors={400: "not one of the three (2)", 404: "no such exec running for this caller (4)"},
    ),
    Route(
        method="POST",
        path="/v1/sandboxes/{id}/dispatch",
        name="dispatch-tool",
        summary="dispatch-tool: relay one request from the sandbox's spool to its lease's endpoint",
        answer=Dispatched,
        body=Body(
            fields={
                "lease": _STRING,
                "request_id": _STRING,
                "wait_seconds": {"type": "integer", "minimum": 0, "maximum": MAX_WAIT, "default": 0},
            },
            required=frozenset({"lease", "request_id"}),
        ),
        errors={
            400: "usage (2)",
            403: "refused (3)",
            404: "no such sandbox (4)",
            409: "not pending yet (75): retry",
            500: "the endpoint failed (5)",
        },
    ),
    Route(
        method="POST",
        path="/v1/sandboxes/{id}/export",
        name="export",
        summary="export: the sandbox's work, made by git inside it and verified by the service before it is sent",
        answer=Raw(
            media_type=_BINARY,
            description="the export's bytes: a Git bundle of the new commits, a tar of the working tree, or "
            "(patch) a tar of NNNN-subject.patch files",
            headers={"Sandboxer-Export": _EXPORT_HEADER},
            holds=(Exported,),
        ),
        query={
            "confirm": {
                "description": "1 (or true): note the export as taken out in this one call, once all of the body "
                "is in the socket, before its end (the last chunk) is sent: a client that got the whole body knows "
                "it was noted. 0 (or false, the default): the client confirms it (export/confirm). HTTP/1.1 only",
                "schema": {"type": "string", "enum": ["1", "true", "0", "false"], "default": "0"},
            }
        },
        body=Body(
            fields={"format": {"type": "string", "enum": ["bundle", "patch", "tar"]}},
            required=frozenset({"format"}),
        ),
        errors={
            400: "usage (2): no commits to export, not ready, confirm neither 1 nor 0",
            403: "refused (3), or the caller's export budget has no room for it (its exports under way and "
            "kept ones hold it)",
            404: "no such sandbox (4)",
            500: "git in the sandbox failed, or its output does not verify (5)",
        },
    ),
    Route(
        method="POST",
        path="/v1/sandboxes/{id}/export/confirm",
        name="export-confirm",
        summary="export confirmed: the client wrote all of an export it was sent; the record notes it (teardown "
        "then loses nothing of it)",
        answer=ExportNoted,
        body=Body(
            fields={
                "token": {
                    "type": "string",
                    "description": "from the export's Sandboxer-Export header; good once, for the account it "
                    "was sent to, for 10 minutes",
                }
            },
            required=frozenset({"token"}),
        ),
        errors={400: "not a token awaiting confirmation (2)", 404: "no such sandbox (4)"},
    ),
    Route(
        method="GET",
        path="/v1/exports",
        name="exports",
        summary="exports: the work the reaper kept of the caller's expired sandboxes (an owner: every one)",
        answer=KeptExports,
    ),
    Route(
        method="GET",
        path="/v1/exports/{id}/{format}",
        name="exports-get",
        summary="exports get: a kept export's new commits as a Git bundle (bundle) or its changed tree as a tar (tar)",
        answer=Raw(media_type=_BINARY, description="the kept file's bytes"),
        errors={
            400: "usage (2): it kept no such file, an unknown format",
            404: "no such kept export (4): another caller's answers the same",
        },
    ),
    Route(
        method="DELETE",
        path="/v1/exports/{id}",
        name="exports-rm",
        summary="exports rm: remove a kept export (its room in the caller's export budget is free at once)",
        answer=KeptExportRemoved,
        errors={404: "no such kept export (4): another caller's answers the same"},
    ),
    Route(
        method="POST",
        path="/v1/gc",
        name="gc",
        summary="gc: finish what crashed creates and teardowns left, and remove the quarantine of every export "
        "whose exporter died",
        answer=GcReport,
    ),
    Route(
        method="GET",
        path="/v1/owner/entries",
        name="ext-list",
        summary="ext list (owners only): every owner file with its approval status",
        answer=OwnerListing,
        errors={403: "not an owner (3)"},
    ),
    Route(
        method="POST",
        path="/v1/owner/approve",
        name="ext-approve",
        summary="ext approve (owners only): approve the exact current bytes of an owner file",
        answer=Approval,
        body=_NAME,
        errors={400: "usage or an invalid file (2)", 403: "not an owner, or a runtime off its pin (3)"},
    ),
    Route(
        method="POST",
        path="/v1/owner/revoke",
        name="ext-revoke",
        summary="ext revoke (owners only): withdraw an approval",
        answer=Approval,
        body=_NAME,
        errors={400: "usage (2)", 403: "not an owner (3)"},
    ),
    Route(
        method="POST",
        path="/v1/runtime/digest",
        name="runtime-digest",
        summary="runtime digest (owners of the service's own account only): the tree digest v1 of a runtime "
        "directory, read with the service's rights",
        answer=RuntimeDigest,
        body=Body(
            fields={
                "path": {"type": "string", "description": "an absolute path"},
                "full": {"type": "boolean", "default": False},
            },
            required=frozenset({"path"}),
        ),
        errors={400: "usage (2)", 403: "not an owner, another account, or a runtime the rules refuse (3)"},
    ),
)

BY_NAME: Mapping[str, Route] = MappingProxyType({route.name: route for route in ROUTES})


def body_fields(name: str) -> set[str]:
    """The fields the JSON body of route `name` may have."""
    body = BY_NAME[name].body
    if not isinstance(body, Body):
        raise TypeError(f"route {name} takes no JSON body")
    return body.names


@functools.cache
def document_bytes() -> bytes:
    """The OpenAPI document of ROUTES as the service sends it, made once per process."""
    return json.dumps(document(ROUTES, PATH_PARAMETERS), indent=1).encode()


def main() -> None:
    """Print the document (what `GET /v1/openapi.json` answers)."""

    sys.stdout.buffer.write(document_bytes() + b"\n")


if __name__ == "__main__":
    main()
