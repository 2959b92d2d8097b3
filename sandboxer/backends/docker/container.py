"""The Docker backend: the same plan as a container, checked through the Engine API after start.

Every Engine call goes through sandboxer.backends.docker.engine, the broker's one Docker client.
Images are inspected locally and never pulled.

The daemon must remap user namespaces (`dockerd --userns-remap=default`): a container's uid
1000 is then the subordinate uid 100000+1000 on the host, no account's, and everything the
broker prepares for a container is owned by the remapped ids (docs/docker.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from sandboxer.backends.docker import engine, execs
from sandboxer.backends.docker.engine import remove_container
from sandboxer.backends.docker.render import LABEL, PROBE_END, STATE_LABEL, create_body, verify
from sandboxer.core.plan import MountKind, Plan
from sandboxer.errors import BackendError
from sandboxer.execio.stdio import to_fds
from sandboxer.host import staging

# The user `--userns-remap=default` makes: its /etc/subuid and /etc/subgid ranges are the host
# ids a container's ids become.
REMAP_USER = "dockremap"
# Below this, a host id may be anybody's (system and login accounts); a sandbox never runs there.
FIRST_UNSHARED_ID = 65536
REMAP_HINT = "start dockerd with --userns-remap=default (scripts/start-dockerd does); see docs/docker.md"

IdMap = tuple[tuple[int, int, int], ...]  # (container id, host id, count), as /proc/PID/uid_map shows it


@dataclass(frozen=True, slots=True, kw_only=True)
class Remap:
    """The daemon's user-namespace remapping: which host ids a container's ids are."""

    uids: IdMap
    gids: IdMap

    def host_ids(self, uid: int, gid: int) -> tuple[int, int]:
        """The host uid and gid of the container's `uid` and `gid`; BackendError if unmapped."""
        return _mapped(self.uids, uid, "uid"), _mapped(self.gids, gid, "gid")

    @property
    def root(self) -> tuple[int, int]:
        """The host ids of the container's root: the owner of what the container's root owns."""
        return self.host_ids(0, 0)


def _mapped(id_map: IdMap, inside: int, what: str) -> int:
    for start, host, count in id_map:
        if start <= inside < start + count:
            return host + inside - start
    raise BackendError(f"the Docker daemon's user-namespace remapping has no host {what} for container {what} {inside}")


def id_map(text: str, *, names: tuple[str, ...]) -> IdMap:
    """The map dockerd builds from an /etc/subuid (or subgid) text for the user known by `names`
    (its name, its uid): the user's ranges in file order, one after another from container id 0."""
    mapped: list[tuple[int, int, int]] = []
    inside = 0
    for line in text.splitlines():
        fields = line.strip().split(":")
        if len(fields) != 3 or fields[0] not in names or not fields[1].isdigit() or not fields[2].isdigit():
            continue
        mapped.append((inside, int(fields[1]), int(fields[2])))
        inside += int(fields[2])
    return tuple(mapped)


class Learnt:
    """What the daemon said of its remapping, learnt once per process (a create asks for it more
    than once): one object, filled under its lock by the first of the service's threads to ask
    (the others wait for that answer); a failure is not kept, so the next create asks again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._remap: Remap | None = None

    def remap(self) -> Remap:
        with self._lock:
            if self._remap is None:
                self._remap = _learn_remap()
            return self._remap


_LEARNT = Learnt()  # this process's


def remap() -> Remap:
    """The Engine's user-namespace remapping, learnt from the daemon (`/info`: its security
    options and storage root) and dockremap's subordinate ranges; BackendError (5) when the
    daemon does not remap, which is refused: its containers' users would be host accounts."""
    return _LEARNT.remap()


def _learn_remap() -> Remap:
    """remap(), asking the daemon."""
    status, info = engine_call("GET", "/info")
    if status != 200 or not isinstance(info, dict):
        raise BackendError(f"docker: the Engine's /info answered HTTP {status}")
    if "name=userns" not in (info.get("SecurityOptions") or []):
        raise BackendError(
            "the Docker daemon does not remap user namespaces: a container's uid 1000 would be the host's "
            "uid 1000, a real account",
            hint=REMAP_HINT,
        )
    # dockerd keeps a remapping daemon's storage in <root>/<uid>.<gid> of the container's root.
    root = re.fullmatch(r"(\d+)\.(\d+)", os.path.basename(str(info.get("DockerRootDir") or "")))
    names: tuple[str, ...] = (REMAP_USER,)
    with contextlib.suppress(KeyError):
        names += (str(pwd.getpwnam(REMAP_USER).pw_uid),)
    try:
        with open("/etc/subuid") as uids, open("/etc/subgid") as gids:
            found = Remap(uids=id_map(uids.read(), names=names), gids=id_map(gids.read(), names=names))
    except OSError as exc:
        raise BackendError(f"the subordinate id ranges cannot be read ({exc.strerror})", hint=REMAP_HINT) from None
    if not found.uids or not found.gids:
        raise BackendError(f"{REMAP_USER} has no subordinate ranges in /etc/subuid and /etc/subgid", hint=REMAP_HINT)
    if root is None or found.root != (int(root[1]), int(root[2])):
        raise BackendError(
            f"the Docker daemon remaps user namespaces, but not to {REMAP_USER}'s subordinate ranges", hint=REMAP_HINT
        )
    return found


def _known_ids(path: str) -> set[int]:
    """The ids an /etc/passwd or /etc/group file gives to accounts (field 3)."""
    known = set()
    try:
        with open(path) as stream:
            for line in stream:
                fields = line.split(":")
                if len(fields) > 2 and fields[2].isdigit():
                    known.add(int(fields[2]))
    except OSError:
        pass
    return known


def account_problems(uid: int, gid: int) -> list[str]:
    """Why host `uid`/`gid` must not run a sandbox: below FIRST_UNSHARED_ID or an account's."""
    problems = []
    if uid < FIRST_UNSHARED_ID or uid in _known_ids("/etc/passwd"):
        problems.append(f"host uid {uid} is an account's or below {FIRST_UNSHARED_ID} (the daemon must remap it)")
    if gid < FIRST_UNSHARED_ID or gid in _known_ids("/etc/group"):
        problems.append(f"host gid {gid} is a group's or below {FIRST_UNSHARED_ID} (the daemon must remap it)")
    return problems


@dataclass(frozen=True, slots=True, kw_only=True)
class HostView:
    """What the host's /proc shows of one process: real ids and seccomp mode."""

    uid: int
    gid: int
    seccomp: int


def host_view(pid: object) -> HostView | None:
    """The host's view of process `pid` (a container's pid 1), or None when it cannot be read."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    fields: dict[str, str] = {}
    try:
        with open(f"/proc/{pid}/status") as stream:
            for line in stream:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        return HostView(
            uid=int(fields["Uid"].split()[0]), gid=int(fields["Gid"].split()[0]), seccomp=int(fields["Seccomp"])
        )
    except (OSError, KeyError, ValueError, IndexError):
        return None


def host_problems(attrs: dict[str, Any], plan: Plan) -> list[str]:
    """The container's pid 1 as the host sees it: the plan's remapped host ids, no account's, and
    under a seccomp filter (mode 2)."""
    return pid1_problems(attrs, (plan.host_uid, plan.host_gid))


def pid1_problems(attrs: dict[str, Any], planned: tuple[int, int] | None) -> list[str]:
    """host_problems for a container whose host ids are `planned` (None: any of the remapping's,
    no account's)."""
    view = host_view((attrs.get("State") or {}).get("Pid"))
    if view is None:
        return ["the container's pid 1 cannot be read on the host"]
    problems = []
    if planned is not None and (view.uid, view.gid) != planned:
        problems.append(
            f"the container's pid 1 is host uid {view.uid} gid {view.gid}, planned {planned[0]}:{planned[1]}"
        )
    problems += account_problems(view.uid, view.gid)
    if view.seccomp != 2:
        problems.append(f"the container's pid 1 has seccomp mode {view.seccomp}, planned 2 (a filter)")
    return problems


def write_etc(plan: Plan, etc_dir: str, *, owner: tuple[int, int]) -> None:
    """The generated /etc files, bound read-only into the container, owned by `owner` (the
    container's root as the host knows it)."""
    os.makedirs(etc_dir, mode=0o755, exist_ok=True)
    for mount in plan.mounts:
        if mount.kind is MountKind.FILE:
            path = os.path.join(etc_dir, os.path.basename(mount.target))
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                view = memoryview(mount.content or b"")
                while view:
                    view = view[os.write(fd, view) :]
                os.fchown(fd, *owner)
                os.fchmod(fd, mount.mode or 0o644)
            finally:
                os.close(fd)


def engine_call(method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    """One Engine API call over the fixed socket: (status, decoded JSON body or None)."""

    try:
        status, content = engine.request(method, path, body)
    except (OSError, engine.EngineError) as exc:
        raise BackendError(f"cannot reach the Docker daemon ({exc})", hint="start dockerd") from None
    try:
        return status, json.loads(content) if content.strip() else None
    except ValueError:
        return status, None


def _message(document: Any) -> str:
    text = document.get("message") if isinstance(document, dict) else None
    return str(text or "no explanation")[:300]


def require_image(image: str) -> None:
    """BackendError unless the Engine has `image` (images are never pulled)."""
    status, document = engine_call("GET", f"/images/{quote(image, safe='/:@')}/json")
    if status == 404:
        raise BackendError(f"image {image}: not present locally (images are never pulled)")
    if status != 200:
        raise BackendError(f"image {image}: the Engine answered HTTP {status} ({_message(document)})")


def start(plan: Plan, *, image: str, etc_dir: str, state_dir: str, network: str | None = None) -> tuple[str, bytes]:
    """Create and start the container (on `network`, the sandbox's own network of service
    containers, if any: render.create_body) from `image` (require_image first); returns its id and
    what its probe printed. Raises BackendError on any Engine error, and then leaves no container
    behind.

    The create hot path speaks the Engine API itself: importing the SDK costs ~70 ms here,
    more than creating the container does.
    """
    # The runtime from its image, the /etc files on a tmpfs: no host path in the container's
    # mount table (host/staging.py); teardown unmounts them (DockerBackend.stop).
    staging.stage_runtime(plan, state_dir, os.path.dirname(etc_dir))
    staging.mount_etc(os.path.dirname(etc_dir))
    write_etc(plan, etc_dir, owner=remap().root)
    body = create_body(plan, image=image, etc_dir=etc_dir, state_dir=state_dir, network=network)
    status, document = engine_call("POST", "/containers/create", body)
    if status != 201 or not isinstance(document, dict) or not isinstance(document.get("Id"), str):
        raise BackendError(f"docker: the container could not be created ({_message(document)})")
    container_id = str(document["Id"])

    try:
        attached = engine.attach(container_id)
        status, document = engine_call("POST", f"/containers/{container_id}/start")
        if status not in (204, 304):
            attached[0].close()
            raise BackendError(f"docker: the container could not be started ({_message(document)})")
        probe = engine.read_until(attached, PROBE_END, timeout=30)
    except (OSError, engine.EngineError) as exc:
        remove(container_id)
        raise BackendError(f"docker: the container's probe failed ({exc})") from None
    except BaseException:
        remove(container_id)
        raise
    return container_id, probe


def deliver(container_id: str, plan: Plan, data: bytes, target: str) -> None:
    """Write `data` to `target` inside the container as the sandbox user (mode 0600, a new file),
    through the stdin of an exec: never its command line, environment or the host's disk."""

    source = os.memfd_create("sandboxer-delivery", os.MFD_CLOEXEC)
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        os.write(source, data)
        os.lseek(source, 0, os.SEEK_SET)
        exec_id = execs.create_exec(
            container_id,
            ["/bin/sh", "-c", 'umask 077 && set -C && exec cat > "$0"', target],
            env=dict(plan.env),
            user=f"{plan.uid}:{plan.gid}",
            cwd="/",
        )
        finished = execs.run(exec_id, stdin=source, output=to_fds(devnull, devnull), timeout=30)
        status = execs.exit_code(exec_id) if finished else 124
    except (OSError, engine.EngineError) as exc:
        raise BackendError(f"delivery of {target}: the Engine failed ({exc})") from None
    finally:
        os.close(source)
        os.close(devnull)
    if status != 0:
        raise BackendError(f"delivery of {target} failed inside the container")


def inspect(container_id: str) -> dict[str, Any]:
    """The Engine's inspect document of the container."""
    status, document = engine_call("GET", f"/containers/{container_id}/json")
    if status == 404:
        raise BackendError(f"container {container_id[:12]}: gone")
    if status != 200 or not isinstance(document, dict):
        raise BackendError(f"container {container_id[:12]}: the Engine answered HTTP {status}")
    return document


def check(container_id: str, plan: Plan, *, etc_dir: str, network: str | None = None) -> list[str]:
    """Final inspection: every way the running container differs from its plan."""
    attrs = inspect(container_id)
    problems = verify(attrs, plan, etc_dir=etc_dir, network=network) + host_problems(attrs, plan)
    if not (attrs.get("State") or {}).get("Running"):
        problems.append("the container is not running")
    return problems


def remove(container_id: str) -> list[str]:
    """Remove the container and its anonymous volumes; returns residue."""

    problem = remove_container(container_id)
    return [] if problem is None or problem == "gone" else [f"container {container_id[:12]}: {problem}"]


def labelled(state_dir: str) -> dict[str, str]:
    """Every container this broker (this state dir) made on the Engine: sandbox id -> container id
    (none when the Engine does not answer)."""

    try:
        listed = engine.containers(f"{STATE_LABEL}={state_dir}")
    except (OSError, ValueError, engine.EngineError):
        return {}
    found: dict[str, str] = {}
    for container in listed:
        labels = container.get("Labels")
        sandbox_id = labels.get(LABEL) if isinstance(labels, dict) else None
        if sandbox_id:
            found[str(sandbox_id)] = str(container["Id"])
    return found


def namespace_process(container_id: str) -> tuple[int, Callable[[], bool]]:
    """The pid of the running container's first process, whose network namespace is the
    sandbox's, and what asks the Engine again once that namespace is open (a container that
    ended in between, its pid reused, is caught: host/netns.py); BackendError unless it runs."""
    pid = _running_pid(container_id)
    if pid is None:
        raise BackendError("the sandbox's container is not running")
    return pid, lambda: _running_pid(container_id) == pid


def _running_pid(container_id: str) -> int | None:
    """The pid of the container's first process, as the Engine has it; None unless it runs."""
    state = (inspect(container_id).get("State") or {}) if container_id else {}
    pid = state.get("Pid")
    return pid if isinstance(pid, int) and pid > 0 and state.get("Running") else None
