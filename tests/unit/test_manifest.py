"""Lease manifests (docs: /work/shared/design/manifest.md): every rule has a case breaking it alone.

Three corpora, each case starting from a complete valid run and changing exactly one thing:
- PARSE_CASES: documents for the pure `parse` (no filesystem, no clock); each is also checked
  through `load` on a real run, where it must fail (or pass) the same way;
- LOAD_CASES: a real run on disk with one thing changed, for `load`;
- the CLI runs a handful of both through `sandboxer manifest check FILE [--json]`.
Every error is checked for its class, exit status and field path (never its wording), and no
error or output may carry a value file's content, the capability or a value file's digest.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from sandboxer.core.manifest import load
from sandboxer.core.manifest.parsing import parse
from sandboxer.core.manifest.schema import LeaseExpiredError, ManifestError
from sandboxer.errors import PolicyError, UsageError
from tests.manifest_samples import (
    CREDENTIAL,
    DIGEST_1,
    DIGEST_3,
    ENDPOINT,
    EXPIRY,
    IMAGE_APP,
    IMAGE_DB,
    MIB,
    MODEL,
    NOTES,
    PROJECT_ENV,
    PROVIDER_ENV,
    REQUEST,
    REVIEW,
    RUN_ID,
    SCM,
    SHARED,
    TUNNEL,
    V1_CREDENTIAL,
    V1_MODEL,
    V1_PROJECT_ENV,
    V1_SCM,
    Run,
    build_run,
    fake_document,
    make_socket,
    marker,
    mkdir,
    render,
    sha256,
    write_file,
)

FILE = "/run/branchbox/managed/run-7.x_y/assignment.json"
PAST = "2000-01-01T00:00:00Z"

Edit = Callable[[dict[str, Any]], None]
Raw = Callable[[str], "str | bytes"]


# --------------------------------------------------------------------------------------------
# A small language for one-change edits of a document: "leases.6.consumer_uid" walks dicts and lists.


def _walk(document: Any, path: str) -> tuple[Any, Any]:
    parts = path.split(".")
    node = document
    for part in parts[:-1]:
        node = node[int(part)] if isinstance(node, list) else node[part]
    last: Any = int(parts[-1]) if isinstance(node, list) else parts[-1]
    return node, last


def put(path: str, value: Any) -> Edit:
    def edit(document: dict[str, Any]) -> None:
        node, key = _walk(document, path)
        node[key] = copy.deepcopy(value)

    return edit


def drop(path: str) -> Edit:
    def edit(document: dict[str, Any]) -> None:
        node, key = _walk(document, path)
        del node[key]

    return edit


def append(path: str, value: Any) -> Edit:
    def edit(document: dict[str, Any]) -> None:
        node, key = _walk(document, path)
        node[key].append(copy.deepcopy(value))

    return edit


def both(*edits: Edit) -> Edit:
    def edit(document: dict[str, Any]) -> None:
        for one in edits:
            one(document)

    return edit


def swap(i: int, j: int) -> Edit:
    def edit(document: dict[str, Any]) -> None:
        leases = document["leases"]
        leases[i], leases[j] = leases[j], leases[i]

    return edit


def dup(key: str) -> Raw:
    """Write the first `"key": value` of the text twice (a duplicate key in raw JSON)."""

    def raw(text: str) -> str:
        match = re.search(rf'"{re.escape(key)}": ("[^"]*"|-?[0-9]+)', text)
        assert match is not None, key
        return text[: match.end()] + ", " + match.group(0) + text[match.end() :]

    return raw


def pad_to(size: int) -> Raw:
    """Pad the document with whitespace after its opening brace to exactly `size` bytes."""

    def raw(text: str) -> str:
        return "{" + " " * (size - len(text.encode())) + text[1:]

    return raw


def mat(lease: int, index: int = 0) -> str:
    return f"leases.{lease}.materializations.{index}"


def field_of(lease: int, key: str = "", index: int | None = None) -> str:
    """The error field path of a lease key, or of a key of one of its materializations."""
    path = f"leases[{lease}]"
    if index is not None:
        path += f".materializations[{index}]"
    return f"{path}.{key}" if key else path


def source_of(lease: int, index: int = 0) -> str:
    return field_of(lease, "source_path", index)


# --------------------------------------------------------------------------------------------
# The parse corpus.


@dataclass(frozen=True)
class Case:
    """One document: the valid one of `version` with `edit` and `raw` applied."""

    id: str
    field: str | tuple[str, ...] | None  # None: valid; a tuple: the contract allows either path
    edit: Edit | None = None
    raw: Raw | None = None
    version: str = "2"
    any_field: bool = False  # assert only the class and exit status
    parse_only: bool = False  # valid, but names sources the on-disk run does not have

    def data(self, document: dict[str, Any]) -> bytes:
        document = copy.deepcopy(document)
        if self.edit is not None:
            self.edit(document)
        if self.raw is None:
            return render(document)
        out = self.raw(json.dumps(document, indent=2))
        return out if isinstance(out, bytes) else out.encode()


def ok(id: str, edit: Edit | None = None, *, version: str = "2", raw: Raw | None = None, **kw: Any) -> Case:
    return Case(id=id, field=None, edit=edit, raw=raw, version=version, **kw)


def bad(
    id: str, edit: Edit | None, field: str | tuple[str, ...], *, version: str = "2", raw: Raw | None = None, **kw: Any
) -> Case:
    return Case(id=id, field=field, edit=edit, raw=raw, version=version, **kw)


def _image(path: str, digest: str = DIGEST_1) -> str:
    return f"{path}@sha256:{digest}"


def _provider_mats(count: int, prefix: str = "EXTRA") -> list[dict[str, str]]:
    return [
        {
            "source_path": f"/run/branchbox/managed/{RUN_ID}/materializations/{prefix.lower()}-{n:02d}",
            "environment_name": f"{prefix}_{n:02d}",
            "sha256": sha256(f"{prefix}{n}".encode()),
        }
        for n in range(count)
    ]


def _lease(lease_id: str, scope: str, consumer: str, **extra: Any) -> dict[str, Any]:
    return {
        "lease_id": lease_id,
        "scope": scope,
        "consumer": consumer,
        **extra,
        "expires_at": EXPIRY,
        "materializations": extra.pop("materializations", []),
    }


SECOND_PROVIDER = _lease(
    "lease_second_delivery", "provider-environment", "coding-agent", materializations=_provider_mats(9, "SECOND")
)
SECOND_PROJECT = _lease(
    "lease_second_project",
    "project-environment",
    "coding-agent",
    materializations=[
        {
            "source_path": f"/run/branchbox/managed/{RUN_ID}/materializations/project-env-2",
            "target_path": "/run/branchbox/leases/project-env",
            "sha256": DIGEST_3,
        }
    ],
)
SECOND_REQUEST = _lease(
    "second_requests",
    "tool-request",
    "coding-agent",
    consumer_uid=1000,
    endpoint_lease_id="delivery_endpoint",
    request_spool_target="/run/branchbox/leases/tool-requests/second",
    materializations=[
        {
            "source_path": f"/run/branchbox/managed/{RUN_ID}/materializations/second-capability",
            "target_path": "/run/branchbox/leases/tool-requests/second/.capability",
            "sha256": DIGEST_3,
        }
    ],
)
V1_SHARED = _lease(
    "shared_exchange",
    "shared-directory",
    "primary-tool",
    materializations=[
        {
            "source_path": f"/run/branchbox/managed/{RUN_ID}/shared/exchange",
            "target_path": "/run/branchbox/leases/shared/exchange",
        }
    ],
)
V1_ENDPOINT = _lease(
    "notes_endpoint",
    "tool-endpoint",
    "primary-tool",
    materializations=[
        {
            "source_path": f"/run/branchbox/managed/{RUN_ID}/tool-endpoints/notes",
            "target_path": "/run/branchbox/leases/tool-endpoints/notes",
        }
    ],
)
V1_PROVIDER = _lease(
    "lease_delivery", "provider-environment", "coding-agent", materializations=_provider_mats(1, "DELIVERY")
)

AMBIENT_MARKERS = [
    "docker.sock",
    "containerd.sock",
    "podman.sock",
    "buildkit",
    "/var/run/docker",
    "/run/docker",
    "/var/lib/docker",
    "/run/containerd",
    "/run/podman",
    "docker_host",
    "container_host",
    "/.ssh",
    "/.gnupg",
    "/run/secrets",
    "/var/run/secrets",
    "ssh_auth_sock",
    "serviceaccount",
]


def _credential_target(index: int, marker_text: str) -> str:
    text = marker_text.upper() if index % 2 else marker_text
    return f"/opt/provider{text}/credential.json" if text.startswith("/") else f"/etc/provider/{text}/credential.json"


def _spool(path: str) -> Edit:
    return both(
        put(f"leases.{REQUEST}.request_spool_target", path),
        put(f"{mat(REQUEST)}.target_path", f"{path}/.capability"),
    )


PROVIDER_NAME = f"{mat(PROVIDER_ENV)}.environment_name"
PROVIDER_NAME_FIELD = field_of(PROVIDER_ENV, "environment_name", 0)
INHERITED = f"leases.{MODEL}.inherited_environment"
INHERITED_FIELD = field_of(MODEL, "inherited_environment")

PARSE_CASES: list[Case] = [
    # ---- valid documents
    ok("v1 full", version="1"),
    ok("v1 minimal", both(drop("leases"), drop("published_ports")), version="1"),
    ok(
        "v1 model identity without executable, past expiry",
        put(f"leases.{V1_MODEL}.expires_at", PAST),
        version="1",
        parse_only=True,
    ),
    ok("v2 full"),
    ok("v3 full", version="3"),
    ok(
        "v2 without leases ports images",
        both(drop("leases"), drop("published_ports"), drop("service_images"), drop("port_proxy_image")),
    ),
    ok(
        "v2 empty leases ports images",
        both(put("leases", []), put("published_ports", []), put("service_images", {}), drop("port_proxy_image")),
    ),
    ok("optional replay_policy absent", drop(f"leases.{REQUEST}.replay_policy")),
    ok("optional inherited_environment absent", drop(f"leases.{REVIEW}.inherited_environment")),
    ok(
        "v3 without workspace_folder and omitted_services",
        both(drop("workspace_folder"), drop("omitted_services")),
        version="3",
    ),
    ok("parse ignores expiry (past)", put(f"leases.{MODEL}.expires_at", PAST), parse_only=True),
    ok("expiry with +02:00 offset", put(f"leases.{MODEL}.expires_at", "2099-01-01T02:00:00+02:00")),
    ok("expiry with fractional seconds", put(f"leases.{MODEL}.expires_at", "2099-01-01T00:00:00.123456Z")),
    ok("expiry with one fraction digit and -07:30", put(f"leases.{MODEL}.expires_at", "2099-01-01T00:00:00.5-07:30")),
    ok("expiry with nanoseconds", put(f"leases.{MODEL}.expires_at", "2099-01-01T00:00:00.123456789Z")),
    ok("request expiry same instant as endpoint", put(f"leases.{REQUEST}.expires_at", "2099-01-01T02:00:00+02:00")),
    ok("request expiry earlier than endpoint", put(f"leases.{REQUEST}.expires_at", "2099-01-01T01:00:00+02:00")),
    ok("image sha256 only", put("service_images.app", f"sha256:{DIGEST_1}")),
    ok("image registry port tag digest", put("service_images.app", _image("registry.example:5000/team/app:1.2"))),
    ok("image of 512 chars", put("service_images.app", _image("r.example/" + "a" * (512 - 10 - 72)))),
    ok("service_images without ports", both(drop("published_ports"), drop("port_proxy_image"))),
    ok("ports without service_images", both(drop("service_images"), drop("port_proxy_image"))),
    ok("port_proxy_image alone", drop("service_images")),
    ok("64 service images", put("service_images", {"app": IMAGE_APP} | {f"svc-{n:02d}": IMAGE_DB for n in range(63)})),
    ok(
        "service image key of 128 chars", put("service_images", {"app": IMAGE_APP, "a" + "b-._9" * 25 + "cd": IMAGE_DB})
    ),
    ok("ports 1 and 65535", put("published_ports", [{"host": 1, "runtime": 65535}, {"host": 65535, "runtime": 1}])),
    ok("revision 64 hex", put("repository.revision", "ab" * 32)),
    ok("revision uppercase", put("repository.revision", "A1" * 20)),
    ok("id with colon dot dash underscore", put(f"leases.{SCM}.lease_id", "scm:lease.1_x-y")),
    ok("run_id of 128 chars", put("run_id", "r" * 128), parse_only=True),
    ok("label with single slashes", put(f"leases.{MODEL}.executable", "/usr/bin/provider-cli")),
    ok("label of 128 chars", put(f"leases.{SCM}.consumer", "c" * 128)),
    ok("env name of 128 chars", put(PROVIDER_NAME, "A" * 128)),
    ok("env name starting underscore", put(PROVIDER_NAME, "_PRIVATE_SETTING")),
    ok("env name PATH_HINT (PATH is a name, not a prefix)", put(PROVIDER_NAME, "PATH_HINT")),
    ok("env name NODE_ENV", put(PROVIDER_NAME, "NODE_ENV")),
    ok("env name GIT_AUTHOR_NAME", put(PROVIDER_NAME, "GIT_AUTHOR_NAME")),
    ok("env name HOMEBREW_X", put(PROVIDER_NAME, "HOMEBREW_X")),
    ok("16 inherited names", put(INHERITED, [f"MODEL_{n:02d}" for n in range(16)])),
    ok(
        "16 provider materializations",
        put(f"leases.{PROVIDER_ENV}.materializations", _provider_mats(16)),
        parse_only=True,
    ),
    ok(
        "8 plus 8 provider materializations",
        both(
            put(f"leases.{PROVIDER_ENV}.materializations", _provider_mats(8)),
            append("leases", {**SECOND_PROVIDER, "materializations": _provider_mats(8, "SECOND")}),
        ),
        parse_only=True,
    ),
    ok(
        "inherited name reused by another consumer",
        both(put(f"leases.{PROVIDER_ENV}.consumer", "review-agent"), put(PROVIDER_NAME, "MODEL_REGION")),
    ),
    ok("consumer_uid 2147483647 in v2", put(f"leases.{REQUEST}.consumer_uid", 2147483647)),
    ok(
        "v3 uid 2147483647",
        both(put("workspace_consumer.uid", 2147483647), put(f"leases.{REQUEST}.consumer_uid", 2147483647)),
        version="3",
    ),
    ok("workspace_folder of 4 segments", put("workspace_folder", "/workspaces/a/b/c/d"), version="3"),
    ok("workspace_folder /workspaces/main-2", put("workspace_folder", "/workspaces/main-2"), version="3"),
    ok("32 omitted services", put("omitted_services", [f"svc-{n}" for n in range(32)]), version="3"),
    ok("omitted service of 64 chars", put("omitted_services", ["s" * 64]), version="3"),
    ok("document of exactly 1 MiB", raw=pad_to(MIB)),
    ok("tool-endpoint after its tool-request", swap(ENDPOINT, REQUEST)),
    ok(
        "expiry with 10 fraction digits (RFC 3339 sets no limit)",
        put(f"leases.{MODEL}.expires_at", "2099-01-01T00:00:00.1234567890Z"),
    ),
    ok(
        "credential target under /usr/local (not refused by the page)",
        put(f"{mat(CREDENTIAL)}.target_path", "/usr/local/etc/provider/credential.json"),
    ),
    ok("env name LANG (not on the page's list)", put(PROVIDER_NAME, "LANG")),
    ok("env name XDG_CONFIG_HOME (not on the page's list)", put(PROVIDER_NAME, "XDG_CONFIG_HOME")),
    # ---- whole document
    bad("not JSON", None, "", raw=lambda text: text[:-1]),
    bad("empty document", None, "", raw=lambda text: ""),
    bad("top level an array", None, "", raw=lambda text: f"[{text}]"),
    bad("top level a string", None, "", raw=lambda text: '"manifest"'),
    bad("trailing object", None, "", raw=lambda text: text + "\n{}"),
    bad("trailing garbage", None, "", raw=lambda text: text + "x"),
    bad("document over 1 MiB", None, "", raw=pad_to(MIB + 1)),
    bad("invalid UTF-8", None, "", raw=lambda text: text.encode().replace(b"task/run-7", b"task/\xff-7")),
    bad("NaN port", put("published_ports.0.host", float("nan")), "", any_field=True),
    bad("Infinity uid", put(f"leases.{REQUEST}.consumer_uid", float("inf")), "", any_field=True),
    # ---- duplicate keys, raw JSON
    bad("duplicate top-level key", None, "run_id", raw=dup("run_id")),
    bad("duplicate lease key", None, field_of(MODEL, "consumer"), raw=dup("consumer")),
    bad("duplicate repository key", None, "repository.revision", raw=dup("revision")),
    bad("duplicate materialization key", None, field_of(PROVIDER_ENV, "sha256", 0), raw=dup("sha256")),
    bad("duplicate service image", None, "service_images.app", raw=dup("app")),
    bad("duplicate port key", None, "published_ports[0].host", raw=dup("host")),
    bad("duplicate workspace_consumer key", None, "workspace_consumer.uid", raw=dup("uid"), version="3"),
    # ---- version
    bad("version as JSON number", put("version", 2), "version"),
    bad("version 4", put("version", "4"), "version"),
    bad("version empty", put("version", ""), "version"),
    bad("version missing", drop("version"), "version"),
    # ---- top level: keys and types
    bad("run_id missing", drop("run_id"), "run_id"),
    bad("lease_id missing", drop("lease_id"), "lease_id"),
    bad("outer_runtime_id missing", drop("outer_runtime_id"), "outer_runtime_id"),
    bad("workspace missing", drop("workspace"), "workspace"),
    bad("repository missing", drop("repository"), "repository"),
    bad("task_branch missing", drop("task_branch"), "task_branch"),
    bad("tunnel_placement missing", drop("tunnel_placement"), "tunnel_placement"),
    bad("unknown top-level key", put("extra", 1), "extra"),
    bad("run_id as JSON number", put("run_id", 7), "run_id"),
    bad("leases a string", put("leases", "none"), "leases"),
    bad("leases null", put("leases", None), "leases"),
    bad("leases an object", put("leases", {}), "leases"),
    bad("lease a list", put(f"leases.{SCM}", []), field_of(SCM)),
    bad("repository a list", put("repository", ["/srv/repos/demo", "a1" * 20]), "repository"),
    bad("published_ports an object", put("published_ports", {"host": 1, "runtime": 1}), "published_ports"),
    bad("service_images a list", put("service_images", [IMAGE_APP]), "service_images"),
    bad("workspace relative", put("workspace", "srv/work"), "workspace"),
    bad("task_branch a number", put("task_branch", 5), "task_branch"),
    bad("task_branch with ..", put("task_branch", "task/a..b"), "task_branch"),
    bad("task_branch with space", put("task_branch", "task b"), "task_branch"),
    bad("tunnel_placement inner", put("tunnel_placement", "inner"), "tunnel_placement"),
    bad("tunnel_placement OUTER", put("tunnel_placement", "OUTER"), "tunnel_placement"),
    # ---- id grammar
    bad("run_id empty", put("run_id", ""), "run_id"),
    bad("run_id of 129 chars", put("run_id", "r" * 129), "run_id"),
    bad("run_id with space", put("run_id", "run 7"), "run_id"),
    bad("outer_runtime_id with slash", put("outer_runtime_id", "outer/1"), "outer_runtime_id"),
    bad("lease lease_id empty", put(f"leases.{SCM}.lease_id", ""), field_of(SCM, "lease_id")),
    bad("lease lease_id of 129 chars", put(f"leases.{SCM}.lease_id", "l" * 129), field_of(SCM, "lease_id")),
    bad("lease lease_id with slash", put(f"leases.{SCM}.lease_id", "lease/scm"), field_of(SCM, "lease_id")),
    bad("lease lease_id missing", drop(f"leases.{SCM}.lease_id"), field_of(SCM, "lease_id")),
    bad("duplicate lease_id", put(f"leases.{TUNNEL}.lease_id", "lease_model"), field_of(TUNNEL, "lease_id")),
    # ---- label grammar
    bad("consumer with space", put(f"leases.{SCM}.consumer", "source host"), field_of(SCM, "consumer")),
    bad("consumer with tab", put(f"leases.{SCM}.consumer", "source\thost"), field_of(SCM, "consumer")),
    bad("consumer with =", put(f"leases.{SCM}.consumer", "source=host"), field_of(SCM, "consumer")),
    bad("consumer with //", put(f"leases.{SCM}.consumer", "source//host"), field_of(SCM, "consumer")),
    bad("consumer empty", put(f"leases.{SCM}.consumer", ""), field_of(SCM, "consumer")),
    bad("consumer of 129 chars", put(f"leases.{SCM}.consumer", "c" * 129), field_of(SCM, "consumer")),
    bad("consumer an int", put(f"leases.{SCM}.consumer", 1), field_of(SCM, "consumer")),
    bad("consumer missing", drop(f"leases.{SCM}.consumer"), field_of(SCM, "consumer")),
    bad("executable with space", put(f"leases.{MODEL}.executable", "provider cli"), field_of(MODEL, "executable")),
    bad("executable with //", put(f"leases.{MODEL}.executable", "//usr/bin/x"), field_of(MODEL, "executable")),
    # ---- lease structure and scope-only keys
    bad("unknown lease key", put(f"leases.{SCM}.note", "x"), field_of(SCM, "note")),
    bad("unknown scope", put(f"leases.{SCM}.scope", "cloud-identity"), field_of(SCM, "scope")),
    bad("scope missing", drop(f"leases.{SCM}.scope"), field_of(SCM, "scope")),
    bad("unknown materialization key", put(f"{mat(PROVIDER_ENV)}.mode", "0600"), field_of(PROVIDER_ENV, "mode", 0)),
    bad(
        "materializations an object",
        put(f"leases.{PROVIDER_ENV}.materializations", {}),
        field_of(PROVIDER_ENV, "materializations"),
    ),
    bad("source_path missing", drop(f"{mat(PROVIDER_ENV)}.source_path"), source_of(PROVIDER_ENV)),
    bad(
        "consumer_uid on shared-directory", put(f"leases.{SHARED}.consumer_uid", 1000), field_of(SHARED, "consumer_uid")
    ),
    bad(
        "executable on provider-environment",
        put(f"leases.{PROVIDER_ENV}.executable", "x"),
        field_of(PROVIDER_ENV, "executable"),
    ),
    bad(
        "spool target on tool-endpoint",
        put(f"leases.{ENDPOINT}.request_spool_target", "/run/branchbox/leases/tool-requests/x"),
        field_of(ENDPOINT, "request_spool_target"),
    ),
    bad(
        "inherited_environment on tool-request",
        put(f"leases.{REQUEST}.inherited_environment", []),
        field_of(REQUEST, "inherited_environment"),
    ),
    bad(
        "replay_policy on model-identity",
        put(f"leases.{MODEL}.replay_policy", "exact-digest-replay-v1"),
        field_of(MODEL, "replay_policy"),
    ),
    bad(
        "endpoint_lease_id on platform-tunnel",
        put(f"leases.{TUNNEL}.endpoint_lease_id", "delivery_endpoint"),
        field_of(TUNNEL, "endpoint_lease_id"),
    ),
    bad("expires_at a number", put(f"leases.{MODEL}.expires_at", 4102444800), field_of(MODEL, "expires_at")),
    # ---- expiry grammar
    bad(
        "expiry without offset", put(f"leases.{MODEL}.expires_at", "2099-01-01T00:00:00"), field_of(MODEL, "expires_at")
    ),
    bad("expiry date only", put(f"leases.{MODEL}.expires_at", "2099-01-01"), field_of(MODEL, "expires_at")),
    bad("expiry month 13", put(f"leases.{MODEL}.expires_at", "2099-13-01T00:00:00Z"), field_of(MODEL, "expires_at")),
    bad("expiry February 30", put(f"leases.{MODEL}.expires_at", "2099-02-30T00:00:00Z"), field_of(MODEL, "expires_at")),
    bad("expiry hour 25", put(f"leases.{MODEL}.expires_at", "2099-01-01T25:00:00Z"), field_of(MODEL, "expires_at")),
    bad(
        "expiry with non-ASCII digits",
        put(f"leases.{MODEL}.expires_at", "\u0662\u0660\u0669\u0669-01-01T00:00:00Z"),
        field_of(MODEL, "expires_at"),
    ),
    bad("expiry empty", put(f"leases.{MODEL}.expires_at", ""), field_of(MODEL, "expires_at")),
    bad("expiry missing on v2 model identity", drop(f"leases.{MODEL}.expires_at"), field_of(MODEL, "expires_at")),
    bad(
        "expiry missing on provider-credential",
        drop(f"leases.{CREDENTIAL}.expires_at"),
        field_of(CREDENTIAL, "expires_at"),
    ),
    # ---- sha256 grammar
    bad("sha256 uppercase", put(f"{mat(PROVIDER_ENV)}.sha256", "AB" * 32), field_of(PROVIDER_ENV, "sha256", 0)),
    bad("sha256 of 63", put(f"{mat(PROVIDER_ENV)}.sha256", "a" * 63), field_of(PROVIDER_ENV, "sha256", 0)),
    bad("sha256 of 65", put(f"{mat(PROVIDER_ENV)}.sha256", "a" * 65), field_of(PROVIDER_ENV, "sha256", 0)),
    bad("sha256 not hex", put(f"{mat(PROVIDER_ENV)}.sha256", "g" * 64), field_of(PROVIDER_ENV, "sha256", 0)),
    bad("sha256 a number", put(f"{mat(PROVIDER_ENV)}.sha256", 1), field_of(PROVIDER_ENV, "sha256", 0)),
    # ---- env names (provider-environment)
    bad("env name lowercase", put(PROVIDER_NAME, "source_token"), PROVIDER_NAME_FIELD),
    bad("env name starting digit", put(PROVIDER_NAME, "1TOKEN"), PROVIDER_NAME_FIELD),
    bad("env name of 129 chars", put(PROVIDER_NAME, "A" * 129), PROVIDER_NAME_FIELD),
    bad("env name with dash", put(PROVIDER_NAME, "SOURCE-TOKEN"), PROVIDER_NAME_FIELD),
    bad("env name empty", put(PROVIDER_NAME, ""), PROVIDER_NAME_FIELD),
    *[
        bad(f"env name denied {name}", put(PROVIDER_NAME, name), PROVIDER_NAME_FIELD)
        for name in ("LD_PRELOAD", "PATH", "HOME", "GIT_DIR", "SSH_AUTH_SOCK", "BASH_ENV", "GIT_CONFIG", "USER")
    ],
    *[
        bad(f"env name denied prefix {name}", put(PROVIDER_NAME, name), PROVIDER_NAME_FIELD)
        for name in (
            "DOCKER_X",
            "SANDBOXER_X",
            "PYTHONPATH",
            "NODE_OPTIONS",
            "BRANCHBOX_X",
            "GIT_CONFIG_X",
            "COMPOSE_FILE",
            "DYLD_INSERT_LIBRARIES",
        )
    ],
    # ---- model identity
    bad(
        "inherited not ascending",
        put(INHERITED, ["MODEL_REGION", "MODEL_ACCESS_TOKEN"]),
        (f"{INHERITED_FIELD}[1]", INHERITED_FIELD),
    ),
    bad(
        "inherited duplicate",
        put(INHERITED, ["MODEL_REGION", "MODEL_REGION"]),
        (f"{INHERITED_FIELD}[1]", INHERITED_FIELD),
    ),
    bad("17 inherited names", put(INHERITED, [f"MODEL_{n:02d}" for n in range(17)]), INHERITED_FIELD),
    bad("inherited denied LD_PRELOAD", put(INHERITED, ["LD_PRELOAD", "MODEL_REGION"]), f"{INHERITED_FIELD}[0]"),
    bad("inherited denied prefix PYTHONPATH", put(INHERITED, ["MODEL_REGION", "PYTHONPATH"]), f"{INHERITED_FIELD}[1]"),
    bad("inherited lowercase", put(INHERITED, ["MODEL_REGION", "model_x"]), f"{INHERITED_FIELD}[1]"),
    bad("inherited a string", put(INHERITED, "MODEL_REGION"), INHERITED_FIELD),
    bad("v2 model identity without executable", drop(f"leases.{MODEL}.executable"), field_of(MODEL, "executable")),
    bad(
        "model identity with a materialization",
        put(f"leases.{MODEL}.materializations", [{"source_path": "/x/y", "sha256": DIGEST_3}]),
        (field_of(MODEL, "materializations"), f"{field_of(MODEL, 'materializations')}[0]"),
    ),
    bad(
        "two model identities for one consumer",
        append("leases", _lease("lease_model_2", "model-identity", "coding-agent", executable="other-cli")),
        field_of(11, "consumer"),
    ),
    bad(
        "executable duplicated across consumers",
        append("leases", _lease("lease_model_3", "model-identity", "third-agent", executable="provider-cli")),
        field_of(11, "executable"),
    ),
    # ---- provider environment
    bad(
        "provider-env with target_path",
        put(f"{mat(PROVIDER_ENV)}.target_path", "/run/x"),
        field_of(PROVIDER_ENV, "target_path", 0),
    ),
    bad("provider-env without sha256", drop(f"{mat(PROVIDER_ENV)}.sha256"), field_of(PROVIDER_ENV, "sha256", 0)),
    bad("provider-env without environment_name", drop(PROVIDER_NAME), PROVIDER_NAME_FIELD),
    bad(
        "provider-env 0 materializations",
        put(f"leases.{PROVIDER_ENV}.materializations", []),
        field_of(PROVIDER_ENV, "materializations"),
    ),
    bad(
        "provider-env 17 materializations",
        put(f"leases.{PROVIDER_ENV}.materializations", _provider_mats(17)),
        (field_of(PROVIDER_ENV, "materializations"), field_of(PROVIDER_ENV, "", 16)),
    ),
    bad(
        "provider-env 8 plus 9 materializations",
        both(put(f"leases.{PROVIDER_ENV}.materializations", _provider_mats(8)), append("leases", SECOND_PROVIDER)),
        (field_of(11, "materializations"), field_of(11, "", 8)),
    ),
    bad(
        "provider-env consumer without model identity",
        put(f"leases.{PROVIDER_ENV}.consumer", "ghost-agent"),
        field_of(PROVIDER_ENV, "consumer"),
    ),
    bad("provider-env name equals an inherited name", put(PROVIDER_NAME, "MODEL_REGION"), PROVIDER_NAME_FIELD),
    bad(
        "provider-env name equals a later model identity's inherited name",
        both(swap(MODEL, PROVIDER_ENV), put("leases.0.materializations.0.environment_name", "MODEL_REGION")),
        f"{field_of(1, 'inherited_environment')}[1]",
    ),
    bad(
        "provider-env name twice",
        put(f"{mat(PROVIDER_ENV, 1)}.environment_name", "SOURCE_DELIVERY_TOKEN"),
        field_of(PROVIDER_ENV, "environment_name", 1),
    ),
    # ---- project environment
    bad(
        "project-env wrong target",
        put(f"{mat(PROJECT_ENV)}.target_path", "/run/branchbox/leases/project-env2"),
        field_of(PROJECT_ENV, "target_path", 0),
    ),
    bad(
        "project-env target with trailing slash",
        put(f"{mat(PROJECT_ENV)}.target_path", "/run/branchbox/leases/project-env/"),
        field_of(PROJECT_ENV, "target_path", 0),
    ),
    bad("project-env target missing", drop(f"{mat(PROJECT_ENV)}.target_path"), field_of(PROJECT_ENV, "target_path", 0)),
    bad("project-env without sha256", drop(f"{mat(PROJECT_ENV)}.sha256"), field_of(PROJECT_ENV, "sha256", 0)),
    bad(
        "project-env 0 materializations",
        put(f"leases.{PROJECT_ENV}.materializations", []),
        field_of(PROJECT_ENV, "materializations"),
    ),
    bad("two project-environment leases", append("leases", SECOND_PROJECT), (field_of(11), field_of(11, "scope"))),
    # ---- provider credential
    bad(
        "credential target under leases",
        put(f"{mat(CREDENTIAL)}.target_path", "/run/branchbox/leases/credential.json"),
        field_of(CREDENTIAL, "target_path", 0),
    ),
    bad(
        "credential target directly in /",
        put(f"{mat(CREDENTIAL)}.target_path", "/cred"),
        field_of(CREDENTIAL, "target_path", 0),
    ),
    bad(
        "credential target relative",
        put(f"{mat(CREDENTIAL)}.target_path", "etc/provider/credential.json"),
        field_of(CREDENTIAL, "target_path", 0),
    ),
    bad("credential target missing", drop(f"{mat(CREDENTIAL)}.target_path"), field_of(CREDENTIAL, "target_path", 0)),
    bad("credential without sha256", drop(f"{mat(CREDENTIAL)}.sha256"), field_of(CREDENTIAL, "sha256", 0)),
    bad(
        "credential 2 materializations",
        append(
            f"leases.{CREDENTIAL}.materializations",
            {"source_path": "/x/c2", "target_path": "/etc/p/c2", "sha256": DIGEST_3},
        ),
        (field_of(CREDENTIAL, "materializations"), field_of(CREDENTIAL, "", 1)),
    ),
    *[
        bad(
            f"credential target ambient {m}",
            put(f"{mat(CREDENTIAL)}.target_path", _credential_target(i, m)),
            field_of(CREDENTIAL, "target_path", 0),
        )
        for i, m in enumerate(AMBIENT_MARKERS)
    ],
    # ---- shared directory
    bad(
        "shared target equal to namespace/",
        put(f"{mat(SHARED)}.target_path", "/run/branchbox/leases/shared/"),
        field_of(SHARED, "target_path", 0),
    ),
    bad(
        "shared target equal to namespace",
        put(f"{mat(SHARED)}.target_path", "/run/branchbox/leases/shared"),
        field_of(SHARED, "target_path", 0),
    ),
    bad(
        "shared target outside namespace",
        put(f"{mat(SHARED)}.target_path", "/run/branchbox/leases/exchange"),
        field_of(SHARED, "target_path", 0),
    ),
    bad(
        "shared target with ..",
        put(f"{mat(SHARED)}.target_path", "/run/branchbox/leases/shared/../exchange"),
        field_of(SHARED, "target_path", 0),
    ),
    bad(
        "shared target Docker.Sock",
        put(f"{mat(SHARED)}.target_path", "/run/branchbox/leases/shared/Docker.Sock"),
        field_of(SHARED, "target_path", 0),
    ),
    bad(
        "shared target /.ssh",
        put(f"{mat(SHARED)}.target_path", "/run/branchbox/leases/shared/home/.ssh"),
        field_of(SHARED, "target_path", 0),
    ),
    bad("shared with sha256", put(f"{mat(SHARED)}.sha256", DIGEST_3), field_of(SHARED, "sha256", 0)),
    bad("shared target missing", drop(f"{mat(SHARED)}.target_path"), field_of(SHARED, "target_path", 0)),
    bad(
        "shared 2 materializations",
        append(
            f"leases.{SHARED}.materializations",
            {"source_path": "/x/s2", "target_path": "/run/branchbox/leases/shared/s2"},
        ),
        (field_of(SHARED, "materializations"), field_of(SHARED, "", 1)),
    ),
    # ---- tool endpoint
    bad(
        "endpoint target outside namespace",
        put(f"{mat(ENDPOINT)}.target_path", "/run/branchbox/leases/tool-endpoint/delivery.sock"),
        field_of(ENDPOINT, "target_path", 0),
    ),
    bad(
        "endpoint target in shared namespace",
        put(f"{mat(ENDPOINT)}.target_path", "/run/branchbox/leases/shared/delivery.sock"),
        field_of(ENDPOINT, "target_path", 0),
    ),
    bad(
        "endpoint target equal to namespace",
        put(f"{mat(ENDPOINT)}.target_path", "/run/branchbox/leases/tool-endpoints"),
        field_of(ENDPOINT, "target_path", 0),
    ),
    bad(
        "endpoint target SSH_AUTH_SOCK",
        put(f"{mat(NOTES)}.target_path", "/run/branchbox/leases/tool-endpoints/SSH_AUTH_SOCK"),
        field_of(NOTES, "target_path", 0),
    ),
    bad("endpoint with sha256", put(f"{mat(NOTES)}.sha256", DIGEST_3), field_of(NOTES, "sha256", 0)),
    # ---- tool request
    bad(
        "request without endpoint", drop(f"leases.{REQUEST}.endpoint_lease_id"), field_of(REQUEST, "endpoint_lease_id")
    ),
    bad(
        "request endpoint unknown",
        put(f"leases.{REQUEST}.endpoint_lease_id", "no_such_lease"),
        field_of(REQUEST, "endpoint_lease_id"),
    ),
    bad(
        "request endpoint not a tool-endpoint",
        put(f"leases.{REQUEST}.endpoint_lease_id", "lease_credential"),
        field_of(REQUEST, "endpoint_lease_id"),
    ),
    bad(
        "request endpoint of another consumer",
        put(f"leases.{ENDPOINT}.consumer", "primary-tool"),
        field_of(REQUEST, "endpoint_lease_id"),
    ),
    bad("one endpoint backing two spools", append("leases", SECOND_REQUEST), field_of(11, "endpoint_lease_id")),
    bad(
        "request spool outside namespace",
        _spool("/run/branchbox/leases/tool-request/delivery"),
        field_of(REQUEST, "request_spool_target"),
    ),
    bad(
        "request spool equal to namespace",
        _spool("/run/branchbox/leases/tool-requests"),
        field_of(REQUEST, "request_spool_target"),
    ),
    bad(
        "request spool missing",
        drop(f"leases.{REQUEST}.request_spool_target"),
        field_of(REQUEST, "request_spool_target"),
    ),
    bad(
        "capability target not spool/.capability",
        put(f"{mat(REQUEST)}.target_path", "/run/branchbox/leases/tool-requests/delivery/capability"),
        field_of(REQUEST, "target_path", 0),
    ),
    bad(
        "capability target in another spool",
        put(f"{mat(REQUEST)}.target_path", "/run/branchbox/leases/tool-requests/other/.capability"),
        field_of(REQUEST, "target_path", 0),
    ),
    bad("capability without sha256", drop(f"{mat(REQUEST)}.sha256"), field_of(REQUEST, "sha256", 0)),
    bad(
        "replay_policy other",
        put(f"leases.{REQUEST}.replay_policy", "always-replay"),
        field_of(REQUEST, "replay_policy"),
    ),
    bad("consumer_uid 0", put(f"leases.{REQUEST}.consumer_uid", 0), field_of(REQUEST, "consumer_uid")),
    bad(
        "consumer_uid 2147483648", put(f"leases.{REQUEST}.consumer_uid", 2147483648), field_of(REQUEST, "consumer_uid")
    ),
    bad("consumer_uid a bool", put(f"leases.{REQUEST}.consumer_uid", True), field_of(REQUEST, "consumer_uid")),
    bad("consumer_uid a string", put(f"leases.{REQUEST}.consumer_uid", "1000"), field_of(REQUEST, "consumer_uid")),
    bad("consumer_uid missing", drop(f"leases.{REQUEST}.consumer_uid"), field_of(REQUEST, "consumer_uid")),
    bad(
        "v3 consumer_uid not workspace uid",
        put(f"leases.{REQUEST}.consumer_uid", 1001),
        field_of(REQUEST, "consumer_uid"),
        version="3",
    ),
    bad(
        "request expiry later than endpoint",
        put(f"leases.{REQUEST}.expires_at", "2099-01-01T00:00:01Z"),
        field_of(REQUEST, "expires_at"),
    ),
    bad(
        "request expiry later than endpoint by offset",
        put(f"leases.{REQUEST}.expires_at", "2098-12-31T23:00:00-02:00"),
        field_of(REQUEST, "expires_at"),
    ),
    bad(
        "request consumer without model identity",
        both(put(f"leases.{ENDPOINT}.consumer", "primary-tool"), put(f"leases.{REQUEST}.consumer", "primary-tool")),
        field_of(REQUEST, "consumer"),
    ),
    # ---- outer leases
    bad(
        "scm lease with a materialization",
        put(f"leases.{SCM}.materializations", [{"source_path": "/x/y", "sha256": DIGEST_3}]),
        (field_of(SCM, "materializations"), field_of(SCM, "", 0)),
    ),
    bad(
        "tunnel lease with executable", put(f"leases.{TUNNEL}.executable", "tunnel-cli"), field_of(TUNNEL, "executable")
    ),
    # ---- published ports
    bad("port 0", put("published_ports.0.host", 0), "published_ports[0].host"),
    bad("port 65536", put("published_ports.0.runtime", 65536), "published_ports[0].runtime"),
    bad("port negative", put("published_ports.1.host", -1), "published_ports[1].host"),
    bad("port a float", put("published_ports.0.host", 3000.0), "published_ports[0].host"),
    bad("port a bool", put("published_ports.0.host", True), "published_ports[0].host"),
    bad("port a string", put("published_ports.0.runtime", "3000"), "published_ports[0].runtime"),
    bad("port duplicate host", put("published_ports.1.host", 3000), "published_ports[1].host"),
    bad("port duplicate runtime", put("published_ports.1.runtime", 3000), "published_ports[1].runtime"),
    bad("port extra key", put("published_ports.0.protocol", "tcp"), "published_ports[0].protocol"),
    bad("port runtime missing", drop("published_ports.0.runtime"), "published_ports[0].runtime"),
    # ---- repository
    bad("repository extra key", put("repository.branch", "main"), "repository.branch"),
    bad("repository path missing", drop("repository.path"), "repository.path"),
    bad("revision of 39 hex", put("repository.revision", "a" * 39), "repository.revision"),
    bad("revision of 41 hex", put("repository.revision", "a" * 41), "repository.revision"),
    bad("revision not hex", put("repository.revision", "g" * 40), "repository.revision"),
    # ---- images
    bad(
        "65 service images",
        put("service_images", {"app": IMAGE_APP} | {f"svc-{n:02d}": IMAGE_DB for n in range(64)}),
        "service_images",
    ),
    bad("service image key starting _", put("service_images._app", IMAGE_DB), "service_images._app"),
    bad("service image key with space", put("service_images.my app", IMAGE_DB), "service_images.my app"),
    bad("service image key empty", put("service_images.", IMAGE_DB), "service_images."),
    bad("image tag only", put("service_images.app", "registry.example/team/app:1.2"), "service_images.app"),
    bad(
        "image uppercase digest",
        put("service_images.app", _image("registry.example/team/app", DIGEST_1.upper())),
        "service_images.app",
    ),
    bad("image uppercase path", put("service_images.app", _image("registry.example/Team/app")), "service_images.app"),
    bad(
        "image https scheme",
        put("service_images.app", _image("https://registry.example/team/app")),
        "service_images.app",
    ),
    bad("image with $", put("service_images.app", _image("registry.example/team/$app")), "service_images.app"),
    bad("image with //", put("service_images.app", _image("registry.example//team/app")), "service_images.app"),
    bad("image with space", put("service_images.app", _image("registry.example/team app")), "service_images.app"),
    bad(
        "image digest of 63",
        put("service_images.app", "registry.example/team/app@sha256:" + "a" * 63),
        "service_images.app",
    ),
    bad("image sha512", put("service_images.app", "sha512:" + "a" * 128), "service_images.app"),
    bad(
        "image of 513 chars",
        put("service_images.app", _image("r.example/" + "a" * (513 - 10 - 72))),
        "service_images.app",
    ),
    bad("image without registry/", put("service_images.app", f"app@sha256:{DIGEST_1}"), "service_images.app"),
    bad("image a number", put("service_images.app", 1), "service_images.app"),
    bad(
        "port_proxy_image tag only", put("port_proxy_image", "registry.example/runtime/tcp-proxy:1"), "port_proxy_image"
    ),
    bad("port_proxy_image missing with images and ports", drop("port_proxy_image"), "port_proxy_image"),
    # ---- version gating
    bad(
        "v1 executable",
        put(f"leases.{V1_MODEL}.executable", "provider-cli"),
        field_of(V1_MODEL, "executable"),
        version="1",
    ),
    bad(
        "v1 inherited_environment",
        put(f"leases.{V1_MODEL}.inherited_environment", ["MODEL_REGION"]),
        field_of(V1_MODEL, "inherited_environment"),
        version="1",
    ),
    bad("v1 provider-environment lease", append("leases", V1_PROVIDER), field_of(5, "scope"), version="1"),
    bad("v1 shared-directory lease", append("leases", V1_SHARED), field_of(5, "scope"), version="1"),
    bad("v1 tool-endpoint lease", append("leases", V1_ENDPOINT), field_of(5, "scope"), version="1"),
    bad("v1 service_images", put("service_images", {"app": IMAGE_APP}), "service_images", version="1"),
    bad("v1 port_proxy_image", put("port_proxy_image", IMAGE_APP), "port_proxy_image", version="1"),
    bad(
        "v1 workspace_consumer",
        put("workspace_consumer", {"uid": 1000, "gid": 1000}),
        "workspace_consumer",
        version="1",
    ),
    bad("v2 workspace_consumer", put("workspace_consumer", {"uid": 1000, "gid": 1000}), "workspace_consumer"),
    bad(
        "v2 workspace_folder",
        both(put("workspace_folder", "/workspaces/a"), put("omitted_services", ["x"])),
        "workspace_folder",
    ),
    # ---- workspace consumer (v3)
    bad("v3 workspace_consumer missing", drop("workspace_consumer"), "workspace_consumer", version="3"),
    bad(
        "v3 uid 0",
        both(put("workspace_consumer.uid", 0), put(f"leases.{REQUEST}.consumer_uid", 1)),
        "workspace_consumer.uid",
        version="3",
    ),
    bad("v3 uid 2147483648", put("workspace_consumer.uid", 2147483648), "workspace_consumer.uid", version="3"),
    bad("v3 gid 0", put("workspace_consumer.gid", 0), "workspace_consumer.gid", version="3"),
    bad("v3 uid a bool", put("workspace_consumer.uid", True), "workspace_consumer.uid", version="3"),
    bad("v3 gid missing", drop("workspace_consumer.gid"), "workspace_consumer.gid", version="3"),
    bad(
        "v3 workspace_consumer extra key",
        put("workspace_consumer.name", "agent"),
        "workspace_consumer.name",
        version="3",
    ),
    # ---- workspace folder (v3)
    bad(
        "workspace_folder without omitted_services",
        drop("omitted_services"),
        ("omitted_services", "workspace_folder"),
        version="3",
    ),
    bad(
        "omitted_services without workspace_folder",
        drop("workspace_folder"),
        ("omitted_services", "workspace_folder"),
        version="3",
    ),
    bad(
        "workspace_folder without images",
        both(drop("service_images"), drop("port_proxy_image")),
        "workspace_folder",
        version="3",
    ),
    bad(
        "workspace_folder /workspaces/main",
        put("workspace_folder", "/workspaces/main"),
        "workspace_folder",
        version="3",
    ),
    bad("workspace_folder outside /workspaces", put("workspace_folder", "/srv/app"), "workspace_folder", version="3"),
    bad("workspace_folder /workspaces/", put("workspace_folder", "/workspaces/"), "workspace_folder", version="3"),
    bad(
        "workspace_folder 5 segments", put("workspace_folder", "/workspaces/a/b/c/d/e"), "workspace_folder", version="3"
    ),
    bad("workspace_folder with ..", put("workspace_folder", "/workspaces/a/../b"), "workspace_folder", version="3"),
    bad("workspace_folder with //", put("workspace_folder", "/workspaces/a//b"), "workspace_folder", version="3"),
    bad(
        "33 omitted services", put("omitted_services", [f"svc-{n}" for n in range(33)]), "omitted_services", version="3"
    ),
    bad("omitted service of 65 chars", put("omitted_services", ["s" * 65]), "omitted_services[0]", version="3"),
    bad("omitted service empty", put("omitted_services", [""]), "omitted_services[0]", version="3"),
    bad("omitted service a number", put("omitted_services", [1]), "omitted_services[0]", version="3"),
]


def _fields(case_field: str | tuple[str, ...]) -> tuple[str, ...]:
    return (case_field,) if isinstance(case_field, str) else case_field


def check_usage_error(
    error: BaseException, expected: str | tuple[str, ...], file: str, *, any_field: bool = False
) -> None:
    """A ManifestError (usage, exit 2) naming `file` and exactly one of the expected fields."""
    assert isinstance(error, ManifestError), repr(error)
    assert isinstance(error, UsageError)
    assert not isinstance(error, LeaseExpiredError)
    assert error.exit_status == 2
    assert error.file == file
    assert isinstance(error.rule, str)
    assert error.rule
    if not any_field:
        assert error.field in _fields(expected), f"field {error.field!r}, message {error}"


def _params(cases: list[Any]) -> list[Any]:
    ids = [case.id for case in cases]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    return [pytest.param(case, id=case.id) for case in cases]


@pytest.mark.parametrize("case", _params(PARSE_CASES))
def test_parse(case: Case) -> None:
    data = case.data(fake_document(case.version))
    if case.field is None:
        assert parse(data, file=FILE) is not None
        return
    with pytest.raises(ManifestError) as info:
        parse(data, file=FILE)
    check_usage_error(info.value, case.field, FILE, any_field=case.any_field)


@pytest.mark.parametrize("case", _params([case for case in PARSE_CASES if not case.parse_only]))
def test_parse_case_through_load(case: Case, tmp_path_factory: pytest.TempPathFactory) -> None:
    """`load` runs `parse` first: the same document on a real run fails (or passes) the same way."""
    run = build_run(tmp_path_factory.mktemp("run"), case.version)
    run.save(case.data(run.doc))
    path = str(run.assignment)
    if case.field is None:
        assert load(path) is not None
        return
    with pytest.raises(ManifestError) as info:
        load(path)
    check_usage_error(info.value, case.field, path, any_field=case.any_field)


# --------------------------------------------------------------------------------------------
# The load corpus: a real run with one thing changed.

Setup = Callable[[Run], "dict[str, Any] | None"]


@dataclass(frozen=True)
class LoadCase:
    id: str
    setup: Setup
    field: str | tuple[str, ...] | None  # None: valid
    version: str = "2"
    expired: bool = False  # LeaseExpiredError rather than ManifestError
    root_only: bool = False


def ok_load(id: str, setup: Setup, *, version: str = "2") -> LoadCase:
    return LoadCase(id=id, setup=setup, field=None, version=version)


def bad_load(id: str, setup: Setup, field: str | tuple[str, ...], **kw: Any) -> LoadCase:
    return LoadCase(id=id, setup=setup, field=field, **kw)


def nothing(run: Run) -> None:
    return None


def edit(*edits: Edit) -> Setup:
    def setup(run: Run) -> None:
        both(*edits)(run.doc)

    return setup


def chmod(relative: str, mode: int) -> Setup:
    def setup(run: Run) -> None:
        (run.run_dir / relative).chmod(mode)

    return setup


def rewrite(lease: int, data: bytes, index: int = 0) -> Setup:
    def setup(run: Run) -> None:
        run.rewrite(lease, data, index)

    return setup


def rewrite_text(lease: int, make: Callable[[], str]) -> Setup:
    def setup(run: Run) -> None:
        run.rewrite(lease, make().encode())

    return setup


def forbid(*relatives: str) -> Setup:
    def setup(run: Run) -> dict[str, Any]:
        return {"forbidden": [str(run.run_dir / relative) for relative in relatives]}

    return setup


def at_time(moment: datetime, *edits: Edit) -> Setup:
    def setup(run: Run) -> dict[str, Any]:
        both(*edits)(run.doc)
        return {"now": moment}

    return setup


def assignment_symlink(run: Run) -> dict[str, Any]:
    link = run.run_dir / "assignment-link.json"
    link.symlink_to(run.assignment)
    return {"path": str(link)}


def assignment_read_only(run: Run) -> dict[str, Any]:
    run.save()
    run.assignment.chmod(0o400)
    return {"saved": True}  # a non-root owner could not write it again


def assignment_relative(run: Run) -> dict[str, Any]:
    return {"path": "assignment.json", "cwd": run.run_dir}


def value_outside_materializations(run: Run) -> None:
    run.move_source(PROVIDER_ENV, run.run_dir / "delivery-token")


def value_in_subdirectory(run: Run) -> None:
    mkdir(run.mat_dir / "sub", 0o700)
    run.move_source(PROVIDER_ENV, run.mat_dir / "sub" / "delivery-token")


def value_symlink(run: Run) -> None:
    source = run.source(PROVIDER_ENV)
    real = run.mat_dir / "delivery-token-real"
    os.rename(source, real)
    source.symlink_to(real.name)


def value_directory(run: Run) -> None:
    source = run.source(PROVIDER_ENV)
    source.unlink()
    mkdir(source, 0o700)


def value_missing(run: Run) -> None:
    run.source(PROVIDER_ENV).unlink()


def value_relative(run: Run) -> None:
    run.mat(PROVIDER_ENV)["source_path"] = "materializations/delivery-token"


def value_digest_mismatch(run: Run) -> None:
    run.mat(PROVIDER_ENV)["sha256"] = sha256(b"some other value")


def value_named(name: str) -> Setup:
    def setup(run: Run) -> None:
        run.move_source(PROVIDER_ENV, run.mat_dir / name)

    return setup


def shared_as_file(run: Run) -> None:
    source = run.source(SHARED)
    source.rmdir()
    write_file(source, b"not a directory\n", 0o755)


def shared_parent_symlink(run: Run) -> None:
    os.rename(run.run_dir / "shared", run.run_dir / "shared-real")
    (run.run_dir / "shared").symlink_to("shared-real")


def shared_symlink(run: Run) -> None:
    source = run.source(SHARED)
    os.rename(source, source.parent / "exchange-real")
    source.symlink_to("exchange-real")


def shared_outside_run(run: Run) -> None:
    outside = mkdir(run.run_dir.parent / "exchange-outside", 0o755)
    run.mat(SHARED)["source_path"] = str(outside)


def shared_path(relative: str) -> Setup:
    def setup(run: Run) -> None:
        run.mat(SHARED)["source_path"] = f"{run.run_dir}/{relative}"

    return setup


def shared_named(name: str) -> Setup:
    def setup(run: Run) -> None:
        run.move_source(SHARED, run.run_dir / "shared" / name)

    return setup


def notes_as_file(run: Run) -> None:
    source = run.source(NOTES)
    source.rmdir()
    write_file(source, b"notes\n", 0o600)


def notes_named(name: str) -> Setup:
    def setup(run: Run) -> None:
        run.move_source(NOTES, run.run_dir / "tool-endpoints" / name)

    return setup


def endpoint_directory(run: Run) -> None:
    source = run.source(ENDPOINT)
    source.unlink()
    mkdir(source, 0o700)


def socket_inside_notes(run: Run) -> None:
    run.move_source(ENDPOINT, run.source(NOTES) / "delivery.sock")


def socket_mode(mode: int) -> Setup:
    def setup(run: Run) -> None:
        source = run.source(ENDPOINT)
        source.unlink()
        make_socket(source, mode)

    return setup


def equal_sources(run: Run) -> None:
    run.mat(PROVIDER_ENV, 1)["source_path"] = run.mat(PROVIDER_ENV, 0)["source_path"]
    run.mat(PROVIDER_ENV, 1)["sha256"] = run.mat(PROVIDER_ENV, 0)["sha256"]


def run_dir_symlink(run: Run) -> None:
    """The run directory's name is a symlink to the real (0700) directory."""
    real = run.run_dir.parent / "real-run"
    os.rename(run.run_dir, real)
    run.run_dir.symlink_to(real.name)


def forbidden_through_alias(run: Run) -> dict[str, Any]:
    """The run is named through a symlinked ancestor; `forbidden` names the real directory holding it."""
    alias = run.base.parent / f"{run.base.name}-alias"
    alias.symlink_to(run.base)
    run.save(render(run.doc).replace(f"{run.base}/".encode(), f"{alias}/".encode()))
    return {
        "saved": True,
        "path": str(alias / "managed" / RUN_ID / "assignment.json"),
        "forbidden": [str(run.base)],
    }


def chown(relative: str) -> Setup:
    def setup(run: Run) -> None:
        os.chown(run.run_dir / relative, 1000, 1000)

    return setup


def project(*lines: str) -> Callable[[], str]:
    def make() -> str:
        return "".join(lines)

    return make


def secret_line(name: str) -> str:
    return f"{name}={marker('projsecret')}\n"


def _cap(length: int, fill: str = "c") -> bytes:
    text = marker("capsecret").replace("-", "_")
    return (text + fill * length)[:length].encode()


NOW = datetime(2050, 1, 1, tzinfo=UTC)
JUST_BEFORE = datetime(2049, 12, 31, 23, 59, 59, tzinfo=UTC)
SOURCE_CHAIN_FIELDS = ("", "run_id", source_of(PROVIDER_ENV), source_of(SHARED))

LOAD_CASES: list[LoadCase] = [
    # ---- valid runs
    ok_load("v1 run", nothing, version="1"),
    ok_load("v2 run", nothing),
    ok_load("v3 run", nothing, version="3"),
    ok_load("assignment mode 0400", assignment_read_only),
    ok_load("credential mode 0444", chmod("materializations/credential.json", 0o444)),
    ok_load("provider value of 8 bytes", rewrite(PROVIDER_ENV, b"8bytes!?")),
    ok_load("provider value of 16384 bytes", rewrite(PROVIDER_ENV, b"v" * 16384)),
    ok_load("capability of 32 chars", rewrite(REQUEST, _cap(32))),
    ok_load("capability of 128 chars", rewrite(REQUEST, _cap(128, "._-"))),
    ok_load("socket mode 0700", socket_mode(0o700)),
    ok_load(
        "credential mode 0755 (readable by all, writable by owner only)",
        chmod("materializations/credential.json", 0o755),
    ),
    ok_load("project value containing =", rewrite_text(PROJECT_ENV, project("ALPHA=a=b\n"))),
    ok_load("project env of 256 lines", rewrite_text(PROJECT_ENV, project(*[f"V{n:03d}=x\n" for n in range(256)]))),
    ok_load("project env of 64 KiB", rewrite_text(PROJECT_ENV, project("A=" + "x" * (65536 - 3) + "\n"))),
    ok_load("project env expiry not checked", edit(put(f"leases.{PROJECT_ENV}.expires_at", PAST))),
    ok_load(
        "outer lease expiry not checked",
        edit(put(f"leases.{SCM}.expires_at", PAST), put(f"leases.{TUNNEL}.expires_at", PAST)),
    ),
    ok_load("v1 model identity expiry not checked", edit(put(f"leases.{V1_MODEL}.expires_at", PAST)), version="1"),
    ok_load("v1 scm expiry not checked", edit(put(f"leases.{V1_SCM}.expires_at", PAST)), version="1"),
    ok_load(
        "expired lease live for an earlier now",
        at_time(datetime(1999, 1, 1, tzinfo=UTC), put(f"leases.{MODEL}.expires_at", PAST)),
    ),
    ok_load(
        "expiry with offset live just before",
        at_time(JUST_BEFORE, put(f"leases.{CREDENTIAL}.expires_at", "2050-01-01T02:00:00+02:00")),
    ),
    ok_load("forbidden unrelated", forbid("../elsewhere")),
    ok_load("forbidden is a string prefix, not a parent", forbid("shared/exch")),
    # ---- the assignment file
    bad_load("assignment symlink", assignment_symlink, ""),
    bad_load("assignment mode 0644", chmod("assignment.json", 0o644), ""),
    bad_load("assignment mode 0640", chmod("assignment.json", 0o640), ""),
    bad_load("assignment mode 0602", chmod("assignment.json", 0o602), ""),
    bad_load("assignment path relative", assignment_relative, ""),
    # ---- the run directory
    bad_load("run dir name is not run_id", edit(put("run_id", "run-8")), "run_id"),
    bad_load("run dir mode 0755", chmod(".", 0o755), SOURCE_CHAIN_FIELDS),
    bad_load("run dir mode 0750", chmod(".", 0o750), SOURCE_CHAIN_FIELDS),
    bad_load("run dir a symlink", run_dir_symlink, SOURCE_CHAIN_FIELDS),
    bad_load("materializations dir mode 0750", chmod("materializations", 0o750), source_of(PROVIDER_ENV)),
    # ---- file sources
    bad_load("value mode 0640", chmod("materializations/delivery-token", 0o640), source_of(PROVIDER_ENV)),
    bad_load("value mode 0604", chmod("materializations/delivery-token", 0o604), source_of(PROVIDER_ENV)),
    bad_load("value in the run dir itself", value_outside_materializations, source_of(PROVIDER_ENV)),
    bad_load("value in a subdirectory of materializations", value_in_subdirectory, source_of(PROVIDER_ENV)),
    bad_load("value a symlink", value_symlink, source_of(PROVIDER_ENV)),
    bad_load("value a directory", value_directory, source_of(PROVIDER_ENV)),
    bad_load("value missing", value_missing, source_of(PROVIDER_ENV)),
    bad_load("value path relative", value_relative, source_of(PROVIDER_ENV)),
    bad_load(
        "value sha256 mismatch", value_digest_mismatch, (field_of(PROVIDER_ENV, "sha256", 0), source_of(PROVIDER_ENV))
    ),
    bad_load("value named SSH_AUTH_SOCK", value_named("SSH_AUTH_SOCK-token"), source_of(PROVIDER_ENV)),
    bad_load("value named docker_host", value_named("docker_host.txt"), source_of(PROVIDER_ENV)),
    bad_load(
        "provider value trailing newline",
        rewrite(PROVIDER_ENV, marker("provsecret").encode() + b"\n"),
        source_of(PROVIDER_ENV),
    ),
    bad_load("provider value of 7 bytes", rewrite(PROVIDER_ENV, b"Zq7#wX1"), source_of(PROVIDER_ENV)),
    bad_load("provider value empty", rewrite(PROVIDER_ENV, b""), source_of(PROVIDER_ENV)),
    bad_load("provider value of 16385 bytes", rewrite(PROVIDER_ENV, b"v" * 16385), source_of(PROVIDER_ENV)),
    bad_load(
        "provider value invalid UTF-8",
        rewrite(PROVIDER_ENV, marker("provsecret").encode() + b"\xff\xfe"),
        source_of(PROVIDER_ENV),
    ),
    bad_load(
        "provider value with tab",
        rewrite(PROVIDER_ENV, b"provsecret\t" + marker("x").encode()),
        source_of(PROVIDER_ENV),
    ),
    bad_load(
        "provider value with control byte",
        rewrite(PROVIDER_ENV, b"provsecret\x01" + marker("x").encode()),
        source_of(PROVIDER_ENV),
    ),
    bad_load(
        "second provider value mode 0644", chmod("materializations/provider-setting", 0o644), source_of(PROVIDER_ENV, 1)
    ),
    bad_load("capability with space", rewrite(REQUEST, b"cap " + marker("capsecret").encode()), source_of(REQUEST)),
    bad_load("capability of 31 chars", rewrite(REQUEST, _cap(31)), source_of(REQUEST)),
    bad_load("capability of 129 chars", rewrite(REQUEST, _cap(129)), source_of(REQUEST)),
    bad_load("capability trailing newline", rewrite(REQUEST, marker("capsecret").encode() + b"\n"), source_of(REQUEST)),
    bad_load("capability with +", rewrite(REQUEST, b"capsecret+" + marker("x").encode()), source_of(REQUEST)),
    bad_load("capability mode 0644", chmod("materializations/delivery-capability", 0o644), source_of(REQUEST)),
    bad_load(
        "project env unsorted",
        rewrite_text(PROJECT_ENV, project(secret_line("ZETA"), secret_line("ALPHA"))),
        source_of(PROJECT_ENV),
    ),
    bad_load(
        "project env duplicate name",
        rewrite_text(PROJECT_ENV, project(secret_line("ALPHA"), secret_line("ALPHA"))),
        source_of(PROJECT_ENV),
    ),
    bad_load(
        "project env missing final newline",
        rewrite_text(PROJECT_ENV, lambda: secret_line("ALPHA").rstrip("\n")),
        source_of(PROJECT_ENV),
    ),
    bad_load("project env line without =", rewrite_text(PROJECT_ENV, project("ALPHA\n")), source_of(PROJECT_ENV)),
    bad_load(
        "project env with CR",
        rewrite_text(PROJECT_ENV, lambda: secret_line("ALPHA").replace("\n", "\r\n")),
        source_of(PROJECT_ENV),
    ),
    bad_load("project env with NUL", rewrite_text(PROJECT_ENV, project("ALPHA=a\0b\n")), source_of(PROJECT_ENV)),
    bad_load(
        "project env of 257 lines",
        rewrite_text(PROJECT_ENV, project(*[f"V{n:03d}=x\n" for n in range(257)])),
        source_of(PROJECT_ENV),
    ),
    bad_load(
        "project env over 64 KiB",
        rewrite_text(PROJECT_ENV, project("A=" + "x" * (65536 - 2) + "\n")),
        source_of(PROJECT_ENV),
    ),
    *[
        bad_load(
            f"project env denied {name}", rewrite_text(PROJECT_ENV, project(secret_line(name))), source_of(PROJECT_ENV)
        )
        for name in (
            "OPENAI_API_KEY",
            "GITHUB_TOKEN",
            "CODEX_HOME",
            "OP_SERVICE_ACCOUNT_TOKEN",
            "LD_PRELOAD",
            "SANDBOXER_MODE",
            "PYTHONPATH",
            "DOCKER_HOST",
        )
    ],
    bad_load("project env mode 0644", chmod("materializations/project-env", 0o644), source_of(PROJECT_ENV)),
    bad_load("credential mode 0600", chmod("materializations/credential.json", 0o600), source_of(CREDENTIAL)),
    bad_load("credential mode 0664", chmod("materializations/credential.json", 0o664), source_of(CREDENTIAL)),
    bad_load("credential mode 0666", chmod("materializations/credential.json", 0o666), source_of(CREDENTIAL)),
    bad_load("credential mode 0640", chmod("materializations/credential.json", 0o640), source_of(CREDENTIAL)),
    # ---- run-owned sources
    bad_load("shared mode 0750", chmod("shared/exchange", 0o750), source_of(SHARED)),
    bad_load("shared mode 0700", chmod("shared/exchange", 0o700), source_of(SHARED)),
    bad_load("shared mode 0777", chmod("shared/exchange", 0o777), source_of(SHARED)),
    bad_load("shared a regular file", shared_as_file, source_of(SHARED)),
    bad_load("shared parent mode 0755", chmod("shared", 0o755), source_of(SHARED)),
    bad_load("shared parent a symlink", shared_parent_symlink, source_of(SHARED)),
    bad_load("shared a symlink", shared_symlink, source_of(SHARED)),
    bad_load("shared outside the run dir", shared_outside_run, source_of(SHARED)),
    bad_load("shared path with ..", shared_path("shared/../shared/exchange"), source_of(SHARED)),
    bad_load("shared path with .", shared_path("shared/./exchange"), source_of(SHARED)),
    bad_load("shared named BuildKit", shared_named("BuildKit"), source_of(SHARED)),
    bad_load("socket mode 0660", socket_mode(0o660), source_of(ENDPOINT)),
    bad_load("socket mode 0606", socket_mode(0o606), source_of(ENDPOINT)),
    bad_load("tool-endpoints dir mode 0755", chmod("tool-endpoints", 0o755), source_of(ENDPOINT)),
    bad_load("endpoint dir mode 0755", chmod("tool-endpoints/notes", 0o755), source_of(NOTES)),
    bad_load("endpoint dir mode 0500", chmod("tool-endpoints/notes", 0o500), source_of(NOTES)),
    bad_load("endpoint a regular file", notes_as_file, source_of(NOTES)),
    bad_load("endpoint named serviceaccount", notes_named("serviceaccount"), source_of(NOTES)),
    bad_load("request endpoint a directory", endpoint_directory, field_of(REQUEST, "endpoint_lease_id")),
    bad_load("source nested in another", socket_inside_notes, source_of(NOTES)),
    bad_load("two equal sources", equal_sources, source_of(PROVIDER_ENV, 1)),
    bad_load("source inside forbidden", forbid("shared"), source_of(SHARED)),
    bad_load("source equal to forbidden", forbid("shared/exchange"), source_of(SHARED)),
    bad_load("file source inside forbidden", forbid("materializations"), source_of(PROVIDER_ENV)),
    bad_load("socket equal to forbidden", forbid("tool-endpoints/delivery.sock"), source_of(ENDPOINT)),
    # A run reached through a symlinked ancestor is refused before any source is looked at.
    bad_load("run reached through a symlinked ancestor", forbidden_through_alias, ""),
    bad_load("shared owned by another user", chown("shared/exchange"), source_of(SHARED), root_only=True),
    bad_load("shared parent owned by another user", chown("shared"), source_of(SHARED), root_only=True),
    bad_load(
        "socket owned by another user", chown("tool-endpoints/delivery.sock"), source_of(ENDPOINT), root_only=True
    ),
    # ---- expiry (after every other rule)
    bad_load(
        "model identity expired",
        edit(put(f"leases.{MODEL}.expires_at", PAST)),
        field_of(MODEL, "expires_at"),
        expired=True,
    ),
    bad_load(
        "provider-env expired",
        edit(put(f"leases.{PROVIDER_ENV}.expires_at", PAST)),
        field_of(PROVIDER_ENV, "expires_at"),
        expired=True,
    ),
    bad_load(
        "credential expired",
        edit(put(f"leases.{CREDENTIAL}.expires_at", PAST)),
        field_of(CREDENTIAL, "expires_at"),
        expired=True,
    ),
    bad_load(
        "shared expired", edit(put(f"leases.{SHARED}.expires_at", PAST)), field_of(SHARED, "expires_at"), expired=True
    ),
    bad_load(
        "tool-request expired",
        edit(put(f"leases.{REQUEST}.expires_at", PAST)),
        field_of(REQUEST, "expires_at"),
        expired=True,
    ),
    bad_load(
        "v1 credential expired",
        edit(put(f"leases.{V1_CREDENTIAL}.expires_at", PAST)),
        field_of(V1_CREDENTIAL, "expires_at"),
        version="1",
        expired=True,
    ),
    bad_load(
        "expiry equal to now",
        at_time(NOW, put(f"leases.{MODEL}.expires_at", "2050-01-01T00:00:00Z")),
        field_of(MODEL, "expires_at"),
        expired=True,
    ),
    bad_load(
        "expiry with offset equal to now",
        at_time(NOW, put(f"leases.{CREDENTIAL}.expires_at", "2050-01-01T02:00:00+02:00")),
        field_of(CREDENTIAL, "expires_at"),
        expired=True,
    ),
    bad_load(
        "review model identity expired",
        at_time(NOW, put(f"leases.{REVIEW}.expires_at", "2049-06-01T00:00:00.5Z")),
        field_of(REVIEW, "expires_at"),
        expired=True,
    ),
]
assert V1_PROJECT_ENV == 1  # the v1 layout keeps project-environment where make_document puts it


def run_load(case: LoadCase, base: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Run, str, BaseException | None]:
    """Build the run, apply the case, load it; return the run, the path loaded and the error if any."""
    if case.root_only and os.geteuid() != 0:
        pytest.skip("needs root to give a file another owner")
    run = build_run(base, case.version)
    overrides = case.setup(run) or {}
    if not overrides.get("saved"):
        run.save()
    path = overrides.get("path", str(run.assignment))
    if "cwd" in overrides:
        monkeypatch.chdir(overrides["cwd"])
    try:
        load(path, now=overrides.get("now"), forbidden=overrides.get("forbidden", ()))
    except Exception as error:  # checked by the caller
        return run, path, error
    return run, path, None


def check_load_outcome(case: LoadCase, path: str, error: BaseException | None) -> None:
    if case.field is None:
        assert error is None, f"{type(error).__name__}: {error}"
        return
    assert error is not None, "loaded"
    if case.expired:
        assert isinstance(error, LeaseExpiredError), repr(error)
        assert isinstance(error, PolicyError)
        assert not isinstance(error, UsageError)
        assert error.exit_status == 3
        assert error.file == path
        assert isinstance(error.rule, str)
        assert error.rule
        assert error.field in _fields(case.field), f"field {error.field!r}, message {error}"
        return
    check_usage_error(error, case.field, path)


@pytest.mark.parametrize("case", _params(LOAD_CASES))
def test_load(case: LoadCase, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    _run, path, error = run_load(case, tmp_path_factory.mktemp("run"), monkeypatch)
    check_load_outcome(case, path, error)


def test_load_without_now_uses_the_clock(tmp_path_factory: pytest.TempPathFactory) -> None:
    run = build_run(tmp_path_factory.mktemp("run"))
    moment = datetime.now(UTC).replace(microsecond=0)
    run.doc["leases"][CREDENTIAL]["expires_at"] = moment.isoformat().replace("+00:00", "Z")
    run.save()
    with pytest.raises(LeaseExpiredError) as info:
        load(str(run.assignment))
    assert info.value.field == field_of(CREDENTIAL, "expires_at")


def test_expiry_is_checked_after_every_source_rule(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A run both expired and with a bad source reports the source (usage, 2): expiry comes last."""
    run = build_run(tmp_path_factory.mktemp("run"))
    run.doc["leases"][MODEL]["expires_at"] = PAST
    run.save()
    (run.mat_dir / "delivery-token").chmod(0o640)
    with pytest.raises(ManifestError) as info:
        load(str(run.assignment))
    check_usage_error(info.value, source_of(PROVIDER_ENV), str(run.assignment))


def test_parse_reads_no_file(tmp_path_factory: pytest.TempPathFactory) -> None:
    """parse takes bytes only: a run whose every source is broken still parses."""
    run = build_run(tmp_path_factory.mktemp("run"))
    for path in run.mat_dir.iterdir():
        path.chmod(0o666)
    (run.run_dir / "shared" / "exchange").chmod(0o700)
    run.run_dir.chmod(0o755)
    assert parse(render(run.doc), file=str(run.assignment)) is not None


# --------------------------------------------------------------------------------------------
# No error carries a secret: every invalid case of both corpora, value files holding random markers.


def _secret_free(text: str, run: Run) -> None:
    for secret in run.secrets:
        assert secret not in text, "a value file's content is in the message"
    for digest in run.value_digests():
        assert digest not in text, "a value file's digest is in the message"


def parse_setup(case: Case) -> Setup:
    """Write a parse case's document on a real run (the assignment is then already saved)."""

    def setup(run: Run) -> dict[str, Any]:
        run.save(case.data(run.doc))
        return {"saved": True}

    return setup


SECRET_CASES = [
    *[pytest.param(case, id=f"load: {case.id}") for case in LOAD_CASES if case.field is not None],
    *[
        pytest.param(
            LoadCase(id=case.id, setup=parse_setup(case), field=case.field, version=case.version),
            id=f"parse: {case.id}",
        )
        for case in PARSE_CASES
        if case.field is not None
    ],
]


@pytest.mark.parametrize("case", SECRET_CASES)
def test_no_error_carries_a_secret(
    case: LoadCase, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, _path, error = run_load(case, tmp_path_factory.mktemp("run"), monkeypatch)
    if error is None:
        pytest.skip("accepted: test_parse / test_load report that")
    assert run.secrets
    for text in (str(error), repr(error), repr(error.args), getattr(error, "rule", ""), getattr(error, "field", "")):
        _secret_free(str(text), run)


# --------------------------------------------------------------------------------------------
# The CLI: `sandboxer --config-dir C --state-dir S manifest check FILE [--json]`.


@dataclass
class CliRun:
    status: int
    stdout: str
    stderr: str


@pytest.fixture
def broker_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Empty config and state directories, apart from every run."""
    config = tmp_path_factory.mktemp("config")
    state = tmp_path_factory.mktemp("state")
    config.chmod(0o700)
    state.chmod(0o700)
    return config, state


def cli(dirs: tuple[Path, Path], file: str, *extra: str) -> CliRun:
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")
    env = {key: os.environ[key] for key in keep if key in os.environ}
    argv = [sys.executable, "-m", "sandboxer", "--config-dir", str(dirs[0]), "--state-dir", str(dirs[1])]
    proc = subprocess.run(
        [*argv, "manifest", "check", file, *extra], capture_output=True, env=env, check=False, timeout=120
    )
    return CliRun(proc.returncode, proc.stdout.decode(), proc.stderr.decode())


LOAD_BY_ID = {case.id: case for case in LOAD_CASES}
PARSE_BY_ID = {case.id: case for case in PARSE_CASES}
CLI_CASES = [
    LoadCase(id="unknown top-level key", setup=parse_setup(PARSE_BY_ID["unknown top-level key"]), field="extra"),
    LoadCase(
        id="duplicate lease key",
        setup=parse_setup(PARSE_BY_ID["duplicate lease key"]),
        field=field_of(MODEL, "consumer"),
    ),
    LOAD_BY_ID["value mode 0640"],
    LOAD_BY_ID["value sha256 mismatch"],
    LOAD_BY_ID["provider value trailing newline"],
    LOAD_BY_ID["capability of 31 chars"],
    LOAD_BY_ID["project env denied OPENAI_API_KEY"],
    LOAD_BY_ID["socket mode 0660"],
    LOAD_BY_ID["model identity expired"],
    LOAD_BY_ID["assignment mode 0644"],
]


def _cli_secret_free(text: str, run: Run) -> None:
    for secret in run.secrets:
        assert secret not in text, "a value file's content is in the output"
    for digest in run.value_digests():
        assert digest not in text, "a value file's digest is in the output"


@pytest.mark.parametrize("as_json", [True, False], ids=["json", "human"])
@pytest.mark.parametrize("case", _params(CLI_CASES))
def test_cli_refuses(
    case: LoadCase, as_json: bool, tmp_path_factory: pytest.TempPathFactory, broker_dirs: tuple[Path, Path]
) -> None:
    run = build_run(tmp_path_factory.mktemp("run"), case.version)
    overrides = case.setup(run) or {}
    if not overrides.get("saved"):
        run.save()
    assert "now" not in overrides
    assert "forbidden" not in overrides
    result = cli(broker_dirs, str(run.assignment), *(["--json"] if as_json else []))
    assert result.status == (3 if case.expired else 2), result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("sandboxer: ")
    expected = _fields(case.field or "")
    if expected != ("",):
        assert any(field in lines[0] for field in expected), lines[0]
    if as_json:
        document = json.loads(result.stdout)
        assert set(document) == {"error"}
        assert isinstance(document["error"]["message"], str)
        assert document["error"]["message"] in lines[0]
    else:
        assert result.stdout == ""
    _cli_secret_free(result.stdout + result.stderr, run)


@pytest.mark.parametrize("version", ["1", "2", "3"])
def test_cli_accepts_a_valid_run_and_prints_no_value(
    version: str, tmp_path_factory: pytest.TempPathFactory, broker_dirs: tuple[Path, Path]
) -> None:
    run = build_run(tmp_path_factory.mktemp("run"), version)
    digests = [m["sha256"] for lease in run.doc["leases"] for m in lease["materializations"] if "sha256" in m]
    assert digests
    result = cli(broker_dirs, str(run.assignment), "--json")
    assert result.status == 0, result.stderr
    assert result.stderr == ""
    document = json.loads(result.stdout)
    assert isinstance(document, dict)
    human = cli(broker_dirs, str(run.assignment))
    assert human.status == 0, human.stderr
    for text in (result.stdout, human.stdout):
        _cli_secret_free(text, run)
        for digest in digests:
            assert digest not in text, "a materialization's sha256 is in the output"


@pytest.mark.parametrize("which", [0, 1], ids=["config-dir", "state-dir"])
def test_cli_refuses_a_source_inside_the_broker_dirs(which: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The CLI passes its own config and state directories as `forbidden`."""
    config = tmp_path_factory.mktemp("config")
    state = tmp_path_factory.mktemp("state")
    dirs = (config, state)
    run = build_run(dirs[which])
    result = cli(dirs, str(run.assignment), "--json")
    assert result.status == 2, result.stderr
    assert source_of(PROVIDER_ENV) in result.stderr
    assert "error" in json.loads(result.stdout)
