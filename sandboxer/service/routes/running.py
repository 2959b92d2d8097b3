"""The routes that reach into a running sandbox: exec and its signals, a tool request's dispatch,
and export with its confirmation."""

from __future__ import annotations

from sandboxer.api.results import Dispatched, Exported, ExportNoted, Signalled
from sandboxer.commands.dispatch import MAX_WAIT
from sandboxer.execio.stdio import FORWARDED
from sandboxer.service import exec_answers, frames
from sandboxer.service.openapi import BINARY, STRING, Body, Raw, Route

_EXPORT_HEADER = {
    "description": "export --json, with `token`: POST it to /v1/sandboxes/{id}/export/confirm once all of "
    "the body is written (no `token` with ?confirm=1: the export is noted before the body's end is sent)",
    "schema": {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {
            "allOf": [
                {"$ref": "#/components/schemas/Exported"},
                {"type": "object", "properties": {"token": STRING}},
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

RUNNING: tuple[Route, ...] = (
    Route(
        method="POST",
        path="/v1/sandboxes/{id}/exec",
        name="exec",
        summary="exec: run a command in the sandbox",
        body=Raw(
            media_type=BINARY,
            description="One line of JSON options (ExecOptions), a newline, then the command's stdin, streamed.",
            options=Body(
                fields={
                    "argv": {"type": "array", "items": STRING, "minItems": 1},
                    "cwd": STRING,
                    "timeout": {"type": "number", "description": "seconds"},
                    "consumer": STRING,
                    "executable": STRING,
                    "env": {
                        "type": "object",
                        "additionalProperties": STRING,
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
                "lease": STRING,
                "request_id": STRING,
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
            media_type=BINARY,
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
)
