"""Making a sandbox: admitting a create request, its plan, the clone, starting and verifying it on
bwrap, delivering its bootstrap. Shared by create and the warm pool."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sandboxer import workspace
from sandboxer.errors import BackendError, PolicyError
from sandboxer.registry import Registry

if TYPE_CHECKING:
    from sandboxer import limits
    from sandboxer.approvals import Ledger
    from sandboxer.backends.bwrap import namespace as bwrap
    from sandboxer.bootstrap import Bootstrap
    from sandboxer.config import ExtensionConfig, Profile
    from sandboxer.dirs import Dirs
    from sandboxer.leases import Assignment
    from sandboxer.plan import Grants, Plan

HOST_LINKS_CANDIDATES = (("/bin", "usr/bin"), ("/lib", "usr/lib"), ("/lib64", "usr/lib64"), ("/sbin", "usr/sbin"))
HOST_ETC_CANDIDATES = ("/etc/ssl/certs", "/etc/ca-certificates", "/etc/ld.so.cache", "/etc/localtime")


def _host_layout() -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    links = tuple((target, link) for target, link in HOST_LINKS_CANDIDATES if os.path.isdir(f"/{link}"))
    etc = tuple(path for path in HOST_ETC_CANDIDATES if os.path.exists(path))
    return links, etc


def _require_approved(ledger: Ledger, name: str, file_sha256: str) -> None:
    from sandboxer.approvals import Status

    status = ledger.status(name, file_sha256)
    if status is Status.UNAPPROVED:
        raise PolicyError(f"{name} is not approved", hint=f"sandboxer ext approve {name}")
    if status is Status.CHANGED:
        raise PolicyError(f"{name} changed since it was approved", hint=f"review it, then sandboxer ext approve {name}")


def now_text() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _admit(dirs: Dirs, profile_name: str) -> tuple[str, Profile, ExtensionConfig]:
    """Every check before anything is made: approvals, backend, runtime pin, reachability."""
    from sandboxer.approvals import Ledger
    from sandboxer.backends.bwrap import namespace as bwrap
    from sandboxer.configdir import load_extension, load_profile
    from sandboxer.runtime import verify_pin

    Registry(dirs.state).ensure()  # the state dir first, with its own mode, before any cache in it
    cache_dir = os.path.join(dirs.state, "parsed")
    raw, profile = load_profile(dirs.config, profile_name, cache_dir=cache_dir)
    ledger = Ledger(dirs.config)
    _require_approved(ledger, profile.name, profile.file_sha256)
    _, extension = load_extension(dirs.config, profile.extension, cache_dir=cache_dir)
    _require_approved(ledger, extension.extension, extension.file_sha256)
    if extension.extension == "ext.docker":
        if os.geteuid() != 0:
            raise BackendError(
                "ext.docker: the Docker backend needs a root broker", hint="Docker access is root-equivalent"
            )
    else:
        bwrap.find_bwrap()
    verify_pin(
        extension.runtime,
        state_dir=dirs.state,
        others={
            "config dir": dirs.config,
            "state dir": dirs.state,
            "workspace repository": profile.workspace.repository,
        },
    )
    if os.geteuid() == 0 and extension.extension == "ext.bwrap":
        # The sandbox's host uid is no account's: "others" permission bits are what it gets.
        anyone = bwrap.HOST_ID_RANGE[0] - 1
        bwrap.check_reachable(extension.runtime.path, uid=anyone, gid=anyone, what="runtime")
        bwrap.check_reachable(os.path.dirname(dirs.state), uid=anyone, gid=anyone, what="state dir")
    return raw.path, profile, extension


class CreateRequest:
    """Everything a create checks before anything is made: the approved profile and extension,
    the lease manifest and the runtime bootstrap."""

    def __init__(self, dirs: Dirs, profile_name: str, manifest_path: str | None, bootstrap_path: str | None) -> None:
        self.state_dir = dirs.state
        self.profile_file, self.profile, self.extension = _admit(dirs, profile_name)
        self.backend = "bwrap" if self.extension.extension == "ext.bwrap" else "docker"
        repository = self.profile.workspace.repository
        self.assignment = _admit_manifest(dirs, manifest_path, backend=self.backend, repository=repository)
        self.delivery = _admit_bootstrap(bootstrap_path, self.assignment)
        image = self.assignment.image if self.assignment is not None else None
        self.image = image or str(self.extension.image)


def plan_for(
    request: CreateRequest, registry: Registry, sandbox_id: str, *, docker_ids: tuple[int, int] | None = None
) -> Plan:
    """The plan of the sandbox `sandbox_id` for this request. `docker_ids`: the host ids of a
    container that already runs (a warm one's, checked on its pid 1 before it is taken), which
    spares asking the daemon for its remapping again."""
    from sandboxer.backends.bwrap import namespace as bwrap
    from sandboxer.plan import SANDBOX_GID, SANDBOX_UID, build_plan

    assignment, delivery = request.assignment, request.delivery
    links, etc = _host_layout()
    grants = None if assignment is None else assignment.grants(request.backend, registry.path(sandbox_id))
    if delivery is not None and delivery[0].suspend_control:
        grants = _with_suspend_dir(grants)
    if request.backend == "bwrap":
        ids = bwrap.allocate_host_ids()
    else:
        # The daemon remaps user namespaces: the container's user is a subordinate host id of the
        # daemon's remapping, no account's (checked again on the running container's pid 1).
        from sandboxer.backends.docker import container as docker_backend

        inside = (grants.uid or SANDBOX_UID, grants.gid or SANDBOX_GID) if grants else (SANDBOX_UID, SANDBOX_GID)
        ids = docker_ids or docker_backend.remap().host_ids(*inside)
        refused = docker_backend.account_problems(*ids)
        if refused:
            raise BackendError("docker: " + "; ".join(refused), hint=docker_backend.REMAP_HINT)
    return build_plan(
        sandbox_id=sandbox_id,
        profile=request.profile,
        extension=request.extension,
        workspace_source=registry.path(sandbox_id, "workspace"),
        # Only root can mount a sized filesystem on the host: an unprivileged broker's bwrap
        # sandbox gets a sized tmpfs of its own instead.
        workspace_in_memory=request.backend == "bwrap" and os.geteuid() != 0,
        host_ids=ids,
        host_links=links,
        host_etc=etc,
        grants=grants,
    )


def clone_workspace(request: CreateRequest, plan: Plan) -> None:
    """The workspace: the profile's repository (or the manifest's revision) cloned for this plan."""
    from sandboxer.backends.bwrap import namespace as bwrap

    assignment = request.assignment
    host_uid, host_gid = bwrap.host_ids(plan)
    workspace.clone(
        repository=request.profile.workspace.repository,
        ref=assignment.revision if assignment else request.profile.workspace.ref,
        destination=str(plan.workspace_source),
        git_home=Registry(request.state_dir).path(plan.sandbox_id, workspace.GIT_HOME),  # gc finds what it leaves
        profile_file=assignment.file if assignment else request.profile_file,
        owner=(host_uid, host_gid) if os.geteuid() == 0 else None,
        branch=assignment.branch if assignment else None,
        ref_field="repository.revision" if assignment else "workspace.ref",
    )


def deliver_requested(request: CreateRequest, plan: Plan, record: dict[str, Any]) -> None:
    """Deliver the runtime bootstrap of the request, if it has one, into the started sandbox."""
    if request.delivery is not None:
        from sandboxer.bootstrap import TARGET

        _deliver_bootstrap(plan, record, request.delivery[1])
        record["bootstrap"] = {"target": TARGET, "suspend_control": request.delivery[0].suspend_control}


def start_bwrap(plan: Plan, registry: Registry, record: dict[str, Any]) -> None:
    """Set up the limits, start the namespace inside them, record it, and refuse it unless it is
    the plan."""
    import hashlib

    from sandboxer import limits, seccomp
    from sandboxer.backends.bwrap import namespace as bwrap
    from sandboxer.plan import MountKind

    limit_setup = limits.setup(plan.sandbox_id, plan.limits)
    record["limits"] = {**limit_setup.as_record(), "memory_mib": plan.limits.memory_mib, "pids": plan.limits.pids}
    program = seccomp.cached_bpf(os.path.join(registry.state_dir, "parsed"), allow_ptrace=plan.allow_ptrace)
    bwrap.save_seccomp(registry.path(plan.sandbox_id), program)
    record["seccomp"] = {"sha256": hashlib.sha256(program).hexdigest(), "allow_ptrace": plan.allow_ptrace}
    started = plan
    if os.geteuid() == 0 and any(m.lease is not None and m.kind is MountKind.RO_BIND for m in plan.mounts):
        from sandboxer import leases

        started = leases.stage(plan, registry.path(plan.sandbox_id), owner=int(record["manifest"]["owner_uid"]))
    live = bwrap.start(started, seccomp_program=program, limit_setup=limit_setup)
    record.update(live.as_record())
    record.update(plan_record(plan, plan.host_uid, plan.host_gid))
    registry.write(plan.sandbox_id, record)
    _verify(plan, live, limit_setup, program)


def _admit_bootstrap(path: str | None, assignment: Assignment | None) -> tuple[Bootstrap, bytes] | None:
    """The runtime bootstrap of a create, read once and checked before anything is made."""
    if path is None:
        return None
    from sandboxer import bootstrap

    document, data = bootstrap.load(path)
    file = os.path.abspath(path)
    if document.workspace != bootstrap.PUBLIC_WORKSPACE:
        raise PolicyError(f"{file}: workspace: must be {bootstrap.PUBLIC_WORKSPACE}, where the sandbox serves it")
    if assignment is not None:
        from sandboxer import manifest

        for lease in assignment.manifest.leases:
            if lease.scope in (manifest.PROVIDER_ENVIRONMENT, manifest.PROVIDER_CREDENTIAL):
                raise PolicyError(
                    f"{file}: the bootstrap is the launch's only credential source, and the manifest's "
                    f"{lease.field} ({lease.scope}) is another"
                )
    return document, data


def _with_suspend_dir(grants: Grants | None) -> Grants:
    """The grants plus the suspend control's directory (0700, the sandbox user's)."""
    from dataclasses import replace

    from sandboxer.bootstrap import SUSPEND_DIR
    from sandboxer.plan import Grants, Mount, MountKind

    base = grants or Grants()
    return replace(base, mounts=(*base.mounts, Mount(kind=MountKind.DIR, target=SUSPEND_DIR, mode=0o700)))


def _deliver_bootstrap(plan: Plan, record: dict[str, Any], data: bytes) -> None:
    """Write the bootstrap into the sandbox user's home before anything else runs there."""
    from sandboxer.bootstrap import TARGET

    if plan.backend == "docker":
        from sandboxer.backends.docker import container as docker_backend

        docker_backend.deliver(str(record["container_id"]), plan, data, TARGET)
        return
    from sandboxer.backends.bwrap import namespace as bwrap

    live = bwrap.Live(
        bwrap_pid=record["bwrap_pid"],
        init_pid=record["init_pid"],
        holder_pid=record["holder_pid"],
        pid_namespace=record["pid_namespace"],
        holder_start=record["holder_start"],
    )
    program = bwrap.load_seccomp(os.path.dirname(plan.workspace_source))  # the sandbox's directory
    bwrap.deliver(live, plan, data, TARGET, procs_files=tuple(record["limits"]["procs_files"]), seccomp=program)


def _admit_manifest(dirs: Dirs, path: str | None, *, backend: str, repository: str) -> Assignment | None:
    """The lease manifest of a create, fully checked before anything is made (or None)."""
    if path is None:
        return None
    from sandboxer import leases

    assignment = leases.admit_assignment(
        os.path.abspath(path), forbidden=(dirs.config, dirs.state), backend=backend, repository=repository
    )
    registry = Registry(dirs.state)
    for other in registry.ids():  # a run is one sandbox: its spools, ledger and materializations are one
        record = registry.read_or_none(other)
        held = record.get("manifest") if record else None
        if isinstance(held, dict) and held.get("run_id") == assignment.manifest.run_id:
            raise PolicyError(f"{assignment.file}: run_id: run {held.get('run_id')} already has sandbox {other}")
    return assignment


def _verify(plan: Plan, live: bwrap.Live, limit_setup: limits.LimitSetup, program: bytes) -> None:
    """Refuse to hand out a sandbox whose observed state differs from its plan (exit 5)."""
    from sandboxer.backends.bwrap import namespace as bwrap
    from sandboxer.backends.bwrap.argv import HOLDER_TARGET
    from sandboxer.observe import differences, interfaces_from_proc, read_mountinfo

    observed = bwrap.probe(
        live, plan, procs_files=limit_setup.procs_files, rlimits=limit_setup.rlimits, seccomp=program
    )
    mounts = read_mountinfo(live.holder_pid)
    problems = differences(
        plan, mounts, interfaces_from_proc(live.holder_pid), observed, backend_files=(HOLDER_TARGET,)
    )
    problems += bwrap.confinement_problems(live, limit_setup)
    if limit_setup.groups and not any(plan.sandbox_id in line for line in observed.cgroups):
        problems.append("limits: the probe is not in the sandbox's cgroup")
    if problems:
        raise BackendError("the live sandbox differs from its plan: " + "; ".join(problems))


def plan_record(plan: Plan, host_uid: int, host_gid: int) -> dict[str, Any]:
    return {
        "uid": plan.uid,
        "gid": plan.gid,
        "host_uid": host_uid,
        "host_gid": host_gid,
        "env": [list(pair) for pair in plan.env],
        "runtime_path": plan.runtime_path,
        "runtime_sha256": plan.runtime_sha256,
        "allow_ptrace": plan.allow_ptrace,
        "mounts": [
            {
                "target": m.target,
                "kind": m.kind.value,
                "source": m.source,
                "read_only": m.read_only,
                "mode": m.mode,
                "size_bytes": m.size_bytes,
                "lease": m.lease,
                "beneath": m.beneath,
            }
            for m in plan.mounts
        ],
    }
