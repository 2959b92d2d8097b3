"""The embedded Python API: the broker in-process, with the CLI's verbs and typed results.

    from sandboxer import Broker

    broker = Broker(config_dir="/etc/sandboxer", state_dir="/var/lib/sandboxer")
    with broker.create("bwrap-local") as sb:
        result = sb.exec(["python3", "-c", "print(1)"], timeout=30)
        assert result.status == 0 and result.stdout == b"1\\n"

Every verb is the command of the same name (docs/api.md): the same checks, the same state on
disk, the same errors — the classes of `sandboxer.errors`, each with the CLI's exit status as
`.status`. The process calling it needs what the CLI would need: root or the owner's account,
and the same directories.
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Callable, Mapping

from sandboxer.api.caller import Authority, Caller
from sandboxer.api.exec_stream import ExecStream
from sandboxer.api.owner import Owner
from sandboxer.api.results import (
    CallerView,
    GcReport,
    GrantedProfile,
    KeptExport,
    KeptExportRemoved,
    SandboxInfo,
    WarmFill,
)
from sandboxer.api.sandbox import Sandbox
from sandboxer.api.verbs import checked_create, checked_export
from sandboxer.backends import Backends
from sandboxer.commands.create import create as create_sandbox
from sandboxer.commands.export_delivery import copy_to_path
from sandboxer.commands.kept import kept_file, list_kept, remove_kept
from sandboxer.commands.owner import status_of
from sandboxer.commands.services import Services
from sandboxer.commands.teardown import gc as collect
from sandboxer.commands.teardown import list_sandboxes
from sandboxer.commands.teardown import teardown as remove_sandbox
from sandboxer.commands.usage import described
from sandboxer.commands.warm import fill
from sandboxer.core.reading import CallerFile
from sandboxer.dirs import Dirs, require_state_dir, resolve_dirs
from sandboxer.errors import Interrupted, NotFoundError
from sandboxer.host.registry import Registry, check_id

__all__ = ["Broker", "ExecStream", "Owner", "Sandbox"]

# Why a service takes a lease manifest from its own account only.
MANIFEST_PATHS = "a lease manifest names host paths the broker binds into the sandbox and later removes"


class Broker:
    """The broker for one config directory and one state directory, as one caller sees it.

    Unset directories resolve as the CLI resolves them: SANDBOXER_CONFIG / SANDBOXER_STATE, then
    the defaults for the calling user (/etc/sandboxer and /var/lib/sandboxer for root). A state
    dir another account could have written in is refused here (PolicyError, 3), as the CLI
    refuses it (sandboxer.dirs.state_dir_problem). In-process the caller is this process's
    account, an owner; the service makes one per request for the caller the kernel reported
    (`Broker.serving`). Every verb is authorized here (sandboxer.api.caller.Authority), whichever
    front end asks. `backends`: the engines sandboxes run on (default: bubblewrap and Docker; a
    test gives a fake one, sandboxer.backends.Backends).
    """

    def __init__(
        self,
        *,
        config_dir: str | None = None,
        state_dir: str | None = None,
        caller: Caller | None = None,
        backends: Backends | None = None,
    ) -> None:
        self.dirs: Dirs = resolve_dirs(
            config_dir=config_dir,
            state_dir=state_dir,
            environ=os.environ,
            euid=os.geteuid(),
            home=os.path.expanduser("~"),
        )
        require_state_dir(self.dirs.state)
        self.services = Services.of(backends)
        self.environ: Mapping[str, str] = os.environ  # the caller's: a provider launch inherits from it
        self.authority = Authority(self.dirs, caller or Caller.this_process())
        self.owner = Owner(self.dirs, self.authority, self.services.backends)

    @classmethod
    def serving(
        cls, dirs: Dirs, caller: Caller, services: Services, *, environ: Mapping[str, str] | None = None
    ) -> Broker:
        """The broker of a service (whose state dir was checked when it started) for one caller,
        on the service's engines and fills; `environ`: the caller's environment when it sent one
        (a CLI client does, an HTTP client does not)."""
        broker = cls.__new__(cls)
        broker.dirs = dirs
        broker.services = services
        broker.environ = {} if environ is None else environ
        broker.authority = Authority(dirs, caller)
        broker.owner = Owner(dirs, broker.authority, services.backends)
        return broker

    @property
    def backends(self) -> Backends:
        return self.services.backends

    @property
    def caller(self) -> Caller:
        return self.authority.caller

    @property
    def config_dir(self) -> str:
        return self.dirs.config

    @property
    def state_dir(self) -> str:
        return self.dirs.state

    def create(
        self,
        profile: str,
        *,
        manifest: str | None = None,
        bootstrap: str | CallerFile | None = None,
        ttl: float | None = None,
        ref: str | None = None,
        branch: str | None = None,
        abandoned: Callable[[], bool] | None = None,
    ) -> Sandbox:
        """A new sandbox from the approved `profile` (with a lease manifest and a runtime
        bootstrap file, by path, if given; its workspace at `ref`, on a new `branch`, if given).
        Nothing is left behind when it fails, nor when `abandoned()` says the one who asked went
        away meanwhile (Interrupted, 130: it would never learn the id)."""
        sent = bootstrap if isinstance(bootstrap, CallerFile) else None  # a front end's own read of it
        manifest, path = checked_create(
            profile, manifest=manifest, bootstrap=None if sent else bootstrap, ref=ref, branch=branch
        )
        if manifest is not None:
            self.authority.require_own_files("manifest", why=MANIFEST_PATHS)
        with self.authority.creating(profile, ttl) as lifetime:
            created = create_sandbox(
                self.dirs,
                profile,
                manifest_path=manifest,
                bootstrap=sent or path,
                ttl=ttl,
                default_ttl=lifetime if ttl is None else None,  # a granted caller's ceiling
                caller_uid=self.authority.caller_uid(),
                ref=ref,
                branch=branch,
                services=self.services,
            )
        sandbox = Sandbox(self, created)
        if abandoned is not None and abandoned():
            remove_sandbox(self.dirs, sandbox.id, services=self.services)
            raise Interrupted("interrupted")
        return sandbox

    def sandbox(self, sandbox_id: str, *, unknown: Exception | None = None) -> Sandbox:
        """The sandbox `sandbox_id` of this state directory, when this caller may name it;
        NotFoundError (4) — or `unknown` — when there is none (or it is another caller's)."""
        error = unknown if unknown is not None else NotFoundError(f"no such sandbox: {sandbox_id}")
        self.authority.require_own(sandbox_id, error)
        check_id(sandbox_id)
        record = Registry(self.dirs.state).read_or_none(sandbox_id)
        if record is None or record.hidden:
            raise error
        return Sandbox(self, None, sandbox_id=sandbox_id)

    def list(self, *, work: bool = True) -> list[SandboxInfo]:
        """Every sandbox of this state directory this caller may see, with its status, whose it
        is, its age and time left, and (`work`: its git asked, a command in each running one)
        its work."""
        entries = list(list_sandboxes(self.dirs, backends=self.backends).sandboxes)
        own = self.authority.visible([entry.id for entry in entries])
        seen = entries if own is None else [entry for entry in entries if entry.id in own]
        return described(self.dirs, seen, backends=self.backends, work=work)

    def gc(self) -> GcReport:
        """Finish what crashed creates and teardowns left; healthy and busy sandboxes stay (owners)."""
        self.authority.require_owner("gc")
        return collect(self.dirs, backends=self.backends)

    def warm(self, profile: str) -> WarmFill:
        """Start the warm sandboxes `profile` keeps; remove stale ones (owners)."""
        self.authority.require_owner("warm")
        return fill(self.dirs, profile, backends=self.backends)

    def whoami(self) -> CallerView:
        """What this caller may do: an owner everything; a granted caller its profiles, with their
        limits and approval now, and its live sandboxes."""
        caller = self.caller
        rights = caller.rights
        if rights is None:
            return CallerView(uid=caller.uid, owner=True, live=None, profiles=())
        names = sorted({name for entry in rights.entries for name in entry.profiles})
        profiles = tuple(
            GrantedProfile(
                name=name,
                max_sandboxes=rights.limit_for(name),
                max_ttl_seconds=rights.ttl_ceiling_for(name),
                status=status_of(self.dirs, name),
            )
            for name in names
        )
        live = len(self.authority.visible([*Registry(self.dirs.state).ids()]) or ())
        return CallerView(uid=caller.uid, owner=False, live=live, profiles=profiles)

    def exports(self) -> builtins.list[KeptExport]:
        """The work the service's reaper kept of this caller's expired sandboxes (an owner's: all)."""
        return list(list_kept(self.dirs, self.authority.kept_viewer()).exports)

    def kept_export_file(self, export_id: str, format: str = "bundle") -> str:
        """The path of a kept export's commits (`format` "bundle") or changed tree ("tar"), for a
        caller that may name it; the front end copies it out."""
        return kept_file(self.dirs, export_id, format, self.authority.kept_viewer())

    def get_export(self, export_id: str, destination: str, *, format: str = "bundle") -> None:
        """Write a kept export's commits (`format` "bundle") or changed tree ("tar") to the new
        local file `destination`."""
        destination = checked_export("get_export", format, destination)
        copy_to_path(self.kept_export_file(export_id, format), destination)

    def remove_export(self, export_id: str) -> KeptExportRemoved:
        """Remove a kept export; the files it held."""
        return remove_kept(self.dirs, export_id, self.authority.kept_viewer())
