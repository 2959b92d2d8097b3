"""`inspect`: the live sandbox observed against its plan, on either backend."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from sandboxer.api.results import Evidence
from sandboxer.commands.logs import counts, has_egress
from sandboxer.commands.services import Services
from sandboxer.commands.sites import site_of
from sandboxer.commands.usage import usage
from sandboxer.core.plan import MIB, RUNTIME_TARGET, STATE_ROOT, TMP_TARGETS, MountKind
from sandboxer.errors import BackendError, not_running
from sandboxer.host.digest_cache import digest_runtime
from sandboxer.host.interfaces import own_listeners
from sandboxer.host.registry import Registry, check_id

if TYPE_CHECKING:
    from sandboxer.core.plan import Mount
    from sandboxer.core.record import SandboxRecord
    from sandboxer.dirs import Dirs
    from sandboxer.host.observe import MountSeen, ProbeSeen


def inspect(dirs: Dirs, sandbox_id: str, *, services: Services) -> Evidence:
    """Evidence observed from the live sandbox, compared with its plan."""

    registry = Registry(dirs.state)
    record = registry.read_caller(check_id(sandbox_id))
    backend = services.backends.backend(record.backend)
    gone = f"tear it down: sandboxer teardown {sandbox_id}"  # its caller may (gc is the owners')
    if record.state != "ready":
        raise BackendError(not_running(sandbox_id, record.state), hint=gone)
    if not backend.is_running(record):
        raise BackendError(not_running(sandbox_id))
    if record.plan is None or record.limits is None:
        raise BackendError(f"sandbox {sandbox_id}: its record has no plan", hint=gone)
    seen = backend.observe(record, site=site_of(registry, record.id))
    evidence = _evidence(record, state_dir=dirs.state, mounts=seen.mounts, probe=seen.probe, problems=seen.problems)
    evidence["network"] = seen.network
    if has_egress(record):  # the proxy that is its only way out, and what it decided so far
        proxy = services.egress.status(sandbox_id) or "down (this process serves no egress: sandboxer serve does)"
        evidence["network"] = {**seen.network, "egress": {"proxy": proxy, **counts(dirs, sandbox_id)}}
    published = () if record.manifest is None else record.manifest.published
    if published:  # each mapping as the service forwards it, and the listener the host shows
        served = services.publish.status(sandbox_id) or [
            {"host": f"127.0.0.1:{host}", "runtime": runtime, "forwarder": "down (sandboxer serve forwards them)"}
            for host, runtime in published
        ]
        listening = own_listeners()
        evidence["network"] = {
            **evidence["network"],
            "published": [{**item, "listening": item["host"] in listening} for item in served],
        }
    evidence["limits"].update(seen.limits)
    evidence["usage"] = usage(dirs, sandbox_id, backends=services.backends).to_json()
    evidence.update(seen.sections)
    return Evidence.from_json(evidence)


def _evidence(
    record: SandboxRecord,
    *,
    state_dir: str,
    mounts: list[MountSeen],
    probe: ProbeSeen,
    problems: list[str],
) -> dict[str, Any]:
    """The evidence both backends report, in the contract's shape; the runtime is re-digested
    now (through the stat cache) and a changed runtime is one more difference."""

    if record.plan is None or record.limits is None:
        raise BackendError(f"sandbox {record.id}: its record has no plan")
    runtime_mount = next((m for m in reversed(mounts) if m.target == RUNTIME_TARGET), None)
    started = time.monotonic()
    observed_digest = digest_runtime(record.plan.runtime_path, state_dir=state_dir).sha256
    digest_ms = round((time.monotonic() - started) * 1000, 1)
    if observed_digest != record.plan.runtime_sha256:
        problems.append("runtime: its tree digest no longer matches the pin")
    policy: dict[str, Any] = {"mode": probe.seccomp}
    if record.seccomp is not None:
        if record.seccomp.sha256 is not None:
            policy["sha256"] = record.seccomp.sha256
        policy["allow_ptrace"] = record.seccomp.allow_ptrace
    workspace_fs = record.workspace_fs
    return {
        "id": record.id,
        "profile": record.profile,
        "backend": record.backend,
        "status": "running",
        "runtime": {
            "sha256": observed_digest,
            "pinned_sha256": record.plan.runtime_sha256,
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
        "seccomp": policy,
        "env_names": list(probe.env_names),
        "leases": _lease_evidence(record, mounts),
        "limits": {
            "mechanism": record.limits.mechanism,
            "memory_mib": record.limits.memory_mib,
            "pids": record.limits.pids,
            "cpus": record.limits.cpus,  # the CPU quota in cores (None: none)
            # The workspace's own sized filesystem (root brokers): ENOSPC inside past this size.
            "workspace_mib": workspace_fs.mib if workspace_fs else None,
            "workspace_enforced": bool(workspace_fs and workspace_fs.enforced),
            # The private tmpfs mounts' sizes as planned (the comparison checks the live ones).
            "state_mib": _tmpfs_mib(record.plan.mounts, STATE_ROOT),
            "tmp_mib": _tmpfs_mib(record.plan.mounts, TMP_TARGETS[0]),
        },
        "matches_plan": not problems,
        "differences": problems,
    }


def _lease_evidence(record: SandboxRecord, mounts: list[MountSeen]) -> dict[str, Any] | None:
    """The manifest's share of the evidence: run, leases, and each lease mount as it is seen."""
    assignment = record.manifest
    if assignment is None:
        return None
    seen = {mount.target: mount for mount in mounts}
    return {
        "run_id": assignment.run_id,
        "manifest_sha256": assignment.sha256,
        "leases": [
            {
                "lease_id": lease.lease_id,
                "scope": lease.scope,
                "consumer": lease.consumer,
                "expires_at": lease.expires_at,
            }
            for lease in assignment.leases
        ],
        "mounts": [
            {
                "lease_id": m.lease_id,
                "target": m.target,
                "kind": m.kind,
                "present": m.target in seen,
                "read_only": bool(seen[m.target].read_only) if m.target in seen else None,
            }
            for m in assignment.mounts
        ],
    }


def _tmpfs_mib(mounts: tuple[Mount, ...], target: str) -> int | None:
    """The planned size of the tmpfs at `target`, in MiB (None: no such tmpfs in this plan)."""

    sizes = [m.size_bytes for m in mounts if m.target == target and m.kind is MountKind.TMPFS]
    return sizes[0] // MIB if sizes and sizes[0] is not None else None
