"""The bubblewrap backend: a sandbox is one long-lived namespace (namespace.py) started from the
plan inside its limits, verified against it, observed and stopped (BwrapBackend)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from typing import TYPE_CHECKING, Any

from sandboxer.backends.bwrap import live as bwrap_live
from sandboxer.backends.bwrap import namespace as bwrap
from sandboxer.backends.bwrap import warm
from sandboxer.backends.bwrap.argv import HOLDER_TARGET
from sandboxer.backends.bwrap.enter import BwrapExecution
from sandboxer.backends.bwrap.namespace import BWRAP_PATH
from sandboxer.backends.bwrap.netview import observe_network
from sandboxer.backends.bwrap.starting import start_verified
from sandboxer.backends.bwrap.stop import stop
from sandboxer.backends.protocol import Check, Observed
from sandboxer.core.removal import Removal
from sandboxer.errors import BackendError
from sandboxer.host import limits, netns, procs, staging, usage, workspace
from sandboxer.host.fstree import remove_tree
from sandboxer.host.inside_sockets import InsideSockets, inside_sockets
from sandboxer.host.lease_mounts import unmount_below
from sandboxer.host.observe import differences, read_mountinfo

SPOOLS = "spools"  # the sandbox directory's subdirectory of request spools

# teardown, list and gc ask only is_running, stop and release: what else a method needs (the
# namespace code, the plan, YAML through the config) is imported inside it.
if TYPE_CHECKING:
    from collections.abc import Callable

    from sandboxer.backends.protocol import Note, Site
    from sandboxer.core.config_types import ExtensionConfig
    from sandboxer.core.plan import Plan
    from sandboxer.core.record import SandboxRecord


class BwrapBackend(BwrapExecution):
    """One bubblewrap namespace per sandbox, for a root or an unprivileged broker."""

    def health(self) -> list[Check]:
        """bwrap is installed where the broker looks for it (never on PATH) and makes namespaces."""

        path = shutil.which("bwrap", path=BWRAP_PATH)
        if path is None:
            return [Check("bwrap", "fail", f"not installed (looked in {BWRAP_PATH})", "apt-get install bubblewrap")]
        try:
            done = subprocess.run(
                [path, "--unshare-all", "--ro-bind", "/", "/", "--", "/bin/true"],
                capture_output=True,
                timeout=30,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return [Check("bwrap", "fail", f"{path} cannot run ({exc})", "apt-get install --reinstall bubblewrap")]
        if done.returncode != 0:
            said = (done.stderr.decode(errors="replace").strip().splitlines() or ["no message"])[-1]
            return [Check("bwrap", "fail", f"{path} cannot make namespaces ({said[:200]})", "see user namespaces")]
        return [Check("bwrap", "ok", f"{path} makes namespaces")]

    def check_extension(self, extension: ExtensionConfig, file: str) -> None:
        """Nothing beyond the runtime pin, which approval checks for every backend."""

    def preflight(self, extension: ExtensionConfig) -> None:

        bwrap.find_bwrap()

    def admit(self, extension: ExtensionConfig, *, state_dir: str) -> None:
        """As root, the sandbox's host uid is no account's: "others" permission bits are what it
        gets of the runtime and the state dir's parent."""

        if os.geteuid() == 0:
            anyone = bwrap.HOST_ID_RANGE[0] - 1
            bwrap.check_reachable(extension.runtime.path, uid=anyone, gid=anyone, what="runtime")
            bwrap.check_reachable(os.path.dirname(state_dir), uid=anyone, gid=anyone, what="state dir")

    def host_ids(self, inside: tuple[int, int], *, known: tuple[int, int] | None = None) -> tuple[int, int]:

        return known or bwrap.allocate_host_ids()

    def workspace_in_memory(self) -> bool:
        """Only root can mount a sized filesystem on the host: an unprivileged broker's sandbox
        gets a sized tmpfs of its own instead."""
        return os.geteuid() != 0

    def start(
        self, plan: Plan, record: SandboxRecord, *, site: Site, image: str, profile_file: str, note: Note
    ) -> SandboxRecord:

        record, _, _, _ = start_verified(plan, record, site=site, note=note)
        self.fill_workspace(plan, record, profile_file=profile_file)
        return record

    def fill_workspace(self, plan: Plan, record: SandboxRecord, *, profile_file: str) -> None:
        """An unprivileged broker's clone goes into the sandbox's own tmpfs (the host keeps
        none); a root broker's is already in the sized filesystem bound at /workspace."""
        if not plan.workspace_in_memory:
            return

        live = bwrap_live.Live.of(record.processes)
        workspace.seed(
            str(plan.workspace_source),
            holder_pid=live.holder_pid,
            holder_start=live.holder_start,
            profile_file=profile_file,
            size_mib=plan.limits.workspace_mib,
        )

    def deliver(self, plan: Plan, record: SandboxRecord, data: bytes, target: str) -> None:

        live = bwrap_live.Live.of(record.processes)
        program = bwrap_live.load_seccomp(os.path.dirname(plan.workspace_source))  # the sandbox's directory
        procs_files = record.limits.procs_files if record.limits else ()
        bwrap_live.deliver(live, plan, data, target, procs_files=procs_files, seccomp=program)

    def stop(self, record: SandboxRecord, *, site: Site) -> Removal:

        stopped = stop(record)
        if not stopped.clean:
            return stopped
        # Nothing of the sandbox runs: its runtime image's mount goes.

        return stopped + staging.unstage(site.directory)

    def release(self, record: SandboxRecord) -> Removal:
        """The sandbox's cgroups (those recorded, or left by a create that died first)."""

        groups = record.limits.groups if record.limits else ()
        if not groups:
            groups = limits.leftover_groups(record.id)
        # A record is not trusted with a path: a group not of the broker's naming for this
        # sandbox is left alone and reported.
        ours = tuple(g for g in groups if limits.of_sandbox(g, record.id))
        refused = [
            f"cgroup {g}: not this sandbox's (sandboxer/{record.id}), left alone" for g in groups if g not in ours
        ]
        left = limits.remove(ours)
        return Removal.of(
            removed=[f"cgroup {g}" for g in ours if g not in left], residue=[f"cgroup {g}" for g in left] + refused
        )

    def is_running(self, record: SandboxRecord) -> bool | None:
        processes = record.processes
        if processes is None or processes.init_pid is None or processes.holder_pid is None:
            return False
        return procs.alive(processes.init_pid, processes.init_start) and procs.alive(
            processes.holder_pid, processes.holder_start
        )

    def listen_inside(self, record: SandboxRecord, address: tuple[str, int]) -> socket.socket:
        # The holder's namespace is the sandbox's; an unprivileged broker's belongs to its own
        # user namespace, which a child of ours joins (host/netns.py).
        processes = record.processes
        if processes is None or processes.holder_pid is None:
            raise BackendError("the sandbox's record names no process")
        return netns.listen_inside(processes.holder_pid, processes.holder_start, address, join_user=os.geteuid() != 0)

    def inside_sockets(self, record: SandboxRecord) -> InsideSockets:
        processes = record.processes
        if processes is None or processes.holder_pid is None:
            raise BackendError("the sandbox's record names no process")
        namespace = netns.open_namespace(processes.holder_pid, processes.holder_start)
        return inside_sockets(namespace, join_user=os.geteuid() != 0)

    def observe(self, record: SandboxRecord, *, site: Site) -> Observed:

        live = bwrap_live.Live.of(record.processes)
        if record.limits is None:
            raise BackendError("the sandbox's record has no limits")
        mounts = read_mountinfo(live.holder_pid)
        network = observe_network(live.holder_pid)
        plan = record.plan_for(site.path("workspace"))
        limit_setup = limits.LimitSetup.of(record.limits)
        probe = bwrap_live.probe(
            live,
            plan,
            procs_files=limit_setup.procs_files,
            rlimits=limit_setup.rlimits,
            seccomp=bwrap_live.load_seccomp(site.directory),
        )
        problems = differences(plan, mounts, network["interfaces"], probe, backend_files=(HOLDER_TARGET,))
        problems += bwrap_live.confinement_problems(live, limit_setup)
        if os.path.isdir(site.path(staging.RUNTIME_POINT)):  # a root broker's: its image
            problems += staging.runtime_mismatches(site.directory, mounts)
        return Observed(
            mounts=mounts,
            probe=probe,
            problems=problems,
            network=network,
            limits={"cgroups": list(probe.cgroups) if limit_setup.groups else []},
        )

    def sample(self, record: SandboxRecord) -> usage.Sample:
        live = bwrap_live.Live.of(record.processes)
        holder = live.holder_pid if procs.alive(live.holder_pid, live.holder_start) else None
        groups = record.limits.groups if record.limits is not None else ()
        if groups:
            counters = usage.cgroup_counters(groups)
        else:
            counters = usage.Counters() if holder is None else usage.process_counters(holder)
        return usage.Sample(counters=counters, source="cgroup" if groups else "processes", root_pid=holder)

    def warm_fingerprint(self, plan: Plan, *, site: Site, image: str) -> str:

        return warm.fingerprint(plan, state_dir=site.state_dir)

    def start_warm(
        self, plan: Plan, record: SandboxRecord, *, site: Site, image: str, note: Note
    ) -> tuple[SandboxRecord, dict[str, Any]]:

        return warm.start(plan, record, site=site, note=note)

    def warm_problems(self, record: SandboxRecord, plan: Plan, *, site: Site) -> list[str]:

        return warm.problems(record, plan)

    def taken_warm_problems(self, record: SandboxRecord, plan: Plan, *, site: Site) -> list[str]:
        """Nothing more: `warm_problems` ran under the create's lock just before, and the
        workspace was cloned when the sandbox was made."""
        return []

    def admits_service_images(self) -> bool:
        """No: a namespace runs the host's own files, never an image."""
        return False

    def spool_place(self, name: str, *, sandbox_dir: str) -> tuple[str, str | None]:
        """A directory below the sandbox's own `spools/`, opened below that."""
        spools = os.path.join(sandbox_dir, SPOOLS)
        return os.path.join(spools, name), spools

    def make_spool_root(self, source: str, *, sandbox_id: str, state_dir: str, group: int) -> str:
        spools = os.path.dirname(source)
        if not os.path.isdir(spools):  # bwrap walks it as the sandbox's uid and gid; nobody else
            os.mkdir(spools, 0o700)
            os.chown(spools, 0, group)
            os.chmod(spools, 0o710)  # noqa: S103 - root's, passable by the sandbox's own group only
        os.mkdir(source, 0o755)
        return source

    def spool_directory(self, name: str, *, sandbox_dir: str) -> str:
        return os.path.join(sandbox_dir, SPOOLS, name)

    def remove_spool(self, source: str, *, sandbox_id: str) -> Removal:

        if not unmount_below(source) and remove_tree(source):
            return Removal(removed=(f"spool {source}",))
        return Removal(residue=(f"spool {source}",))

    def collect_orphans(self, *, state_dir: str, present: Callable[[], set[str]]) -> dict[str, Removal]:
        """Nothing: what a namespace leaves is collected with its sandbox's directory and record."""
        return {}
