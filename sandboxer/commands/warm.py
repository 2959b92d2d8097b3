"""Warm containers: Docker sandboxes started ahead of the create that takes one.

Most of a Docker create is the Engine starting the container (about 150 ms here; see
docs/performance.md). An owner who sets `config.warm: N` in ext.docker.yaml has the broker keep
N containers of each Docker profile started, verified and idle. Each is made exactly as a create
makes its container, from the same plan under an id of its own, with one difference: its
workspace is an empty directory, the container root's and 0700, bound at /workspace. Nothing
runs in a warm container but its pid 1 (the holder) until a create takes it, clones the
workspace into that directory, and inspects the container again against the plan.

Registry states: `warming` (a fill is starting it) → `warm` (started, verified, idle) → taken by
a create: `creating` → `ready`. Callers never see a warm container: `list` leaves it out, and
`exec`, `inspect` and `teardown` answer "no such sandbox".

A warm container is taken only while everything it was made from still holds: the approved bytes
of the profile and of the extension (their sha256), the image, the container settings rendered
from the taker's plan (their sha256), and what Docker and its pid 1 showed when it started.
Anything else is stale: the create that meets it, the next fill, or `gc` removes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from typing import TYPE_CHECKING, Any

from sandboxer import procs
from sandboxer.errors import BackendError, NotFoundError, SandboxerError, UsageError
from sandboxer.registry import HIDDEN_STATES, Registry, try_lock_file

if TYPE_CHECKING:
    from sandboxer.commands.making import CreateRequest
    from sandboxer.dirs import Dirs
    from sandboxer.plan import Plan

WARMING, WARM = HIDDEN_STATES


def wanted(request: CreateRequest) -> int:
    """How many warm containers the request's profile keeps; 0 when this create cannot take one.

    A lease manifest, or a bootstrap with suspend control, adds mounts and variables of its own to
    the plan, so such a create always starts its own container.
    """
    if request.backend != "docker" or request.assignment is not None:
        return 0
    if request.delivery is not None and request.delivery[0].suspend_control:
        return 0
    return request.extension.warm


def claim(request: CreateRequest, registry: Registry) -> tuple[str, int, dict[str, Any], Plan] | None:
    """Take a warm container of the request's profile: (id, its held lock, its record, its plan).

    Stale ones met on the way are removed; None when there is none to take.
    """
    from sandboxer.commands.destroy import destroy
    from sandboxer.commands.making import plan_for

    for sandbox_id in _candidates(registry, request.profile.name):
        lock = _try_lock(registry, sandbox_id)
        if lock is None:
            continue
        record = registry.read_or_none(sandbox_id)
        if record is None or record.get("state") != WARM:
            os.close(lock)
            continue
        plan = plan_for(request, registry, sandbox_id, known_ids=_host_ids(record))
        if _problems(request, registry, record, plan):
            with contextlib.suppress(SandboxerError, OSError):
                destroy(registry, sandbox_id, {**record, "state": "failed"})
            os.close(lock)
            continue
        return sandbox_id, lock, record, plan
    return None


def _host_ids(record: dict[str, Any]) -> tuple[int, int] | None:
    """The host uid and gid a warm container was planned with: the daemon's remapping as it was
    when the container started. Taking it is checked where it matters: the container's pid 1
    must still be those ids, no account's (docker.host_problems)."""
    uid, gid = record.get("host_uid"), record.get("host_gid")
    if type(uid) is int and type(gid) is int:
        return uid, gid
    return None


def finish(request: CreateRequest, registry: Registry, record: dict[str, Any], plan: Plan) -> None:
    """The rest of a create that took a warm container: clone, inspect again, deliver."""
    from sandboxer.commands.making import clone_workspace, deliver_requested

    # Host-side git works only in a directory of the host root's (it refuses one of another
    # owner's): the container root's empty workspace is the host root's until the clone gives it
    # to the sandbox user. Nothing runs in the container but its pid 1 meanwhile.
    os.chown(str(plan.workspace_source), 0, 0)
    clone_workspace(request, plan)
    problems = _container_problems(registry, record, plan)
    if problems:
        raise BackendError("the live sandbox differs from its plan: " + "; ".join(problems))
    deliver_requested(request, plan, record)


def fill(dirs: Dirs, profile_name: str) -> dict[str, Any]:
    """Bring the profile's warm containers to the extension's `warm` count: remove the stale
    and the surplus, start the missing. One fill per profile runs at a time."""
    from sandboxer.commands.destroy import destroy
    from sandboxer.commands.making import CreateRequest, plan_for
    from sandboxer.config import PROFILE_NAME

    if not PROFILE_NAME.fullmatch(profile_name):
        raise UsageError(f"warm: {profile_name[:64]!r} is not a profile name")
    registry = Registry(dirs.state)
    registry.ensure()
    result: dict[str, Any] = {"profile": profile_name, "warm": 0, "started": [], "removed": [], "busy": False}
    fill_lock = try_lock_file(os.path.join(registry.root, f".warm-{profile_name}.lock"))
    if fill_lock is None:
        result["busy"] = True
        return result
    try:
        try:
            request = CreateRequest(dirs, profile_name, None, None)
        except SandboxerError:
            result["removed"] = _drain(registry, profile_name)  # unapproved or invalid: none may stay warm
            raise
        want = wanted(request)
        kept: list[str] = []
        for sandbox_id in _candidates(registry, request.profile.name):
            lock = _try_lock(registry, sandbox_id)
            if lock is None:
                continue
            try:
                record = registry.read_or_none(sandbox_id)
                if record is None or record.get("state") != WARM:
                    continue
                stale = len(kept) >= want or bool(
                    _problems(request, registry, record, plan_for(request, registry, sandbox_id))
                )
                if stale:
                    destroy(registry, sandbox_id, {**record, "state": "failed"})
                    result["removed"].append(sandbox_id)
                else:
                    kept.append(sandbox_id)
            finally:
                os.close(lock)
        while len(kept) < want:
            kept.append(_start_one(request, registry))
            result["started"].append(kept[-1])
        result["warm"] = len(kept)
        return result
    finally:
        os.close(fill_lock)


def spawn_fill(dirs: Dirs, profile_name: str) -> None:
    """Start `sandboxer warm PROFILE` detached: its own session, no stream or descriptor of ours
    (errors go to warm.log in the state dir), the root directory as its cwd, an environment of its
    own. The caller does not wait for it, not even for its execve (a plain fork: about 1 ms here,
    against 8 for subprocess, which waits for the exec); once this process exits, init reaps it."""
    import sys

    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    log = os.open(os.path.join(dirs.state, "warm.log"), flags, 0o600)
    argv = [sys.executable, "-I", "-m", "sandboxer", "--config-dir", dirs.config, "--state-dir", dirs.state]
    argv += ["warm", profile_name]
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
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


def is_current(dirs: Dirs, record: dict[str, Any]) -> bool:
    """gc's question: may this warm container stay? Only while its profile and extension are
    approved with the bytes it was made from and the extension still keeps warm containers."""
    from sandboxer.approvals import Ledger, Status
    from sandboxer.configdir import load_extension, load_profile

    stamp = record.get("warm")
    if not isinstance(stamp, dict):
        return False
    try:
        cache_dir = os.path.join(dirs.state, "parsed")
        _, profile = load_profile(dirs.config, str(record.get("profile")), cache_dir=cache_dir)
        _, extension = load_extension(dirs.config, profile.extension, cache_dir=cache_dir)
        ledger = Ledger(dirs.config)
        approved = ledger.status(profile.name, profile.file_sha256) is Status.APPROVED
        approved = approved and ledger.status(extension.extension, extension.file_sha256) is Status.APPROVED
    except (SandboxerError, OSError):
        return False
    return (
        approved
        and extension.warm > 0
        and stamp.get("profile_sha256") == profile.file_sha256
        and stamp.get("extension_sha256") == extension.file_sha256
    )


def _start_one(request: CreateRequest, registry: Registry) -> str:
    """Start, verify and record one warm container; nothing is left of it if any step fails."""
    from sandboxer.backends.docker.backend import start_docker
    from sandboxer.commands.destroy import destroy
    from sandboxer.commands.making import now_text, plan_for

    sandbox_id, lock = registry.allocate()
    record: dict[str, Any] = {
        "id": sandbox_id,
        "profile": request.profile.name,
        "backend": "docker",
        "state": WARMING,
        "created_at": now_text(),
        "owner_pid": os.getpid(),
        "owner_start": procs.start_time(os.getpid()),
    }
    since = int(time.time()) - 1  # whole seconds: the Engine's event history is asked from here on
    try:
        registry.write(sandbox_id, record)
        from sandboxer.backends.docker import container as docker_backend

        plan = plan_for(request, registry, sandbox_id)
        # Its own sized filesystem (as every create's), empty until a create clones into it, and
        # the container root's (who enters it as the container's working directory before
        # becoming the sandbox user, who cannot).
        from sandboxer import workspace_volume

        workspace_volume.make(registry.path(sandbox_id), size_mib=plan.limits.workspace_mib)
        record["workspace_fs"] = {"mib": plan.limits.workspace_mib, "enforced": True}
        os.chown(str(plan.workspace_source), *docker_backend.remap().root)
        probe, interfaces = start_docker(plan, request.image, registry, record)

        state = docker_backend.inspect(str(record["container_id"])).get("State") or {}
        record["warm"] = {
            **_stamp(request, registry, plan),
            "probe": {
                "uid": probe.uid,
                "gid": probe.gid,
                "groups": list(probe.groups),
                "cap_eff": probe.cap_eff,
                "cap_prm": probe.cap_prm,
                "cap_bnd": probe.cap_bnd,
                "no_new_privs": probe.no_new_privs,
                "env_names": list(probe.env_names),
                "cgroups": list(probe.cgroups),
                "seccomp": probe.seccomp,
            },
            "interfaces": interfaces,
            "pid": state.get("Pid"),
            "started_at": state.get("StartedAt"),
            "since": since,
        }
        record["state"] = WARM
        registry.write(sandbox_id, record)
    except BaseException:
        record["state"] = "failed"
        with contextlib.suppress(OSError, SandboxerError):
            registry.write(sandbox_id, record)
        destroy(registry, sandbox_id, record)
        raise
    finally:
        os.close(lock)
    return sandbox_id


def _stamp(request: CreateRequest, registry: Registry, plan: Plan) -> dict[str, str]:
    """What a warm container was made from, to compare with what a create would make."""
    from sandboxer.backends.docker.render import create_body

    body = create_body(
        plan, image=request.image, etc_dir=registry.path(plan.sandbox_id, "etc"), state_dir=registry.state_dir
    )
    return {
        "profile_sha256": request.profile.file_sha256,
        "extension_sha256": request.extension.file_sha256,
        "image": request.image,
        "body_sha256": hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest(),
    }


def _problems(request: CreateRequest, registry: Registry, record: dict[str, Any], plan: Plan) -> list[str]:
    """Every reason the warm container may not become this request's sandbox."""
    from sandboxer.observe import ProbeSeen, process_differences

    stamp = record.get("warm")
    if not isinstance(stamp, dict):
        return ["it has no warm record"]
    problems = [
        f"stale: {key} changed" for key, value in _stamp(request, registry, plan).items() if stamp.get(key) != value
    ]
    if problems:
        return problems
    try:
        seen = stamp["probe"]
        probe = ProbeSeen(
            uid=int(seen["uid"]),
            gid=int(seen["gid"]),
            groups=tuple(int(g) for g in seen["groups"]),
            cap_eff=int(seen["cap_eff"]),
            cap_prm=int(seen["cap_prm"]),
            cap_bnd=int(seen["cap_bnd"]),
            no_new_privs=bool(seen["no_new_privs"]),
            env_names=tuple(str(n) for n in seen["env_names"]),
            cgroups=tuple(str(c) for c in seen["cgroups"]),
            seccomp=int(seen["seccomp"]),
        )
        interfaces = [str(name) for name in stamp["interfaces"]]
    except (KeyError, TypeError, ValueError):
        return ["its warm record has an unexpected shape"]
    return process_differences(plan, interfaces, probe) + _container_problems(registry, record, plan)


def _container_problems(registry: Registry, record: dict[str, Any], plan: Plan) -> list[str]:
    """The final inspection of a warm container: the Engine's view against the plan, and the
    same pid 1 that was probed when it started, with no exec ever run in it."""
    from sandboxer.backends.docker import container as docker_backend
    from sandboxer.backends.docker.render import verify

    try:
        attrs = docker_backend.inspect(str(record.get("container_id")))
    except BackendError as exc:
        return [exc.message]
    problems = verify(attrs, plan, etc_dir=registry.path(plan.sandbox_id, "etc"))
    problems += docker_backend.host_problems(attrs, plan)
    state = attrs.get("State") or {}
    stamp = record.get("warm") or {}
    if not state.get("Running"):
        problems.append("the container is not running")
    if state.get("Pid") != stamp.get("pid") or state.get("StartedAt") != stamp.get("started_at"):
        problems.append("the container was restarted after it was verified")
    if attrs.get("ExecIDs") or _execs_since(str(record.get("container_id")), stamp.get("since")):
        problems.append("something was executed in the warm container")
    return problems


def _execs_since(container_id: str, since: object) -> bool:
    """Whether the Engine's event history shows an exec created in the container since it was
    warmed (or cannot say: then it is taken as yes). The history is bounded (the Engine keeps
    its last 256 events), so this catches what a running-exec check alone would miss, not all."""
    from urllib.parse import quote

    from sandboxer.backends.docker import engine

    if not isinstance(since, int):
        return True
    filters = quote(json.dumps({"type": ["container"], "container": [container_id], "event": ["exec_create"]}))
    try:
        status, content = engine.request(
            "GET",
            f"/events?since={since}&until={time.time():.9f}&filters={filters}",  # now: never a wait
        )
    except (OSError, engine.EngineError):
        return True
    return status != 200 or bool(content.strip())


def _candidates(registry: Registry, profile_name: str) -> list[str]:
    """Ids of the profile's warm containers, oldest first."""
    found = []
    for sandbox_id in registry.ids():
        record = registry.read_or_none(sandbox_id)
        if record and record.get("state") == WARM and record.get("profile") == profile_name:
            found.append((str(record.get("created_at")), sandbox_id))
    return [sandbox_id for _, sandbox_id in sorted(found)]


def _try_lock(registry: Registry, sandbox_id: str) -> int | None:
    try:
        return registry.lock(sandbox_id, wait=False)
    except NotFoundError:
        return None


def _drain(registry: Registry, profile_name: str) -> list[str]:
    """Remove every warm container of the profile; the ids removed."""
    from sandboxer.commands.destroy import destroy

    removed = []
    for sandbox_id in _candidates(registry, profile_name):
        lock = _try_lock(registry, sandbox_id)
        if lock is None:
            continue
        try:
            record = registry.read_or_none(sandbox_id)
            if record is not None and record.get("state") == WARM:
                destroy(registry, sandbox_id, {**record, "state": "failed"})
                removed.append(sandbox_id)
        finally:
            os.close(lock)
    return removed
