"""`sandboxer serve`: one service per state dir, on a Unix socket, in the foreground.

It takes the state dir's service lock first (a second `serve` on the same state dir exits 3),
then its socket: a socket file nobody answers on (a dead service's) is replaced, one that answers
is refused (exit 3), and anything else at that path is never touched. The socket is 0666: who
may do what is decided per connection by the caller's kernel-reported credentials (peer.py),
never by file modes. SIGTERM or SIGINT stops accepting and ends the open requests; live
sandboxes keep running, and the next service answers for them from the registry. Logs go to
stderr. Under systemd socket activation (contrib/sandboxer.socket) it serves the socket it is
given instead of making one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import socket
import stat
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from aiohttp import web

from sandboxer.backends import Backends
from sandboxer.commands.services import Services
from sandboxer.dirs import Dirs, default_socket, require_state_dir
from sandboxer.errors import PolicyError, UsageError
from sandboxer.host.registry import Registry, try_lock_file
from sandboxer.invocation import install_thread_streams
from sandboxer.service.admission import CallerSlots
from sandboxer.service.app import Handler, make_app
from sandboxer.service.cliserver import CommandTable, Serving
from sandboxer.service.connections import Activity, Connections
from sandboxer.service.egress.proxies import Proxies
from sandboxer.service.http import AUDIT, EXECS, HEAD_SECONDS, Protocol
from sandboxer.service.lifetimes import KEEP_EXPORTS, REAP_EVERY, Reaper
from sandboxer.service.publish.table import Publishers

if TYPE_CHECKING:
    from collections.abc import Callable

LOCK_FILE = "service.lock"
SHUTDOWN_GRACE = 5.0  # seconds open requests get to finish after SIGTERM; then they are cancelled
WORKERS = 256  # commands the service runs at once: CLI commands and execs, each as long as it runs
SHORT_WORKERS = 64  # the other requests' blocking steps (admission, create, inspect, ...) at once


def serve(
    dirs: Dirs,
    *,
    socket_path: str | None,
    idle_exit: float | None,
    commands: CommandTable,
    keep_exports: float = KEEP_EXPORTS,
) -> int:
    """Run the service until SIGTERM/SIGINT (or `idle_exit` seconds without a request)."""
    path = socket_path or default_socket(dirs)
    require_state_dir(dirs.state)  # never serve records another account could have written
    registry = Registry(dirs.state)
    registry.ensure()
    require_state_dir(dirs.state)  # again once made: nobody swapped a directory above it meanwhile
    lock = try_lock_file(os.path.join(dirs.state, LOCK_FILE))
    if lock is None:
        raise PolicyError(f"a service already answers for the state dir {dirs.state}")
    _raise_descriptor_limit()
    try:
        inherited = _activated_listener()
        listener = inherited or _listen(path)
        try:
            asyncio.run(_run(dirs, listener, idle_exit, lock, commands=commands, keep_exports=keep_exports))
        finally:
            listener.close()
            if inherited is None:  # a socket systemd made stays systemd's
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
    finally:
        os.close(lock)
    return 0


def _raise_descriptor_limit() -> None:
    """Every exec holds a connection, the client's three descriptors, pipes and a pidfd: the
    usual soft limit of 1024 would run out at a few hundred; take the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _activated_listener() -> socket.socket | None:
    """The listening socket systemd passed (socket activation: LISTEN_PID names this process and
    LISTEN_FDS is 1, the socket at fd 3), or None."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()) or os.environ.get("LISTEN_FDS") != "1":
        return None
    listener = socket.socket(fileno=3)
    if listener.family != socket.AF_UNIX or listener.type != socket.SOCK_STREAM:
        listener.detach()
        raise UsageError("the socket passed by socket activation is not a Unix stream socket")
    os.set_inheritable(3, False)
    return listener


def _listen(path: str) -> socket.socket:
    """A listening socket at `path`, replacing only a dead service's socket file."""
    if len(path.encode()) > 107:
        raise UsageError(f"--socket: {path} is longer than a Unix socket path may be (107 bytes)")
    try:
        seen = os.lstat(path)
    except FileNotFoundError:
        seen = None
    if seen is not None:
        if not stat.S_ISSOCK(seen.st_mode):
            raise UsageError(f"--socket: {path} exists and is not a socket; it is left alone")
        if _answers(path):
            raise PolicyError(f"a service already listens on {path}")
        os.unlink(path)  # a dead service's socket
    os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        os.chmod(path, 0o666)  # noqa: S103 - callers are told apart by their credentials, not modes
        listener.listen(128)
    except BaseException:
        listener.close()
        raise
    return listener


def _answers(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


def _idle_clock(activity: Activity) -> Any:
    """The middleware that tells `activity` when requests begin and end (the idle exit)."""

    @web.middleware
    async def idle_clock(request: web.Request, handler: Handler) -> web.StreamResponse:
        activity.begin()
        try:
            return await handler(request)
        finally:
            activity.end()

    return idle_clock


def _start_helpers(services: Services) -> ThreadPoolExecutor:
    """What the service keeps running beside its requests: bwrap's execs are forked by a small
    process of their own, and warm pools are topped up on a thread of ours, one fill at a time."""

    services.backends.serve(True)
    fills = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandboxer-warm")
    services.fills.run_on(fills)
    return fills


def _stop_helpers(services: Services, fills: ThreadPoolExecutor) -> None:

    services.fills.run_on(None)
    fills.shutdown(wait=False, cancel_futures=True)  # a fill cut short leaves what gc removes
    services.backends.serve(False)


def _reopen(proxies: Proxies, publishers: Publishers) -> None:
    """Serve live sandboxes' egress and published ports again (the service's start)."""
    proxies.reopen()
    publishers.reopen()


async def _stop_network(
    stop: asyncio.Event, watchers: list[asyncio.Task[None]], proxies: Proxies, publishers: Publishers
) -> None:
    """The watches end, every proxy and forwarder closes (the sandboxes keep running, without
    egress or published ports)."""
    stop.set()
    for watcher in watchers:
        with contextlib.suppress(Exception):  # their passes log their own failures
            await watcher
    await proxies.close_all()
    await publishers.close_all()


async def _http_server(app: web.Application) -> tuple[web.AppRunner, Callable[[], Protocol]]:
    """aiohttp's server for the application, and what makes its handler of one connection:
    aiohttp's own, but answering what does not parse as HTTP as every other refusal (Protocol)."""

    loop = asyncio.get_running_loop()
    options: dict[str, Any] = {"access_log": None, "keepalive_timeout": HEAD_SECONDS}
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=SHUTDOWN_GRACE, **options)
    await runner.setup()
    server = runner.server
    if server is None:
        raise RuntimeError("aiohttp's runner made no server")

    def protocol() -> Protocol:
        return Protocol(server, app[AUDIT], loop=loop, **options)

    return runner, protocol


async def _run(
    dirs: Dirs,
    listener: socket.socket,
    idle_exit: float | None,
    lock: int,
    *,
    commands: CommandTable,
    keep_exports: float,
) -> None:

    # Commands run as long as they take (an exec as long as its command): they have a pool of
    # their own, so that however many run, admission, the other requests and the reaper go on.
    workers = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="sandboxer-command")
    reaper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandboxer-reaper")
    slots = CallerSlots()
    loop = asyncio.get_running_loop()
    backends = Backends()
    proxies = Proxies(dirs, backends, loop)  # the egress of sandboxes that have it
    publishers = Publishers(dirs, backends, loop)  # the published ports of sandboxes that have them
    services = Services.of(backends, egress=proxies, publish=publishers)  # what every request shares
    app = make_app(dirs, services=services, workers=workers, slots=slots)
    lifetimes = Reaper(dirs, services, app[AUDIT], keep_exports=keep_exports)
    activity = Activity()
    app.middlewares.insert(0, _idle_clock(activity))
    install_thread_streams()  # a CLI client's command prints on the client's own descriptors
    loop.set_default_executor(ThreadPoolExecutor(max_workers=SHORT_WORKERS, thread_name_prefix="sandboxer"))
    runner, protocol = await _http_server(app)
    serving = Serving(dirs=dirs, services=services, audit=app[AUDIT], commands=commands)
    connections = Connections(listener, protocol, serving, activity=activity, slots=slots, workers=workers)
    # Live sandboxes' egress and ports are served again before the first client is: none finds
    # them down.
    await loop.run_in_executor(workers, _reopen, proxies, publishers)
    acceptor = asyncio.create_task(connections.accept())
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    helpers = _start_helpers(services)
    watchers = [asyncio.create_task(proxies.watch(stop)), asyncio.create_task(publishers.watch(stop))]
    sys.stderr.write(f"sandboxer: serving {dirs.state} on {listener.getsockname()}\n")
    sys.stderr.flush()
    try:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=REAP_EVERY)
            await loop.run_in_executor(reaper, lifetimes.reap)
            await loop.run_in_executor(reaper, app[AUDIT].flush)  # suppressed refusals, counted
            # A sandbox with egress or published ports has them only while the service runs:
            # never idle then.
            forwarding = proxies.serving() or publishers.serving()
            if idle_exit is not None and activity.idle_for() > idle_exit and not forwarding:
                sys.stderr.write("sandboxer: idle, exiting\n")
                break
            if os.fstat(lock).st_nlink == 0:
                sys.stderr.write("sandboxer: the state dir was removed, exiting\n")
                break
    finally:
        await _stop_network(stop, watchers, proxies, publishers)
        acceptor.cancel()
        for gone in app[EXECS].copy():  # an exec runs as long as its command: it is cancelled
            gone.set()
        await connections.close()
        await runner.cleanup()
        workers.shutdown(wait=False)
        reaper.shutdown(wait=False)
        _stop_helpers(services, helpers)
        app[AUDIT].flush(everything=True)
    sys.stderr.write("sandboxer: stopped; live sandboxes keep running\n")
