"""Owner configuration: extension configs and profiles, parsed strictly into frozen values.

Pure: takes bytes and a display name, returns values or raises. Structural faults (unknown,
duplicate, missing keys, wrong types, bad grammar) raise `ConfigError` (exit 2); settings that
are well formed but that no backend can honour raise `ForbiddenSettingError` (exit 3).
"""

from __future__ import annotations

import hashlib
import re
from typing import Literal

from sandboxer.core.config_doc import Doc
from sandboxer.core.config_egress import parse_network, parse_routes
from sandboxer.core.config_types import (
    DEFAULT_GIT_USER,
    DEFAULT_MEMORY_MIB,
    DEFAULT_PIDS,
    DEFAULT_STATE_MIB,
    DEFAULT_TMP_MIB,
    DEFAULT_WORKSPACE_MIB,
    EXTENSIONS,
    GRANTS_NAME,
    ExtensionConfig,
    Grant,
    GrantsFile,
    Lifetime,
    Limits,
    OwnerFile,
    Profile,
    RuntimePin,
    Security,
    Workspace,
    no_routes,
)
from sandboxer.core.plan import PLAN_ENV_NAMES
from sandboxer.core.yamlstrict import YMap, YNode, YScalar, parse_yaml
from sandboxer.errors import UsageError

PROFILE_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
# An immutable image reference: a local image id, or repository@sha256:digest with an optional
# registry (host[:port]/) and tag. Lowercase only; nothing a shell or template would expand.
_REPO_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REGISTRY = r"(?:[a-z0-9](?:[a-z0-9-]*[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)*(?::[0-9]{1,5})?/)"
IMAGE_REFERENCE = re.compile(
    rf"sha256:[0-9a-f]{{64}}|{_REGISTRY}?{_REPO_COMPONENT}(?:/{_REPO_COMPONENT})*"
    rf"(?::[a-z0-9_][a-z0-9_.-]{{0,127}})?@sha256:[0-9a-f]{{64}}"
)
_GIT_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,199}")
_GIT_REF_PATTERN = re.compile(r"[A-Za-z0-9*][A-Za-z0-9._/*-]{0,199}")
GIT_USER_NAME = re.compile(r"[^\x00-\x1f\x7f<>]{1,100}")  # what git takes as a name: no control characters, no <>
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
ENV_VALUE = re.compile(r"[^\x00-\x1f\x7f]{0,4096}")
GIT_USER_EMAIL = re.compile(r"[^\s<>@]{1,64}@[^\s<>@]{1,189}")

MEMORY_MIB_RANGE = (64, 1024 * 1024)
WORKSPACE_MIB_RANGE = (16, 1024 * 1024)
TMPFS_MIB_RANGE = (16, 64 * 1024)  # limits.state_mib, limits.tmp_mib: memory-backed, so at most 64 GiB
PIDS_RANGE = (16, 65536)
IDLE_SECONDS_RANGE = (1, 30 * 24 * 3600)  # lifetime.idle_seconds: a second to 30 days
MAX_SECONDS_RANGE = (60, 365 * 24 * 3600)  # lifetime.max_seconds: a minute to a year
CPUS_RANGE = (0.01, 1024.0)  # limits.cpus: cores of CPU time per second of wall time
WARM_RANGE = (0, 8)  # containers started ahead for each Docker profile (docs/docker.md, "Warm containers")


def is_git_ref(value: str, *, pattern: bool = False) -> bool:
    """A branch, tag or commit name git takes (`pattern`: with `*` wildcards too)."""
    parts = value.split("/")
    return bool((_GIT_REF_PATTERN if pattern else _GIT_REF).fullmatch(value)) and not (
        ".." in value
        or "@{" in value
        or value.endswith((".lock", "/", "."))
        or any(not p or p.startswith(".") for p in parts)
    )


def _git_ref(doc: Doc, node: YNode, path: str, *, pattern: bool = False) -> str:
    """A branch, tag or commit name (`pattern`: one with `*` wildcards, for workspace.refs)."""
    rule = "must be a Git branch, tag or commit name (letters, digits, . _ / -)"
    if pattern:
        rule = "must be a Git ref name or a pattern of one with * (letters, digits, . _ / - *)"
    value = doc.string(node, path)
    if not is_git_ref(value, pattern=pattern):
        raise doc.fail(node.mark, path, rule)
    return value


def _parse_extension(doc: Doc, root: YNode, digest: str) -> ExtensionConfig:
    top = doc.mapping(root, "", ("extension", "config"))
    extension = doc.extension_name(top["extension"], "extension")
    doc.own_name(top["extension"], "extension", extension)
    needs_image = extension == "ext.docker"
    required = ("runtime", "image") if needs_image else ("runtime",)
    body = doc.mapping(top["config"], "config", required, ("warm", "routes", "service_user"))
    runtime = doc.mapping(body["runtime"], "config.runtime", ("path", "sha256"))
    image = None
    if needs_image:
        image = doc.string(
            body["image"],
            "config.image",
            IMAGE_REFERENCE,
            "must be an immutable image reference (sha256:<64 hex> or repository@sha256:<64 hex>)",
        )
    pin = RuntimePin(
        path=doc.absolute_path(runtime["path"], "config.runtime.path"),
        sha256=doc.string(
            runtime["sha256"],
            "config.runtime.sha256",
            SHA256_HEX,
            "must be 64 lowercase hex digits",
        ),
    )
    warm = doc.integer(body["warm"], "config.warm", WARM_RANGE) if "warm" in body else 0
    routes = parse_routes(doc, body["routes"]) if "routes" in body else no_routes()
    service_user: Literal["sandbox", "image"] = "sandbox"
    if "service_user" in body:
        node = body["service_user"]
        if not needs_image:
            raise doc.fail(node.mark, "config.service_user", "only ext.docker runs service containers")
        value = doc.string(node, "config.service_user")
        if value not in ("sandbox", "image"):
            raise doc.fail(node.mark, "config.service_user", "must be sandbox or image")
        service_user = "image" if value == "image" else "sandbox"
    return ExtensionConfig(
        extension=extension,
        runtime=pin,
        image=image,
        file_sha256=digest,
        warm=warm,
        routes=routes,
        service_user=service_user,
    )


def _exec_section(doc: Doc, node: YNode | None) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """exec.caller_env: the names a caller may set with `exec --env`; exec.env: variables the
    owner sets in every exec (hints such as PIP_NO_INDEX). Neither may name a variable the
    sandbox's own environment sets (PATH, HOME, ..., SANDBOXER_*): that stays the broker's."""

    if node is None:
        return (), ()
    section = doc.mapping(node, "exec", (), ("caller_env", "env"))

    def name(entry: YNode, path: str) -> str:
        value = doc.string(entry, path, ENV_NAME, "must be an environment name: letters, digits, _; not a digit first")
        if value in PLAN_ENV_NAMES or value.startswith("SANDBOXER_"):
            raise doc.fail(entry.mark, path, f"{value} is set by the sandbox itself, not by a caller")
        return value

    caller_env = doc.sequence(section["caller_env"], "exec.caller_env", name) if "caller_env" in section else ()
    return caller_env, (_exec_env(doc, section["env"], PLAN_ENV_NAMES) if "env" in section else ())


def _exec_env(doc: Doc, node: YNode, reserved: frozenset[str]) -> tuple[tuple[str, str], ...]:
    if not isinstance(node, YMap):
        raise doc.fail(node.mark, "exec.env", "must be a mapping of names to values")
    found: list[tuple[str, str]] = []
    for key, key_mark, value in node.items:
        path = f"exec.env.{key}"
        if not ENV_NAME.fullmatch(key):
            raise doc.fail(key_mark, path, "must be an environment name: letters, digits, _; not a digit first")
        if key in reserved or key.startswith("SANDBOXER_"):
            raise doc.fail(key_mark, path, f"{key} is set by the sandbox itself")
        if not isinstance(value, YScalar) or not isinstance(value.value, str):
            raise doc.fail(value.mark, path, "must be a string (quote numbers)")
        text = doc.string(value, path, ENV_VALUE, "must be at most 4096 printable characters")
        found.append((key, text))
    return tuple(found)


def _git_user(doc: Doc, node: YNode | None) -> tuple[str, str]:
    """workspace.git.user: the commit identity the clone is given (a neutral one by default)."""
    name, email = DEFAULT_GIT_USER
    if node is None:
        return name, email
    git = doc.mapping(node, "workspace.git", (), ("user",))
    if "user" not in git:
        return name, email
    user = doc.mapping(git["user"], "workspace.git.user", (), ("name", "email"))
    if "name" in user:
        name = doc.string(user["name"], "workspace.git.user.name", GIT_USER_NAME, "must be 1-100 printable characters")
    if "email" in user:
        email = doc.string(user["email"], "workspace.git.user.email", GIT_USER_EMAIL, "must be an address like a@b")
    return name, email


def _opaque_string(doc: Doc, node: YNode, path: str) -> str:
    return doc.string(node, path)


def _parse_profile(doc: Doc, root: YNode, digest: str) -> Profile:
    top = doc.mapping(
        root, "", ("profile", "extension", "workspace", "network", "setup"), ("limits", "security", "lifetime", "exec")
    )
    name = doc.string(
        top["profile"],
        "profile",
        PROFILE_NAME,
        "must be 1-63 of a-z 0-9 _ - starting with a letter or digit",
    )
    if name == GRANTS_NAME:
        raise doc.fail(top["profile"].mark, "profile", f"{GRANTS_NAME} is reserved for grants.yaml")
    doc.own_name(top["profile"], "profile", name)
    extension = doc.extension_name(top["extension"], "extension")
    workspace = doc.mapping(top["workspace"], "workspace", ("repository", "ref"), ("git", "refs"))
    network = parse_network(doc, top["network"], extension)
    setup = doc.mapping(top["setup"], "setup", ("secrets",))
    secrets = doc.sequence(setup["secrets"], "setup.secrets", lambda n, p: _opaque_string(doc, n, p))

    limits = Limits()
    if "limits" in top:
        known = ("memory_mib", "pids", "workspace_mib", "state_mib", "tmp_mib", "cpus", "best_effort")
        raw = doc.mapping(top["limits"], "limits", (), known)
        limits = Limits(
            memory_mib=doc.integer(raw["memory_mib"], "limits.memory_mib", MEMORY_MIB_RANGE)
            if "memory_mib" in raw
            else DEFAULT_MEMORY_MIB,
            pids=doc.integer(raw["pids"], "limits.pids", PIDS_RANGE) if "pids" in raw else DEFAULT_PIDS,
            workspace_mib=doc.integer(raw["workspace_mib"], "limits.workspace_mib", WORKSPACE_MIB_RANGE)
            if "workspace_mib" in raw
            else DEFAULT_WORKSPACE_MIB,
            state_mib=doc.integer(raw["state_mib"], "limits.state_mib", TMPFS_MIB_RANGE)
            if "state_mib" in raw
            else DEFAULT_STATE_MIB,
            tmp_mib=doc.integer(raw["tmp_mib"], "limits.tmp_mib", TMPFS_MIB_RANGE)
            if "tmp_mib" in raw
            else DEFAULT_TMP_MIB,
            cpus=doc.decimal(raw["cpus"], "limits.cpus", CPUS_RANGE) if "cpus" in raw else None,
            best_effort=doc.boolean(raw["best_effort"], "limits.best_effort") if "best_effort" in raw else False,
        )
    security = Security()
    if "security" in top:
        raw_security = doc.mapping(top["security"], "security", (), ("allow_ptrace",))
        if "allow_ptrace" in raw_security:
            security = Security(allow_ptrace=doc.boolean(raw_security["allow_ptrace"], "security.allow_ptrace"))
    lifetime = Lifetime()
    if "lifetime" in top:
        raw_lifetime = doc.mapping(top["lifetime"], "lifetime", (), ("idle_seconds", "max_seconds"))
        lifetime = Lifetime(
            idle_seconds=doc.integer(raw_lifetime["idle_seconds"], "lifetime.idle_seconds", IDLE_SECONDS_RANGE)
            if "idle_seconds" in raw_lifetime
            else None,
            max_seconds=doc.integer(raw_lifetime["max_seconds"], "lifetime.max_seconds", MAX_SECONDS_RANGE)
            if "max_seconds" in raw_lifetime
            else None,
        )
    repository = doc.absolute_path(workspace["repository"], "workspace.repository")
    ref = _git_ref(doc, workspace["ref"], "workspace.ref")
    git_name, git_email = _git_user(doc, workspace.get("git"))
    caller_env, exec_env = _exec_section(doc, top.get("exec"))
    refs = (
        doc.sequence(workspace["refs"], "workspace.refs", lambda n, p: _git_ref(doc, n, p, pattern=True))
        if "refs" in workspace
        else (ref,)
    )

    # No secret is ever put into a sandbox: a credential reaches its host through a route the
    # broker's proxy adds (network.routes), so a profile that asks for one is refused, not ignored.
    if secrets:
        doc.forbid(
            setup["secrets"].mark,
            "setup.secrets",
            f"must be empty for {extension} (secrets never enter a sandbox: use network.routes)",
        )
    if doc.forbidden:
        raise doc.forbidden[0]
    return Profile(
        name=name,
        extension=extension,
        workspace=Workspace(
            repository=repository, ref=ref, git_user_name=git_name, git_user_email=git_email, refs=refs
        ),
        network_default="deny",
        egress=network.egress,
        secrets=(),
        limits=limits,
        file_sha256=digest,
        security=security,
        lifetime=lifetime,
        caller_env=caller_env,
        exec_env=exec_env,
        routes=network.routes,
        egress_limits=network.limits,
        publish=network.publish,
    )


def parse_owner_file(data: bytes, file: str, *, expected_name: str | None = None) -> OwnerFile:
    """Parse an extension config or a profile from its exact bytes; `file` names it in errors.

    `expected_name`, when given, is the name the file's path gives it, and the file must declare it.
    """
    root = parse_yaml(data, file)
    digest = hashlib.sha256(data).hexdigest()
    doc = Doc(file, expected_name)
    if isinstance(root, YMap) and "profile" in set(root.keys()):
        return _parse_profile(doc, root, digest)
    if isinstance(root, YMap) and GRANTS_NAME in set(root.keys()):
        return _parse_grants(doc, root, digest)
    return _parse_extension(doc, root, digest)


ACCOUNT_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")  # a POSIX account or group name (useradd's rule)
MAX_SANDBOXES_RANGE = (1, 1000)
MAX_TTL_RANGE = (60, 30 * 24 * 3600)
MAX_EXPORTS_MIB_RANGE = (16, 1024 * 1024)  # a caller's exports under way and kept: 16 MiB - 1 TiB


def _parse_grants(doc: Doc, root: YNode, digest: str) -> GrantsFile:
    """grants.yaml: a list of entries, each naming users and/or groups, their profiles, limits."""
    if doc.expected_name is not None and doc.expected_name != GRANTS_NAME:
        raise doc.fail(root.mark, GRANTS_NAME, f"belongs in {GRANTS_NAME}.yaml, not a {doc.expected_name} file")
    top = doc.mapping(root, "", (GRANTS_NAME,))

    def account(node: YNode, path: str) -> str:
        return doc.string(node, path, ACCOUNT_NAME, "must be an account name (a-z 0-9 _ -, at most 32)")

    def profile(node: YNode, path: str) -> str:
        return doc.string(node, path, PROFILE_NAME, "must be a profile name (a-z 0-9 _ -)")

    def entry(node: YNode, path: str) -> Grant:
        body = doc.mapping(
            node, path, ("profiles", "max_sandboxes", "max_ttl_seconds"), ("users", "groups", "max_exports_mib")
        )
        users = doc.sequence(body["users"], f"{path}.users", account) if "users" in body else ()
        groups = doc.sequence(body["groups"], f"{path}.groups", account) if "groups" in body else ()
        if not users and not groups:
            raise doc.fail(node.mark, f"{path}.users", "an entry names at least one user or group")
        profiles = doc.sequence(body["profiles"], f"{path}.profiles", profile)
        if not profiles:
            raise doc.fail(body["profiles"].mark, f"{path}.profiles", "must name at least one profile")
        return Grant(
            users=users,
            groups=groups,
            profiles=profiles,
            max_sandboxes=doc.integer(body["max_sandboxes"], f"{path}.max_sandboxes", MAX_SANDBOXES_RANGE),
            max_ttl_seconds=doc.integer(body["max_ttl_seconds"], f"{path}.max_ttl_seconds", MAX_TTL_RANGE),
            max_exports_mib=(
                doc.integer(body["max_exports_mib"], f"{path}.max_exports_mib", MAX_EXPORTS_MIB_RANGE)
                if "max_exports_mib" in body
                else None
            ),
        )

    return GrantsFile(grants=doc.sequence(top[GRANTS_NAME], GRANTS_NAME, entry), file_sha256=digest)


def validate_name(name: str) -> str:
    """Check an approval NAME and return the config-relative file it stands for."""
    if name in EXTENSIONS:
        return f"extensions/{name}.yaml"
    if name == GRANTS_NAME:
        return f"{GRANTS_NAME}.yaml"
    if PROFILE_NAME.fullmatch(name):
        return f"profiles/{name}.yaml"
    raise UsageError(
        f"{name!r} is not a configuration name: use {' or '.join(EXTENSIONS)}, {GRANTS_NAME} or a profile name"
        " (a-z 0-9 _ -)"
    )
