"""The service's published ports: the forwarders of every sandbox whose lease manifest publishes
ports (and whose profile says network.publish: loopback), by sandbox id (docs/publish.md).

A create reserves the host's ports first (`reserve`: each 127.0.0.1:HOST bound and listening, so a
taken one refuses the create before anything is made), then, once the sandbox runs, hands them to
`open` with what makes sockets inside the sandbox. The forwarders live on the service's loop and
outlive the caller; teardown closes them (`close`). `watch` closes those of sandboxes that ended
elsewhere; `reopen`, at the service's start, serves every live sandbox's ports again (a port taken
meanwhile leaves that mapping down, which `status` says).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import threading
from collections.abc import Sequence
from concurrent.futures import Future

from sandboxer.backends import Backends
from sandboxer.core.approvals import Ledger, Status
from sandboxer.core.configdir import load_profile
from sandboxer.dirs import Dirs
from sandboxer.errors import PolicyError, SandboxerError
from sandboxer.host.inside_sockets import InsideSockets
from sandboxer.host.parse_cache import ParseCache
from sandboxer.host.registry import Registry
from sandboxer.service.egress.proxies import owner_files_state
from sandboxer.service.publish.forwarder import Budget, PortForwarder

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
LISTEN_BACKLOG = 128
WATCH_SECONDS = 0.5
OPEN_SECONDS = 10.0
PortMapping = tuple[int, int]  # (host port on 127.0.0.1, port inside the sandbox)


def reserve(file: str, ports: Sequence[PortMapping]) -> list[socket.socket]:
    """A listening socket on the host's 127.0.0.1 for each mapping, in order; PolicyError (3)
    naming the mapping when a port is taken (every socket made so far closed)."""
    made: list[socket.socket] = []
    try:
        for index, (host, _) in enumerate(ports):
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            made.append(listener)
            # SO_REUSEADDR: a restarted service binds again past TIME_WAIT; still refused while
            # anything listens there. Never SO_REUSEPORT: no second listener shares the port.
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                listener.bind((LOOPBACK, host))
                listener.listen(LISTEN_BACKLOG)  # may find the port taken too, by a racing listener
            except OSError as exc:
                why = "is taken" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
                raise PolicyError(f"{file}: published_ports[{index}].host: {LOOPBACK}:{host} {why}") from None
    except BaseException:
        for listener in made:
            listener.close()
        raise
    return made


def publishing_refused(dirs: Dirs, profile_name: str) -> str | None:
    """None when `profile_name` is approved as it is now and says network.publish: loopback; else
    why its sandboxes may not publish (the owner edited, revoked or closed it)."""
    try:
        _, profile = load_profile(dirs.config, profile_name, cache=ParseCache.of_state(dirs.state))
    except SandboxerError as exc:
        return exc.message
    if Ledger(dirs.config).status(profile.name, profile.file_sha256) is not Status.APPROVED:
        return f"profile {profile_name} is not approved as it is now"
    return None if profile.publish == "loopback" else f"profile {profile_name} no longer publishes ports"


class Publishers:
    """Every published port of one service, by sandbox id. Threads call `open`, `close`, `status`;
    the forwarders live on `loop`. The table is this object's, under its lock."""

    def __init__(self, dirs: Dirs, backends: Backends, loop: asyncio.AbstractEventLoop) -> None:
        self.dirs = dirs
        self.backends = backends
        self.loop = loop
        self._lock = threading.Lock()
        self._forwarders: dict[str, tuple[list[PortForwarder], InsideSockets]] = {}
        self._down: dict[str, dict[PortMapping, str]] = {}  # sandbox id: mapping: why it is not served
        self._budget = Budget()  # connections at once on all of them (the loop's alone)

    def require(self, profile: str) -> None:
        return None  # the service serves every sandbox's ports

    def reserve(self, file: str, ports: Sequence[PortMapping]) -> list[socket.socket]:
        return reserve(file, ports)

    def open(
        self, sandbox_id: str, ports: Sequence[PortMapping], listeners: Sequence[socket.socket], inside: InsideSockets
    ) -> None:
        """Forward `listeners` (reserved for `ports`, taken over) into the sandbox from now on."""
        done: Future[None] = asyncio.run_coroutine_threadsafe(
            self._start(sandbox_id, ports, listeners, inside), self.loop
        )
        try:
            done.result(timeout=OPEN_SECONDS)
        except BaseException:
            done.cancel()  # not started yet: it never will be; started: _start undoes itself
            raise

    async def _start(
        self, sandbox_id: str, ports: Sequence[PortMapping], listeners: Sequence[socket.socket], inside: InsideSockets
    ) -> None:
        try:
            pairs = zip(listeners, ports, strict=True)
            forwarders = [PortForwarder(listener, runtime, inside, self._budget) for listener, (_, runtime) in pairs]
            for forwarder in forwarders:
                forwarder.start()
        except BaseException:
            for listener in listeners:
                listener.close()
            await asyncio.to_thread(inside.close)
            raise
        with self._lock:
            old = self._forwarders.pop(sandbox_id, None)
            self._forwarders[sandbox_id] = (forwarders, inside)
        if old is not None:
            await _close(*old)

    def close(self, sandbox_id: str) -> None:
        """Stop `sandbox_id`'s forwarders, if it has any (from any thread but the loop's)."""
        with self._lock:
            entry = self._forwarders.pop(sandbox_id, None)
            self._down.pop(sandbox_id, None)
        if entry is not None and not self.loop.is_closed():
            asyncio.run_coroutine_threadsafe(_close(*entry), self.loop).result(timeout=OPEN_SECONDS)

    def status(self, sandbox_id: str) -> list[dict[str, object]] | None:
        """Each mapping as this service serves it: host address, port inside, `up` or `down
        (why)`, connections forwarded and refused; None when it publishes nothing here."""
        with self._lock:
            entry = self._forwarders.get(sandbox_id)
            down = dict(self._down.get(sandbox_id, {}))
        if entry is None and not down:
            return None
        seen: list[dict[str, object]] = []
        for forwarder in entry[0] if entry is not None else []:
            seen.append(
                {
                    "host": f"{LOOPBACK}:{forwarder.host}",
                    "runtime": forwarder.runtime,
                    "forwarder": "up",
                    "forwarded": forwarder.forwarded,
                    "refused": forwarder.refused,
                }
            )
        for (host, runtime), why in down.items():
            seen.append({"host": f"{LOOPBACK}:{host}", "runtime": runtime, "forwarder": f"down ({why})"})
        return sorted(seen, key=lambda item: str(item["host"]))

    def reopen(self) -> None:
        """Serve again every live sandbox's published ports (the service's start, on a worker)."""
        registry = Registry(self.dirs.state)
        for sandbox_id in registry.ids():
            record = registry.read_or_none(sandbox_id)
            if record is None or record.state != "ready" or record.manifest is None or not record.manifest.published:
                continue
            ports = record.manifest.published
            refused = publishing_refused(self.dirs, record.profile)
            if refused is not None:
                self._mark_down(sandbox_id, ports, f"revoked: {refused}")
                continue
            try:
                listeners = reserve(record.manifest.file, ports)
            except PolicyError as exc:
                self._mark_down(sandbox_id, ports, exc.message.rsplit(": ", 1)[-1])
                continue
            try:
                inside = self.backends.backend(record.backend).inside_sockets(record)
            except (SandboxerError, OSError) as exc:
                for listener in listeners:
                    listener.close()
                self._mark_down(sandbox_id, ports, exc.message if isinstance(exc, SandboxerError) else str(exc))
                continue
            try:
                self.open(sandbox_id, ports, listeners, inside)
            except (SandboxerError, OSError, TimeoutError) as exc:
                for listener in listeners:
                    listener.close()
                inside.close()
                self._mark_down(sandbox_id, ports, exc.message if isinstance(exc, SandboxerError) else str(exc))

    def _mark_down(self, sandbox_id: str, ports: Sequence[PortMapping], why: str) -> None:
        with self._lock:
            self._down[sandbox_id] = {mapping: why for mapping in ports}
        log.warning("published ports of sandbox %s are down: %s", sandbox_id, why)

    async def watch(self, stop: asyncio.Event) -> None:
        """Until `stop`: close the forwarders of sandboxes that ended elsewhere, and of those whose
        profile no longer publishes (approved as it is): all of them when the owner's files
        change, and each new one on the pass after it opened (a create that began before the
        owner's change may open its ports after the pass that saw it)."""
        seen = owner_files_state(self.dirs.config)
        checked: set[str] = set()  # the sandboxes looked at since the owner's files were `seen`
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=WATCH_SECONDS)
            try:
                now = await asyncio.to_thread(owner_files_state, self.dirs.config)
                if now != seen:
                    checked = set()
                revoked, looked = await asyncio.to_thread(self._revoked, checked)
                seen, checked = now, checked | looked
                for sandbox_id, why in [*revoked.items(), *((i, None) for i in await asyncio.to_thread(self._ended))]:
                    with self._lock:
                        entry = self._forwarders.pop(sandbox_id, None)
                    if entry is not None:
                        await _close(*entry)
                        if why is not None:
                            ports = [(forwarder.host, forwarder.runtime) for forwarder in entry[0]]
                            self._mark_down(sandbox_id, ports, f"revoked: {why}")
            except Exception:  # one bad pass is logged; the watch goes on
                log.exception("the published ports' watch failed a pass")

    def _revoked(self, checked: set[str]) -> tuple[dict[str, str], set[str]]:
        """The served sandboxes, but those `checked` already, whose profile no longer lets them
        publish (id -> why), and the ids looked at."""
        registry = Registry(self.dirs.state)
        with self._lock:
            ids = set(self._forwarders) - checked
        found: dict[str, str] = {}
        for sandbox_id in ids:
            record = registry.read_or_none(sandbox_id)
            why = None if record is None else publishing_refused(self.dirs, record.profile)
            if why is not None:
                found[sandbox_id] = why
        return found, ids

    async def close_all(self) -> None:
        """The service stops: every forwarder closes (the sandboxes keep running, unpublished)."""
        with self._lock:
            entries, self._forwarders = self._forwarders, {}
        await asyncio.gather(*(_close(*entry) for entry in entries.values()), return_exceptions=True)

    def serving(self) -> bool:
        """Whether any sandbox's ports are served (the service must not exit idle then)."""
        with self._lock:
            return bool(self._forwarders)

    def _ended(self) -> list[str]:
        registry = Registry(self.dirs.state)
        with self._lock:
            ids = list(self._forwarders)
        ended = []
        for sandbox_id in ids:
            record = registry.read_or_none(sandbox_id)
            if record is None or record.state not in ("ready", "creating"):
                ended.append(sandbox_id)
        return ended


async def _close(forwarders: list[PortForwarder], inside: InsideSockets) -> None:
    await asyncio.gather(*(forwarder.close() for forwarder in forwarders), return_exceptions=True)
    await asyncio.to_thread(inside.close)  # a child helper is waited for: not on the loop
