"""Lease manifests for the tests: a complete valid run laid out on disk, and the document it holds.

`make_document(version, run_dir, digests)` is the assignment of a complete valid run (v1, v2 or v3);
`build_run(base, version)` lays that run out below `base` exactly as docs/manifest.md wants it:

    <base>/managed/<RUN_ID>/            0700
        assignment.json                 0600
        materializations/               0700  owner-only value files (credential 0644)
        shared/                         0700
            exchange/                   0755  shared-directory source
        tool-endpoints/                 0700
            delivery.sock               0600  Unix socket, tool-endpoint linked to the tool-request
            notes/                      0700  standalone tool-endpoint directory

Every value file and the capability carry a fresh random marker, listed in `Run.secrets`, so tests
can check that no error or output ever carries one.

Lease indexes of the v2/v3 document (v1 has 0 model-identity, 1 project-environment,
2 provider-credential, 3 source-control-identity, 4 platform-tunnel):

     0 model-identity        coding-agent   executable provider-cli, inherits MODEL_ACCESS_TOKEN MODEL_REGION
     1 provider-environment  coding-agent   SOURCE_DELIVERY_TOKEN, EXTRA_PROVIDER_SETTING
     2 project-environment   coding-agent
     3 provider-credential   coding-agent   /etc/provider/credential.json
     4 shared-directory      primary-tool
     5 tool-endpoint         coding-agent   delivery.sock (socket)
     6 tool-request          coding-agent   linked to 5
     7 source-control-identity
     8 platform-tunnel
     9 tool-endpoint         primary-tool   notes (directory)
    10 model-identity        review-agent   executable review-cli
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Docker names a run's spool volumes after its id, one name per daemon: each pytest-xdist worker
# (`make check` runs two) has a run id of its own.
RUN_ID = "run-7.x_y" + os.environ.get("PYTEST_XDIST_WORKER", "")
EXPIRY = "2099-01-01T00:00:00Z"
FAKE_RUN_DIR = f"/run/branchbox/managed/{RUN_ID}"

DIGEST_1 = "0123456789abcdef" * 4
DIGEST_2 = "abcdef0123456789" * 4
DIGEST_3 = "d" * 64
IMAGE_APP = f"registry.example:5000/team/app:1.2@sha256:{DIGEST_1}"
IMAGE_DB = f"sha256:{DIGEST_2}"
IMAGE_PROXY = f"registry.example/runtime/tcp-proxy@sha256:{DIGEST_3}"

VALUE_FILES = ("delivery-token", "provider-setting", "project-env", "credential.json", "delivery-capability")
FAKE_DIGESTS = {name: hashlib.sha256(name.encode()).hexdigest() for name in VALUE_FILES}

# Lease indexes in the v2/v3 document.
MODEL, PROVIDER_ENV, PROJECT_ENV, CREDENTIAL, SHARED, ENDPOINT, REQUEST, SCM, TUNNEL, NOTES, REVIEW = range(11)
# Lease indexes in the v1 document.
V1_MODEL, V1_PROJECT_ENV, V1_CREDENTIAL, V1_SCM, V1_TUNNEL = range(5)

MIB = 1024 * 1024


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_document(version: str, run_dir: str, digests: dict[str, str]) -> dict[str, Any]:
    """The assignment of a complete valid run of this version, its sources below `run_dir`."""
    mat = f"{run_dir}/materializations"
    model: dict[str, Any] = {
        "lease_id": "lease_model",
        "scope": "model-identity",
        "consumer": "coding-agent",
        "expires_at": EXPIRY,
        "materializations": [],
    }
    project = {
        "lease_id": "lease_project",
        "scope": "project-environment",
        "consumer": "coding-agent",
        "expires_at": EXPIRY,
        "materializations": [
            {
                "source_path": f"{mat}/project-env",
                "target_path": "/run/branchbox/leases/project-env",
                "sha256": digests["project-env"],
            }
        ],
    }
    credential = {
        "lease_id": "lease_credential",
        "scope": "provider-credential",
        "consumer": "coding-agent",
        "expires_at": EXPIRY,
        "materializations": [
            {
                "source_path": f"{mat}/credential.json",
                "target_path": "/etc/provider/credential.json",
                "sha256": digests["credential.json"],
            }
        ],
    }
    scm = {
        "lease_id": "lease_scm",
        "scope": "source-control-identity",
        "consumer": "source-host",
        "expires_at": EXPIRY,
        "materializations": [],
    }
    tunnel = {
        "lease_id": "lease_tunnel",
        "scope": "platform-tunnel",
        "consumer": "tunnel-helper",
        "expires_at": EXPIRY,
        "materializations": [],
    }
    document: dict[str, Any] = {
        "version": version,
        "run_id": RUN_ID,
        "lease_id": "assignment-1",
        "outer_runtime_id": "outer-runtime-1",
        "workspace": "/srv/work/run-7",
        "repository": {"path": "/srv/repos/demo", "revision": "a1" * 20},
        "task_branch": "task/run-7",
        "tunnel_placement": "outer",
        "published_ports": [{"host": 3000, "runtime": 3000}, {"host": 8080, "runtime": 80}],
    }
    if version == "1":
        document["leases"] = [model, project, credential, scm, tunnel]
        return document
    model["executable"] = "provider-cli"
    model["inherited_environment"] = ["MODEL_ACCESS_TOKEN", "MODEL_REGION"]
    provider = {
        "lease_id": "lease_delivery",
        "scope": "provider-environment",
        "consumer": "coding-agent",
        "expires_at": EXPIRY,
        "materializations": [
            {
                "source_path": f"{mat}/delivery-token",
                "environment_name": "SOURCE_DELIVERY_TOKEN",
                "sha256": digests["delivery-token"],
            },
            {
                "source_path": f"{mat}/provider-setting",
                "environment_name": "EXTRA_PROVIDER_SETTING",
                "sha256": digests["provider-setting"],
            },
        ],
    }
    shared = {
        "lease_id": "shared_exchange",
        "scope": "shared-directory",
        "consumer": "primary-tool",
        "expires_at": EXPIRY,
        "materializations": [
            {"source_path": f"{run_dir}/shared/exchange", "target_path": "/run/branchbox/leases/shared/exchange"}
        ],
    }
    endpoint = {
        "lease_id": "delivery_endpoint",
        "scope": "tool-endpoint",
        "consumer": "coding-agent",
        "expires_at": EXPIRY,
        "materializations": [
            {
                "source_path": f"{run_dir}/tool-endpoints/delivery.sock",
                "target_path": "/run/branchbox/leases/tool-endpoints/delivery.sock",
            }
        ],
    }
    request = {
        "lease_id": "delivery_requests",
        "scope": "tool-request",
        "consumer": "coding-agent",
        "consumer_uid": 1000,
        "endpoint_lease_id": "delivery_endpoint",
        "request_spool_target": "/run/branchbox/leases/tool-requests/delivery",
        "replay_policy": "exact-digest-replay-v1",
        "expires_at": EXPIRY,
        "materializations": [
            {
                "source_path": f"{mat}/delivery-capability",
                "target_path": "/run/branchbox/leases/tool-requests/delivery/.capability",
                "sha256": digests["delivery-capability"],
            }
        ],
    }
    notes = {
        "lease_id": "notes_endpoint",
        "scope": "tool-endpoint",
        "consumer": "primary-tool",
        "expires_at": EXPIRY,
        "materializations": [
            {
                "source_path": f"{run_dir}/tool-endpoints/notes",
                "target_path": "/run/branchbox/leases/tool-endpoints/notes",
            }
        ],
    }
    review = {
        "lease_id": "lease_review_model",
        "scope": "model-identity",
        "consumer": "review-agent",
        "executable": "review-cli",
        "inherited_environment": [],
        "expires_at": EXPIRY,
        "materializations": [],
    }
    document["leases"] = [model, provider, project, credential, shared, endpoint, request, scm, tunnel, notes, review]
    document["service_images"] = {"app": IMAGE_APP, "database": IMAGE_DB}
    document["port_proxy_image"] = IMAGE_PROXY
    if version == "3":
        document["workspace_consumer"] = {"uid": 1000, "gid": 1000}
        document["workspace_folder"] = "/workspaces/run-7/app"
        document["omitted_services"] = ["tunnel"]
    return document


def render(document: Any) -> bytes:
    return json.dumps(document, indent=2).encode()


@dataclass
class Run:
    """One run laid out on disk, with its assignment document (saved by `save`)."""

    base: Path
    run_dir: Path
    version: str
    doc: dict[str, Any]
    secrets: list[str] = field(default_factory=list)

    @property
    def assignment(self) -> Path:
        return self.run_dir / "assignment.json"

    @property
    def mat_dir(self) -> Path:
        return self.run_dir / "materializations"

    def mat(self, lease: int, index: int = 0) -> dict[str, Any]:
        """The materialization `index` of lease `lease` in the document."""
        item: dict[str, Any] = self.doc["leases"][lease]["materializations"][index]
        return item

    def source(self, lease: int, index: int = 0) -> Path:
        return Path(self.mat(lease, index)["source_path"])

    def rewrite(self, lease: int, data: bytes, index: int = 0) -> None:
        """Replace a value file's bytes (keeping its mode) and the document's sha256 of it."""
        self.source(lease, index).write_bytes(data)
        self.mat(lease, index)["sha256"] = sha256(data)
        self.remember(data)

    def remember(self, data: bytes) -> None:
        """Count the distinctive parts of a value as secrets no message may carry."""
        text = data.decode("utf-8", "replace")
        for line in text.splitlines():
            value = line.split("=", 1)[-1]
            if len(value) >= 6:
                self.secrets.append(value)

    def move_source(self, lease: int, new: Path, index: int = 0) -> None:
        """Move a source on disk and point the document at its new place."""
        os.rename(self.source(lease, index), new)
        self.mat(lease, index)["source_path"] = str(new)

    def save(self, data: bytes | None = None) -> None:
        """Write the assignment (the document, or these bytes), keeping the file's mode once it exists."""
        data = render(self.doc) if data is None else data
        if self.assignment.exists() or self.assignment.is_symlink():
            with open(self.assignment, "wb") as handle:
                handle.write(data)
            return
        fd = os.open(self.assignment, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), 0o600)
            handle.write(data)

    def value_digests(self) -> list[str]:
        """The sha256 of every regular file below materializations/ (values no output should show)."""
        return [sha256(path.read_bytes()) for path in self.mat_dir.rglob("*") if path.is_file()]


def mkdir(path: Path, mode: int) -> Path:
    path.mkdir()
    path.chmod(mode)
    return path


def write_file(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    path.chmod(mode)


def make_socket(path: Path, mode: int = 0o600) -> None:
    """A Unix socket file at `path` (the listening socket is closed; the file stays)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))
    path.chmod(mode)


def marker(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(16)}"


def build_run(base: Path, version: str = "2") -> Run:
    """Lay out a complete valid run of this version below `base` and save its assignment."""
    managed = mkdir(base / "managed", 0o700)
    run_dir = mkdir(managed / RUN_ID, 0o700)
    mat = mkdir(run_dir / "materializations", 0o700)
    values: dict[str, tuple[bytes, int]] = {
        "project-env": (f"ALPHA_MODE={marker('projsecret')}\nZETA_LEVEL={marker('projsecret')}\n".encode(), 0o600),
        "credential.json": (json.dumps({"token": marker("credsecret")}).encode() + b"\n", 0o644),
    }
    if version != "1":
        values["delivery-token"] = (marker("provsecret").encode(), 0o600)
        values["provider-setting"] = (f"ünïcödé {marker('provsecret')}".encode(), 0o600)
        values["delivery-capability"] = (f"cap-{secrets.token_hex(20)}".encode(), 0o600)
        shared = mkdir(run_dir / "shared", 0o700)
        mkdir(shared / "exchange", 0o755)
        endpoints = mkdir(run_dir / "tool-endpoints", 0o700)
        make_socket(endpoints / "delivery.sock")
        mkdir(endpoints / "notes", 0o700)
    run = Run(base=base, run_dir=run_dir, version=version, doc={})
    digests = dict(FAKE_DIGESTS)
    for name, (data, mode) in values.items():
        write_file(mat / name, data, mode)
        digests[name] = sha256(data)
        run.remember(data)
    run.doc = make_document(version, str(run_dir), digests)
    run.save()
    return run


def fake_document(version: str) -> dict[str, Any]:
    """The valid document of this version with sources below a run directory that need not exist."""
    return copy.deepcopy(make_document(version, FAKE_RUN_DIR, FAKE_DIGESTS))
