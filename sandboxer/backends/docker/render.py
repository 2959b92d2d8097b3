"""Render a plan as Docker container settings: a pure function, the Docker side of one policy.

The host's /usr, the runtime and the workspace are bind mounts exactly as under bwrap (see
docs/docker.md for why /usr comes from the host), the runtime from its image's mount and the
generated /etc files from a tmpfs, both in the sandbox's own directory (host/staging.py: no host
path in the container's mount table); the private state is tmpfs, 0700, owned by the sandbox user. The
syscall policy is the project's own (sandboxer.core.seccomp), rendered as a Docker seccomp profile.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

from sandboxer.core import seccomp
from sandboxer.core.plan import RUNTIME_TARGET, STATE_ROOT, MountKind, Plan
from sandboxer.core.record import APP_SERVICE
from sandboxer.host.staging import RUNTIME_POINT

LABEL = "io.sandboxer.sandbox"
STATE_LABEL = "io.sandboxer.state-dir"  # gc of one broker never touches another broker's containers
# What a process in the container reads about itself: the create-time proof (and inspect's).
PROBE_FILES = ("/proc/self/environ", "/proc/self/status", "/proc/self/cgroup", "/proc/self/mountinfo", "/proc/net/dev")
PROBE_END = b"sandboxer-probe-end"


def holder(plan: Plan) -> list[str]:
    """pid 1 of the container. Under the plan's environment alone it first runs the probe (its
    output, then the PROBE_END line, on stdout: the broker reads it through an attachment made
    before start, which saves an exec), then sleeps and, in `wait`, reaps whatever execs leave
    behind. As pid 1 the shell ignores TERM from inside. (Docker's own init would be
    bind-mounted at /sbin/docker-init, inside the host's read-only /usr.)"""
    # The state dirs are made in the one state tmpfs (0700, the sandbox user's), so all five share
    # its size, as under bwrap: Docker itself can only mount a tmpfs of its own at each.
    state_dirs = " ".join(m.target for m in plan.mounts if m.kind is MountKind.DIR and m.target.startswith(STATE_ROOT))
    script = f"mkdir -m 700 -- {state_dirs} || exit 1; " if state_dirs else ""
    script += f"unset PWD; cat {' '.join(PROBE_FILES)}; echo; echo {PROBE_END.decode()}; exec >/dev/null 2>&1; "
    script += "while :; do sleep 3600 & wait $!; done"
    return ["/usr/bin/env", "-i", *(f"{name}={value}" for name, value in plan.env), "/bin/sh", "-c", script]


@dataclass(frozen=True, slots=True, kw_only=True)
class BindSpec:
    """One bind mount the container must have, exactly once."""

    source: str
    target: str
    read_only: bool


def binds(plan: Plan, *, etc_dir: str) -> list[BindSpec]:
    """Every bind mount of the container, generated /etc files included. `etc_dir` is in the
    sandbox's directory, where its runtime image is mounted too (host/staging.py)."""
    specs: list[BindSpec] = []
    for mount in plan.mounts:
        if mount.target == RUNTIME_TARGET:
            source = os.path.join(os.path.dirname(etc_dir), RUNTIME_POINT)
            specs.append(BindSpec(source=source, target=mount.target, read_only=True))
        elif mount.kind in (MountKind.RO_BIND, MountKind.BIND):
            specs.append(BindSpec(source=str(mount.source), target=mount.target, read_only=mount.read_only))
        elif mount.kind is MountKind.FILE:
            source = os.path.join(etc_dir, os.path.basename(mount.target))
            specs.append(BindSpec(source=source, target=mount.target, read_only=True))
    return specs


def volumes(plan: Plan) -> list[tuple[str, str]]:
    """(target, volume name) of each request spool: the only named volumes a container has."""
    return [(m.target, str(m.source)) for m in plan.mounts if m.kind is MountKind.SPOOL]


def tmpfs(plan: Plan) -> dict[str, str]:
    """The plan's tmpfs mounts, each sized, owned by the sandbox user: the state root (0700; pid 1
    makes the state dirs in it: `holder`), /tmp and /var/tmp (1777). `exec` is explicit: Docker
    mounts a tmpfs `noexec` unless told, and bwrap's are not (the writable workspace executes
    anyway, so `noexec` here would only make the backends differ: a venv in /tmp, a test binary)."""
    mounts: dict[str, str] = {}
    for mount in plan.mounts:
        if mount.kind is MountKind.TMPFS:
            size = mount.size_bytes
            options = f"rw,exec,nosuid,nodev,size={size},mode={mount.mode or 0o700:o},uid={plan.uid},gid={plan.gid}"
            mounts[mount.target] = options
    return mounts


def security_options(*, allow_ptrace: bool) -> list[str]:
    """`no-new-privileges` and the project's syscall policy as a seccomp profile: exactly these,
    never `unconfined` and never Docker's default profile."""

    return ["no-new-privileges:true", f"seccomp={seccomp.docker_profile_json(allow_ptrace=allow_ptrace)}"]


def short_option(option: object) -> object:
    """A security option as `inspect` shows it: a seccomp profile by the sha256 of its JSON text."""

    if isinstance(option, str) and option.startswith(("seccomp=", "seccomp:")):
        return f"seccomp=sha256:{hashlib.sha256(option[len('seccomp=') :].encode()).hexdigest()}"
    return option


def create_body(plan: Plan, *, image: str, etc_dir: str, state_dir: str, network: str | None = None) -> dict[str, Any]:
    """The Engine API's `POST /containers/create` body for this plan; `network`: the sandbox's
    internal network of service containers (backends/docker/services.py), which it joins as
    APP_SERVICE, else none at all."""
    memory = plan.limits.memory_mib * 1024 * 1024
    mounts: list[dict[str, Any]] = [
        {"Type": "bind", "Source": b.source, "Target": b.target, "ReadOnly": b.read_only}
        for b in binds(plan, etc_dir=etc_dir)
    ]
    mounts += [
        {"Type": "volume", "Source": name, "Target": target, "ReadOnly": False, "VolumeOptions": {"NoCopy": True}}
        for target, name in volumes(plan)
    ]
    body: dict[str, Any] = {
        "Image": image,
        "Cmd": holder(plan),
        "User": f"{plan.uid}:{plan.gid}",
        "Hostname": plan.hostname,
        "WorkingDir": "/workspace",
        "Env": [f"{name}={value}" for name, value in plan.env],
        "Labels": {LABEL: plan.sandbox_id, STATE_LABEL: state_dir, "io.sandboxer.profile": plan.profile},
        "AttachStdin": False,
        "AttachStdout": False,
        "AttachStderr": False,
        "OpenStdin": False,
        "Tty": False,
        "HostConfig": {
            "NetworkMode": network or "none",
            "ReadonlyRootfs": True,
            "CapDrop": ["ALL"],
            "SecurityOpt": security_options(allow_ptrace=plan.allow_ptrace),
            "Privileged": False,
            "PidsLimit": plan.limits.pids,
            "Memory": memory,
            "MemorySwap": memory,
            "NanoCpus": nano_cpus(plan.limits.cpus),
            "Tmpfs": tmpfs(plan),
            "IpcMode": "private",
            "CgroupnsMode": "private",
            "Mounts": mounts,
        },
    }
    if network:
        body["NetworkingConfig"] = {"EndpointsConfig": {network: {"Aliases": [APP_SERVICE]}}}
    return body


def verify(attrs: dict[str, Any], plan: Plan, *, etc_dir: str, network: str | None = None) -> list[str]:
    """Compare Docker's inspect output with the plan (on `network`, as create_body renders it);
    empty when they match."""
    planned = Hardening(
        user=f"{plan.uid}:{plan.gid}",
        network=network or "none",
        pids=plan.limits.pids,
        memory_mib=plan.limits.memory_mib,
        nano_cpus=nano_cpus(plan.limits.cpus),
        allow_ptrace=plan.allow_ptrace,
    )
    return hardening_problems(attrs, planned) + _mount_problems(attrs, plan, etc_dir=etc_dir)


@dataclass(frozen=True, slots=True, kw_only=True)
class Hardening:
    """What every container of a sandbox is held to (its own and its service containers)."""

    user: str
    network: str  # its NetworkMode
    pids: int
    memory_mib: int
    nano_cpus: int  # the CPU quota (limits.cpus) in billionths of a core; 0: none
    allow_ptrace: bool


def nano_cpus(cpus: float | None) -> int:
    """limits.cpus as the Engine's NanoCpus (0: no quota)."""
    return 0 if cpus is None else round(cpus * 1_000_000_000)


def hardening_problems(attrs: dict[str, Any], planned: Hardening) -> list[str]:
    """How a container's inspect document departs from `planned`: read-only root, no
    capabilities, exactly the project's security options, private namespaces, the planned user,
    network and limits, no devices."""
    problems: list[str] = []
    host = attrs.get("HostConfig") or {}
    config = attrs.get("Config") or {}
    if not host.get("ReadonlyRootfs"):
        problems.append("root filesystem is writable")
    if host.get("NetworkMode") != planned.network:
        problems.append(f"network mode is {host.get('NetworkMode')}, planned {planned.network}")
    if host.get("Privileged"):
        problems.append("privileged")
    if sorted(host.get("CapDrop") or []) != ["ALL"] or host.get("CapAdd"):
        problems.append("capabilities are not all dropped")
    problems += _mode_problems(host, allow_ptrace=planned.allow_ptrace)
    if config.get("User") != planned.user:
        problems.append(f"user is {config.get('User')!r}, planned {planned.user}")
    if host.get("Devices"):
        problems.append("devices are passed in")
    if host.get("PidsLimit") != planned.pids or host.get("Memory") != planned.memory_mib * 1024 * 1024:
        problems.append("pids or memory limit differs from the plan")
    if (host.get("NanoCpus") or 0) != planned.nano_cpus:
        problems.append("CPU quota differs from the plan")
    return problems


def _same_security(seen: list[Any], *, allow_ptrace: bool) -> bool:
    """Whether the Engine's SecurityOpt is exactly what `security_options` renders: the same
    options, the seccomp profile the same JSON document (the Engine keeps it as it was sent)."""
    wanted = security_options(allow_ptrace=allow_ptrace)
    if len(seen) != len(wanted) or not all(isinstance(opt, str) for opt in seen):
        return False
    if seen[0].replace("=", ":", 1) != wanted[0]:
        return False
    if not seen[1].startswith(("seccomp=", "seccomp:")):
        return False
    try:
        return bool(json.loads(seen[1][len("seccomp=") :]) == json.loads(wanted[1][len("seccomp=") :]))
    except ValueError:
        return False


def _mode_problems(host: dict[str, Any], *, allow_ptrace: bool) -> list[str]:
    problems: list[str] = []
    # Exactly what we render: any other option (another seccomp profile, Docker's default, label=disable,
    # apparmor=...) is a change of policy, whatever it says.
    if not _same_security(list(host.get("SecurityOpt") or []), allow_ptrace=allow_ptrace):
        problems.append("security options differ from the plan (no-new-privileges and the project's seccomp profile)")
    expected_modes = {"PidMode": "", "IpcMode": "private", "UTSMode": "", "CgroupnsMode": "private", "UsernsMode": ""}
    for key, value in expected_modes.items():
        if (host.get(key) or "") != value:
            problems.append(f"{key} is {host.get(key)!r}, planned {value!r}")
    for key in ("DeviceCgroupRules", "DeviceRequests", "Sysctls", "Ulimits"):
        if host.get(key):
            problems.append(f"{key} is set")
    if not host.get("MaskedPaths") or not host.get("ReadonlyPaths"):
        problems.append("Docker's masked or read-only /proc paths were removed")
    if host.get("MemorySwap") != host.get("Memory"):
        problems.append("swap beyond the memory limit is allowed")
    if host.get("Runtime") not in (None, "runc"):
        problems.append(f"runtime is {host.get('Runtime')!r}, planned runc")
    return problems


def _volume_problems(mounts: list[dict[str, Any]], plan: Plan) -> list[str]:
    """Each spool volume exactly once, writable, by name (the Engine-private Source path of a
    volume is never compared); no other volume."""
    problems: list[str] = []
    planned = volumes(plan)
    seen = [(m.get("Destination"), m.get("Name")) for m in mounts if m.get("Type") == "volume"]
    for mount in mounts:
        if mount.get("Type") == "volume" and (
            (mount.get("Destination"), mount.get("Name")) not in planned or not mount.get("RW")
        ):
            problems.append(f"mount {mount.get('Destination')}: a volume not in the plan, or read-only")
    for target, name in planned:
        if seen.count((target, name)) != 1:
            problems.append(
                f"mount {target}: spool volume {name} planned once, present {seen.count((target, name))} times"
            )
    return problems


def _mount_problems(attrs: dict[str, Any], plan: Plan, *, etc_dir: str) -> list[str]:
    problems: list[str] = []
    mounts = attrs.get("Mounts") or []
    expected = {(b.target, b.source, b.read_only) for b in binds(plan, etc_dir=etc_dir)}
    seen = [(m.get("Destination"), m.get("Source"), not m.get("RW", True)) for m in mounts if m.get("Type") == "bind"]
    problems += _volume_problems(mounts, plan)
    for mount in mounts:
        if mount.get("Type") not in ("bind", "volume"):
            problems.append(f"mount {mount.get('Destination')}: a {mount.get('Type')} not in the plan")
        elif mount.get("Propagation") not in ("", "rprivate", None) and mount.get("Type") == "bind":
            problems.append(f"mount {mount.get('Destination')}: propagation {mount.get('Propagation')}")
        if "docker.sock" in str(mount.get("Source")):
            problems.append("the Docker socket is mounted")
    for entry in seen:
        if entry not in expected:
            problems.append(f"mount {entry[0]}: not in the plan (or not with the planned source and mode)")
    targets = [target for target, _, _ in seen]
    for target, _, _ in expected:
        if targets.count(target) != 1:
            problems.append(f"mount {target}: planned once, present {targets.count(target)} times")
    if ((attrs.get("HostConfig") or {}).get("Tmpfs") or {}) != tmpfs(plan):
        problems.append("tmpfs mounts or their options differ from the plan")
    return problems
