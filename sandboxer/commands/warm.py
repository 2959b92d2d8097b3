"""The `warm` command and create's use of the warm pool (sandboxer.commands.warmpool).

`sandboxer warm PROFILE` brings a profile's warm sandboxes to its extension's `config.warm`
count; a create takes one when the profile keeps them, and its teardown (or the create that
found none) starts a fill in the background. gc asks `is_current` whether a warm one may stay.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from dataclasses import replace
from typing import TYPE_CHECKING

from sandboxer.api.results import WarmFill
from sandboxer.backends import Backends
from sandboxer.commands import warmpool
from sandboxer.commands.making import CreateRequest, clone_workspace, deliver_requested, plan_for
from sandboxer.commands.sites import site_of
from sandboxer.core.approvals import Ledger, Status
from sandboxer.core.config import PROFILE_NAME
from sandboxer.core.configdir import load_extension, load_profile
from sandboxer.errors import BackendError, SandboxerError, UsageError
from sandboxer.host import workspace
from sandboxer.host.parse_cache import ParseCache
from sandboxer.host.registry import Registry, try_lock_file

if TYPE_CHECKING:
    from concurrent.futures import Executor

    from sandboxer.core.plan import Plan
    from sandboxer.core.record import SandboxRecord
    from sandboxer.dirs import Dirs


class Fills:
    """How a process tops warm pools up in the background, on its engines (`backends`): on the
    service's fill thread (an executor it sets at its start and takes back at its stop), or,
    without one, in detached processes. One per process's `Services` (commands/services.py). Read by
    every create and teardown thread of the service while the service may be stopping: the
    executor is this object's, read and changed under its lock, and a fill that can no longer be
    handed to it (shut down meanwhile) is dropped, as a fill cut short is (gc or the next
    create's fill tops the pool up). Handing a fill over never fails the create or teardown
    that asked for it: the sandbox is made or gone by then."""

    def __init__(self, backends: Backends) -> None:
        self.backends = backends
        self._lock = threading.Lock()
        self._executor: Executor | None = None

    def run_on(self, executor: Executor | None) -> None:
        """Run the fills on `executor` from now on (the service: it has every import and bwrap's
        spawner already, where a `sandboxer warm` process would start from nothing and compete
        with the next create for the CPU); None: back to detached processes."""
        with self._lock:
            self._executor = executor

    def spawn(self, dirs: Dirs, profile_name: str) -> None:
        """Top the profile's warm sandboxes up in the background: on the fill thread when there
        is one, else in `sandboxer warm PROFILE` started detached (its own session, no stream or
        descriptor of ours, the root directory as its cwd, an environment of its own). Errors go
        to warm.log in the state dir. The caller does not wait for it, not even for a detached
        one's execve (a plain fork: about 1 ms here, against 8 for subprocess, which waits for
        the exec); once this process exits, init reaps it. It never raises: a fill that cannot
        be started (no descriptor, no process left) is no failure of the create or teardown
        that asked for it, whose sandbox is made or gone by then; gc and the next fill catch up."""
        with self._lock:
            executor = self._executor
            if executor is not None:
                with contextlib.suppress(RuntimeError):  # shut down: the service is stopping
                    executor.submit(_fill_logged, dirs, profile_name, self.backends)
                return
        with contextlib.suppress(OSError):
            _fork_fill(dirs, profile_name)


def wanted(request: CreateRequest) -> int:
    """How many warm sandboxes the request's profile keeps; 0 when this create cannot take one.

    A lease manifest, or a bootstrap with suspend control, adds mounts and variables of its own to
    the plan, and a --ref or --branch checks out another workspace than the profile's ref: such
    a create always starts its own sandbox.
    """
    if request.assignment is not None:
        return 0
    if request.delivery is not None and request.delivery[0].suspend_control:
        return 0
    checkout = request.checkout
    if checkout.ref != request.profile.workspace.ref or checkout.branch is not None:
        return 0  # create --ref, --branch: a warm sandbox's workspace is the profile's ref
    return request.extension.warm


def kind(request: CreateRequest, registry: Registry) -> warmpool.Kind:
    """The warm sandboxes a create of the request would take, and how to plan one."""

    backend = request.engine
    repository = request.profile.workspace.repository

    def planner(sandbox_id: str, known_ids: tuple[int, int] | None) -> Plan:
        return plan_for(request, registry, sandbox_id, known_ids=known_ids)

    def workspace_refs(plan: Plan) -> str:
        return workspace.refs_digest(repository, registry.path(plan.sandbox_id, workspace.GIT_HOME))

    def clone(plan: Plan, record: SandboxRecord) -> SandboxRecord:
        if not plan.workspace_in_memory:
            # Host-side git works only in a directory of the host root's (it refuses one of
            # another owner's): the warm sandbox's empty workspace is the host root's until the
            # clone gives it to the sandbox user. Nothing runs in the sandbox but its holder
            # (bwrap) or its pid 1 (Docker).
            os.chown(str(plan.workspace_source), 0, 0)
        record = replace(record, work=clone_workspace(request, plan))
        backend.fill_workspace(plan, record, profile_file=request.profile_file)
        return record

    return warmpool.Kind(
        profile=request.profile.name,
        profile_sha256=request.profile.file_sha256,
        extension_sha256=request.extension.file_sha256,
        image=request.image,
        backend_name=request.backend,
        backend=backend,
        backends=request.backends,
        planner=planner,
        workspace_refs=workspace_refs,
        clone=clone,
    )


def claim(request: CreateRequest, registry: Registry) -> tuple[int, SandboxRecord, Plan] | None:
    """Take a warm sandbox of the request's profile: (its held lock, its record, its plan)."""
    return warmpool.claim(registry, kind(request, registry))


def finish(request: CreateRequest, registry: Registry, record: SandboxRecord, plan: Plan) -> SandboxRecord:
    """The rest of a create that took a warm sandbox (its workspace cloned ahead): inspect it
    again, deliver."""

    problems = request.engine.taken_warm_problems(record, plan, site=site_of(registry, record.id))
    if problems:
        raise BackendError("the live sandbox differs from its plan: " + "; ".join(problems))
    return deliver_requested(request, plan, record)


def fill(dirs: Dirs, profile_name: str, *, backends: Backends) -> WarmFill:
    """Bring the profile's warm sandboxes to the extension's `warm` count: remove the stale and
    the surplus, start the missing. One fill per profile runs at a time."""

    if not PROFILE_NAME.fullmatch(profile_name):
        raise UsageError(f"warm: {profile_name[:64]!r} is not a profile name")
    registry = Registry(dirs.state)
    registry.ensure()
    fill_lock = try_lock_file(os.path.join(registry.root, f".warm-{profile_name}.lock"))
    if fill_lock is None:
        return WarmFill(profile=profile_name, warm=0, started=(), removed=(), busy=True)
    try:
        try:
            request = CreateRequest(dirs, profile_name, None, None, backends=backends)
        except SandboxerError:
            warmpool.drain(registry, profile_name, backends)  # unapproved or invalid: none may stay warm
            raise
        kept, started, removed = warmpool.refill(registry, kind(request, registry), wanted(request))
        return WarmFill(
            profile=profile_name, warm=len(kept), started=tuple(started), removed=tuple(removed), busy=False
        )
    finally:
        os.close(fill_lock)


def _fork_fill(dirs: Dirs, profile_name: str) -> None:
    """`sandboxer warm PROFILE`, detached (Fills.spawn)."""

    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    log = os.open(os.path.join(dirs.state, "warm.log"), flags, 0o600)
    argv = [sys.executable, "-I", "-m", "sandboxer", "--config-dir", dirs.config, "--state-dir", dirs.state]
    argv += ["warm", profile_name]
    # In its own process, as the command that started it ran (root's would otherwise start a
    # service for the state dir and leave it running until its idle exit).
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "SANDBOXER_NO_SERVICE": "1"}
    try:
        child = os.fork()
        if child == 0:  # pragma: no cover - replaced by execve, or _exit
            try:
                os.setsid()
                devnull = os.open(os.devnull, os.O_RDWR)
                os.dup2(devnull, 0)
                os.dup2(devnull, 1)
                os.dup2(log, 2)
                os.closerange(3, 0x7FFFFFFF)
                os.chdir("/")
                os.execve(sys.executable, argv, env)  # noqa: S606 - our interpreter, an argv, no shell
            finally:
                os._exit(127)
    finally:
        os.close(log)


def is_current(dirs: Dirs, record: SandboxRecord) -> bool:
    """gc's question: may this warm sandbox stay? Only while its profile and extension are
    approved with the bytes it was made from and the extension still keeps warm sandboxes."""

    stamp = record.warm
    if stamp is None:
        return False
    try:
        cache = ParseCache.of_state(dirs.state)
        _, profile = load_profile(dirs.config, record.profile, cache=cache)
        _, extension = load_extension(dirs.config, profile.extension, cache=cache)
        ledger = Ledger(dirs.config)
        approved = ledger.status(profile.name, profile.file_sha256) is Status.APPROVED
        approved = approved and ledger.status(extension.extension, extension.file_sha256) is Status.APPROVED
    except (SandboxerError, OSError):
        return False
    return (
        approved
        and extension.warm > 0
        and stamp.profile_sha256 == profile.file_sha256
        and stamp.extension_sha256 == extension.file_sha256
    )


def _fill_logged(dirs: Dirs, profile_name: str, backends: Backends) -> None:
    """`fill` on the service's thread, its failure a line in warm.log as a detached one's."""
    try:
        fill(dirs, profile_name, backends=backends)
    except (SandboxerError, OSError) as exc:
        message = exc.message if isinstance(exc, SandboxerError) else str(exc)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        with contextlib.suppress(OSError):
            log = os.open(os.path.join(dirs.state, "warm.log"), flags, 0o600)
            try:
                os.write(log, f"sandboxer: warm {profile_name}: {message}\n".encode())
            finally:
                os.close(log)
