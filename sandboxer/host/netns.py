"""A listening socket inside a sandbox's network namespace, made by the broker from the host.

The egress proxy serves a sandbox from the service, in the host's network namespace, but the
address sandboxed code connects to is on the sandbox's own loopback: the broker makes that socket
there, before anything runs in the sandbox, so no sandboxed process can take the port first and no
process of the broker's runs inside. Connections accepted on it come from the sandbox; the
proxy's own connections leave from the host.

A socket belongs to the namespace it was made in, whichever thread later uses it, so it is made
by a thread (or process) that joined the namespace for just that:

- a root broker joins the sandbox's network namespace from a short-lived thread of its own
  (setns(2) moves the calling thread only; root holds CAP_SYS_ADMIN over every namespace);
- an ordinary user's namespace belongs to a user namespace of that user's, which only a
  single-threaded process may join: a small child process joins it and the network namespace,
  makes the socket and hands it back over a socket pair (SCM_RIGHTS), then exits.

The namespace is named by a process of the sandbox (pid and start time, against pid reuse): its
namespace file is opened, then the process is checked to be the same one still (and, where the pid
came from someone else's answer, such as the Docker Engine's, `still_theirs` asks again), so the
descriptor is that sandbox's namespace and no other.
"""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable

from sandboxer.errors import BackendError
from sandboxer.host import procs

CLONE_NEWNET = 0x40000000
LISTEN_BACKLOG = 128
HELPER_SECONDS = 10.0

# The child an unprivileged broker runs, given the network namespace's descriptor, its end of the
# pair, the address and the backlog. It joins the namespace's owning user namespace
# (NS_GET_USERNS), then the network namespace, and sends the bound socket back. Standard library
# only, no site: it starts in a few milliseconds.
_HELPER = """
import ctypes, fcntl, os, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
def join(fd, kind):
    if libc.setns(fd, kind) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
netns, pair, host, port, backlog = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
join(fcntl.ioctl(netns, 0xB701), 0x10000000)
join(netns, 0x40000000)
made = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
made.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
made.bind((host, port))
made.listen(backlog)
socket.send_fds(socket.socket(fileno=pair), [b"ok"], [made.fileno()])
"""


def listen_inside(
    pid: int,
    start: int | None,
    address: tuple[str, int],
    *,
    join_user: bool,
    still_theirs: Callable[[], bool] | None = None,
) -> socket.socket:
    """A TCP socket listening on `address` inside the network namespace of process `pid` (started
    at `start`, in clock ticks). `join_user`: the namespace belongs to a user namespace the broker
    must join first (an unprivileged broker). `still_theirs`: asked once the namespace is open,
    whether `pid` is still the sandbox's process. BackendError, saying why, when it cannot be made:
    the process is gone, or the address is taken inside."""
    netns = open_namespace(pid, start, still_theirs=still_theirs)
    try:
        made = _by_child(netns, address) if join_user else _by_thread(netns, address)
    finally:
        os.close(netns)
    made.setblocking(False)
    return made


def open_namespace(pid: int, start: int | None, *, still_theirs: Callable[[], bool] | None = None) -> int:
    """A descriptor of the network namespace of process `pid` (started at `start`), checked to be
    that process's still (and `still_theirs`) and never the broker's own; BackendError if not."""
    try:
        netns = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise BackendError(f"the sandbox's network namespace cannot be opened: {exc.strerror}") from None
    try:
        if not procs.alive(pid, start) or (still_theirs is not None and not still_theirs()):
            raise BackendError("the sandbox's process is gone: its network namespace cannot be named")
        opened, own = os.fstat(netns), os.stat("/proc/self/ns/net")
        if (opened.st_dev, opened.st_ino) == (own.st_dev, own.st_ino):  # never a socket on the host's loopback
            raise BackendError("the process named is in the broker's own network namespace, not a sandbox's")
    except BaseException:
        os.close(netns)
        raise
    return netns


def _bound(address: tuple[str, int]) -> socket.socket:
    made = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # A restarted service binds again where the last one's closed connections may linger in
        # TIME_WAIT; SO_REUSEADDR lets it, and still refuses while anything listens there (never
        # SO_REUSEPORT, which would let a second listener share the port).
        made.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        made.bind(address)
        made.listen(LISTEN_BACKLOG)
    except OSError:
        made.close()
        raise
    return made


def setns(fd: int, kind: int) -> None:
    """setns(2) for the calling thread (OSError on failure)."""
    if ctypes.CDLL(None, use_errno=True).setns(fd, kind) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def _by_thread(netns: int, address: tuple[str, int]) -> socket.socket:
    """Join `netns` from a thread of ours, make the socket there; the thread ends with it."""
    made: list[socket.socket] = []
    failed: list[OSError] = []

    def run() -> None:
        # The thread never returns to the host's namespace: it ends here, and no other thread of
        # this process is moved.
        try:
            setns(netns, CLONE_NEWNET)
            made.append(_bound(address))
        except OSError as exc:
            failed.append(exc)

    thread = threading.Thread(target=run, name="sandboxer-netns")
    thread.start()
    thread.join()
    if failed or not made:
        reason = failed[0].strerror if failed else "no socket"
        raise BackendError(f"no listener at {address[0]}:{address[1]} inside the sandbox: {reason}")
    return made[0]


def spawn_helper(script: str, netns: int, pair: socket.socket, *args: str, stderr: int) -> subprocess.Popen[bytes]:
    """A child running `script` (standard library only, no site: it starts in a few milliseconds)
    with the namespace's descriptor and its end of `pair` as its first arguments, nothing else
    inherited, a bare environment."""
    return subprocess.Popen(
        [sys.executable, "-S", "-I", "-c", script, str(netns), str(pair.fileno()), *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        pass_fds=(netns, pair.fileno()),
        env={"PATH": "/usr/bin:/bin"},
    )


def _by_child(netns: int, address: tuple[str, int]) -> socket.socket:
    """Make the socket in a child process that joins the user and network namespaces."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours:
        with theirs:
            extra = [address[0], str(address[1]), str(LISTEN_BACKLOG)]
            child = spawn_helper(_HELPER, netns, theirs, *extra, stderr=subprocess.PIPE)
        try:
            _, stderr = child.communicate(timeout=HELPER_SECONDS)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise BackendError("no listener inside the sandbox: its helper did not answer") from None
        fds: list[int] = []
        if child.returncode == 0:
            ours.settimeout(HELPER_SECONDS)
            _, fds, _, _ = socket.recv_fds(ours, 16, 1)
        if not fds:
            last = stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no answer"]
            raise BackendError(f"no listener at {address[0]}:{address[1]} inside the sandbox: {last[0][:200]}")
        return socket.socket(fileno=fds[0])
