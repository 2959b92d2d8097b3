"""What the sandbox's container shows of itself: the probe its pid 1 prints at start (read through
an attachment) and the same files read by an exec for inspect, told apart by their fixed shapes."""

from __future__ import annotations

import re

from sandboxer.backends.docker import engine, execs
from sandboxer.backends.docker.render import PROBE_FILES
from sandboxer.core.plan import Plan
from sandboxer.errors import BackendError
from sandboxer.host.observe import MountSeen, ProbeSeen, parse_mountinfo, parse_probe


def docker_probe(container_id: str, plan: Plan) -> tuple[ProbeSeen, list[str], list[MountSeen], list[dict[str, str]]]:
    """The probe run as an exec is (inspect's view): one `cat` of what a process reads about
    itself — environment, status, cgroups, mounts, interfaces."""

    try:
        data = execs.capture(container_id, ["cat", *PROBE_FILES], env=dict(plan.env), user=f"{plan.uid}:{plan.gid}")
    except (OSError, engine.EngineError) as exc:
        raise BackendError(f"docker: the probe failed ({exc})") from None
    return parse_docker_probe(data)


def parse_docker_probe(data: bytes) -> tuple[ProbeSeen, list[str], list[MountSeen], list[dict[str, str]]]:
    """The probe's output, its parts told apart by their fixed shapes."""

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
