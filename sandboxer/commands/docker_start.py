"""Starting a sandbox's container on the Docker backend and probing it (create and the warm pool)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from sandboxer.commands.making import plan_record
from sandboxer.errors import BackendError
from sandboxer.registry import Registry

if TYPE_CHECKING:
    from sandboxer.observe import MountSeen, ProbeSeen
    from sandboxer.plan import Plan


def start_docker(plan: Plan, image: str, registry: Registry, record: dict[str, Any]) -> tuple[ProbeSeen, list[str]]:
    """Start the container, record it, and refuse it unless Docker and the container itself
    show exactly the plan; returns what its pid 1 saw (the probe and the interfaces)."""
    from sandboxer.backends.docker import container as docker_backend
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
    record.update(plan_record(staged, plan.host_uid, plan.host_gid))  # what the Engine is asked for, and shows
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


def docker_probe(container_id: str, plan: Plan) -> tuple[ProbeSeen, list[str], list[MountSeen], list[dict[str, str]]]:
    """The probe run as an exec is (inspect's view): one `cat` of what a process reads about
    itself — environment, status, cgroups, mounts, interfaces."""
    from sandboxer import dockerexec
    from sandboxer.backends.docker.render import PROBE_FILES

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
