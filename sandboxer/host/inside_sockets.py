"""Sockets made inside a sandbox's network namespace on demand: the inner side of a published port.

A published port forwards each connection the host's 127.0.0.1:HOST accepts to 127.0.0.1:RUNTIME
inside the sandbox. A socket belongs to the namespace it was made in, so the inner socket is made
there and then connected from the service's event loop like any other. Making one must be cheap
(once per connection), so the namespace is joined once per sandbox, not once per connection:

- a root broker keeps one thread per sandbox that joined the sandbox's network namespace
  (setns(2) moves that thread only) and makes sockets when asked;
- an ordinary user's sandbox namespace belongs to a user namespace of that user's, which only a
  single-threaded process may join: one small child process per sandbox joins it and the network
  namespace and hands a fresh socket back over a socket pair (SCM_RIGHTS) per request. It is
  not dumpable, lives in the host's pid namespace (no sandboxed process can name it) and ends
  when the pair closes: when the sandbox's ports are closed, or the service ends.

Either holds the namespace open while it lives, so `close` is called when the sandbox ends
(teardown, the service's watch). Nothing here connects anywhere: the caller does.
"""

from __future__ import annotations

import asyncio
import os
import queue
import socket
import subprocess
import threading
from concurrent.futures import Future
from typing import Protocol

from sandboxer.errors import BackendError
from sandboxer.host.netns import CLONE_NEWNET, HELPER_SECONDS, setns, spawn_helper

ANSWER_SECONDS = 5.0
CONNECT_SECONDS = 5.0

# The child an unprivileged broker keeps per sandbox, given the network namespace's descriptor and
# its end of the pair. Standard library only, no site: it starts in a few milliseconds.
_HELPER = """
import ctypes, fcntl, os, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no process of the sandbox's user may trace it
def join(fd, kind):
    if libc.setns(fd, kind) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
netns, pair = int(sys.argv[1]), socket.socket(fileno=int(sys.argv[2]))
join(fcntl.ioctl(netns, 0xB701), 0x10000000)
join(netns, 0x40000000)
os.close(netns)
pair.sendall(b"r")
while pair.recv(1):
    made = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    socket.send_fds(pair, [b"s"], [made.fileno()])
    made.close()
"""


class InsideSockets(Protocol):
    """Connects to ports on the sandbox's 127.0.0.1 until closed."""

    async def connect(self, port: int) -> socket.socket:
        """A socket connected to 127.0.0.1:`port` inside the sandbox, without blocking the event
        loop; OSError or TimeoutError when nothing answers there (within CONNECT_SECONDS),
        BackendError when no socket can be made."""
        ...

    def close(self) -> None:
        """Let the namespace go."""
        ...


class _Namespaced:
    """Sockets made in the sandbox's namespace (`socket`, by a subclass), connected from here."""

    async def connect(self, port: int) -> socket.socket:
        return await connected(await self.socket(), ("127.0.0.1", port))

    async def socket(self) -> socket.socket:
        """A new TCP socket in the sandbox's namespace, without blocking the event loop;
        BackendError when none can be made (within ANSWER_SECONDS)."""
        raise NotImplementedError


async def connected(made: socket.socket, address: str | tuple[str, int]) -> socket.socket:
    """`made`, connected to `address` from the running loop (closed when that fails)."""
    made.setblocking(False)
    try:
        async with asyncio.timeout(CONNECT_SECONDS):
            await asyncio.get_running_loop().sock_connect(made, address)
    except BaseException:
        made.close()
        raise
    return made


class ProxySockets:
    """A Docker sandbox's with service containers: each port is reached through its port proxy
    (backends/docker/services.py), a Unix socket in `directory` per port inside. The proxy
    accepts before it connects inside, so a port where nothing listens closes at once."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    async def connect(self, port: int) -> socket.socket:
        made = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        return await connected(made, os.path.join(self.directory, f"{port}.sock"))

    def close(self) -> None:
        """Nothing to let go: the proxies are the sandbox's containers."""


Request = tuple[asyncio.AbstractEventLoop, "asyncio.Future[socket.socket]"]


class ThreadSockets(_Namespaced):
    """A root broker's: one thread of ours joined the namespace and makes the sockets."""

    def __init__(self, netns: int) -> None:
        """Takes `netns` (an open descriptor of the namespace; closed here)."""
        self._requests: queue.SimpleQueue[Request | None] = queue.SimpleQueue()
        self._closed = False
        joined: Future[None] = Future()
        self._thread = threading.Thread(target=self._run, args=(netns, joined), name="sandboxer-inside", daemon=True)
        self._thread.start()
        joined.result(timeout=HELPER_SECONDS)

    def _run(self, netns: int, joined: Future[None]) -> None:
        # The thread never returns to the host's namespace: it serves requests until closed and
        # ends there; no other thread of this process is moved.
        try:
            setns(netns, CLONE_NEWNET)
        except OSError as exc:
            joined.set_exception(BackendError(f"the sandbox's network namespace cannot be joined: {exc.strerror}"))
            return
        finally:
            os.close(netns)
        joined.set_result(None)
        while (request := self._requests.get()) is not None:
            loop, answer = request
            made: socket.socket | BackendError
            try:
                made = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            except OSError as exc:
                made = BackendError(f"no socket inside the sandbox: {exc.strerror}")
            try:
                loop.call_soon_threadsafe(_settle, answer, made)
            except RuntimeError:  # the loop is closed: nobody waits for it
                if isinstance(made, socket.socket):
                    made.close()

    async def socket(self) -> socket.socket:
        if self._closed or not self._thread.is_alive():
            raise BackendError("the sandbox's network namespace is no longer held")
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[socket.socket] = loop.create_future()
        self._requests.put((loop, answer))
        try:
            async with asyncio.timeout(ANSWER_SECONDS):
                return await answer
        except TimeoutError:
            raise BackendError("no socket inside the sandbox: its thread did not answer") from None

    def close(self) -> None:
        self._closed = True
        self._requests.put(None)


def _settle(answer: asyncio.Future[socket.socket], made: socket.socket | BackendError) -> None:
    """Hand a made socket (or the failure) to its waiter, on the waiter's loop; a socket nobody
    waits for any more is closed."""
    if answer.done():
        if isinstance(made, socket.socket):
            made.close()
    elif isinstance(made, socket.socket):
        answer.set_result(made)
    else:
        answer.set_exception(made)


class ChildSockets(_Namespaced):
    """An unprivileged broker's: a child of ours in the sandbox's user and network namespaces. One
    request at a time; a request that fails or takes too long leaves the helper unusable (its
    answers could no longer be matched to requests): that sandbox's ports then refuse until the
    service starts again."""

    def __init__(self, netns: int) -> None:
        """Takes `netns` (an open descriptor of the namespace; closed here)."""
        self._lock = asyncio.Lock()
        self._broken = False
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with theirs:
                self._child = spawn_helper(_HELPER, netns, theirs, stderr=subprocess.DEVNULL)
            ours.settimeout(HELPER_SECONDS)
            if ours.recv(1) != b"r":
                raise OSError("no answer")
        except OSError as exc:
            ours.close()
            self._stop()
            raise BackendError(f"the sandbox's network namespace cannot be joined: {exc}") from None
        finally:
            os.close(netns)
        ours.setblocking(False)
        self._pair = ours

    async def socket(self) -> socket.socket:
        async with self._lock:
            if self._broken:
                raise BackendError("no socket inside the sandbox: its helper failed earlier")
            loop = asyncio.get_running_loop()
            try:
                async with asyncio.timeout(ANSWER_SECONDS):
                    await loop.sock_sendall(self._pair, b"s")
                    fds = await _receive_fds(loop, self._pair)
            except (OSError, TimeoutError) as exc:
                self._broken = True
                raise BackendError(f"no socket inside the sandbox: {exc or 'its helper did not answer'}") from None
        if not fds:
            self._broken = True
            raise BackendError("no socket inside the sandbox: its helper ended")
        return socket.socket(fileno=fds[0])

    def close(self) -> None:
        self._pair.close()  # the child reads EOF and ends
        self._stop()

    def _stop(self) -> None:
        child = getattr(self, "_child", None)
        if child is None:
            return
        try:
            child.wait(timeout=HELPER_SECONDS)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


async def _receive_fds(loop: asyncio.AbstractEventLoop, pair: socket.socket) -> list[int]:
    """One message's descriptors from the non-blocking `pair`, waiting for it on the loop."""
    while True:
        try:
            _, fds, _, _ = socket.recv_fds(pair, 1, 1)
        except BlockingIOError:
            await readable(pair)
            continue
        return fds


async def readable(sock: socket.socket) -> None:
    """Until `sock` has something to read (or an error to report), on the running loop; nothing
    is read, so a wait that is cancelled takes nothing away from the caller."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    loop.add_reader(sock.fileno(), _settle_ready, ready)
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())


def _settle_ready(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def inside_sockets(netns: int, *, join_user: bool) -> InsideSockets:
    """Sockets made in the namespace `netns` (an open, checked descriptor: netns.open_namespace;
    taken over). `join_user`: an unprivileged broker's namespace, joined by a child."""
    return ChildSockets(netns) if join_user else ThreadSockets(netns)
