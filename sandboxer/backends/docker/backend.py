"""The Docker backend: a sandbox is one container, started from the plan, probed, inspected and
removed through the Engine (DockerBackend), and its warm containers (warm.py)."""

from __future__ import annotations

import json
import os
import socket
from dataclasses import replace
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from sandboxer.backends.docker import container, engine, service_checks, warm
from sandboxer.backends.docker import container as docker_backend
from sandboxer.backends.docker import services as docker_services
from sandboxer.backends.docker.engine import SOCKET, remove_labelled
from sandboxer.backends.docker.enter import DockerExecution, container_groups
from sandboxer.backends.docker.probe import docker_probe, parse_docker_probe
from sandboxer.backends.docker.render import LABEL, STATE_LABEL, short_option
from sandboxer.backends.docker.volumes import (
    create_volume,
    orphan_volumes,
    remove_volume,
    spool_mismatches,
    volume_mountpoint,
)
from sandboxer.backends.protocol import Check, Observed
from sandboxer.core import seccomp
from sandboxer.core.plan import MountKind
from sandboxer.core.record import LimitsRecord, PlanShare, SeccompRecord
from sandboxer.core.removal import Removal
from sandboxer.errors import BackendError, UsageError
from sandboxer.host import lease_mounts, netns, procs, staging, usage
from sandboxer.host.inside_sockets import InsideSockets, ProxySockets, inside_sockets
from sandboxer.host.lease_mounts import staged_mismatches
from sandboxer.host.observe import process_differences
from sandboxer.host.staging import runtime_mismatches

# teardown, list and gc ask only is_running, stop and release: the plan and the config (YAML)
# are imported by the methods that need them.
if TYPE_CHECKING:
    from collections.abc import Callable

    from sandboxer.backends.protocol import Note, Site
    from sandboxer.core.config_types import ExtensionConfig
    from sandboxer.core.plan import Plan
    from sandboxer.core.record import SandboxRecord
    from sandboxer.host.observe import ProbeSeen


def start_docker(
    plan: Plan, record: SandboxRecord, *, image: str, site: Site, note: Note
) -> tuple[SandboxRecord, ProbeSeen, list[str]]:
    """Start the container, its record handed to `note` before the Engine is asked for it and
    again once it has an id (a crash in between leaves it findable by its labels), and refuse it
    unless Docker and the container itself show exactly the plan; returns the record and what its
    pid 1 saw (the probe and the interfaces)."""

    etc_dir = site.path("etc")
    docker_backend.require_image(image)
    staged = _staged(plan, site, record)
    leases_staged = staged is not plan
    record = replace(
        record,
        limits=LimitsRecord(
            mechanism="docker", memory_mib=plan.limits.memory_mib, pids=plan.limits.pids, cpus=plan.limits.cpus
        ),
        image=image,
        # The project's syscall policy, rendered into the container's settings (render.py); its
        # digest is computed by inspect, not here: compiling it costs more than a warm create.
        seccomp=SeccompRecord(allow_ptrace=plan.allow_ptrace),
        plan=PlanShare.of(staged),  # what the Engine is asked for, and shows
    )
    note(record)
    network = record.services.network if record.services else None
    services = record.services
    if services is not None:
        services = docker_services.start_sidecars_of(record, services, plan, state_dir=site.state_dir)
        record = replace(record, services=services)
        note(record)
        staged = docker_services.with_hosts(staged, services)
    container_id, output = docker_backend.start(
        staged, image=image, etc_dir=etc_dir, state_dir=site.state_dir, network=network
    )
    record = replace(record, container_id=container_id)
    note(record)
    problems = docker_backend.check(container_id, staged, etc_dir=etc_dir, network=network)
    probe, interfaces, mounts, _ = parse_docker_probe(output)
    problems += process_differences(plan, interfaces, probe, network=("eth0",) if network else ())

    if leases_staged:
        problems += staged_mismatches(staged, mounts)
    problems += spool_mismatches(plan, mounts)
    problems += runtime_mismatches(site.directory, mounts)
    if services is not None:
        services = docker_services.start_proxies_of(
            record, services, plan, socket_dir=site.path("publish"), state_dir=site.state_dir
        )
        record = replace(record, services=services)
        note(record)
        problems += service_checks.problems(
            services, plan, app_id=container_id, sandbox_id=record.id, state_dir=site.state_dir
        )
    if problems:
        raise BackendError("the live sandbox differs from its plan: " + "; ".join(problems))
    return record, probe, interfaces


def _staged(plan: Plan, site: Site, record: SandboxRecord) -> Plan:
    """As root, lease binds come from read-only mounts the broker makes of each source it opened
    and checked (as for bwrap): Docker resolves a bind source by path, so it is never given one
    in the run directory, which its owner could swap for a symlink after the check."""

    if not any(m.lease is not None and m.kind is MountKind.RO_BIND for m in plan.mounts):
        return plan

    owner = record.manifest.owner_uid if record.manifest else -1
    return lease_mounts.stage(plan, site.directory, owner=owner)


class DockerBackend(DockerExecution):
    """One container per sandbox, under the daemon's user-namespace remapping (docs/docker.md)."""

    def health(self) -> list[Check]:
        """Whether the Engine answers: only ext.docker profiles need it, so it is a warning."""

        if not engine.ping():
            why = "no Docker Engine answers (only ext.docker profiles need one)"
            return [Check("docker", "warn", why, "start it: systemctl start docker (or scripts/start-dockerd)")]
        return [Check("docker", "ok", "the Engine answers")]

    def check_extension(self, extension: ExtensionConfig, file: str) -> None:
        """config.image is present in the Engine (images are never pulled)."""

        image = str(extension.image)
        try:
            status, _ = engine.request("GET", f"/images/{quote(image, safe='/:@')}/json")
        except (OSError, engine.EngineError):
            raise BackendError(
                f"{file}: config.image: cannot be checked: no Docker Engine answers", hint="start it, then approve"
            ) from None
        if status == 404:
            raise UsageError(
                f"{file}: config.image: not present in the Docker Engine (images are never pulled)",
                hint="scripts/build-base-image, or docker load",
            )
        if status != 200:
            raise BackendError(f"{file}: config.image: the Engine answered HTTP {status}")

    def preflight(self, extension: ExtensionConfig) -> None:

        if os.geteuid() != 0:
            raise BackendError(
                "ext.docker: the Docker backend needs a root broker", hint="Docker access is root-equivalent"
            )

    def admit(self, extension: ExtensionConfig, *, state_dir: str) -> None:
        """Nothing more: the container reaches the runtime and state as the remapped root."""

    def host_ids(self, inside: tuple[int, int], *, known: tuple[int, int] | None = None) -> tuple[int, int]:
        """A subordinate id of the daemon's remapping, no account's (checked again on the running
        container's pid 1)."""

        ids = known or container.remap().host_ids(*inside)
        refused = container.account_problems(*ids)
        if refused:
            raise BackendError("docker: " + "; ".join(refused), hint=container.REMAP_HINT)
        return ids

    def workspace_in_memory(self) -> bool:
        return False

    def start(
        self, plan: Plan, record: SandboxRecord, *, site: Site, image: str, profile_file: str, note: Note
    ) -> SandboxRecord:
        record, _, _ = start_docker(plan, record, image=image, site=site, note=note)
        return record

    def fill_workspace(self, plan: Plan, record: SandboxRecord, *, profile_file: str) -> None:
        """Nothing: the clone is in the sized filesystem bound at /workspace."""

    def deliver(self, plan: Plan, record: SandboxRecord, data: bytes, target: str) -> None:

        container.deliver(str(record.container_id), plan, data, target)

    def stop(self, record: SandboxRecord, *, site: Site) -> Removal:
        """Its processes, then the container (found by its label when a create died before
        recording it)."""

        stopped = procs.stop_sandbox(record.id, record.processes)
        if record.services is not None:  # its service containers first: a port proxy shares its network
            stopped += docker_services.remove_containers(record.id, site.state_dir)
        container_id = record.container_id
        if not container_id:
            container_id = container.labelled(site.state_dir).get(record.id)
        if container_id:
            # The record's container id is not trusted: only a container labelled as this
            # sandbox of this state dir is removed.
            problem = remove_labelled(str(container_id), {LABEL: record.id, STATE_LABEL: site.state_dir})
            if problem is None or problem == "gone":
                stopped += Removal(removed=(f"container {str(container_id)[:12]}",))
            else:
                stopped += Removal(residue=(f"container {str(container_id)[:12]}: {problem}",))
        if record.services is not None:
            stopped += docker_services.remove_networks(record.id, site.state_dir)
        if not stopped.clean:
            return stopped
        # No container holds them now: its runtime image and /etc tmpfs go.

        return stopped + staging.unstage(site.directory)

    def release(self, record: SandboxRecord) -> Removal:
        """Nothing: a container's cgroups are the Engine's, and go with it."""
        return Removal()

    def is_running(self, record: SandboxRecord) -> bool | None:

        try:
            status, content = engine.request("GET", f"/containers/{record.container_id}/json")
        except (OSError, engine.EngineError):
            return None
        if status == 404:
            return False
        if status != 200:
            return None
        return bool((json.loads(content).get("State") or {}).get("Running"))

    def listen_inside(self, record: SandboxRecord, address: tuple[str, int]) -> socket.socket:
        # The container keeps `network none`: its namespace has loopback alone, and root joins it
        # from a thread (host/netns.py).
        pid, still_theirs = container.namespace_process(record.container_id or "")
        return netns.listen_inside(pid, procs.start_time(pid), address, join_user=False, still_theirs=still_theirs)

    def inside_sockets(self, record: SandboxRecord) -> InsideSockets:
        services = record.services
        if services is not None and services.proxies and services.proxy_sockets:
            return ProxySockets(services.proxy_sockets)  # through the port proxies (services.py)
        pid, still_theirs = container.namespace_process(record.container_id or "")
        namespace = netns.open_namespace(pid, procs.start_time(pid), still_theirs=still_theirs)
        return inside_sockets(namespace, join_user=False)

    def sample(self, record: SandboxRecord) -> usage.Sample:
        container_id = record.container_id or ""
        try:
            pid: int | None = container.namespace_process(container_id)[0]
        except BackendError:
            pid = None
        groups = container_groups(container_id, ("memory", "pids", "cpuacct", "")) if container_id else []
        return usage.Sample(counters=usage.cgroup_counters(groups), source="cgroup", root_pid=pid)

    def observe(self, record: SandboxRecord, *, site: Site) -> Observed:
        """What the Engine shows and what the container itself shows."""

        container_id = str(record.container_id)
        allow_ptrace = bool(record.seccomp and record.seccomp.allow_ptrace)
        plan = replace(record.plan_for(site.path("workspace")), allow_ptrace=allow_ptrace)
        probe, interfaces, mounts, routes = docker_probe(container_id, plan)
        attrs = container.inspect(container_id)
        services = record.services
        network = services.network if services else None
        problems = container.check(container_id, plan, etc_dir=site.path("etc"), network=network)
        problems += process_differences(plan, interfaces, probe, network=("eth0",) if network else ())
        if services is not None:
            problems += service_checks.problems(
                services, plan, app_id=container_id, sandbox_id=record.id, state_dir=site.state_dir
            )
        if os.path.isdir(site.path("leases")):
            problems += staged_mismatches(plan, mounts)
        problems += spool_mismatches(plan, mounts)
        problems += runtime_mismatches(site.directory, mounts)
        host = attrs.get("HostConfig") or {}
        seen = container.host_view((attrs.get("State") or {}).get("Pid"))
        return Observed(
            mounts=mounts,
            probe=probe,
            problems=problems,
            network={"interfaces": interfaces, "routes": routes, "mode": host.get("NetworkMode")},
            limits={
                "engine": {
                    "memory": host.get("Memory"),
                    "pids": host.get("PidsLimit"),
                    "nano_cpus": host.get("NanoCpus"),
                }
            },
            sections={
                # The filter the container's pid 1 runs under (the kernel's Seccomp: line), and
                # the identity of the policy the Engine was given (the final inspection compares
                # the rendered profile).
                "seccomp": {
                    "mode": seen.seccomp if seen else None,
                    "sha256": seccomp.digest(allow_ptrace=allow_ptrace),
                    "allow_ptrace": allow_ptrace,
                },
                "docker": {
                    "container": container_id,
                    "image": record.image,
                    "read_only_root": host.get("ReadonlyRootfs"),
                    "cap_drop": host.get("CapDrop"),
                    "security_opt": [short_option(option) for option in host.get("SecurityOpt") or []],
                    "user": (attrs.get("Config") or {}).get("User"),
                    # The ids the container's pid 1 has on the host: the daemon's remapping of
                    # the sandbox user, never an account's (docs/docker.md).
                    "host_uid": seen.uid if seen else None,
                    "host_gid": seen.gid if seen else None,
                    "userns_mode": host.get("UsernsMode") or None,
                    "services": None if services is None else service_checks.evidence(services),
                },
            },
        )

    def warm_fingerprint(self, plan: Plan, *, site: Site, image: str) -> str:

        return warm.fingerprint(plan, site=site, image=image)

    def start_warm(
        self, plan: Plan, record: SandboxRecord, *, site: Site, image: str, note: Note
    ) -> tuple[SandboxRecord, dict[str, Any]]:

        return warm.start(plan, record, site=site, image=image, note=note, start_docker=start_docker)

    def warm_problems(self, record: SandboxRecord, plan: Plan, *, site: Site) -> list[str]:

        return warm.problems(record, plan, site=site)

    def taken_warm_problems(self, record: SandboxRecord, plan: Plan, *, site: Site) -> list[str]:

        return warm.container_problems(record, plan, site=site)

    def admits_service_images(self) -> bool:
        return True

    def spool_place(self, name: str, *, sandbox_dir: str) -> tuple[str, str | None]:
        """A named volume of the Engine's (volumes.py)."""
        return name, None

    def make_spool_root(self, source: str, *, sandbox_id: str, state_dir: str, group: int) -> str:
        """The volume, created; its own directory gets the spool's tmpfs."""

        return create_volume(source, sandbox_id=sandbox_id, state_dir=state_dir)

    def spool_directory(self, name: str, *, sandbox_dir: str) -> str:

        return volume_mountpoint(name)

    def remove_spool(self, source: str, *, sandbox_id: str) -> Removal:
        """The volume, if it is still this sandbox's."""

        problem = remove_volume(source, sandbox_id=sandbox_id)
        if problem == "gone":
            return Removal()
        if problem:
            return Removal(residue=(f"spool volume {source}: {problem}",))
        return Removal(removed=(f"spool volume {source}",))

    def collect_orphans(self, *, state_dir: str, present: Callable[[], set[str]]) -> dict[str, Removal]:
        """Containers and spool volumes labelled with this state dir whose sandbox directory is
        gone. One that cannot be removed is residue of its sandbox id; when the Engine cannot
        even list them, nothing is collected this time (as when no Engine answers at all)."""

        if not os.path.exists(SOCKET):
            return {}

        collected: dict[str, Removal] = {}
        # Containers first, then directories: a create (or a warm fill) makes its directory before
        # its container, so a container whose directory is absent after this order is really an
        # orphan.
        try:
            labelled = container.labelled(state_dir)
        except Exception:  # the Engine stopped answering: like no Engine, nothing to collect
            labelled = {}
        there = present()
        for sandbox_id, container_id in labelled.items():
            if sandbox_id in there:
                continue
            try:
                residue = container.remove(container_id)
            except Exception as exc:  # residue of this sandbox, not the end of gc
                residue = [f"container {container_id[:12]}: {type(exc).__name__}: {exc}"]
            removed = () if residue else (f"container {container_id[:12]}",)
            collected[sandbox_id] = collected.get(sandbox_id, Removal()) + Removal(
                removed=removed, residue=tuple(residue)
            )
        try:
            volumes = orphan_volumes(state_dir, present)
        except Exception:  # as above
            volumes = []
        for sandbox_id, removal in docker_services.orphans(state_dir, present).items():
            collected[sandbox_id] = collected.get(sandbox_id, Removal()) + removal
        for volume, sandbox_id in volumes:
            try:
                removal = self.remove_spool(volume, sandbox_id=sandbox_id)
            except Exception as exc:  # residue of this sandbox, not the end of gc
                removal = Removal(residue=(f"spool volume {volume}: {type(exc).__name__}: {exc}",))
            if removal.removed or removal.residue:
                collected[sandbox_id] = collected.get(sandbox_id, Removal()) + removal
        return collected
