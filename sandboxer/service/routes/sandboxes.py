"""The routes of a sandbox's life and what it shows: the service itself, whoami, list, create,
inspect, usage, work, extend, the network log and teardown."""

from __future__ import annotations

from sandboxer.api.results import CallerView, Created, Evidence, NetworkLog, Receipt, SandboxList, Version
from sandboxer.api.usage_results import Lifetime, Usage, WorkSummary
from sandboxer.commands.create import MAX_TTL, MIN_TTL
from sandboxer.commands.usage import MAX_EXTEND
from sandboxer.service.openapi import STRING, Body, Raw, Route

SANDBOXES: tuple[Route, ...] = (
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
                "profile": STRING,
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
)
