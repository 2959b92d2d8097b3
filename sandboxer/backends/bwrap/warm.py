"""What a warm namespace is: started from a plan and verified ahead of a create (its workspace
empty), fingerprinted by its plan and syscall policy, and checked again before a create takes it.

The pool itself (which sandboxes are warm, claiming one, filling, draining) is the core's:
sandboxer.commands.warmpool. This module is the bubblewrap half it reaches through BwrapBackend.

What a take checks: the namespace still runs with the same holder that was probed when it
started, nothing but that holder runs in it (the broker refuses every exec, dispatch and inspect
of a warm sandbox, so only root going around the broker could have started anything there), and
its mount table, network and confinement still match the plan. A process that root started in it
and that has already ended leaves nothing a take could see (the pid namespace's counter of
allocated pids is readable only from inside it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from sandboxer.backends.bwrap import live as bwrap
from sandboxer.backends.bwrap.argv import HOLDER_TARGET
from sandboxer.backends.bwrap.starting import start_verified
from sandboxer.errors import BackendError
from sandboxer.host import limits, procs, seccomp_cache, workspace_volume
from sandboxer.host.observe import ProbeSeen, differences, interfaces_from_proc, read_mountinfo

_OWN_PROCESSES = ("bwrap's init", "the holder")  # all that runs in a warm namespace

if TYPE_CHECKING:
    from sandboxer.backends.protocol import Note, Site
    from sandboxer.core.plan import Plan
    from sandboxer.core.record import SandboxRecord


def fingerprint(plan: Plan, *, state_dir: str) -> str:
    """The sha256 of the plan and of the syscall policy a namespace of it starts with: a warm
    sandbox is taken only by a create that would start exactly the same one."""

    program = seccomp_cache.cached_bpf(os.path.join(state_dir, "parsed"), allow_ptrace=plan.allow_ptrace)
    document = json.dumps(dataclasses.asdict(plan), sort_keys=True, default=str)
    return hashlib.sha256(document.encode() + hashlib.sha256(program).digest()).hexdigest()


def start(plan: Plan, record: SandboxRecord, *, site: Site, note: Note) -> tuple[SandboxRecord, dict[str, Any]]:
    """Start and verify a warm namespace for `plan`, its workspace empty (a root broker's: its
    own sized filesystem, root's until a create's clone gives it to the sandbox user; an
    unprivileged broker's: the namespace's own tmpfs): its record, and what its probe and holder
    showed, for `problems` to compare when a create takes it."""

    record = replace(record, workspace_fs=workspace_volume.prepare(plan, site.directory))
    record, live, probe, interfaces = start_verified(plan, record, site=site, note=note)
    return record, {
        "probe": probe.fields(),
        "interfaces": interfaces,
        "pid": live.holder_pid,
        "started_at": str(live.holder_start),
        "since": 0,
    }


def problems(record: SandboxRecord, plan: Plan) -> list[str]:
    """Every reason the warm namespace may not become the sandbox of `plan`: the same holder,
    alone in it, and its mounts, network and confinement as the plan has them now."""

    stamp = record.warm
    if stamp is None:
        return ["it has no warm record"]
    try:
        probe = ProbeSeen.of_fields(stamp.probe)
        live = bwrap.Live.of(record.processes)
    except (KeyError, TypeError, ValueError):
        return ["its warm record has an unexpected shape"]
    except BackendError as exc:
        return [exc.message]
    if record.limits is None:
        return ["its record has no limits"]
    holder_start = procs.start_time(live.holder_pid)
    if not procs.alive(live.init_pid, record.processes.init_start if record.processes else None):
        return ["the namespace is not running"]
    if live.holder_pid != stamp.pid or str(holder_start) != stamp.started_at:
        return ["the namespace's holder was replaced after it was verified"]
    try:
        # The namespace's own /proc lists every process of its pid namespace, however started.
        inside = [name for name in os.listdir(f"/proc/{live.holder_pid}/root/proc") if name.isdigit()]
        if len(inside) != len(_OWN_PROCESSES):
            return ["something runs in the warm namespace besides its holder"]
        mounts = read_mountinfo(live.holder_pid)
        interfaces = interfaces_from_proc(live.holder_pid)
    except OSError as exc:
        return [f"the namespace cannot be observed ({exc.strerror})"]
    found = differences(plan, mounts, interfaces, probe, backend_files=(HOLDER_TARGET,))
    return found + bwrap.confinement_problems(live, limits.LimitSetup.of(record.limits))
