"""Starting a namespace: its limits, bwrap inside them, the record, and the verification that
refuses it unless what runs is the plan. Every create's, and every warm sandbox's."""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace
from typing import TYPE_CHECKING

from sandboxer.backends.bwrap import live as bwrap
from sandboxer.backends.bwrap import namespace
from sandboxer.backends.bwrap.argv import HOLDER_TARGET
from sandboxer.core.plan import MountKind
from sandboxer.core.record import PlanShare, SeccompRecord
from sandboxer.errors import BackendError
from sandboxer.host import lease_mounts, limits, seccomp_cache, staging
from sandboxer.host.observe import differences, interfaces_from_proc, read_mountinfo
from sandboxer.host.staging import runtime_mismatches

if TYPE_CHECKING:
    from sandboxer.backends.protocol import Note, Site
    from sandboxer.core.plan import Plan
    from sandboxer.core.record import SandboxRecord
    from sandboxer.host.observe import ProbeSeen


def start_verified(
    plan: Plan, record: SandboxRecord, *, site: Site, note: Note
) -> tuple[SandboxRecord, bwrap.Live, ProbeSeen, list[str]]:
    """Set up the limits, start the namespace inside them, hand its record to `note` (before the
    verification: a crash after the start must leave its processes findable), and refuse it
    unless it is the plan: the record, the live namespace, and what its probe and network showed."""

    limit_setup = limits.setup(plan.sandbox_id, plan.limits)
    program = seccomp_cache.cached_bpf(os.path.join(site.state_dir, "parsed"), allow_ptrace=plan.allow_ptrace)
    namespace.save_seccomp(site.directory, program)
    record = replace(
        record,
        limits=limit_setup.recorded(plan.limits),
        seccomp=SeccompRecord(sha256=hashlib.sha256(program).hexdigest(), allow_ptrace=plan.allow_ptrace),
    )
    started = plan
    if os.geteuid() == 0 and any(m.lease is not None and m.kind is MountKind.RO_BIND for m in plan.mounts):
        owner = record.manifest.owner_uid if record.manifest else -1
        started = lease_mounts.stage(plan, site.directory, owner=owner)
    if os.geteuid() == 0:  # the runtime from its image: no host path in the sandbox's mount table
        point = staging.stage_runtime(plan, site.state_dir, site.directory)
        started = staging.staged_plan(started, point)
    live = namespace.start(started, seccomp_program=program, limit_setup=limit_setup)
    record = replace(record, processes=live.processes(), plan=PlanShare.of(plan))
    note(record)
    probe, interfaces = _verify(plan, live, limit_setup, program)
    return record, live, probe, interfaces


def _verify(
    plan: Plan, live: bwrap.Live, limit_setup: limits.LimitSetup, program: bytes
) -> tuple[ProbeSeen, list[str]]:
    """Refuse to hand out a sandbox whose observed state differs from its plan (exit 5); what
    its probe and network showed."""

    observed = bwrap.probe(
        live, plan, procs_files=limit_setup.procs_files, rlimits=limit_setup.rlimits, seccomp=program
    )
    mounts = read_mountinfo(live.holder_pid)
    interfaces = interfaces_from_proc(live.holder_pid)
    problems = differences(plan, mounts, interfaces, observed, backend_files=(HOLDER_TARGET,))
    problems += bwrap.confinement_problems(live, limit_setup)
    if os.geteuid() == 0:  # the runtime is its staged image (host/staging.py)
        problems += runtime_mismatches(os.path.dirname(plan.workspace_source), mounts)
    if limit_setup.groups and not any(plan.sandbox_id in line for line in observed.cgroups):
        problems.append("limits: the probe is not in the sandbox's cgroup")
    if problems:
        raise BackendError("the live sandbox differs from its plan: " + "; ".join(problems))
    return observed, interfaces
