"""What a valid owner file is: the frozen values `config` parses extension configs and profiles
into, and their normalized meaning (`meaning`, and `from_meaning` back, for the parse cache).

Pure and free of YAML: the plan, the record and the backends read these values without loading
the parser.
"""

from __future__ import annotations

import fnmatch
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, get_args

from sandboxer.core.egress.policy import EgressRule, Route
from sandboxer.core.egress.policy import Limits as EgressLimits

ExtensionName = Literal["ext.bwrap", "ext.docker"]
EXTENSIONS: tuple[ExtensionName, ...] = get_args(ExtensionName)

DEFAULT_MEMORY_MIB = 2048
DEFAULT_PIDS = 512
DEFAULT_WORKSPACE_MIB = 4096
DEFAULT_STATE_MIB = 256  # the private state tmpfs (HOME, XDG dirs, TMPDIR)
DEFAULT_TMP_MIB = 256  # /tmp and /var/tmp, each a private tmpfs
DEFAULT_GIT_USER = ("Sandbox", "sandbox@localhost")  # a neutral commit identity: workspace.git.user
DEFAULT_EGRESS_LIMITS = EgressLimits()  # network.limits left out (docs/egress.md, "Limits")


def no_routes() -> Mapping[str, Route]:
    """An extension config's routes when it lists none (read-only, like every parsed value)."""
    return types.MappingProxyType({})


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimePin:
    """The owner's runtime directory and the tree digest v1 it must have."""

    path: str
    sha256: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ExtensionConfig:
    """One `extensions/<name>.yaml` file."""

    extension: ExtensionName
    runtime: RuntimePin
    image: str | None
    file_sha256: str
    warm: int = 0  # sandboxes kept started ahead for each of its profiles (sandboxer.commands.warmpool)
    # config.routes: the credential routes a profile may opt into by name (network.routes)
    routes: Mapping[str, Route] = field(default_factory=no_routes)
    # config.service_user (ext.docker): a service container runs as the sandbox's user ("sandbox"),
    # or as its image's own user ("image"), which the owner allows for images that need it
    service_user: Literal["sandbox", "image"] = "sandbox"


@dataclass(frozen=True, slots=True, kw_only=True)
class Workspace:
    """The Git repository each sandbox clones, the ref it checks out, the refs a caller may ask
    for instead (workspace.refs: names and `*` patterns; by default only `ref`), and the commit
    identity the clone is given (workspace.git.user)."""

    repository: str
    ref: str
    git_user_name: str = DEFAULT_GIT_USER[0]
    git_user_email: str = DEFAULT_GIT_USER[1]
    refs: tuple[str, ...] = ()

    def allows(self, ref: str) -> bool:
        """Whether `create --ref` may name `ref`: the profile's own, or one workspace.refs matches
        (`*` matches any run of characters, `/` included)."""

        patterns = self.refs or (self.ref,)
        return any(fnmatch.fnmatchcase(ref, pattern) for pattern in patterns)


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """Resource limits of every sandbox of a profile."""

    memory_mib: int = DEFAULT_MEMORY_MIB
    pids: int = DEFAULT_PIDS
    workspace_mib: int = DEFAULT_WORKSPACE_MIB  # the workspace's own filesystem: ENOSPC past it
    state_mib: int = DEFAULT_STATE_MIB  # the state tmpfs: ENOSPC past it
    tmp_mib: int = DEFAULT_TMP_MIB  # /tmp and /var/tmp, each: ENOSPC past it
    cpus: float | None = None  # a CPU quota: cores of CPU time per second (None: no quota)
    best_effort: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Security:
    """What a profile may relax of the sandbox's syscall policy (docs/seccomp.md)."""

    allow_ptrace: bool = False  # debuggers inside: ptrace within one exec's own processes


@dataclass(frozen=True, slots=True, kw_only=True)
class Lifetime:
    """How long a profile's sandboxes live: unused, and at most."""

    idle_seconds: int | None = None  # torn down by the service after this long without an exec
    max_seconds: int | None = None  # no sandbox lives longer from its create (--ttl, extend)


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """One `profiles/<name>.yaml` file."""

    name: str
    extension: ExtensionName
    workspace: Workspace
    network_default: Literal["deny"]
    egress: tuple[EgressRule, ...]  # network.egress: the hosts and ports the proxy lets through
    secrets: tuple[()]
    limits: Limits
    file_sha256: str
    security: Security = Security()
    lifetime: Lifetime = Lifetime()
    caller_env: tuple[str, ...] = ()  # exec.caller_env: names a caller may set with exec --env
    exec_env: tuple[tuple[str, str], ...] = ()  # exec.env: variables the owner sets in every exec
    routes: tuple[str, ...] = ()  # network.routes: the extension's credential routes it uses, by name
    egress_limits: EgressLimits = DEFAULT_EGRESS_LIMITS  # network.limits: the proxy's, per sandbox
    publish: Literal["none", "loopback"] = "none"  # network.publish: loopback lets a manifest publish ports

    @property
    def has_egress(self) -> bool:
        """Whether the sandbox's way out is the broker's proxy (else loopback only)."""
        return bool(self.egress)


GRANTS_NAME = "grants"  # <config-dir>/grants.yaml, approved as `sandboxer ext approve grants`


@dataclass(frozen=True, slots=True, kw_only=True)
class Grant:
    """One entry of grants.yaml: these accounts (by user or group name) may create these profiles,
    with at most `max_sandboxes` live at once and lifetimes no longer than `max_ttl_seconds`;
    their exports under way and kept take at most `max_exports_mib` of the broker's disk (None:
    the broker's default)."""

    users: tuple[str, ...]
    groups: tuple[str, ...]
    profiles: tuple[str, ...]
    max_sandboxes: int
    max_ttl_seconds: int
    max_exports_mib: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class GrantsFile:
    """`grants.yaml`: which accounts other than the owners may call the broker (docs/service.md)."""

    grants: tuple[Grant, ...]
    file_sha256: str


OwnerFile = ExtensionConfig | Profile | GrantsFile


def owner_file_name(item: OwnerFile) -> str:
    """The name an owner file is approved under."""
    if isinstance(item, Profile):
        return item.name
    if isinstance(item, GrantsFile):
        return GRANTS_NAME
    return item.extension


def meaning(item: OwnerFile) -> dict[str, Any]:
    """The normalized meaning of a valid owner file, shaped like the file, defaults filled in."""
    if isinstance(item, GrantsFile):
        return {
            "kind": GRANTS_NAME,
            "grants": [
                {
                    "users": list(grant.users),
                    "groups": list(grant.groups),
                    "profiles": list(grant.profiles),
                    "max_sandboxes": grant.max_sandboxes,
                    "max_ttl_seconds": grant.max_ttl_seconds,
                    "max_exports_mib": grant.max_exports_mib,
                }
                for grant in item.grants
            ],
        }
    if isinstance(item, Profile):
        return {
            "kind": "profile",
            "profile": item.name,
            "extension": item.extension,
            "workspace": {
                "repository": item.workspace.repository,
                "ref": item.workspace.ref,
                "refs": list(item.workspace.refs),
                "git": {"user": {"name": item.workspace.git_user_name, "email": item.workspace.git_user_email}},
            },
            "network": {
                "default": item.network_default,
                "egress": [_rule_meaning(rule) for rule in item.egress],
                "routes": list(item.routes),
                "limits": {
                    "connections": item.egress_limits.connections,
                    "mib": item.egress_limits.mib,
                    "seconds": item.egress_limits.seconds,
                },
                "publish": item.publish,
            },
            "setup": {"secrets": list(item.secrets)},
            "limits": {
                "memory_mib": item.limits.memory_mib,
                "pids": item.limits.pids,
                "workspace_mib": item.limits.workspace_mib,
                "state_mib": item.limits.state_mib,
                "tmp_mib": item.limits.tmp_mib,
                "cpus": item.limits.cpus,
                "best_effort": item.limits.best_effort,
            },
            "security": {"allow_ptrace": item.security.allow_ptrace},
            "lifetime": {"idle_seconds": item.lifetime.idle_seconds, "max_seconds": item.lifetime.max_seconds},
            "exec": {"caller_env": list(item.caller_env), "env": dict(item.exec_env)},
        }
    config: dict[str, Any] = {"runtime": {"path": item.runtime.path, "sha256": item.runtime.sha256}}
    if item.image is not None:
        config["image"] = item.image
    config["warm"] = item.warm
    config["service_user"] = item.service_user
    config["routes"] = {name: _route_meaning(route) for name, route in item.routes.items()}
    return {"kind": "extension", "extension": item.extension, "config": config}


def from_meaning(document: dict[str, Any], file_sha256: str) -> OwnerFile:
    """Rebuild a parsed owner file from `meaning()` output (the broker's own parse cache)."""
    if document["kind"] == GRANTS_NAME:
        return GrantsFile(
            grants=tuple(
                Grant(
                    users=tuple(str(u) for u in entry["users"]),
                    groups=tuple(str(g) for g in entry["groups"]),
                    profiles=tuple(str(p) for p in entry["profiles"]),
                    max_sandboxes=int(entry["max_sandboxes"]),
                    max_ttl_seconds=int(entry["max_ttl_seconds"]),
                    max_exports_mib=None if entry.get("max_exports_mib") is None else int(entry["max_exports_mib"]),
                )
                for entry in document["grants"]
            ),
            file_sha256=file_sha256,
        )
    if document["kind"] == "profile":
        limits = document["limits"]
        network = document["network"]
        egress_limits = network.get("limits", {})
        workspace = document["workspace"]
        git_user = workspace.get("git", {}).get("user", {})
        return Profile(
            name=str(document["profile"]),
            extension=_extension(document["extension"]),
            workspace=Workspace(
                repository=str(workspace["repository"]),
                ref=str(workspace["ref"]),
                git_user_name=str(git_user.get("name", DEFAULT_GIT_USER[0])),
                git_user_email=str(git_user.get("email", DEFAULT_GIT_USER[1])),
                refs=tuple(str(r) for r in workspace.get("refs", ())),
            ),
            network_default="deny",
            egress=tuple(_rule(rule) for rule in network["egress"]),
            secrets=(),
            limits=Limits(
                memory_mib=int(limits["memory_mib"]),
                pids=int(limits["pids"]),
                workspace_mib=int(limits["workspace_mib"]),
                state_mib=int(limits.get("state_mib", DEFAULT_STATE_MIB)),
                tmp_mib=int(limits.get("tmp_mib", DEFAULT_TMP_MIB)),
                cpus=None if limits.get("cpus") is None else float(limits["cpus"]),
                best_effort=bool(limits["best_effort"]),
            ),
            file_sha256=file_sha256,
            security=Security(allow_ptrace=bool(document["security"]["allow_ptrace"])),
            lifetime=_lifetime(document.get("lifetime", {})),
            caller_env=tuple(str(name) for name in document.get("exec", {}).get("caller_env", [])),
            exec_env=tuple((str(k), str(v)) for k, v in document.get("exec", {}).get("env", {}).items()),
            routes=tuple(str(name) for name in network.get("routes", ())),
            egress_limits=EgressLimits(
                connections=int(egress_limits.get("connections", DEFAULT_EGRESS_LIMITS.connections)),
                mib=int(egress_limits.get("mib", DEFAULT_EGRESS_LIMITS.mib)),
                seconds=_seconds(egress_limits.get("seconds", DEFAULT_EGRESS_LIMITS.seconds)),
            ),
            publish="loopback" if network.get("publish") == "loopback" else "none",
        )
    config = document["config"]
    return ExtensionConfig(
        extension=_extension(document["extension"]),
        runtime=RuntimePin(path=str(config["runtime"]["path"]), sha256=str(config["runtime"]["sha256"])),
        image=str(config["image"]) if "image" in config else None,
        file_sha256=file_sha256,
        warm=int(config.get("warm", 0)),
        service_user="image" if config.get("service_user") == "image" else "sandbox",
        routes=types.MappingProxyType(
            {str(name): _route(str(name), route) for name, route in config.get("routes", {}).items()}
        ),
    )


def rfc3339(moment: float) -> str:
    """A moment as RFC 3339 in UTC with `Z` (microseconds only when it has them)."""
    return datetime.fromtimestamp(moment, UTC).isoformat().replace("+00:00", "Z")


def _rule_meaning(rule: EgressRule) -> dict[str, Any]:
    return {"host": rule.host, "ports": list(rule.ports), "addresses": list(rule.addresses)}


def _rule(document: dict[str, Any]) -> EgressRule:
    return EgressRule(
        host=str(document["host"]),
        ports=tuple(int(port) for port in document["ports"]),
        addresses=tuple(str(address) for address in document.get("addresses", ())),
    )


def _route_meaning(route: Route) -> dict[str, Any]:
    return {
        "host": route.host,
        "header": route.header,
        "format": route.format,
        "secret_file": route.secret_file,
        "expires_at": None if route.expires_at is None else rfc3339(route.expires_at),
    }


def _route(name: str, document: dict[str, Any]) -> Route:
    expires = document.get("expires_at")
    return Route(
        name=name,
        host=str(document["host"]),
        header=str(document["header"]),
        format=str(document["format"]),
        secret_file=str(document["secret_file"]),
        expires_at=None if expires is None else datetime.fromisoformat(str(expires)).timestamp(),
    )


def _seconds(value: object) -> int | float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError("seconds in parse cache")
    return value


def _lifetime(document: dict[str, Any]) -> Lifetime:
    idle = document.get("idle_seconds")
    most = document.get("max_seconds")
    return Lifetime(idle_seconds=None if idle is None else int(idle), max_seconds=None if most is None else int(most))


def _extension(value: object) -> ExtensionName:
    for name in EXTENSIONS:
        if value == name:
            return name
    raise ValueError("unknown extension in parse cache")
