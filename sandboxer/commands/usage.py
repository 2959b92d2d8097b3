"""What an orchestrator watches of its sandboxes: `usage` (what one uses now), `work` (its work
as its git reports it), `extend` (a longer lifetime, within its bounds), and the list's view of
each (whose it is, its age and time left, its work)."""

from __future__ import annotations

import os
import pwd
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from sandboxer.api.results import SandboxInfo
from sandboxer.api.usage_results import Lifetime, Usage, WorkSummary
from sandboxer.backends import Backends
from sandboxer.commands.work import GIT_SECONDS, work_state
from sandboxer.core.plan import STATE_ROOT, TMP_TARGETS, WORKSPACE_TARGET
from sandboxer.core.record import expiry_text
from sandboxer.errors import BackendError, NotFoundError, PolicyError, SandboxerError, UsageError, not_running
from sandboxer.host import usage as measure
from sandboxer.host.registry import Registry, check_id

if TYPE_CHECKING:
    from sandboxer.core.record import SandboxRecord
    from sandboxer.dirs import Dirs

LIST_GIT_SECONDS = 10  # the git of one sandbox's work, for `list`: a busy sandbox cannot hold the list
LIST_WORK_SECONDS = 20  # every sandbox's git for one `list`: past it, the rest are listed without work
LIST_GITS_AT_ONCE = 4  # sandboxes whose git one `list` asks at the same time
MIB = 1024 * 1024
MAX_EXTEND = 365 * 24 * 3600  # extend's seconds: at most a year from now


def usage(dirs: Dirs, sandbox_id: str, *, backends: Backends) -> Usage:
    """What the running sandbox uses now (BackendError when it is not running)."""
    record = Registry(dirs.state).read_caller(check_id(sandbox_id))
    if record.state != "ready" or record.limits is None:
        raise BackendError(not_running(sandbox_id, record.state))
    sample = backends.backend(record.backend).sample(record)
    if sample.root_pid is None:
        raise BackendError(not_running(sandbox_id))
    root = sample.root_pid
    counters = sample.counters
    own_fs = record.workspace_fs is not None  # a sized image or a tmpfs: the filesystem is the workspace's
    workspace = (measure.filesystem_used if own_fs else measure.tree_used)(root, WORKSPACE_TARGET)
    state, tmp = measure.filesystem_used(root, STATE_ROOT), measure.filesystem_used(root, TMP_TARGETS[0])
    return Usage(
        id=record.id,
        source=sample.source,
        memory_bytes=counters.memory_bytes,
        memory_peak_bytes=counters.memory_peak_bytes,
        memory_limit_bytes=record.limits.memory_mib * MIB,
        pids=counters.pids,
        pids_limit=record.limits.pids,
        cpu_seconds=None if counters.cpu_seconds is None else round(counters.cpu_seconds, 3),
        cpus=record.limits.cpus,
        workspace_bytes=None if workspace is None else workspace.used_bytes,
        workspace_complete=workspace is not None and not workspace.at_least,
        state_bytes=None if state is None else state.used_bytes,
        tmp_bytes=None if tmp is None else tmp.used_bytes,
    )


def work_summary(dirs: Dirs, sandbox_id: str, *, backends: Backends, seconds: float | None = None) -> WorkSummary:
    """The sandbox's work as its git reports it now, and what of it no export took out."""
    limit = GIT_SECONDS if seconds is None else seconds
    try:
        state, record = work_state(dirs, sandbox_id, backends=backends, seconds=limit)
    except (BackendError, UsageError) as exc:  # worded for export, which asks the same of git
        raise type(exc)(f"work: {exc.message.removeprefix('export: ')}", hint=exc.hint) from None
    unexported = tuple(state.unexported(record))
    has_work = state.ahead != 0 or state.dirty
    return WorkSummary(
        id=sandbox_id,
        head=state.head,
        branch=state.branch,
        commits=state.ahead,
        dirty=state.dirty,
        exported=has_work and not unexported,
        unexported=unexported,
    )


def extend(dirs: Dirs, sandbox_id: str, seconds: object, *, ceiling: float | None) -> Lifetime:
    """The ready sandbox's lifetime ends `seconds` from now (never earlier than it did; one made
    without an end keeps none): at most its profile's lifetime.max_seconds after its create, and
    `ceiling` seconds after it (a granted caller's max_ttl_seconds); PolicyError (3) past either.
    A lifetime that has ended already is not brought back: the reaper is taking the sandbox."""
    if isinstance(seconds, bool) or not isinstance(seconds, int) or not 1 <= seconds <= MAX_EXTEND:
        raise UsageError(f"extend: seconds must be a whole number from 1 to {MAX_EXTEND}")
    registry = Registry(dirs.state)
    lock = registry.lock(check_id(sandbox_id))
    if lock is None:  # (a waiting lock is never refused)
        raise NotFoundError(f"no such sandbox: {sandbox_id}")
    try:
        record = registry.read_caller(sandbox_id)
        if record.state != "ready":
            raise UsageError(f"extend: sandbox {sandbox_id} is not ready (state {record.state})")
        if record.expires_at is None:
            raise UsageError(f"extend: sandbox {sandbox_id} has no end to its lifetime (made without --ttl)")
        now = time.time()
        if record.expires_at <= now:
            raise UsageError(f"extend: sandbox {sandbox_id}'s lifetime has ended ({expiry_text(record.expires_at)})")
        latest = _latest(record, ceiling)
        wanted = now + seconds
        if latest is not None and wanted > latest + 1:  # (a second's grace: created_at is to the second)
            raise PolicyError(
                f"extend: {seconds:g} seconds from now is past the sandbox's latest end, {expiry_text(latest)}"
                " (the profile's lifetime.max_seconds or the grant's max_ttl_seconds, from its create)"
            )
        expires = max(wanted if latest is None else min(wanted, latest), record.expires_at)
        registry.write(replace(record, expires_at=expires))
    finally:
        os.close(lock)
    return Lifetime(
        id=sandbox_id,
        expires_at=expiry_text(expires),
        seconds_left=int(expires - now),
        max_expires_at=None if latest is None else expiry_text(latest),
    )


def _latest(record: SandboxRecord, ceiling: float | None) -> float | None:
    """The latest end of the sandbox's lifetime: the record's (its profile's), and `ceiling`
    seconds after its create; None when neither bounds it."""
    bounds = [record.max_expires_at] if record.max_expires_at is not None else []
    if ceiling is not None:
        bounds.append(created_time(record) + ceiling)
    return min(bounds) if bounds else None


def created_time(record: SandboxRecord) -> float:
    """The record's created_at as POSIX time."""
    return datetime.strptime(record.created_at, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def described(dirs: Dirs, entries: list[SandboxInfo], *, backends: Backends, work: bool = True) -> list[SandboxInfo]:
    """The list's lines with whose each sandbox is, its age, its time left and (running, `work`)
    its work: each sandbox's git within LIST_GIT_SECONDS, LIST_GITS_AT_ONCE of them at a time,
    and all of them within LIST_WORK_SECONDS, so that no sandbox (nor many) can hold the list."""
    deadline = time.monotonic() + LIST_WORK_SECONDS

    def line(info: SandboxInfo) -> SandboxInfo:
        left = min(LIST_GIT_SECONDS, deadline - time.monotonic()) if work else 0
        return _described(dirs, info, backends=backends, git_seconds=left)

    if not work or len(entries) < 2:
        return [line(info) for info in entries]
    # Each git waits mostly on its own process inside: a few at a time, in the list's order.
    with ThreadPoolExecutor(max_workers=LIST_GITS_AT_ONCE, thread_name_prefix="sandboxer-list") as pool:
        return list(pool.map(line, entries))


def _described(dirs: Dirs, info: SandboxInfo, *, backends: Backends, git_seconds: float) -> SandboxInfo:
    record = Registry(dirs.state).read_or_none(info.id)
    if record is None:
        return info
    now = time.time()
    uid = record.caller_uid if record.caller_uid is not None else os.stat(dirs.state).st_uid
    try:
        age: int | None = max(0, int(now - created_time(record)))
    except ValueError:
        age = None
    summary = None
    if git_seconds >= 1 and info.status == "running" and record.work is not None:
        try:
            summary = work_summary(dirs, record.id, backends=backends, seconds=git_seconds)
        except SandboxerError:
            summary = None  # busy, or its git failed: the line says nothing of its work
    return replace(
        info,
        caller_uid=uid,
        caller=_account(uid),
        age_seconds=age,
        seconds_left=None if record.expires_at is None else max(0, int(record.expires_at - now)),
        work=summary,
    )


def _account(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None
