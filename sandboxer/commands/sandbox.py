"""Caller commands: create, inspect, list, teardown, gc (exec lives in sandboxer.fastexec)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sandboxer import procs, workspace
from sandboxer.errors import BackendError, NotFoundError, PolicyError, ResidueError, SandboxerError
from sandboxer.registry import HIDDEN_STATES, Registry, check_id

# teardown, list and gc run often and need little; what only create and inspect use is
# imported inside them, so a teardown does not pay for YAML, netlink or the plan checker.
if TYPE_CHECKING:
    from sandboxer import limits
    from sandboxer.approvals import Ledger
    from sandboxer.backends import bwrap
    from sandboxer.bootstrap import Bootstrap
    from sandboxer.config import ExtensionConfig, Profile
    from sandboxer.dirs import Dirs
    from sandboxer.leases import Assignment
    from sandboxer.observe import MountSeen, ProbeSeen
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
    from sandboxer.backends import bwrap
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


def create(
    dirs: Dirs, profile_name: str, *, manifest_path: str | None = None, bootstrap_path: str | None = None
) -> dict[str, Any]:
    """Create a sandbox from an approved profile (a lease manifest, a runtime bootstrap);
    nothing is left behind if any step fails."""
    from sandboxer.plan import WORKSPACE_TARGET

    request = CreateRequest(dirs, profile_name, manifest_path, bootstrap_path)
    registry = Registry(dirs.state)
    warm_count, taken = 0, None
    if request.backend == "docker":
        from sandboxer.commands import warm

        warm_count = warm.wanted(request)
        taken = warm.claim(request, registry) if warm_count else None
    if taken is None:
        sandbox_id, lock = registry.allocate()
        record: dict[str, Any] = {}
    else:
        sandbox_id, lock, record, plan = taken
    record.update(
        {
            "id": sandbox_id,
            "profile": request.profile.name,
            "backend": request.backend,
            "state": "creating",
            "created_at": now_text(),
            "owner_pid": os.getpid(),
            "owner_start": procs.start_time(os.getpid()),
            "warm_profile": bool(warm_count),  # its teardown tops the profile's warm containers up
        }
    )
    try:
        registry.write(sandbox_id, record)
        if taken is None:
            _make(request, registry, record)
        else:
            warm.finish(request, registry, record, plan)
        record["state"] = "ready"
        registry.write(sandbox_id, record)
    except BaseException as exc:
        record["state"] = "failed"
        with contextlib.suppress(OSError, SandboxerError):
            registry.write(sandbox_id, record)
        _, residue = destroy(registry, sandbox_id, record)
        if residue and isinstance(exc, SandboxerError):
            exc.message += f" (and cleanup left residue: {'; '.join(residue)})"
        raise
    finally:
        os.close(lock)
    if warm_count and taken is None:
        # None was warm (the first create of the profile, or a burst took them all): fill now.
        # A taken one is replaced when its sandbox is torn down, not while the caller uses it.
        warm.spawn_fill(dirs, request.profile.name)
    result = {
        "id": sandbox_id,
        "profile": request.profile.name,
        "backend": record["backend"],
        "runtime_sha256": request.extension.runtime.sha256,
        "workspace": WORKSPACE_TARGET,
        "limits": record["limits"]["mechanism"],
    }
    if request.assignment is not None:
        manifest = request.assignment.manifest
        result["manifest"] = {"run_id": manifest.run_id, "leases": len(manifest.leases)}
    if "bootstrap" in record:
        result["bootstrap"] = record["bootstrap"]
    return result


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


def _make(request: CreateRequest, registry: Registry, record: dict[str, Any]) -> None:
    """Plan, clone, spools, start and verify, deliver: the body of a create."""
    from sandboxer.backends import bwrap

    sandbox_id = str(record["id"])
    assignment = request.assignment
    plan = plan_for(request, registry, sandbox_id)
    from sandboxer import workspace_volume

    if plan.workspace_in_memory:
        record["workspace_fs"] = {"mib": plan.limits.workspace_mib, "enforced": True, "kind": "tmpfs"}
    else:
        bounded = workspace_volume.make(registry.path(sandbox_id), size_mib=plan.limits.workspace_mib)
        record["workspace_fs"] = {"mib": plan.limits.workspace_mib, "enforced": bounded, "kind": "ext4"}
    clone_workspace(request, plan)
    if assignment is not None:
        host_uid, host_gid = bwrap.host_ids(plan)
        record["manifest"] = assignment.record(plan)
        registry.write(sandbox_id, record)
        assignment.make_spools(plan, request.state_dir, consumer=(host_uid, host_gid))
    if plan.backend == "docker":
        start_docker(plan, request.image, registry, record)
    else:
        _start_bwrap(plan, registry, record)
    if plan.workspace_in_memory:
        workspace.seed(
            str(plan.workspace_source),
            holder_pid=int(record["holder_pid"]),
            holder_start=record.get("holder_start"),
            profile_file=request.profile_file,
            size_mib=plan.limits.workspace_mib,
        )
    deliver_requested(request, plan, record)


def plan_for(
    request: CreateRequest, registry: Registry, sandbox_id: str, *, docker_ids: tuple[int, int] | None = None
) -> Plan:
    """The plan of the sandbox `sandbox_id` for this request. `docker_ids`: the host ids of a
    container that already runs (a warm one's, checked on its pid 1 before it is taken), which
    spares asking the daemon for its remapping again."""
    from sandboxer.backends import bwrap
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
        from sandboxer.backends import docker as docker_backend

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
    from sandboxer.backends import bwrap

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


def _start_bwrap(plan: Plan, registry: Registry, record: dict[str, Any]) -> None:
    """Set up the limits, start the namespace inside them, record it, and refuse it unless it is
    the plan."""
    import hashlib

    from sandboxer import limits, seccomp
    from sandboxer.backends import bwrap
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
    record.update(_plan_record(plan, plan.host_uid, plan.host_gid))
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
        from sandboxer.backends import docker as docker_backend

        docker_backend.deliver(str(record["container_id"]), plan, data, TARGET)
        return
    from sandboxer.backends import bwrap

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


def start_docker(plan: Plan, image: str, registry: Registry, record: dict[str, Any]) -> tuple[ProbeSeen, list[str]]:
    """Start the container, record it, and refuse it unless Docker and the container itself
    show exactly the plan; returns what its pid 1 saw (the probe and the interfaces)."""
    from sandboxer.backends import docker as docker_backend
    from sandboxer.observe import process_differences

    sandbox_id = plan.sandbox_id
    etc_dir = registry.path(sandbox_id, "etc")
    record["limits"] = {
        "mechanism": "docker",
        "groups": [],
        "procs_files": [],
        "rlimits": [],
        "memory_mib": plan.limits.memory_mib,
        "pids": plan.limits.pids,
    }
    record["image"] = image
    # The project's syscall policy, rendered into the container's settings (docker_render); its
    # digest is computed by inspect, not here: compiling it costs more than a warm create.
    record["seccomp"] = {"allow_ptrace": plan.allow_ptrace}
    staged = _staged(plan, registry, record)
    record.update(_plan_record(staged, plan.host_uid, plan.host_gid))  # what the Engine is asked for, and shows
    registry.write(sandbox_id, record)
    container_id, output = docker_backend.start(staged, image=image, etc_dir=etc_dir, state_dir=registry.state_dir)
    record["container_id"] = container_id
    registry.write(sandbox_id, record)
    problems = docker_backend.check(container_id, staged, etc_dir=etc_dir)
    probe, interfaces, mounts, _ = _parse_docker_probe(output)
    problems += process_differences(plan, interfaces, probe)
    from sandboxer import leases

    if staged is not plan:
        problems += leases.staged_mismatches(staged, mounts)
    problems += leases.spool_mismatches(plan, mounts)
    if problems:
        raise BackendError("the live sandbox differs from its plan: " + "; ".join(problems))
    return probe, interfaces


def _staged(plan: Plan, registry: Registry, record: dict[str, Any]) -> Plan:
    """As root, lease binds come from read-only mounts the broker makes of each source it opened
    and checked (as for bwrap): Docker resolves a bind source by path, so it is never given one
    in the run directory, which its owner could swap for a symlink after the check."""
    from sandboxer.plan import MountKind

    if not any(m.lease is not None and m.kind is MountKind.RO_BIND for m in plan.mounts):
        return plan
    from sandboxer import leases

    return leases.stage(plan, registry.path(plan.sandbox_id), owner=int(record["manifest"]["owner_uid"]))


def _docker_probe(container_id: str, plan: Plan) -> tuple[ProbeSeen, list[str], list[MountSeen], list[dict[str, str]]]:
    """The probe run as an exec is (inspect's view): one `cat` of what a process reads about
    itself — environment, status, cgroups, mounts, interfaces."""
    from sandboxer import dockerexec
    from sandboxer.backends.docker_render import PROBE_FILES

    try:
        data = dockerexec.capture(
            container_id, ["cat", *PROBE_FILES], env=dict(plan.env), user=f"{plan.uid}:{plan.gid}"
        )
    except (OSError, dockerexec.EngineError) as exc:
        raise BackendError(f"docker: the probe failed ({exc})") from None
    return _parse_docker_probe(data)


def _parse_docker_probe(data: bytes) -> tuple[ProbeSeen, list[str], list[MountSeen], list[dict[str, str]]]:
    """The probe's output, its parts told apart by their fixed shapes."""
    from sandboxer.observe import parse_mountinfo, parse_probe

    split = data.find(b"\0Name:\t")
    if split < 0:
        raise BackendError("docker: the probe's output has an unexpected shape")
    environ, text = data[: split + 1], data[split + 1 :].decode(errors="replace")
    head, _, netdev = text.partition("Inter-|")
    status_lines, cgroup_lines, mount_lines = [], [], []
    for line in head.splitlines():
        if re.match(r"^[A-Za-z_]+:\s", line):
            status_lines.append(line)
        elif re.match(r"^\d+:[^:]*:/", line):
            cgroup_lines.append(line)
        elif line.strip():
            mount_lines.append(line)
    probe = parse_probe("\n".join(status_lines), environ, "\n".join(cgroup_lines))
    netdev, _, route_text = netdev.partition("Iface\t")
    interfaces = sorted(line.split(":", 1)[0].strip() for line in netdev.splitlines()[2:] if ":" in line)
    routes = []
    for line in route_text.splitlines()[1:]:
        fields = line.split()
        if len(fields) == 10 and len(fields[0]) == 32:  # /proc/net/ipv6_route
            routes.append({"family": "inet6", "dst": f"{fields[0]}/{int(fields[1], 16)}", "dev": fields[9]})
        elif len(fields) >= 8:  # /proc/net/route: Iface Destination Gateway … Mask
            routes.append({"family": "inet", "dst": fields[1], "dev": fields[0]})
    return probe, interfaces, parse_mountinfo("\n".join(mount_lines)), routes


def _verify(plan: Plan, live: bwrap.Live, limit_setup: limits.LimitSetup, program: bytes) -> None:
    """Refuse to hand out a sandbox whose observed state differs from its plan (exit 5)."""
    from sandboxer.backends import bwrap
    from sandboxer.backends.bwrap_argv import HOLDER_TARGET
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


def _plan_record(plan: Plan, host_uid: int, host_gid: int) -> dict[str, Any]:
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


def destroy(registry: Registry, sandbox_id: str, record: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Remove everything a sandbox owns: processes, cgroups, clone, directory. (removed, residue)."""
    from sandboxer.backends.stop import stop

    record = {**record, "id": sandbox_id}
    # A create killed mid-clone: git died with it, a helper of git may still write below.
    stray = workspace.stop_git(registry.path(sandbox_id, workspace.GIT_HOME))
    removed, residue = stop(record)
    residue += [f"host git process {pid}" for pid in stray]
    if record.get("backend") == "docker":
        container_id = record.get("container_id")
        if not container_id:  # a create that died before recording it: find it by its label
            from sandboxer.backends import docker as docker_backend

            container_id = docker_backend.labelled(registry.state_dir).get(sandbox_id)
        if container_id:
            from sandboxer.dockerexec import remove_container  # no SDK, no plan code: teardown stays lean

            problem = remove_container(str(container_id))
            if problem is None or problem == "gone":
                removed.append(f"container {str(container_id)[:12]}")
            else:
                residue.append(f"container {str(container_id)[:12]}: {problem}")
    still_running = list(residue)  # processes that survived, a container the Engine kept
    if os.path.isdir(registry.path(sandbox_id, "leases")):  # no process or container uses them now
        from sandboxer import leases

        leases.unstage(registry.path(sandbox_id))  # what stays mounted is residue, found below
    if isinstance(record.get("bootstrap"), dict) and not residue:
        removed.append(f"bootstrap file {record['bootstrap'].get('target')} (with the sandbox's private state)")
    if isinstance(record.get("manifest"), dict):
        from sandboxer import leases

        # The assignment's own files go only once the sandbox had consumed it (it was ready).
        lease_removed, lease_residue = leases.remove(
            record["manifest"],
            backend=str(record.get("backend")),
            sandbox_id=sandbox_id,
            materializations=record.get("state") == "ready" or bool(record.get("consumed")),
        )
        removed.extend(lease_removed)
        residue.extend(lease_residue)
    if record.get("backend") != "docker":  # Docker's cgroups are the Engine's
        from sandboxer import limits

        groups = tuple(record.get("limits", {}).get("groups", ()))
        if not groups:
            groups = limits.leftover_groups(sandbox_id)
        left = limits.remove(groups)
        removed.extend(f"cgroup {g}" for g in groups if g not in left)
        residue.extend(f"cgroup {g}" for g in left)
    if not still_running:  # no process or container can hold the workspace filesystem now
        from sandboxer import workspace_volume

        fs_removed, fs_residue = workspace_volume.unmount(registry.path(sandbox_id))
        removed.extend(fs_removed)
        residue.extend(fs_residue)
    more_removed, more_residue = _remove_directory(registry.path(sandbox_id))
    return removed + more_removed, residue + more_residue


def _remove_directory(directory: str) -> tuple[list[str], list[str]]:
    """The sandbox's own directory: its clone, replay ledger and the rest, unless something is
    still mounted below it (then all of it is residue)."""
    removed: list[str] = []
    mounted = _host_mounts_below(directory)
    residue = [f"mount {m}" for m in mounted]
    clone_dir = os.path.join(directory, "workspace")
    if os.path.lexists(clone_dir):
        if workspace.remove_tree(clone_dir):
            removed.append(f"workspace {clone_dir}")
        else:
            residue.append(f"workspace {clone_dir}")
    ledger = os.path.join(directory, "ledger")
    if os.path.isdir(ledger) and not mounted and workspace.remove_tree(ledger):
        removed.append(f"replay ledger {ledger}")
    if not mounted and workspace.remove_tree(directory):
        removed.append(f"sandbox dir {directory}")
    elif os.path.lexists(directory):
        residue.append(f"sandbox dir {directory}")
    return removed, residue


def _host_mounts_below(directory: str) -> list[str]:
    from sandboxer.fsutil import mount_points

    return [point for point in mount_points() if point == directory or point.startswith(directory + "/")]


def teardown(dirs: Dirs, sandbox_id: str) -> dict[str, Any]:
    """Tear a sandbox down and return the receipt; ResidueError (6) carries it if anything is left."""
    registry = Registry(dirs.state)
    check_id(sandbox_id)
    lock = registry.lock(sandbox_id)
    if lock is None:
        raise BackendError(f"sandbox {sandbox_id}: its lock could not be taken")
    try:
        record = registry.read_or_none(sandbox_id) or {"id": sandbox_id}
        if record.get("state") in HIDDEN_STATES:
            raise NotFoundError(f"no such sandbox: {sandbox_id}")
        if "state" in record:
            if record["state"] == "ready":
                record["consumed"] = True  # the assignment was used: its materializations go too
            record["state"] = "tearing-down"
            with contextlib.suppress(OSError, SandboxerError):
                registry.write(sandbox_id, record)
        removed, residue = destroy(registry, sandbox_id, record)
    finally:
        os.close(lock)
    if record.get("warm_profile") and isinstance(record.get("profile"), str):
        from sandboxer.commands.warm import spawn_fill

        spawn_fill(dirs, record["profile"])
    return {"id": sandbox_id, "removed": removed, "residue": residue}


def receipt_or_raise(receipt: dict[str, Any]) -> dict[str, Any]:
    """A receipt with residue is exit status 6."""
    if receipt["residue"]:
        raise ResidueError(f"teardown of {receipt['id']} left residue: {'; '.join(receipt['residue'])}")
    return receipt


def _running(record: dict[str, Any]) -> bool | None:
    """Whether the sandbox's processes run; None when that cannot be known (Engine silent)."""
    if record.get("backend") == "docker":
        from sandboxer import dockerexec

        try:
            status, content = dockerexec.engine_request("GET", f"/containers/{record.get('container_id')}/json")
        except (OSError, dockerexec.EngineError):
            return None
        if status == 404:
            return False
        if status != 200:
            return None
        return bool((json.loads(content).get("State") or {}).get("Running"))
    return all(
        isinstance(record.get(f"{key}_pid"), int) and procs.alive(record[f"{key}_pid"], record.get(f"{key}_start"))
        for key in ("init", "holder")
    )


def list_sandboxes(dirs: Dirs) -> dict[str, Any]:
    """Every sandbox in the registry with its state."""
    registry = Registry(dirs.state)
    entries = []
    for sandbox_id in registry.ids():
        record = registry.read_or_none(sandbox_id)
        if record is None:
            entries.append(
                {"id": sandbox_id, "profile": None, "backend": None, "status": "unknown", "created_at": None}
            )
            continue
        status = record.get("state", "unknown")
        if status in HIDDEN_STATES:
            continue
        if status == "ready":
            running = _running(record)
            status = "unknown" if running is None else "running" if running else "dead"
        entries.append(
            {
                "id": sandbox_id,
                "profile": record.get("profile"),
                "backend": record.get("backend"),
                "status": status,
                "created_at": record.get("created_at"),
            }
        )
    return {"sandboxes": entries}


def gc(dirs: Dirs) -> dict[str, Any]:
    """Finish what crashed creates and teardowns left; never touch a healthy or busy sandbox.

    Each sandbox is collected on its own: whatever goes wrong with one (a tree it made hostile, a
    broken record) is that sandbox's residue in its receipt, and the others are still collected.
    """
    registry = Registry(dirs.state)
    collected, healthy, busy, warm = [], [], [], []
    collected += _collect_orphan_containers(registry)
    for sandbox_id in registry.ids():
        try:
            lock = registry.try_lock_for_gc(sandbox_id)
            if lock is None:
                busy.append(sandbox_id)
                continue
            try:
                record = registry.read_or_none(sandbox_id)
                state = record.get("state") if record is not None else None
                running = _running(record) if record is not None and state in ("ready", "warm") else False
                if running is None:  # the Engine does not answer: never destroy what may be healthy
                    busy.append(sandbox_id)
                    continue
                if running and state == "warm":
                    from sandboxer.commands.warm import is_current

                    if is_current(dirs, record or {}):
                        warm.append(sandbox_id)
                        continue
                elif running:
                    healthy.append(sandbox_id)
                    continue
                removed, residue = destroy(registry, sandbox_id, record or {"id": sandbox_id})
                collected.append({"id": sandbox_id, "removed": removed, "residue": residue})
            finally:
                os.close(lock)
        except Exception as exc:  # one sandbox's failure is its own residue, never gc's end
            problem = " ".join(f"{type(exc).__name__}: {exc}".split())
            collected.append({"id": sandbox_id, "removed": [], "residue": [f"gc failed ({problem})"]})
    return {"collected": collected, "healthy": healthy, "busy": busy, "warm": warm}


def _collect_orphan_containers(registry: Registry) -> list[dict[str, Any]]:
    """Containers labelled with this state dir whose sandbox directory is gone (found by label).

    A container or volume that cannot be removed is residue of its sandbox id; when the Engine
    cannot even list them, nothing is collected this time (as when no Engine answers at all).
    """
    import importlib.util

    if importlib.util.find_spec("docker") is None or not os.path.exists("/var/run/docker.sock"):
        return []
    from sandboxer.backends import docker as docker_backend

    receipts: list[dict[str, Any]] = []
    # Containers first, then directories: a create (or a warm fill) makes its directory before its
    # container, so a container whose directory is absent after this order is really an orphan.
    try:
        labelled = docker_backend.labelled(registry.state_dir)
    except Exception:  # the Engine stopped answering: like no Engine, nothing to collect
        labelled = {}
    present = set(registry.ids())
    for sandbox_id, container_id in labelled.items():
        if sandbox_id in present:
            continue
        try:
            residue = docker_backend.remove(container_id)
        except Exception as exc:  # residue of this sandbox, not the end of gc
            residue = [f"container {container_id[:12]}: {type(exc).__name__}: {exc}"]
        removed = [] if residue else [f"container {container_id[:12]}"]
        receipts.append({"id": sandbox_id, "removed": removed, "residue": residue})
    from sandboxer import leases

    try:
        volumes = leases.orphan_volumes(registry.state_dir, lambda: set(registry.ids()))
    except Exception:  # as above
        volumes = []
    for volume, sandbox_id in volumes:
        item = f"spool volume {volume}"
        try:
            problem = leases.remove_volume(volume, sandbox_id=sandbox_id)
        except Exception as exc:  # residue of this sandbox, not the end of gc
            problem = f"{type(exc).__name__}: {exc}"
        if problem != "gone":
            receipts.append(
                {
                    "id": sandbox_id,
                    "removed": [] if problem else [item],
                    "residue": [f"{item}: {problem}"] if problem else [],
                }
            )
    return receipts


def inspect(dirs: Dirs, sandbox_id: str) -> dict[str, Any]:
    """Evidence observed from the live sandbox, compared with its plan."""
    from sandboxer import limits
    from sandboxer.backends import bwrap
    from sandboxer.backends.bwrap_argv import HOLDER_TARGET
    from sandboxer.netview import observe_network
    from sandboxer.observe import differences, read_mountinfo

    registry = Registry(dirs.state)
    record = registry.read_caller(check_id(sandbox_id))
    if record.get("state") != "ready" or not _running(record):
        raise BackendError(f"sandbox {sandbox_id} is not running (state {record.get('state')})", hint="sandboxer gc")
    if record.get("backend") == "docker":
        return _inspect_docker(dirs, record)
    holder = int(record["holder_pid"])
    mounts = read_mountinfo(holder)
    network = observe_network(holder)
    plan = _plan_from_record(record, registry.path(sandbox_id, "workspace"))
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


def _plan_from_record(record: dict[str, Any], workspace_source: str) -> Plan:
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
    from sandboxer.backends import docker as docker_backend
    from sandboxer.backends.docker_render import short_option
    from sandboxer.observe import process_differences

    registry = Registry(dirs.state)
    sandbox_id = str(record["id"])
    container_id = str(record["container_id"])
    allow_ptrace = bool((record.get("seccomp") or {}).get("allow_ptrace"))
    plan = replace(_plan_from_record(record, registry.path(sandbox_id, "workspace")), allow_ptrace=allow_ptrace)
    probe, interfaces, mounts, routes = _docker_probe(container_id, plan)
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
