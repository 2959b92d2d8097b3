"""A listener made by the broker inside another network namespace (host/netns.py): root joins it
from a thread, an ordinary user through a child that joins the user namespace first. Each test
makes its own namespaces (unshare) and connects only to their loopback."""

from __future__ import annotations

import asyncio
import os
import pwd
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxer.errors import BackendError
from sandboxer.host import netns, procs
from sandboxer.host.inside_sockets import inside_sockets

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="making namespaces for other accounts needs root"),
]

REPO = Path(__file__).resolve().parents[2]
ACCOUNT = f"sbxnetns{os.environ.get('PYTEST_XDIST_WORKER', 'm')[-3:]}"
CONNECT = "import socket,sys; s=socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=5); s.sendall(b'hi')"


def _holder(*argv: str) -> Iterator[int]:
    """A process in new namespaces (`argv` runs it), until the test ends: its pid."""
    child = subprocess.Popen([*argv, "sleep", "60"])
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # unshare has exec'd sleep once its namespace differs
            if os.readlink(f"/proc/{child.pid}/ns/net") != os.readlink("/proc/self/ns/net"):
                break
            time.sleep(0.01)
        yield child.pid
    finally:
        child.kill()
        child.wait()


@pytest.fixture
def root_netns() -> Iterator[int]:
    yield from _holder("unshare", "--net", "--", "sh", "-c", 'ip link set lo up && exec "$0" "$@"')


@pytest.fixture(scope="module")
def account() -> Iterator[pwd.struct_passwd]:
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", ACCOUNT], check=True)
    try:
        yield pwd.getpwnam(ACCOUNT)
    finally:
        subprocess.run(["userdel", ACCOUNT], check=False)


def _reached(pid: int, listener_port: int, accept: object) -> bytes:
    """Connect from inside the namespace of `pid`; what the listener received."""
    inside = subprocess.Popen(
        ["nsenter", "-t", str(pid), "-n", sys.executable, "-S", "-c", CONNECT, str(listener_port)]
    )
    try:
        conn, _ = accept()  # type: ignore[operator]
        with conn:
            return bytes(conn.recv(16))
    finally:
        assert inside.wait(timeout=10) == 0


def test_root_makes_a_listener_only_the_namespace_reaches(root_netns: int) -> None:
    made = netns.listen_inside(root_netns, procs.start_time(root_netns), ("127.0.0.1", 3128), join_user=False)
    with made:
        made.setblocking(True)
        made.settimeout(10)
        assert _reached(root_netns, 3128, made.accept) == b"hi"
        with pytest.raises(ConnectionRefusedError):  # the host's own loopback has no such listener
            socket.create_connection(("127.0.0.1", 3128), timeout=2).close()


def test_a_taken_address_and_a_gone_process_are_refused(root_netns: int) -> None:
    start = procs.start_time(root_netns)
    first = netns.listen_inside(root_netns, start, ("127.0.0.1", 3128), join_user=False)
    with first, pytest.raises(BackendError, match=r"no listener at 127\.0\.0\.1:3128 inside the sandbox"):
        netns.listen_inside(root_netns, start, ("127.0.0.1", 3128), join_user=False)
    with pytest.raises(BackendError, match=r"gone|cannot be opened"):
        netns.listen_inside(root_netns, (start or 0) + 1, ("127.0.0.1", 3129), join_user=False)


def test_a_pid_its_owner_no_longer_names_is_refused_after_the_namespace_is_opened(root_netns: int) -> None:
    """The Docker Engine names a container's pid; asked again once the namespace is open, an
    answer that changed (the container ended, the pid reused) refuses the listener."""
    asked: list[int] = []

    def still_theirs() -> bool:
        asked.append(root_netns)
        return False

    start = procs.start_time(root_netns)
    with pytest.raises(BackendError, match="gone"):
        netns.listen_inside(root_netns, start, ("127.0.0.1", 3130), join_user=False, still_theirs=still_theirs)
    assert asked == [root_netns]
    # Nothing was left listening: the address is free inside.
    netns.listen_inside(root_netns, start, ("127.0.0.1", 3130), join_user=False, still_theirs=lambda: True).close()


def test_an_ordinary_user_makes_it_through_a_child_in_its_user_namespace(account: pwd.struct_passwd) -> None:
    """The user's own namespaces (unshare -Urn as the user); the listener is made by a process of
    the user's, and handed back: the connection from inside reaches it."""
    as_user = ["setpriv", f"--reuid={account.pw_uid}", f"--regid={account.pw_gid}", "--clear-groups"]
    script = (
        "import socket, sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from sandboxer.host import netns, procs\n"
        "pid = int(sys.argv[1])\n"
        "made = netns.listen_inside(pid, procs.start_time(pid), ('127.0.0.1', 3128), join_user=True)\n"
        "made.setblocking(True); made.settimeout(10)\n"
        "print('listening', flush=True)\n"
        "conn, _ = made.accept(); print(conn.recv(16).decode(), flush=True)\n"
    )
    up = ["sh", "-c", 'ip link set lo up && exec "$0" "$@"']
    for pid in _holder(*as_user, "unshare", "--user", "--map-root-user", "--net", "--", *up):
        server = subprocess.Popen(
            [*as_user, sys.executable, "-c", script, str(pid)], stdout=subprocess.PIPE, text=True, cwd="/"
        )
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "listening"
        inside = subprocess.run(
            [
                "nsenter",
                "-t",
                str(pid),
                "-U",
                "-n",
                "--preserve-credentials",
                sys.executable,
                "-S",
                "-c",
                CONNECT,
                "3128",
            ],
            check=False,
        )
        assert inside.returncode == 0
        assert server.stdout.readline().strip() == "hi"
        assert server.wait(timeout=10) == 0
        server.stdout.close()


SERVE = (
    "import socket,sys; s=socket.create_server(('127.0.0.1', int(sys.argv[1]))); print('up', flush=True)\n"
    "for _ in range(int(sys.argv[2])):\n    c,_=s.accept(); c.sendall(b'inside:'+c.recv(16)); c.close()"
)


def _server_inside(pid: int, port: int, *enter: str, count: int = 1) -> subprocess.Popen[str]:
    """A server of `count` connections on 127.0.0.1:`port` in the namespace of `pid`, listening."""
    server = subprocess.Popen(
        ["nsenter", "-t", str(pid), *enter, sys.executable, "-S", "-c", SERVE, str(port), str(count)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None
    assert server.stdout.readline().strip() == "up"
    return server


def test_root_makes_sockets_inside_that_reach_only_the_namespace(root_netns: int) -> None:
    """One thread joined the namespace makes every socket; each connects to the namespace's
    loopback, not the host's."""
    with socket.create_server(("127.0.0.1", 0)) as on_host:  # a port the host has and the namespace lacks
        host_only = on_host.getsockname()[1]
        made = inside_sockets(netns.open_namespace(root_netns, procs.start_time(root_netns)), join_user=False)
        try:
            server = _server_inside(root_netns, 3131, "-n")
            with asyncio.run(made.socket()) as inner:
                inner.settimeout(10)
                inner.connect(("127.0.0.1", 3131))
                inner.sendall(b"hi")
                assert inner.recv(32) == b"inside:hi"
            assert server.wait(timeout=10) == 0
            assert server.stdout is not None
            server.stdout.close()
            with asyncio.run(made.socket()) as inner, pytest.raises(ConnectionRefusedError):
                inner.connect(("127.0.0.1", host_only))
        finally:
            made.close()


def test_an_ordinary_user_makes_sockets_inside_through_one_child(account: pwd.struct_passwd) -> None:
    as_user = ["setpriv", f"--reuid={account.pw_uid}", f"--regid={account.pw_gid}", "--clear-groups"]
    script = (
        "import asyncio, sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from sandboxer.host import netns, procs\n"
        "from sandboxer.host.inside_sockets import inside_sockets\n"
        "pid = int(sys.argv[1])\n"
        "made = inside_sockets(netns.open_namespace(pid, procs.start_time(pid)), join_user=True)\n"
        "async def both():\n"
        "    return [await made.socket() for _ in range(2)]\n"
        "for word, s in zip((b'one', b'two'), asyncio.run(both())):\n"
        "    s.setblocking(True); s.settimeout(10); s.connect(('127.0.0.1', int(sys.argv[2])))\n"
        "    s.sendall(word); print(s.recv(32).decode(), flush=True); s.close()\n"
        "made.close()\n"
    )
    up = ["sh", "-c", 'ip link set lo up && exec "$0" "$@"']
    for pid in _holder(*as_user, "unshare", "--user", "--map-root-user", "--net", "--", *up):
        server = _server_inside(pid, 3132, "-U", "-n", "--preserve-credentials", count=2)
        argv = [*as_user, sys.executable, "-c", script, str(pid), "3132"]
        client = subprocess.run(argv, capture_output=True, text=True, cwd="/", timeout=30, check=False)
        assert client.returncode == 0, client.stderr
        assert client.stdout.split() == ["inside:one", "inside:two"]
        assert server.wait(timeout=10) == 0
        assert server.stdout is not None
        server.stdout.close()
