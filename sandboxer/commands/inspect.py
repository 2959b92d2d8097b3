"""`inspect`: the live sandbox observed against its plan, on either backend."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from sandboxer.commands.docker_start import docker_probe
from sandboxer.commands.teardown import is_running
from sandboxer.errors import BackendError
from sandboxer.registry import Registry, check_id

if TYPE_CHECKING:
    from sandboxer.dirs import Dirs
    from sandboxer.observe import MountSeen, ProbeSeen
    from sandboxer.plan import Plan


def inspect(dirs: Dirs, sandbox_id: str) -> dict[str, Any]:
    """Evidence observed from the live sandbox, compared with its plan."""
    from sandboxer import limits
    from sandboxer.backends.bwrap import namespace as bwrap
    from sandboxer.backends.bwrap.argv import HOLDER_TARGET
    from sandboxer.netview import observe_network
    from sandboxer.observe import differences, read_mountinfo

    registry = Registry(dirs.state)
    record = registry.read_caller(check_id(sandbox_id))
    if record.get("state") != "ready" or not is_running(record):
        raise BackendError(f"sandbox {sandbox_id} is not running (state {record.get('state')})", hint="sandboxer gc")
    if record.get("backend") == "docker":
        return _inspect_docker(dirs, record)
    holder = int(record["holder_pid"])
    mounts = read_mountinfo(holder)
    network = observe_network(holder)
    plan = plan_from_record(record, registry.path(sandbox_id, "workspace"))
    live = bwrap.Live(
        bwrap_pid=record["bwrap_pid"],
        init_pid=record["init_pid"],
        holder_pid=holder,
        pid_namespace=record["pid_namespace"],
        holder_start=record["holder_start"],
    )
    limit_record = record["limits"]
    limit_setup = limits.LimitSetup(
        mechanism=limit_record["mechanism"],
        groups=tuple(limit_record["groups"]),
        procs_files=tuple(limit_record["procs_files"]),
        rlimits=tuple((int(a), int(b)) for a, b in limit_record["rlimits"]),
    )
    probe = bwrap.probe(
        live,
        plan,
        procs_files=limit_setup.procs_files,
        rlimits=limit_setup.rlimits,
        seccomp=bwrap.load_seccomp(registry.path(sandbox_id)),
    )
    problems = differences(plan, mounts, network["interfaces"], probe, backend_files=(HOLDER_TARGET,))
    problems += bwrap.confinement_problems(live, limit_setup)
    evidence = _evidence(record, state_dir=dirs.state, mounts=mounts, probe=probe, problems=problems)
    evidence["network"] = network
    evidence["limits"]["cgroups"] = list(probe.cgroups) if limit_record["groups"] else []
    return evidence


def _evidence(
    record: dict[str, Any],
    *,
    state_dir: str,
    mounts: list[MountSeen],
    probe: ProbeSeen,
    problems: list[str],
) -> dict[str, Any]:
    """The evidence both backends report, in the contract's shape; the runtime is re-digested
    now (through the stat cache) and a changed runtime is one more difference."""
    from sandboxer.plan import RUNTIME_TARGET
    from sandboxer.runtime import digest_runtime

    runtime_mount = next((m for m in reversed(mounts) if m.target == RUNTIME_TARGET), None)
    started = time.monotonic()
    observed_digest = digest_runtime(record["runtime_path"], state_dir=state_dir).sha256
    digest_ms = round((time.monotonic() - started) * 1000, 1)
    if observed_digest != record["runtime_sha256"]:
        problems.append("runtime: its tree digest no longer matches the pin")
    return {
        "id": record["id"],
        "profile": record["profile"],
        "backend": record["backend"],
        "status": "running",
        "runtime": {
            "sha256": observed_digest,
            "pinned_sha256": record["runtime_sha256"],
            "target": RUNTIME_TARGET,
            "read_only": bool(runtime_mount and runtime_mount.read_only),
            "digest_ms": digest_ms,
        },
        "network": {},
        "mounts": [{"target": m.target, "read_only": m.read_only, "fstype": m.fstype} for m in mounts],
        "user": {"uid": probe.uid, "gid": probe.gid, "groups": list(probe.groups)},
        "capabilities": {
            "effective": f"{probe.cap_eff:016x}",
            "permitted": f"{probe.cap_prm:016x}",
            "bounding": f"{probe.cap_bnd:016x}",
            "no_new_privs": probe.no_new_privs,
        },
        # The syscall policy as the kernel reports it for a process started like an exec, and
        # the digest of the policy the broker compiled for this sandbox (docs/seccomp.md).
        "seccomp": {"mode": probe.seccomp, **(record.get("seccomp") or {})},
        "env_names": list(probe.env_names),
        "leases": _lease_evidence(record, mounts),
        "limits": {
            "mechanism": record["limits"]["mechanism"],
            "memory_mib": record["limits"]["memory_mib"],
            "pids": record["limits"]["pids"],
            # The workspace's own sized filesystem (root brokers): ENOSPC inside past this size.
            "workspace_mib": (record.get("workspace_fs") or {}).get("mib"),
            "workspace_enforced": bool((record.get("workspace_fs") or {}).get("enforced")),
        },
        "matches_plan": not problems,
        "differences": problems,
    }


def _lease_evidence(record: dict[str, Any], mounts: list[MountSeen]) -> dict[str, Any] | None:
    """The manifest's share of the evidence: run, leases, and each lease mount as it is seen."""
    assignment = record.get("manifest")
    if not isinstance(assignment, dict):
        return None
    seen = {mount.target: mount for mount in mounts}
    return {
        "run_id": assignment.get("run_id"),
        "manifest_sha256": assignment.get("sha256"),
        "leases": assignment.get("leases", []),
        "mounts": [
            {
                "lease_id": m["lease_id"],
                "target": m["target"],
                "kind": m["kind"],
                "present": m["target"] in seen,
                "read_only": bool(seen[m["target"]].read_only) if m["target"] in seen else None,
            }
            for m in assignment.get("mounts", [])
        ],
    }


def plan_from_record(record: dict[str, Any], workspace_source: str) -> Plan:
    """The plan a sandbox was made from, as its record keeps it (what verification compares)."""
    from sandboxer.config import DEFAULT_WORKSPACE_MIB, Limits
    from sandboxer.plan import Mount, MountKind, Plan

    return Plan(
        sandbox_id=record["id"],
        profile=record["profile"],
        backend=record["backend"],
        runtime_path=record["runtime_path"],
        runtime_sha256=record["runtime_sha256"],
        workspace_source=workspace_source,
        uid=record["uid"],
        gid=record["gid"],
        host_uid=record["host_uid"],
        host_gid=record["host_gid"],
        user="sandbox",
        hostname="sandbox",
        mounts=tuple(
            Mount(
                kind=MountKind(m["kind"]),
                target=m["target"],
                source=m.get("source"),
                mode=m.get("mode"),
                size_bytes=m.get("size_bytes"),
                content=b"" if m["kind"] == "file" else None,
                lease=m.get("lease"),
                beneath=m.get("beneath"),
            )
            for m in record["mounts"]
        ),
        env=tuple((k, v) for k, v in record["env"]),
        limits=Limits(
            memory_mib=record["limits"]["memory_mib"],
            pids=record["limits"]["pids"],
            workspace_mib=(record.get("workspace_fs") or {}).get("mib", DEFAULT_WORKSPACE_MIB),
        ),
        allow_ptrace=bool(record.get("allow_ptrace", False)),
    )


def _inspect_docker(dirs: Dirs, record: dict[str, Any]) -> dict[str, Any]:
    """inspect on the Docker backend: what the Engine shows and what the container itself shows."""
    from dataclasses import replace

    from sandboxer import leases, seccomp
    from sandboxer.backends.docker import container as docker_backend
    from sandboxer.backends.docker.render import short_option
    from sandboxer.observe import process_differences

    registry = Registry(dirs.state)
    sandbox_id = str(record["id"])
    container_id = str(record["container_id"])
    allow_ptrace = bool((record.get("seccomp") or {}).get("allow_ptrace"))
    plan = replace(plan_from_record(record, registry.path(sandbox_id, "workspace")), allow_ptrace=allow_ptrace)
    probe, interfaces, mounts, routes = docker_probe(container_id, plan)
    attrs = docker_backend.inspect(container_id)
    problems = docker_backend.check(container_id, plan, etc_dir=registry.path(sandbox_id, "etc"))
    problems += process_differences(plan, interfaces, probe)
    if os.path.isdir(registry.path(sandbox_id, "leases")):
        problems += leases.staged_mismatches(plan, mounts)
    problems += leases.spool_mismatches(plan, mounts)
    host = attrs.get("HostConfig") or {}
    seen = docker_backend.host_view((attrs.get("State") or {}).get("Pid"))
    evidence = _evidence(record, state_dir=dirs.state, mounts=mounts, probe=probe, problems=problems)
    evidence["network"] = {"interfaces": interfaces, "routes": routes, "mode": host.get("NetworkMode")}
    evidence["limits"]["engine"] = {"memory": host.get("Memory"), "pids": host.get("PidsLimit")}
    # The filter the container's pid 1 runs under (the kernel's Seccomp: line), and the identity
    # of the policy the Engine was given (the final inspection compares the rendered profile).
    evidence["seccomp"] = {
        "mode": seen.seccomp if seen else None,
        "sha256": seccomp.digest(allow_ptrace=allow_ptrace),
        "allow_ptrace": allow_ptrace,
    }
    evidence["docker"] = {
        "container": container_id,
        "image": record.get("image"),
        "read_only_root": host.get("ReadonlyRootfs"),
        "cap_drop": host.get("CapDrop"),
        "security_opt": [short_option(option) for option in host.get("SecurityOpt") or []],
        "user": (attrs.get("Config") or {}).get("User"),
        # The ids the container's pid 1 has on the host: the daemon's remapping of the sandbox
        # user, never an account's (docs/docker.md).
        "host_uid": seen.uid if seen else None,
        "host_gid": seen.gid if seen else None,
        "userns_mode": host.get("UsernsMode") or None,
    }
    return evidence
