"""The plan: a pure, frozen description of one sandbox that every backend renders.

Built from an approved profile, its extension config and the request; it names every mount,
every environment variable, the user, the network and the limits. Nothing outside the plan is
visible inside a sandbox, and after start the broker checks the live sandbox against it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Literal

from sandboxer.core.egress.inside import TRUST_BUNDLE, proxy_env, trust_env

RUNTIME_TARGET = "/opt/sandboxer/runtime"
WORKSPACE_TARGET = "/workspace"
STATE_ROOT = "/run/sandboxer/state"
SANDBOX_UID = 1000
SANDBOX_GID = 1000
SANDBOX_USER = "sandbox"
HOSTNAME = "sandbox"
SAFE_PATH = f"{RUNTIME_TARGET}/bin:/usr/local/bin:/usr/bin:/bin"
# Inside the sandbox: each a private tmpfs of limits.tmp_mib, mode 1777, gone at teardown.
TMP_TARGETS = ("/tmp", "/var/tmp")  # noqa: S108
MIB = 1024 * 1024

# Environment variable → directory below STATE_ROOT.
STATE_DIRS: tuple[tuple[str, str], ...] = (
    ("HOME", "home"),
    ("XDG_CONFIG_HOME", "config"),
    ("XDG_CACHE_HOME", "cache"),
    ("XDG_STATE_HOME", "data"),
    ("TMPDIR", "tmp"),
)

if TYPE_CHECKING:  # the owner's types, for annotations: the record (teardown, gc) imports this module
    from sandboxer.core.config_types import ExtensionConfig, ExtensionName, Limits, Profile

Backend = Literal["bwrap", "docker"]
BACKEND_OF: dict[ExtensionName, Backend] = {"ext.bwrap": "bwrap", "ext.docker": "docker"}  # an extension's engine


class MountKind(StrEnum):
    """What a mount entry makes at its target."""

    RO_BIND = "ro-bind"  # a host path, read-only
    BIND = "bind"  # a host path, writable
    TMPFS = "tmpfs"  # a private, size-capped tmpfs
    PROC = "proc"
    DEV = "dev"  # a minimal /dev (null, zero, full, random, urandom, tty, shm, pts)
    DIR = "dir"  # a directory inside a tmpfs
    SYMLINK = "symlink"
    FILE = "file"  # generated content, read-only
    SPOOL = "spool"  # a lease's request spool, writable: a host directory (bwrap) or a named volume (Docker)


@dataclass(frozen=True, slots=True, kw_only=True)
class Mount:
    """One entry of the sandbox's filesystem, in the order it is made."""

    kind: MountKind
    target: str
    source: str | None = None  # host path (binds) or link target (symlinks)
    mode: int | None = None
    size_bytes: int | None = None
    content: bytes | None = None  # FILE only
    lease: str | None = None  # the manifest lease that grants this mount
    beneath: str | None = None  # open `source` below this directory without following symlinks

    @property
    def read_only(self) -> bool:
        """Whether the sandbox user may not write here."""
        return self.kind in (MountKind.RO_BIND, MountKind.FILE)


@dataclass(frozen=True, slots=True, kw_only=True)
class Grants:
    """What a lease manifest adds to a sandbox: its user (a version 3 workspace consumer), lease
    mounts, and project variables for every exec."""

    uid: int | None = None
    gid: int | None = None
    mounts: tuple[Mount, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """Everything one sandbox is."""

    sandbox_id: str
    profile: str
    backend: Backend
    runtime_path: str
    runtime_sha256: str
    workspace_source: str
    uid: int
    gid: int
    host_uid: int  # who the sandbox user is on the host: never root, and (as root) no account's uid
    host_gid: int
    user: str
    hostname: str
    mounts: tuple[Mount, ...]
    env: tuple[tuple[str, str], ...]
    limits: Limits
    # loopback: `lo` and nothing else; proxy: the same, with the broker's proxy listening on it
    # (core/egress/inside.py) and the proxy variables set
    network: Literal["loopback", "proxy"] = "loopback"
    routes: tuple[str, ...] = ()  # the credential routes the proxy adds (the profile's network.routes)
    allow_ptrace: bool = False  # the profile's security.allow_ptrace: the syscall policy's one switch
    caller_env: tuple[str, ...] = ()  # the profile's exec.caller_env: names exec --env may set

    @property
    def egress(self) -> bool:
        """Whether the broker's proxy is the sandbox's way out (the service must start one)."""
        return self.network == "proxy"

    def mount_at(self, target: str) -> Mount:
        """The mount entry at `target`."""
        for mount in self.mounts:
            if mount.target == target:
                return mount
        raise KeyError(target)

    @property
    def workspace_in_memory(self) -> bool:
        """Whether /workspace is a sized tmpfs of the sandbox's own (an unprivileged broker's
        bwrap sandbox), filled from the host-side clone once the sandbox runs, rather than the
        bound clone itself."""
        return self.mount_at(WORKSPACE_TARGET).kind is MountKind.TMPFS

    def exec_env(self, *, consumer: str | None) -> tuple[tuple[str, str], ...]:
        """The environment of one exec: the plan's, plus the consumer identity when given."""
        if consumer is None:
            return self.env
        return (*self.env, ("SANDBOXER_CONSUMER", consumer))


def _etc_files(uid: int, gid: int, user: str, hostname: str) -> tuple[Mount, ...]:
    home = f"{STATE_ROOT}/home"
    files = {
        "/etc/passwd": f"root:x:0:0:root:/nonexistent:/usr/sbin/nologin\n{user}:x:{uid}:{gid}:{user}:{home}:/bin/sh\n",
        "/etc/group": f"root:x:0:\n{user}:x:{gid}:\n",
        "/etc/hosts": f"127.0.0.1\tlocalhost {hostname}\n::1\tlocalhost ip6-localhost ip6-loopback\n",
        "/etc/hostname": f"{hostname}\n",
        "/etc/nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
        "/etc/resolv.conf": "# loopback only: no name servers\n",
    }
    return tuple(
        Mount(kind=MountKind.FILE, target=target, content=text.encode(), mode=0o644) for target, text in files.items()
    )


def _workspace(source: str, size_mib: int, *, in_memory: bool) -> Mount:
    if in_memory:
        return Mount(kind=MountKind.TMPFS, target=WORKSPACE_TARGET, mode=0o700, size_bytes=size_mib * 1024 * 1024)
    return Mount(kind=MountKind.BIND, target=WORKSPACE_TARGET, source=source)


def _merged(base: tuple[tuple[str, str], ...], extra: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """`base` with `extra` set on top: a name keeps its place and takes the later value."""
    merged = dict(base)
    merged.update(extra)
    return tuple(merged.items())


def base_env(*, sandbox_id: str, profile: str, user: str) -> tuple[tuple[str, str], ...]:
    """The environment built from nothing: fixed PATH, state dirs, Python switches, identity."""
    env = [("PATH", SAFE_PATH)]
    env += [(name, f"{STATE_ROOT}/{sub}") for name, sub in STATE_DIRS]
    env += [
        ("PYTHONNOUSERSITE", "1"),
        ("PYTHONDONTWRITEBYTECODE", "1"),
        ("LANG", "C.UTF-8"),
        ("USER", user),
        ("LOGNAME", user),
        ("SANDBOXER_SANDBOX_ID", sandbox_id),
        ("SANDBOXER_PROFILE", profile),
        # Offline by policy, and it says so: a program can tell why the network is missing.
        ("SANDBOXER_NETWORK", "loopback"),
    ]
    return tuple(env)


# The names the sandbox's own environment sets, with egress and routes too: never the owner's to
# set (exec.env) nor a caller's (exec.caller_env, exec --env), in any sandbox.
PLAN_ENV_NAMES = frozenset(
    name for name, _ in (*base_env(sandbox_id="", profile="", user=""), *proxy_env(), *trust_env())
)


def cpu_env(cpus: float | None) -> tuple[tuple[str, str], ...]:
    """With limits.cpus, the quota's cores rounded up as OMP_NUM_THREADS: what `nproc`, OpenMP
    and the libraries that follow it take for the count of CPUs (the kernel's own count, from
    the CPUs a process may run on, knows nothing of a quota). The owner's exec.env may set it."""
    return () if cpus is None else (("OMP_NUM_THREADS", str(math.ceil(cpus))),)


def egress_env(*, egress: bool, routes: bool) -> tuple[tuple[str, str], ...]:
    """What egress adds to the environment: the proxy variables, and the trust bundle's when the
    proxy terminates TLS for routes."""
    if not egress:
        return ()
    return (*proxy_env(), *(trust_env() if routes else ()))


def build_plan(
    *,
    sandbox_id: str,
    profile: Profile,
    extension: ExtensionConfig,
    workspace_source: str,
    host_ids: tuple[int, int] = (SANDBOX_UID, SANDBOX_GID),
    host_links: tuple[tuple[str, str], ...] = (("/bin", "usr/bin"), ("/lib", "usr/lib"), ("/sbin", "usr/sbin")),
    host_etc: tuple[str, ...] = (),
    grants: Grants | None = None,
    workspace_in_memory: bool = False,
    trust_bundle: bytes | None = None,
) -> Plan:
    """The plan of one sandbox. `host_links` and `host_etc` describe the host's /usr layout.

    With `workspace_in_memory` /workspace is a tmpfs of `limits.workspace_mib`, for a broker that
    cannot mount a sized filesystem on the host (an unprivileged one): then the clone at
    `workspace_source` is copied in once the sandbox runs, and is not bound.

    `host_links` are the top-level links into /usr (merged-/usr hosts: /bin, /lib, /lib64, /sbin);
    `host_etc` are host /etc entries bound read-only (TLS certificates, the loader cache).

    A profile with `network.egress` gets the proxy variables (docs/egress.md); one that uses
    routes also gets the trust bundle's, and `trust_bundle` (the host's CA certificates and the
    sandbox's own CA's: host/sandbox_ca.trust_bundle, never a key) as a read-only file at
    TRUST_BUNDLE: it is required then (ValueError without it).
    """
    if profile.routes and profile.egress and trust_bundle is None:
        raise ValueError("a profile with network.routes needs the sandbox's trust_bundle")
    routes = profile.routes if profile.egress else ()
    grants = grants or Grants()
    uid, gid, user = grants.uid or SANDBOX_UID, grants.gid or SANDBOX_GID, SANDBOX_USER
    mounts: list[Mount] = [
        Mount(kind=MountKind.RO_BIND, target="/usr", source="/usr"),
        *(Mount(kind=MountKind.SYMLINK, target=target, source=link) for target, link in host_links),
        Mount(kind=MountKind.PROC, target="/proc"),
        Mount(kind=MountKind.DEV, target="/dev"),
        *_etc_files(uid, gid, user, HOSTNAME),
        *(Mount(kind=MountKind.RO_BIND, target=path, source=path) for path in host_etc),
        Mount(kind=MountKind.RO_BIND, target=RUNTIME_TARGET, source=extension.runtime.path),
        _workspace(workspace_source, profile.limits.workspace_mib, in_memory=workspace_in_memory),
        Mount(kind=MountKind.TMPFS, target=STATE_ROOT, mode=0o700, size_bytes=profile.limits.state_mib * MIB),
        *(Mount(kind=MountKind.DIR, target=f"{STATE_ROOT}/{sub}", mode=0o700) for _, sub in STATE_DIRS),
        *(
            Mount(kind=MountKind.TMPFS, target=t, mode=0o1777, size_bytes=profile.limits.tmp_mib * MIB)
            for t in TMP_TARGETS
        ),
        *grants.mounts,
    ]
    if routes and trust_bundle is not None:
        mounts.append(Mount(kind=MountKind.FILE, target=TRUST_BUNDLE, content=trust_bundle, mode=0o444))
    return Plan(
        sandbox_id=sandbox_id,
        profile=profile.name,
        backend=BACKEND_OF[extension.extension],
        runtime_path=extension.runtime.path,
        runtime_sha256=extension.runtime.sha256,
        workspace_source=workspace_source,
        uid=uid,
        gid=gid,
        host_uid=host_ids[0],
        host_gid=host_ids[1],
        user=user,
        hostname=HOSTNAME,
        mounts=tuple(mounts),
        # The owner's exec.env on the environment built from nothing (it never names one of its
        # variables) and the CPU quota's count, then a manifest's project variables; egress's
        # last, so nothing redirects it.
        env=_merged(
            _merged(
                _merged(
                    base_env(sandbox_id=sandbox_id, profile=profile.name, user=user) + cpu_env(profile.limits.cpus),
                    profile.exec_env,
                ),
                grants.env,
            ),
            egress_env(egress=bool(profile.egress), routes=bool(routes)),
        ),
        limits=profile.limits,
        network="proxy" if profile.egress else "loopback",
        routes=routes,
        allow_ptrace=profile.security.allow_ptrace,
        caller_env=profile.caller_env,
    )
