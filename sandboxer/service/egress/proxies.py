"""The service's egress proxies: one `EgressProxy` per sandbox whose profile lists network.egress,
on the service's event loop (docs/egress.md).

Creates run on worker threads: `open` hands the sandbox's listener (made inside its network
namespace by the backend) to the loop and waits until the proxy serves it. Each proxy asks
`policy_of_profile` for its policy on every connection and request: the sandbox's profile and
extension as they are approved now, so an edit revokes until it is approved again (and a file
that does not load, or an approval withdrawn, refuses everything: fail closed). `watch` runs
beside the service: every WATCH_SECONDS it looks at the owner's files and, when any changed,
has every proxy close the connections the new policy no longer allows (within a second of the
change); it also closes the proxy of a sandbox that ended elsewhere (a teardown or gc by another
process), so no listener outlives its sandbox. When the service starts, `reopen` serves every
live sandbox with egress again (a sandbox outlives its service): a listener that cannot be made
again (its address taken inside meanwhile) leaves that sandbox's egress down, which `status` says.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
from concurrent.futures import Future

from sandboxer.backends import Backends
from sandboxer.commands.logs import ACCESS_LOG, REFUSED_LOG, has_egress
from sandboxer.core.approvals import Ledger, Status
from sandboxer.core.configdir import load_extension, load_profile
from sandboxer.core.egress.inside import EGRESS_PORT
from sandboxer.core.egress.policy import EgressPolicy
from sandboxer.core.egress.profile_policy import policy_of
from sandboxer.dirs import Dirs
from sandboxer.errors import PolicyError, SandboxerError
from sandboxer.host.parse_cache import ParseCache
from sandboxer.host.registry import Registry
from sandboxer.host.sandbox_ca import load_ca
from sandboxer.service.egress.proxy import EgressProxy
from sandboxer.service.egress.report import AccessLog

log = logging.getLogger(__name__)

WATCH_SECONDS = 0.5
OPEN_SECONDS = 10.0


def policy_of_profile(dirs: Dirs, profile_name: str) -> EgressPolicy:
    """The egress policy of `profile_name` as its files are approved now; PolicyError when the
    profile or its extension is not approved as it is (an edit not approved yet, a revocation)."""
    cache = ParseCache.of_state(dirs.state)
    _, profile = load_profile(dirs.config, profile_name, cache=cache)
    _, extension = load_extension(dirs.config, profile.extension, cache=cache)
    ledger = Ledger(dirs.config)
    for name, digest in ((profile.name, profile.file_sha256), (extension.extension, extension.file_sha256)):
        if ledger.status(name, digest) is not Status.APPROVED:
            raise PolicyError(f"{name} is not approved as it is now")
    policy = policy_of(profile, extension)
    if policy is None:
        raise PolicyError(f"profile {profile_name} no longer lists network.egress")
    return policy


class Proxies:
    """Every egress proxy of one service, by sandbox id. Threads call `open`, `close` and
    `status`; the proxies themselves live on `loop`. The table is this object's, under its lock."""

    def __init__(self, dirs: Dirs, backends: Backends, loop: asyncio.AbstractEventLoop) -> None:
        self.dirs = dirs
        self.backends = backends
        self.loop = loop
        self._lock = threading.Lock()
        self._proxies: dict[str, EgressProxy] = {}
        self._down: dict[str, str] = {}  # sandbox id: why its egress is not served

    def require(self, profile: str) -> None:
        return None  # the service serves every sandbox's egress

    def open(self, sandbox_id: str, profile: str, listener: socket.socket) -> None:
        """Serve `sandbox_id`'s egress on `listener` (from a worker thread; waits until it serves)."""
        done: Future[None] = asyncio.run_coroutine_threadsafe(self._start(sandbox_id, profile, listener), self.loop)
        done.result(timeout=OPEN_SECONDS)

    def close(self, sandbox_id: str) -> None:
        """Stop `sandbox_id`'s proxy, if it has one (from any thread but the loop's)."""
        with self._lock:
            proxy = self._proxies.pop(sandbox_id, None)
            self._down.pop(sandbox_id, None)
        if proxy is not None and not self.loop.is_closed():
            asyncio.run_coroutine_threadsafe(proxy.close(), self.loop).result(timeout=OPEN_SECONDS)

    def status(self, sandbox_id: str) -> str | None:
        """ "up", "down (why)", or None when the sandbox has no egress this service knows of."""
        with self._lock:
            if sandbox_id in self._proxies:
                return "up"
            why = self._down.get(sandbox_id)
        return None if why is None else f"down ({why})"

    async def _start(self, sandbox_id: str, profile: str, listener: socket.socket) -> None:
        directory = Registry(self.dirs.state).path(sandbox_id)
        ca = load_ca(directory)  # None when the profile has no routes
        proxy = EgressProxy(
            lambda: policy_of_profile(self.dirs, profile),
            AccessLog(os.path.join(directory, ACCESS_LOG), os.path.join(directory, REFUSED_LOG)),
            ca=ca,
        )
        await proxy.start(listener)
        with self._lock:
            old = self._proxies.pop(sandbox_id, None)
            self._proxies[sandbox_id] = proxy
            self._down.pop(sandbox_id, None)
        if old is not None:
            await old.close()

    def reopen(self) -> None:
        """Serve again every live sandbox with egress (the service's start, on a worker thread)."""
        registry = Registry(self.dirs.state)
        for sandbox_id in registry.ids():
            record = registry.read_or_none(sandbox_id)
            if record is None or record.state != "ready" or not has_egress(record):
                continue
            try:
                listener = self.backends.backend(record.backend).listen_inside(record, ("127.0.0.1", EGRESS_PORT))
                self.open(sandbox_id, record.profile, listener)
            except (SandboxerError, OSError, TimeoutError) as exc:
                why = exc.message if isinstance(exc, SandboxerError) else str(exc)
                with self._lock:
                    self._down[sandbox_id] = why
                log.warning("egress of sandbox %s is down: %s", sandbox_id, why)

    async def watch(self, stop: asyncio.Event) -> None:
        """Until `stop`: revoke what the owner's files no longer allow, close ended sandboxes'."""
        seen = owner_files_state(self.dirs.config)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=WATCH_SECONDS)
            try:
                seen = await self._watch_once(seen)
            except Exception:  # one bad pass (no descriptor left, a record unreadable) is logged; the watch goes on
                log.exception("the egress watch failed a pass")

    async def _watch_once(self, seen: tuple[tuple[str, int, int], ...]) -> tuple[tuple[str, int, int], ...]:
        """One pass: revoke on a change of the owner's files, close the proxies of ended sandboxes."""
        now = await asyncio.to_thread(owner_files_state, self.dirs.config)
        if now != seen:
            for proxy in self._snapshot().values():
                proxy.revoke_check()
        for sandbox_id in await asyncio.to_thread(self._ended):
            with self._lock:
                ended_proxy = self._proxies.pop(sandbox_id, None)
            if ended_proxy is not None:
                await ended_proxy.close()
        return now

    async def close_all(self) -> None:
        """The service stops: every proxy closes (the sandboxes keep running without egress)."""
        with self._lock:
            proxies, self._proxies = self._proxies, {}
        await asyncio.gather(*(proxy.close() for proxy in proxies.values()), return_exceptions=True)

    def serving(self) -> bool:
        """Whether any sandbox's egress is served (the service must not exit idle then)."""
        with self._lock:
            return bool(self._proxies)

    def _snapshot(self) -> dict[str, EgressProxy]:
        with self._lock:
            return dict(self._proxies)

    def _ended(self) -> list[str]:
        registry = Registry(self.dirs.state)
        ended = []
        for sandbox_id in self._snapshot():
            record = registry.read_or_none(sandbox_id)
            if record is None or record.state not in ("ready", "creating"):
                ended.append(sandbox_id)
        return ended


def owner_files_state(config_dir: str) -> tuple[tuple[str, int, int], ...]:
    """What changes when an owner edits, approves or revokes: each owner file's and the ledger's
    name, size and modification time (nanoseconds)."""
    found: list[tuple[str, int, int]] = []
    for sub in ("", "extensions", "profiles"):
        directory = os.path.join(config_dir, sub)
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            continue
        for name in names:
            try:
                info = os.stat(os.path.join(directory, name), follow_symlinks=False)
            except OSError:
                continue
            found.append((os.path.join(sub, name), info.st_size, info.st_mtime_ns))
    return tuple(found)
