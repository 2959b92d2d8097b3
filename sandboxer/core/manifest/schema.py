"""The schema of a lease manifest (docs/manifest.md): its types, constants and field rules.

The frozen types a checked manifest is (`Manifest`, its `Lease`s and their `Materialization`s),
its two errors, and the rules the parsing (parsing.py, lease_parsing.py) and the source checks
(sources.py) apply: the scopes, namespaces and bounds, the grammar of each kind of field, the
keys each object has, and the environment names and mount targets that are refused.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import datetime

from sandboxer.errors import DocumentError, PolicyError

MAX_DOCUMENT = 1 << 20
NAMESPACE = "/run/branchbox/leases"
SHARED_NAMESPACE = NAMESPACE + "/shared/"
ENDPOINT_NAMESPACE = NAMESPACE + "/tool-endpoints/"
REQUEST_NAMESPACE = NAMESPACE + "/tool-requests/"
PROJECT_ENV_TARGET = NAMESPACE + "/project-env"
REPLAY_POLICY = "exact-digest-replay-v1"
UID_MAX = 2147483647

MODEL_IDENTITY = "model-identity"
PROVIDER_ENVIRONMENT = "provider-environment"
PROJECT_ENVIRONMENT = "project-environment"
PROVIDER_CREDENTIAL = "provider-credential"
SHARED_DIRECTORY = "shared-directory"
TOOL_ENDPOINT = "tool-endpoint"
TOOL_REQUEST = "tool-request"
OUTER_SCOPES = ("source-control-identity", "platform-tunnel")
SCOPES = (
    MODEL_IDENTITY,
    PROVIDER_ENVIRONMENT,
    PROJECT_ENVIRONMENT,
    PROVIDER_CREDENTIAL,
    SHARED_DIRECTORY,
    TOOL_ENDPOINT,
    TOOL_REQUEST,
    *OUTER_SCOPES,
)
FILE_SCOPES = (PROVIDER_ENVIRONMENT, PROJECT_ENVIRONMENT, PROVIDER_CREDENTIAL, TOOL_REQUEST)
RUN_OWNED_SCOPES = (SHARED_DIRECTORY, TOOL_ENDPOINT)
# Scopes whose expiry is required and must be live (model-identity: from version 2 on).
EXPIRING = (PROVIDER_ENVIRONMENT, PROVIDER_CREDENTIAL, SHARED_DIRECTORY, TOOL_ENDPOINT, TOOL_REQUEST)
V1_REFUSED_SCOPES = (PROVIDER_ENVIRONMENT, SHARED_DIRECTORY, TOOL_ENDPOINT, TOOL_REQUEST)

# The grammars of the fields (each must match a whole value).
ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
SHA256 = re.compile(r"[0-9a-f]{64}")
REVISION = re.compile(r"[0-9A-Fa-f]{40}|[0-9A-Fa-f]{64}")
ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]{0,127}")
SERVICE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
OMITTED = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
CAPABILITY = re.compile(rb"[A-Za-z0-9._-]{32,128}")
SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_IMAGE_DIGEST = r"sha256:[0-9a-f]{64}"
IMAGE = re.compile(
    rf"{_IMAGE_DIGEST}|[a-z0-9][a-z0-9.-]*(?::[0-9]{{1,5}})?/[a-z0-9][a-z0-9._-]*(?:/[a-z0-9][a-z0-9._-]*)*"
    rf"(?::[a-z0-9_][a-z0-9_.-]{{0,127}})?@{_IMAGE_DIGEST}"
)
EXPIRY = re.compile(r"(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(\.\d+)?([Zz]|[+-]\d{2}:\d{2})", re.ASCII)

AMBIENT_MARKERS = (
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
)
PROVIDER_DENIED = frozenset(
    (
        "BASH_ENV",
        "CDPATH",
        "CONTAINER_HOST",
        "ENV",
        "GIT_ALTERNATE_OBJECT_DIRECTORIES",
        "GIT_CONFIG",
        "GIT_DIR",
        "GIT_EXEC_PATH",
        "GIT_INDEX_FILE",
        "GIT_OBJECT_DIRECTORY",
        "GIT_SSH",
        "GIT_SSH_COMMAND",
        "GIT_TEMPLATE_DIR",
        "GIT_WORK_TREE",
        "HOME",
        "HOSTNAME",
        "LD_LIBRARY_PATH",
        "LD_PRELOAD",
        "LOGNAME",
        "PATH",
        "PROMPT_COMMAND",
        "PWD",
        "RUBYOPT",
        "SHELL",
        "SHELLOPTS",
        "SSH_AUTH_SOCK",
        "USER",
    )
)
PROVIDER_DENIED_PREFIXES = (
    "BRANCHBOX_",
    "COMPOSE_",
    "CONTAINERD_",
    "DEVCONTAINER_",
    "DOCKER_",
    "DYLD_",
    "GIT_CONFIG_",
    "NODE_OPTIONS",
    "SANDBOXER_",
    "PYTHON",
)
PROJECT_DENIED = PROVIDER_DENIED | {"OP_SERVICE_ACCOUNT_TOKEN", "API_KEY", "TOKEN"}
PROJECT_DENIED_PREFIXES = (*PROVIDER_DENIED_PREFIXES, "CODEX_")
PROJECT_DENIED_SUFFIXES = ("_API_KEY", "_TOKEN")
# This broker's policy (create refuses with 3; `manifest check` follows the page): a provider
# credential never lands on a path the sandbox's own plan mounts.
RESERVED_TARGETS = (
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/proc",
    "/dev",
    "/sys",
    "/workspace",
    "/opt/sandboxer",
    "/run/sandboxer",
    "/etc/passwd",
    "/etc/group",
    "/etc/hosts",
    "/etc/hostname",
    "/etc/nsswitch.conf",
    "/etc/resolv.conf",
    "/etc/ssl",
    "/etc/ca-certificates",
    "/etc/ld.so.cache",
    "/etc/localtime",
)
PROVIDER_VALUE_BYTES = (8, 16384)
PROJECT_ENV_MAX_LINES = 256
PROJECT_ENV_MAX_BYTES = 64 * 1024
MAX_PROVIDER_VALUES = 16
MAX_INHERITED = 16

# The document's keys, the keys every lease has, and the keys only some scopes' leases have.
TOP_REQUIRED = (
    "version",
    "run_id",
    "lease_id",
    "outer_runtime_id",
    "workspace",
    "repository",
    "task_branch",
    "tunnel_placement",
)
TOP_OPTIONAL = (
    "published_ports",
    "leases",
    "service_images",
    "port_proxy_image",
    "workspace_consumer",
    "workspace_folder",
    "omitted_services",
)
LEASE_KEYS = ("lease_id", "scope", "consumer", "materializations")
SCOPE_KEYS = {
    MODEL_IDENTITY: ("executable", "inherited_environment"),
    TOOL_REQUEST: ("consumer_uid", "endpoint_lease_id", "request_spool_target", "replay_policy"),
}

# scope -> (fewest, most, the keys each materialization has besides source_path; no others)
MATERIAL_RULES: dict[str, tuple[int, int, tuple[str, ...]]] = {
    MODEL_IDENTITY: (0, 0, ()),
    PROVIDER_ENVIRONMENT: (1, MAX_PROVIDER_VALUES, ("environment_name", "sha256")),
    PROJECT_ENVIRONMENT: (1, 1, ("target_path", "sha256")),
    PROVIDER_CREDENTIAL: (1, 1, ("target_path", "sha256")),
    SHARED_DIRECTORY: (1, 1, ("target_path",)),
    TOOL_ENDPOINT: (1, 1, ("target_path",)),
    TOOL_REQUEST: (1, 1, ("target_path", "sha256")),
    "source-control-identity": (0, 0, ()),
    "platform-tunnel": (0, 0, ()),
}


class ManifestError(DocumentError):
    """A manifest breaks a rule (exit 2): `file: field.path: rule`."""

    kind = "manifest"


class LeaseExpiredError(PolicyError):
    """A lease's expiry is not in the future (exit 3)."""

    kind = "lease-expired"

    def __init__(self, file: str, field: str, rule: str) -> None:
        super().__init__(f"{file}: {field}: {rule}")
        self.file = file
        self.field = field
        self.rule = rule


@dataclass(frozen=True, slots=True, kw_only=True)
class Materialization:
    source_path: str
    target_path: str | None
    environment_name: str | None
    sha256: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Lease:
    index: int
    lease_id: str
    scope: str
    consumer: str
    expires_at: datetime | None
    materializations: tuple[Materialization, ...]
    executable: str | None = None
    inherited_environment: tuple[str, ...] = ()
    consumer_uid: int | None = None
    endpoint_lease_id: str | None = None
    request_spool_target: str | None = None
    replay_policy: str | None = None

    @property
    def field(self) -> str:
        return f"leases[{self.index}]"


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    file: str
    version: str
    run_id: str
    lease_id: str
    outer_runtime_id: str
    workspace: str
    repository_path: str
    repository_revision: str
    task_branch: str
    tunnel_placement: str
    published_ports: tuple[tuple[int, int], ...]
    leases: tuple[Lease, ...]
    service_images: tuple[tuple[str, str], ...]
    port_proxy_image: str | None
    workspace_consumer: tuple[int, int] | None
    workspace_folder: str | None
    omitted_services: tuple[str, ...]
    sha256: str  # of the assignment's bytes

    def by_scope(self, scope: str) -> list[Lease]:
        return [lease for lease in self.leases if lease.scope == scope]

    def lease(self, lease_id: str) -> Lease | None:
        return next((lease for lease in self.leases if lease.lease_id == lease_id), None)

    def linked_endpoints(self) -> set[str]:
        """Endpoint lease ids a tool-request links (their binds are suppressed)."""
        return {lease.endpoint_lease_id for lease in self.by_scope(TOOL_REQUEST) if lease.endpoint_lease_id}


def run_dir(manifest: Manifest) -> str:
    """The run directory: the one the assignment file is in."""
    return os.path.dirname(manifest.file)


def expiry_checked(manifest: Manifest, lease: Lease) -> bool:
    """Whether a lease's expiry must be live (model identities: from version 2 on)."""
    return lease.scope in EXPIRING or (lease.scope == MODEL_IDENTITY and manifest.version != "1")


def denied_name(name: str, *, project: bool) -> bool:
    """Whether an environment name is refused for a provider (or, `project`, a project) variable."""
    if project:
        return (
            name in PROJECT_DENIED or name.startswith(PROJECT_DENIED_PREFIXES) or name.endswith(PROJECT_DENIED_SUFFIXES)
        )
    return name in PROVIDER_DENIED or name.startswith(PROVIDER_DENIED_PREFIXES)
