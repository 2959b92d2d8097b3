"""Lease manifests: the assignment an orchestrator signs off for one run (docs/manifest.md).

`parse` is pure: JSON syntax, structure, grammars, bounds, version gating and the rules between
leases. `load` is the whole check a caller gets from `manifest check` and `create --manifest`:
the assignment file, `parse`, every source on the filesystem (modes, owners, digests, value
contents), then expiry. Errors name the file, the field path and the rule; they never carry a
value read from the manifest's value files, a capability or a digest of either.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta, timezone
from typing import Any, NoReturn

from sandboxer import strictjson
from sandboxer.errors import DocumentError, PolicyError
from sandboxer.fsutil import UnfitFile, open_beneath, open_dir_nofollow, read_owner_only
from sandboxer.strictjson import JsonObject

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
_EXPIRING = (PROVIDER_ENVIRONMENT, PROVIDER_CREDENTIAL, SHARED_DIRECTORY, TOOL_ENDPOINT, TOOL_REQUEST)
_V1_REFUSED_SCOPES = (PROVIDER_ENVIRONMENT, SHARED_DIRECTORY, TOOL_ENDPOINT, TOOL_REQUEST)

_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_REVISION = re.compile(r"[0-9A-Fa-f]{40}|[0-9A-Fa-f]{64}")
_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]{0,127}")
_SERVICE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_OMITTED = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_CAPABILITY = re.compile(rb"[A-Za-z0-9._-]{32,128}")
_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_IMAGE_DIGEST = r"sha256:[0-9a-f]{64}"
_IMAGE = re.compile(
    rf"{_IMAGE_DIGEST}|[a-z0-9][a-z0-9.-]*(?::[0-9]{{1,5}})?/[a-z0-9][a-z0-9._-]*(?:/[a-z0-9][a-z0-9._-]*)*"
    rf"(?::[a-z0-9_][a-z0-9_.-]{{0,127}})?@{_IMAGE_DIGEST}"
)
_EXPIRY = re.compile(r"(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(\.\d+)?([Zz]|[+-]\d{2}:\d{2})", re.ASCII)

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


class _Reader:
    """Walks the document, failing at the first rule broken, with its field path."""

    def __init__(self, file: str) -> None:
        self.file = file

    def fail(self, field: str, rule: str) -> NoReturn:
        raise ManifestError(self.file, field, rule)

    def obj(self, value: Any, path: str, *, required: Sequence[str], optional: Sequence[str] = ()) -> JsonObject:
        if not isinstance(value, JsonObject):
            self.fail(path, "must be a JSON object")
        if value.duplicates:
            self.fail(_join(path, value.duplicates[0]), "duplicate key")
        known = set(required) | set(optional)
        for key in value:
            if key not in known:
                self.fail(_join(path, key), "unknown field")
        for key in required:
            if key not in value:
                self.fail(_join(path, key), "missing required field")
        return value

    def string(self, value: Any, path: str, pattern: re.Pattern[str] | None = None, rule: str = "") -> str:
        if not isinstance(value, str):
            self.fail(path, "must be a string")
        if "\0" in value:
            self.fail(path, "must not contain NUL")
        if pattern is not None and not pattern.fullmatch(value):
            self.fail(path, rule)
        return value

    def integer(self, value: Any, path: str, low: int, high: int) -> int:
        if type(value) is not int:
            self.fail(path, "must be an integer")
        if not low <= value <= high:
            self.fail(path, f"must be between {low} and {high}")
        return value

    def array(self, value: Any, path: str, most: int | None = None) -> list[Any]:
        if not isinstance(value, list):
            self.fail(path, "must be an array")
        if most is not None and len(value) > most:
            self.fail(path, f"at most {most} entries")
        return value


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _decode(data: bytes, file: str) -> Any:
    try:
        return strictjson.document(data, max_bytes=MAX_DOCUMENT)
    except strictjson.Malformed as exc:  # the position only, never the text
        rules = {
            "size": f"larger than {MAX_DOCUMENT} bytes",
            "utf8": "not UTF-8",
            "depth": "nested too deeply",
            "constant": "NaN and Infinity are not JSON (one JSON object and nothing after it)",
            "syntax": f"not valid JSON at line {exc.line} column {exc.column} (one JSON object and nothing after it)",
        }
        raise ManifestError(file, "", rules[exc.kind]) from None


_TOP_REQUIRED = (
    "version",
    "run_id",
    "lease_id",
    "outer_runtime_id",
    "workspace",
    "repository",
    "task_branch",
    "tunnel_placement",
)
_TOP_OPTIONAL = (
    "published_ports",
    "leases",
    "service_images",
    "port_proxy_image",
    "workspace_consumer",
    "workspace_folder",
    "omitted_services",
)


def parse(data: bytes, *, file: str) -> Manifest:
    """The manifest `data` means, or ManifestError naming the first rule it breaks."""
    r = _Reader(file)
    document = _decode(data, file)
    if not isinstance(document, JsonObject):
        r.fail("", "the manifest must be one JSON object")
    if document.duplicates:
        r.fail(document.duplicates[0], "duplicate key")
    version = _version(r, document)
    r.obj(document, "", required=_TOP_REQUIRED, optional=_TOP_OPTIONAL)
    _version_gates(r, document, version)

    run_id = r.string(document["run_id"], "run_id", _ID, "must be 1-128 of [A-Za-z0-9._:-]")
    lease_id = r.string(document["lease_id"], "lease_id", _ID, "must be 1-128 of [A-Za-z0-9._:-]")
    outer = r.string(document["outer_runtime_id"], "outer_runtime_id", _ID, "must be 1-128 of [A-Za-z0-9._:-]")
    workspace = _absolute(r, document["workspace"], "workspace")
    repository = r.obj(document["repository"], "repository", required=("path", "revision"))
    repository_path = _absolute(r, repository["path"], "repository.path")
    revision = r.string(repository["revision"], "repository.revision", _REVISION, "must be 40 or 64 hex digits")
    branch = r.string(document["task_branch"], "task_branch")
    if not _valid_branch(branch):
        r.fail("task_branch", "must be a valid Git branch name")
    if r.string(document["tunnel_placement"], "tunnel_placement") != "outer":
        r.fail("tunnel_placement", 'must be "outer"')
    ports = _ports(r, document.get("published_ports", []))
    images = _images(r, document["service_images"]) if "service_images" in document else ()
    proxy = document.get("port_proxy_image")
    if proxy is not None or "port_proxy_image" in document:
        proxy = _image(r, proxy, "port_proxy_image")
    if images and ports and proxy is None:
        r.fail("port_proxy_image", "required when service_images and published_ports are both non-empty")
    consumer = None
    if "workspace_consumer" in document:
        pair = r.obj(document["workspace_consumer"], "workspace_consumer", required=("uid", "gid"))
        consumer = (
            r.integer(pair["uid"], "workspace_consumer.uid", 1, UID_MAX),
            r.integer(pair["gid"], "workspace_consumer.gid", 1, UID_MAX),
        )
    folder, omitted = _folder(r, document, has_images=bool(images))
    leases = tuple(
        _lease(r, value, i, version) for i, value in enumerate(r.array(document.get("leases", []), "leases"))
    )
    manifest = Manifest(
        file=file,
        version=version,
        run_id=run_id,
        lease_id=lease_id,
        outer_runtime_id=outer,
        workspace=workspace,
        repository_path=repository_path,
        repository_revision=revision,
        task_branch=branch,
        tunnel_placement="outer",
        published_ports=ports,
        leases=leases,
        service_images=images,
        port_proxy_image=proxy,
        workspace_consumer=consumer,
        workspace_folder=folder,
        omitted_services=omitted,
        sha256=hashlib.sha256(data).hexdigest(),
    )
    _between_leases(r, manifest)
    return manifest


def _version(r: _Reader, document: JsonObject) -> str:
    if "version" not in document:
        r.fail("version", "missing required field")
    version = document["version"]
    if not isinstance(version, str):
        r.fail("version", 'must be a JSON string: "1", "2" or "3"')
    if version not in ("1", "2", "3"):
        r.fail("version", 'must be "1", "2" or "3"')
    return version


def _version_gates(r: _Reader, document: JsonObject, version: str) -> None:
    for key in ("service_images", "port_proxy_image") if version == "1" else ():
        if key in document:
            r.fail(key, "version 1 allows no images")
    if "workspace_consumer" in document and version != "3":
        r.fail("workspace_consumer", "only version 3 has a workspace consumer")
    if version == "3" and "workspace_consumer" not in document:
        r.fail("workspace_consumer", "missing required field (version 3)")
    for key in ("workspace_folder", "omitted_services"):
        if key in document and version != "3":
            r.fail(key, "only version 3 has it")


def _absolute(r: _Reader, value: Any, path: str) -> str:
    text = r.string(value, path)
    if not text.startswith("/") or len(text) > 4096:
        r.fail(path, "must be an absolute path")
    return text


def _clean_absolute(r: _Reader, value: Any, path: str) -> str:
    text = _absolute(r, value, path)
    parts = text.split("/")[1:]
    if text == "/" or text.endswith("/") or "//" in text or any(p in (".", "..") for p in parts):
        r.fail(path, "must be a clean absolute path (no ., .., // or trailing /)")
    lowered = text.lower()
    if any(marker in lowered for marker in AMBIENT_MARKERS):
        r.fail(path, "names an ambient-authority or secret path")
    return text


def _valid_branch(name: str) -> bool:
    if not name or len(name) > 255 or name == "@" or name.startswith(("-", "/")) or name.endswith(("/", ".", ".lock")):
        return False
    if any(ord(c) < 0x20 or ord(c) == 0x7F or c in " ~^:?*[\\" for c in name):
        return False
    if ".." in name or "@{" in name or "//" in name:
        return False
    return not any(part.startswith(".") or part.endswith(".lock") for part in name.split("/"))


def _ports(r: _Reader, value: Any) -> tuple[tuple[int, int], ...]:
    ports: list[tuple[int, int]] = []
    for i, entry in enumerate(r.array(value, "published_ports")):
        path = f"published_ports[{i}]"
        pair = r.obj(entry, path, required=("host", "runtime"))
        host = r.integer(pair["host"], f"{path}.host", 1, 65535)
        runtime = r.integer(pair["runtime"], f"{path}.runtime", 1, 65535)
        if any(host == h for h, _ in ports):
            r.fail(f"{path}.host", "host ports must be unique")
        if any(runtime == p for _, p in ports):
            r.fail(f"{path}.runtime", "runtime ports must be unique")
        ports.append((host, runtime))
    return tuple(ports)


def _image(r: _Reader, value: Any, path: str) -> str:
    text = r.string(value, path)
    if len(text) > 512 or not _IMAGE.fullmatch(text) or "//" in text:
        r.fail(path, "must be an immutable image reference (repository@sha256:<64 hex> or sha256:<64 hex>)")
    return text


def _images(r: _Reader, value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, JsonObject):
        r.fail("service_images", "must be a JSON object")
    if value.duplicates:
        r.fail(f"service_images.{value.duplicates[0]}", "duplicate key")
    if len(value) > 64:
        r.fail("service_images", "at most 64 entries")
    images = []
    for name, image in value.items():
        if not _SERVICE.fullmatch(name):
            r.fail(f"service_images.{name}", "service names are 1-128 of [A-Za-z0-9._-], starting alphanumeric")
        images.append((name, _image(r, image, f"service_images.{name}")))
    return tuple(images)


def _folder(r: _Reader, document: JsonObject, *, has_images: bool) -> tuple[str | None, tuple[str, ...]]:
    if "workspace_folder" not in document and "omitted_services" not in document:
        return None, ()
    for key, other in (("workspace_folder", "omitted_services"), ("omitted_services", "workspace_folder")):
        if key in document and other not in document:
            r.fail(other, f"required together with {key}")
    if not has_images:
        r.fail("workspace_folder", "only with service_images")
    folder = r.string(document["workspace_folder"], "workspace_folder")
    segments = folder.removeprefix("/workspaces/").split("/")
    if (
        not folder.startswith("/workspaces/")
        or not 1 <= len(segments) <= 4
        or not all(_SEGMENT.fullmatch(s) and s not in (".", "..") for s in segments)
        or folder == "/workspaces/main"
    ):
        r.fail("workspace_folder", "must be /workspaces/ and 1-4 clean segments, not /workspaces/main")
    names = r.array(document["omitted_services"], "omitted_services", 32)
    for i, name in enumerate(names):
        r.string(name, f"omitted_services[{i}]", _OMITTED, "names are 1-64 of [A-Za-z0-9._-], starting alphanumeric")
    return folder, tuple(names)


def expiry(value: str) -> datetime | None:
    """An RFC 3339 time with offset, or None if `value` is not one."""
    match = _EXPIRY.fullmatch(value)
    if match is None:
        return None
    year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
    fraction, offset = match.group(7), match.group(8)
    micro = int((fraction[1:] + "000000")[:6]) if fraction else 0
    if offset in ("Z", "z"):
        zone = UTC
    else:
        hours, minutes = int(offset[1:3]), int(offset[4:6])
        if hours > 23 or minutes > 59:
            return None
        delta = timedelta(hours=hours, minutes=minutes)
        zone = timezone(delta if offset[0] == "+" else -delta)
    try:
        return datetime(year, month, day, hour, minute, second, micro, tzinfo=zone)
    except ValueError:
        return None


_COMMON = ("lease_id", "scope", "consumer", "materializations")
_SCOPE_KEYS = {
    MODEL_IDENTITY: ("executable", "inherited_environment"),
    TOOL_REQUEST: ("consumer_uid", "endpoint_lease_id", "request_spool_target", "replay_policy"),
}


def _label(r: _Reader, value: Any, path: str) -> str:
    text = r.string(value, path)
    if not 1 <= len(text) <= 128 or any(c.isspace() for c in text) or "=" in text or "//" in text:
        r.fail(path, "must be 1-128 characters without whitespace, '=' or '//'")
    return text


def _lease(r: _Reader, value: Any, index: int, version: str) -> Lease:
    path = f"leases[{index}]"
    scope = _lease_keys(r, value, path, version)
    lease_id = r.string(value["lease_id"], f"{path}.lease_id", _ID, "must be 1-128 of [A-Za-z0-9._:-]")
    consumer = _label(r, value["consumer"], f"{path}.consumer")
    expires = None
    if "expires_at" in value:
        expires = expiry(r.string(value["expires_at"], f"{path}.expires_at"))
        if expires is None:
            r.fail(f"{path}.expires_at", "must be an RFC 3339 time with an offset")
    lease = Lease(
        index=index,
        lease_id=lease_id,
        scope=scope,
        consumer=consumer,
        expires_at=expires,
        materializations=_materializations(r, value["materializations"], path, scope),
    )
    if scope == MODEL_IDENTITY and version != "1":
        lease = _model_identity(r, value, lease)
    if scope == TOOL_REQUEST:
        lease = _request_fields(r, value, lease)
    return lease


def _lease_keys(r: _Reader, value: Any, path: str, version: str) -> str:
    """A lease's keys are exactly its scope's (for its version); returns the scope."""
    if not isinstance(value, JsonObject):
        r.fail(path, "must be a JSON object")
    if value.duplicates:
        r.fail(f"{path}.{value.duplicates[0]}", "duplicate key")
    if "scope" not in value:
        r.fail(f"{path}.scope", "missing required field")
    scope = r.string(value["scope"], f"{path}.scope")
    if scope not in SCOPES:
        r.fail(f"{path}.scope", "unknown scope")
    if version == "1" and scope in _V1_REFUSED_SCOPES:
        r.fail(f"{path}.scope", "version 1 does not have this scope")
    extra = _SCOPE_KEYS.get(scope, ())
    every_extra = {key for keys in _SCOPE_KEYS.values() for key in keys}
    for key in value:
        if key in every_extra and key not in extra:
            r.fail(f"{path}.{key}", "belongs to another scope")
        if key in extra and scope == MODEL_IDENTITY and version == "1":
            r.fail(f"{path}.{key}", "version 1 does not have it")
    required = list(_COMMON)
    if scope in _EXPIRING or (scope == MODEL_IDENTITY and version != "1"):
        required.append("expires_at")
    optional = ["expires_at"]
    if scope == MODEL_IDENTITY and version != "1":
        required.append("executable")
        optional.append("inherited_environment")
    elif scope == TOOL_REQUEST:
        required += ["consumer_uid", "endpoint_lease_id", "request_spool_target"]
        optional.append("replay_policy")
    r.obj(value, path, required=required, optional=optional)
    return scope


def _model_identity(r: _Reader, value: JsonObject, lease: Lease) -> Lease:
    path = lease.field
    executable = _label(r, value["executable"], f"{path}.executable")
    names = r.array(value.get("inherited_environment", []), f"{path}.inherited_environment", MAX_INHERITED)
    inherited: list[str] = []
    for j, name in enumerate(names):
        where = f"{path}.inherited_environment[{j}]"
        _env_name(r, name, where, project=False)
        if inherited and name <= inherited[-1]:
            r.fail(where, "names must be unique and strictly ascending")
        inherited.append(name)
    return replace(lease, executable=executable, inherited_environment=tuple(inherited))


def _request_fields(r: _Reader, value: JsonObject, lease: Lease) -> Lease:
    path = lease.field
    uid = r.integer(value["consumer_uid"], f"{path}.consumer_uid", 1, UID_MAX)
    endpoint = r.string(value["endpoint_lease_id"], f"{path}.endpoint_lease_id", _ID, "must be a lease id")
    spool = _clean_absolute(r, value["request_spool_target"], f"{path}.request_spool_target")
    if not spool.startswith(REQUEST_NAMESPACE) or spool == REQUEST_NAMESPACE:
        r.fail(f"{path}.request_spool_target", f"must be strictly below {REQUEST_NAMESPACE}")
    policy = value.get("replay_policy")
    if "replay_policy" in value and r.string(policy, f"{path}.replay_policy") != REPLAY_POLICY:
        r.fail(f"{path}.replay_policy", f'must be "{REPLAY_POLICY}" or absent')
    if lease.materializations[0].target_path != spool + "/.capability":
        r.fail(f"{path}.materializations[0].target_path", "must be <request_spool_target>/.capability")
    return replace(
        lease, consumer_uid=uid, endpoint_lease_id=endpoint, request_spool_target=spool, replay_policy=policy
    )


# scope -> (fewest, most, the keys each materialization has besides source_path; no others)
_MATERIAL_RULES: dict[str, tuple[int, int, tuple[str, ...]]] = {
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


def _materializations(r: _Reader, value: Any, path: str, scope: str) -> tuple[Materialization, ...]:
    fewest, most, required = _MATERIAL_RULES[scope]
    items = r.array(value, f"{path}.materializations")
    if not fewest <= len(items) <= most:
        count = "none" if most == 0 else f"exactly {most}" if fewest == most else f"{fewest} to {most}"
        r.fail(f"{path}.materializations", f"a {scope} lease has {count}")
    found = []
    for j, item in enumerate(items):
        where = f"{path}.materializations[{j}]"
        obj = r.obj(item, where, required=("source_path", *required))
        source = _clean_absolute(r, obj["source_path"], f"{where}.source_path")
        target = None
        if "target_path" in obj:
            target = _clean_absolute(r, obj["target_path"], f"{where}.target_path")
            _target_rule(r, target, f"{where}.target_path", scope)
        name = None
        if "environment_name" in obj:
            name = _env_name(r, obj["environment_name"], f"{where}.environment_name", project=False)
        digest = None
        if "sha256" in obj:
            digest = r.string(obj["sha256"], f"{where}.sha256", _SHA256, "must be 64 lowercase hex digits")
        found.append(Materialization(source_path=source, target_path=target, environment_name=name, sha256=digest))
    return tuple(found)


def _target_rule(r: _Reader, target: str, path: str, scope: str) -> None:
    namespace = {SHARED_DIRECTORY: SHARED_NAMESPACE, TOOL_ENDPOINT: ENDPOINT_NAMESPACE}.get(scope)
    if namespace is not None and (not target.startswith(namespace) or target == namespace.rstrip("/")):
        r.fail(path, f"must be strictly below {namespace}")
    if scope == PROJECT_ENVIRONMENT and target != PROJECT_ENV_TARGET:
        r.fail(path, f"must be exactly {PROJECT_ENV_TARGET}")
    if scope == PROVIDER_CREDENTIAL:
        if target == NAMESPACE or target.startswith(NAMESPACE + "/"):
            r.fail(path, f"must not be under {NAMESPACE}")
        if os.path.dirname(target) == "/":
            r.fail(path, "must not be directly in /")


def _env_name(r: _Reader, value: Any, path: str, *, project: bool) -> str:
    name = r.string(value, path, _ENV_NAME, "must be [A-Z_][A-Z0-9_]*, at most 128 characters")
    if denied_name(name, project=project):
        r.fail(path, "this environment name is refused (shell, loader, Git, supervisor or broker control)")
    return name


def denied_name(name: str, *, project: bool) -> bool:
    """Whether an environment name is refused for a provider (or, `project`, a project) variable."""
    if project:
        return (
            name in PROJECT_DENIED or name.startswith(PROJECT_DENIED_PREFIXES) or name.endswith(PROJECT_DENIED_SUFFIXES)
        )
    return name in PROVIDER_DENIED or name.startswith(PROVIDER_DENIED_PREFIXES)


def _between_leases(r: _Reader, manifest: Manifest) -> None:
    """The rules that relate leases to each other; the later of two places is named."""
    identities = _identities(r, manifest)
    names: dict[str, set[str]] = {}
    values = 0
    projects = 0
    spooled: set[str] = set()
    for lease in manifest.leases:
        if lease.scope in (PROVIDER_ENVIRONMENT, TOOL_REQUEST) and lease.consumer not in identities:
            r.fail(f"{lease.field}.consumer", "this consumer has no model-identity lease")
        if lease.scope == MODEL_IDENTITY:  # in document order: a clash names the later place
            taken = names.setdefault(lease.consumer, set())
            for j, name in enumerate(lease.inherited_environment):
                if name in taken:
                    r.fail(f"{lease.field}.inherited_environment[{j}]", "this consumer already has this name")
                taken.add(name)
        if lease.scope == PROVIDER_ENVIRONMENT:
            values = _provider_values(r, lease, names.setdefault(lease.consumer, set()), values)
        if lease.scope == PROJECT_ENVIRONMENT:
            projects += 1
            if projects > 1:
                r.fail(f"{lease.field}.scope", "at most one project-environment lease")
        if lease.scope == TOOL_REQUEST:
            _tool_request(r, manifest, lease, spooled)


def _provider_values(r: _Reader, lease: Lease, taken: set[str], values: int) -> int:
    """Checks one provider-environment lease's names; returns the running count of values."""
    for j, item in enumerate(lease.materializations):
        values += 1
        where = f"{lease.field}.materializations[{j}]"
        if values > MAX_PROVIDER_VALUES:
            r.fail(where, f"at most {MAX_PROVIDER_VALUES} provider-environment values in all")
        if item.environment_name in taken:
            r.fail(f"{where}.environment_name", "this consumer already has this name")
        taken.add(str(item.environment_name))
    return values


def _identities(r: _Reader, manifest: Manifest) -> dict[str, Lease]:
    """Unique lease ids; at most one model identity per consumer; unique executables."""
    seen_ids: set[str] = set()
    identities: dict[str, Lease] = {}
    executables: set[str] = set()
    for lease in manifest.leases:
        if lease.lease_id in seen_ids:
            r.fail(f"{lease.field}.lease_id", "lease ids must be unique")
        seen_ids.add(lease.lease_id)
        if lease.scope == MODEL_IDENTITY:
            if lease.consumer in identities:
                r.fail(f"{lease.field}.consumer", "at most one model-identity lease per consumer")
            identities[lease.consumer] = lease
            if lease.executable is not None:
                if lease.executable in executables:
                    r.fail(f"{lease.field}.executable", "executables must be unique across leases")
                executables.add(lease.executable)
    return identities


def _tool_request(r: _Reader, manifest: Manifest, lease: Lease, spooled: set[str]) -> None:
    endpoint = manifest.lease(str(lease.endpoint_lease_id))
    where = f"{lease.field}.endpoint_lease_id"
    if endpoint is None or endpoint.scope != TOOL_ENDPOINT or endpoint.consumer != lease.consumer:
        r.fail(where, "must name a tool-endpoint lease of the same consumer")
    if endpoint.lease_id in spooled:
        r.fail(where, "each endpoint backs one request spool")
    spooled.add(endpoint.lease_id)
    if lease.expires_at and endpoint.expires_at and lease.expires_at > endpoint.expires_at:
        r.fail(f"{lease.field}.expires_at", "must not be later than its endpoint's")
    if manifest.workspace_consumer is not None and lease.consumer_uid != manifest.workspace_consumer[0]:
        r.fail(f"{lease.field}.consumer_uid", "must equal workspace_consumer.uid")


def targets_apart(manifest: Manifest) -> str | None:
    """The field of the first mount target equal to or nested in an earlier one (a capability
    sits inside its own spool), or None."""
    suppressed = manifest.linked_endpoints()
    taken: list[str] = []
    for lease in manifest.leases:
        if lease.lease_id in suppressed:
            continue
        targets = [(f"{lease.field}.request_spool_target", lease.request_spool_target)]
        if lease.scope != TOOL_REQUEST:
            targets = [
                (f"{lease.field}.materializations[{j}].target_path", m.target_path)
                for j, m in enumerate(lease.materializations)
            ]
        for where, target in targets:
            if target is None:
                continue
            if any(_nested(target, other) for other in taken):
                return where
            taken.append(target)
    return None


def _nested(a: str, b: str) -> bool:
    return a == b or a.startswith(b + "/") or b.startswith(a + "/")


# ---------------------------------------------------------------- the filesystem and the clock


def load(path: str, *, now: datetime | None = None, forbidden: Sequence[str] = ()) -> Manifest:
    """The whole check of an assignment file: ManifestError (2) or LeaseExpiredError (3)."""
    data, info = read_assignment(path)
    manifest = parse(data, file=path)
    check_sources(manifest, owner=info.st_uid, forbidden=forbidden)
    check_live(manifest, now=now)
    return manifest


def read_assignment(path: str) -> tuple[bytes, os.stat_result]:
    """The assignment's bytes: an absolute path to an owner-only regular file, not a symlink."""
    if not path.startswith("/"):
        raise ManifestError(path, "", "the manifest must be given as an absolute path")
    try:
        # No symlink anywhere on its path: every source is named below this directory, and the
        # broker later removes them as root.
        os.close(open_dir_nofollow(os.path.dirname(path)))
    except OSError as exc:
        symlink = exc.errno in (errno.ELOOP, errno.ENOTDIR)
        rule = "must be reached without symlinks" if symlink else f"cannot be reached ({exc.strerror})"
        raise ManifestError(path, "", f"the manifest's directory {rule}") from None
    try:
        return read_owner_only(path, MAX_DOCUMENT)
    except UnfitFile as exc:
        raise ManifestError(path, "", f"the manifest {exc.reason}") from None


def _read_bounded(fd: int, limit: int) -> bytes | None:
    chunks, size = [], 0
    while chunk := os.read(fd, 65536):
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def run_dir(manifest: Manifest) -> str:
    return os.path.dirname(manifest.file)


def check_sources(manifest: Manifest, *, owner: int, forbidden: Sequence[str] = ()) -> None:
    """Every source rule that needs the filesystem."""
    r = _Reader(manifest.file)
    directory = run_dir(manifest)
    if os.path.basename(directory) != manifest.run_id:
        r.fail("run_id", "the assignment's directory must be named after run_id")
    _private_dir(r, directory, owner, "run_id", "the run directory")
    sources: list[str] = []
    for lease, j, item, where in _each_material(manifest):
        source = item.source_path
        real = os.path.realpath(source)
        for f in forbidden:
            if _nested(source, os.path.normpath(f)) or _nested(real, os.path.realpath(f)):
                r.fail(where, "must not be the broker's own config or state")
        if any(_nested(source, other) for other in sources):
            r.fail(where, "sources must not be equal or nested")
        sources.append(source)
        if lease.scope in FILE_SCOPES:
            read_material(manifest, lease, j, owner=owner)
        else:
            _run_owned(r, manifest, lease, source=source, where=where, owner=owner)
    for lease in manifest.by_scope(TOOL_REQUEST):
        endpoint = manifest.lease(str(lease.endpoint_lease_id))
        if endpoint is not None and not _is_socket(endpoint.materializations[0].source_path):
            r.fail(f"{lease.field}.endpoint_lease_id", "the linked endpoint's source must be a socket")


def _each_material(manifest: Manifest) -> Iterator[tuple[Lease, int, Materialization, str]]:
    for lease in manifest.leases:
        for j, item in enumerate(lease.materializations):
            yield lease, j, item, f"{lease.field}.materializations[{j}].source_path"


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


def _private_dir(r: _Reader, path: str, owner: int, field: str, what: str) -> None:
    try:
        info = os.lstat(path)
    except OSError as exc:
        r.fail(field, f"{what} {path} cannot be read ({exc.strerror})")
    if not stat.S_ISDIR(info.st_mode):
        r.fail(field, f"{what} {path} must be a directory, not a symlink")
    if stat.S_IMODE(info.st_mode) != 0o700 or info.st_uid != owner:
        r.fail(field, f"{what} {path} must be mode 0700 and owned by the assignment's owner")


def _run_owned(r: _Reader, manifest: Manifest, lease: Lease, *, source: str, where: str, owner: int) -> None:
    directory = run_dir(manifest)
    if not source.startswith(directory + "/"):
        r.fail(where, "must be inside the run directory")
    parent = os.path.dirname(source)
    while parent != directory:
        _private_dir(r, parent, owner, where, "the directory")
        parent = os.path.dirname(parent)
    try:
        info = os.lstat(source)
    except OSError as exc:
        r.fail(where, f"cannot be read ({exc.strerror})")
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid != owner:
        r.fail(where, "must belong to the assignment's owner")
    if lease.scope == SHARED_DIRECTORY and not (stat.S_ISDIR(info.st_mode) and mode == 0o755):
        r.fail(where, "a shared directory must be a directory of mode exactly 0755 (not a symlink)")
    if lease.scope == TOOL_ENDPOINT:
        directory_ok = stat.S_ISDIR(info.st_mode) and mode == 0o700
        socket_ok = stat.S_ISSOCK(info.st_mode) and not mode & 0o077
        if not (directory_ok or socket_ok):
            r.fail(where, "a tool endpoint must be a 0700 directory or an owner-only socket (not a symlink)")


def read_material(manifest: Manifest, lease: Lease, index: int, *, owner: int) -> bytes:
    """A file materialization's bytes, checked: place, type, owner, mode, size, sha256 and the
    scope's content rules. Read once through one descriptor; the caller uses exactly these bytes."""
    r = _Reader(manifest.file)
    item = lease.materializations[index]
    where = f"{lease.field}.materializations[{index}].source_path"
    source = item.source_path
    materials = os.path.join(run_dir(manifest), "materializations")
    if os.path.dirname(source) != materials:
        r.fail(where, "must be directly in the run's materializations/ directory")
    _private_dir(r, materials, owner, where, "the directory")
    try:
        fd = open_beneath(run_dir(manifest), source, os.O_RDONLY | os.O_NONBLOCK, strict_root=True)
    except OSError as exc:
        r.fail(where, "is a symlink" if exc.errno == errno.ELOOP else f"cannot be read ({exc.strerror})")
    try:
        info = os.fstat(fd)
        mode = stat.S_IMODE(info.st_mode)
        if not stat.S_ISREG(info.st_mode):
            r.fail(where, "must be a regular file")
        if info.st_uid != owner:
            r.fail(where, "must belong to the assignment's owner")
        if lease.scope == PROVIDER_CREDENTIAL:
            if mode & 0o022 or mode & 0o444 != 0o444:
                r.fail(where, "a provider credential must be readable by all and writable by its owner only")
        elif mode & 0o077:
            r.fail(where, "must be owner-only (no group or other permissions)")
        data = _read_bounded(fd, MAX_DOCUMENT)
    finally:
        os.close(fd)
    if data is None:
        r.fail(where, f"larger than {MAX_DOCUMENT} bytes")
    if hashlib.sha256(data).hexdigest() != item.sha256:
        r.fail(f"{lease.field}.materializations[{index}].sha256", "does not match the file's bytes")
    _content_rule(r, lease.scope, data, where)
    return data


def _content_rule(r: _Reader, scope: str, data: bytes, where: str) -> None:
    if scope == PROVIDER_ENVIRONMENT:
        low, high = PROVIDER_VALUE_BYTES
        if not low <= len(data) <= high:
            r.fail(where, f"a provider value is {low}-{high} bytes")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            r.fail(where, "a provider value must be UTF-8")
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in text):
            r.fail(where, "a provider value must have no control characters (no trailing newline either)")
    elif scope == TOOL_REQUEST and not _CAPABILITY.fullmatch(data):
        r.fail(where, "a capability is 32-128 of [A-Za-z0-9._-]")
    elif scope == PROJECT_ENVIRONMENT:
        project_variables(data, r, where)


def project_variables(data: bytes, r: _Reader | None = None, where: str = "") -> list[tuple[str, str]]:
    """The variables of a project-env file: sorted unique NAME=value lines, each ending in \\n."""
    reader = r or _Reader("project-env")
    if len(data) > PROJECT_ENV_MAX_BYTES:
        reader.fail(where, f"a project-env file is at most {PROJECT_ENV_MAX_BYTES} bytes")
    if b"\r" in data or b"\0" in data:
        reader.fail(where, "a project-env file has no CR or NUL")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        reader.fail(where, "a project-env file must be UTF-8")
    if text and not text.endswith("\n"):
        reader.fail(where, "every project-env line ends with a newline")
    lines = text.split("\n")[:-1] if text else []
    if len(lines) > PROJECT_ENV_MAX_LINES:
        reader.fail(where, f"at most {PROJECT_ENV_MAX_LINES} project-env lines")
    pairs: list[tuple[str, str]] = []
    for number, line in enumerate(lines, 1):
        name, equals, value = line.partition("=")
        if not equals or not _ENV_NAME.fullmatch(name):
            reader.fail(where, f"project-env line {number} is not NAME=value")
        if denied_name(name, project=True):
            reader.fail(where, f"project-env line {number}: this name is refused")
        if pairs and name <= pairs[-1][0]:
            reader.fail(where, f"project-env line {number}: names must be unique and sorted")
        pairs.append((name, value))
    return pairs


def check_live(manifest: Manifest, *, now: datetime | None = None) -> None:
    """Every lease whose expiry is checked must expire strictly after `now` (LeaseExpiredError)."""
    moment = now or datetime.now(UTC)
    for lease in manifest.leases:
        if expiry_checked(manifest, lease) and lease.expires_at is not None and lease.expires_at <= moment:
            raise LeaseExpiredError(manifest.file, f"{lease.field}.expires_at", "the lease has expired")


def expiry_checked(manifest: Manifest, lease: Lease) -> bool:
    """Whether a lease's expiry must be live (model identities: from version 2 on)."""
    return lease.scope in _EXPIRING or (lease.scope == MODEL_IDENTITY and manifest.version != "1")


def meaning(manifest: Manifest) -> dict[str, Any]:
    """What `manifest check --json` prints: ids, scopes, targets and expiries; never a value,
    a capability or a digest."""
    return {
        "file": manifest.file,
        "version": manifest.version,
        "run_id": manifest.run_id,
        "lease_id": manifest.lease_id,
        "outer_runtime_id": manifest.outer_runtime_id,
        "repository": {"path": manifest.repository_path, "revision": manifest.repository_revision},
        "task_branch": manifest.task_branch,
        "published_ports": [{"host": h, "runtime": p} for h, p in manifest.published_ports],
        "workspace_consumer": (
            None
            if manifest.workspace_consumer is None
            else {"uid": manifest.workspace_consumer[0], "gid": manifest.workspace_consumer[1]}
        ),
        "service_images": dict(manifest.service_images),
        "leases": [
            {
                "lease_id": lease.lease_id,
                "scope": lease.scope,
                "consumer": lease.consumer,
                "expires_at": None if lease.expires_at is None else lease.expires_at.isoformat(),
                "targets": [m.target_path for m in lease.materializations if m.target_path is not None],
                "environment_names": [m.environment_name for m in lease.materializations if m.environment_name],
                **({"executable": lease.executable} if lease.executable else {}),
                **({"inherited_environment": list(lease.inherited_environment)} if lease.executable else {}),
                **(
                    {"request_spool_target": lease.request_spool_target, "consumer_uid": lease.consumer_uid}
                    if lease.scope == TOOL_REQUEST
                    else {}
                ),
            }
            for lease in manifest.leases
        ],
    }
