"""Host-side git, as the broker runs it (sandboxer/host/workspace.py clones with it; export
checks bundles with it): no system or global configuration, hooks disabled, a HOME of the
broker's own, a process group of its own, SIGKILL when the broker dies. And `stop_git`, which
finds and kills what a clone's git left running when its broker was killed mid-way.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
from collections.abc import Callable

from sandboxer.errors import BackendError
from sandboxer.host import procs

GIT_TIMEOUT = 300  # seconds
PR_SET_PDEATHSIG = 1


def run_git(args: list[str], *, home: str, cwd: str | None = None) -> subprocess.CompletedProcess[bytes]:
    """Host-side git: no system or global config, no hooks, HOME `home` (a directory of the
    broker's own), in a process group of its own, killed with the broker. Never in a clone a
    sandbox used."""

    git = shutil.which("git", path="/usr/bin:/bin:/usr/local/bin")
    if git is None:
        raise BackendError("git is not installed", hint="apt-get install -y git")
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": home,
        "LANG": "C",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.path.join(home, "gitconfig"),  # also how stop_git finds them
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_ASKPASS": "/bin/false",
    }
    argv = [git, "-c", "core.hooksPath=/dev/null", "-c", "protocol.file.allow=always", *args]
    child = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        process_group=0,  # its helpers (upload-pack, pack-objects, index-pack) share one group to kill
        preexec_fn=_dies_with(os.getpid()),  # noqa: PLW1509 - one prctl through ctypes: takes no lock (docs/api.md)
    )
    try:
        out, err = child.communicate(timeout=GIT_TIMEOUT)
    except BaseException as exc:  # a timeout, ^C, anything: none of its processes outlives this call
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        if isinstance(exc, subprocess.TimeoutExpired):
            raise BackendError(f"git {args[0]} did not finish within {GIT_TIMEOUT} s") from None
        raise
    return subprocess.CompletedProcess(argv, child.returncode, out, err)


def _dies_with(broker: int) -> Callable[[], None]:
    """What a host-side git runs between fork and exec: SIGKILL once `broker` dies.

    A broker killed during a clone must not leave git writing into a directory gc is removing.
    The death signal is armed first and the parent checked after: a broker already gone before
    the signal was armed is noticed too.
    """

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    kill = int(signal.SIGKILL)

    def arm() -> None:
        armed = prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(kill), 0, 0, 0) == 0
        if not armed or os.getppid() != broker:
            os.kill(os.getpid(), kill)

    return arm


def stop_git(git_home: str) -> list[int]:
    """SIGKILL every host-side git a clone with HOME `git_home` left running; the pids that
    survive.

    Its broker died mid-clone: git itself got SIGKILL with it, but a helper it started (an
    index-pack resolving deltas, a pack-objects on the owner's repository) may still run and
    write below the sandbox's directory. They are found by the environment every one of them
    inherits, among our own uid's processes, and signalled through a pidfd so that a recycled
    pid is never hit.
    """
    if not os.path.isdir(git_home):  # the clone finished, or never began
        return []

    marker = f"GIT_CONFIG_GLOBAL={os.path.join(git_home, 'gitconfig')}".encode()
    found: list[int] = []
    for _ in range(3):  # a helper may fork once more between a scan and its signal
        found = [pid for pid in procs.all_pids() if _has_environment(pid, marker)]
        for pid in found:
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                if _has_environment(pid, marker):  # still that process, now pinned by the pidfd
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(pidfd)
        found = procs.wait_gone(found, 5.0)
        if not found:
            return []
    return found


def _has_environment(pid: int, entry: bytes) -> bool:
    """Whether the process `pid`, one of our uid's, was started with `entry` in its environment."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.geteuid():
            return False
        with open(f"/proc/{pid}/environ", "rb") as stream:
            return entry in stream.read().split(b"\0")
    except OSError:
        return False
