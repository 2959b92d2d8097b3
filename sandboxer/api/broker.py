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
from collections.abc import Callable, Mapping, Sequence

from sandboxer.api.caller import Authority, Caller
from sandboxer.api.exec_stream import ExecSink, ExecStream, fed
from sandboxer.api.results import (
    Approval,
    CallerView,
    Created,
    Dispatched,
    Evidence,
    ExecResult,
    Exported,
    GcReport,
    GrantedProfile,
    KeptExport,
    KeptExportRemoved,
    Lifetime,
    NetworkLog,
    OwnerCheck,
    OwnerEntry,
    OwnerListing,
    Receipt,
    RuntimeDigest,
    RuntimePin,
    SandboxInfo,
    Stream,
    Usage,
    WarmFill,
    WorkSummary,
)
from sandboxer.api.verbs import Input, SandboxBase, Stdin, check_dispatch, checked_create, checked_exec, checked_export
from sandboxer.backends import Backends
from sandboxer.commands import execute
from sandboxer.commands import owner as owner_commands
from sandboxer.commands.create import create as create_sandbox
from sandboxer.commands.dispatch import dispatch
from sandboxer.commands.export import Export, check_format, discard_quarantine, finished, prepare
from sandboxer.commands.export_delivery import copy_to_path, deliver_to_path
from sandboxer.commands.inspect import inspect as inspect_sandbox
from sandboxer.commands.kept import kept_file, list_kept, remove_kept
from sandboxer.commands.logs import network_log
from sandboxer.commands.owner import status_of
from sandboxer.commands.services import Services
from sandboxer.commands.teardown import gc as collect
from sandboxer.commands.teardown import list_sandboxes, residue_error
from sandboxer.commands.teardown import teardown as remove_sandbox
from sandboxer.commands.usage import described, extend, usage, work_summary
from sandboxer.commands.warm import fill
from sandboxer.core.exec_request import ExecRequest
from sandboxer.core.reading import CallerFile
from sandboxer.dirs import Dirs, require_state_dir, resolve_dirs
from sandboxer.errors import EntryError, ExecError, ExecUsage, Interrupted, NotFoundError
from sandboxer.execio.stdio import Program
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
        self.owner = Owner(self)

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
        broker.owner = Owner(broker)
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


class Sandbox(SandboxBase):
    """One live sandbox, as its caller reaches it. As a context manager it is torn down when the
    block ends."""

    def __init__(self, broker: Broker, created: Created | None, *, sandbox_id: str | None = None) -> None:
        super().__init__(created, sandbox_id)
        self.broker = broker

    def exec(
        self,
        argv: Sequence[str],
        *,
        stdin: Input = b"",
        cwd: str | None = None,
        timeout: float | None = None,
        consumer: str | None = None,
        executable: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        """Run `argv` in the sandbox and wait for it: its status and all of its output (collected
        in this thread: in-process there is no need for exec_stream's)."""
        argv, stdin = checked_exec(
            argv, stdin, cwd=cwd, timeout=timeout, consumer=consumer, executable=executable, env=env
        )
        out: list[bytes] = []
        err: list[bytes] = []

        def sink(stream: Stream, chunk: bytes) -> None:
            (out if stream == "stdout" else err).append(chunk)

        status = self._execute(
            argv, sink, stdin=stdin, cwd=cwd, timeout=timeout, consumer=consumer, executable=executable, env=env
        )
        return ExecResult(status=status, stdout=b"".join(out), stderr=b"".join(err))

    def exec_stream(
        self,
        argv: Sequence[str],
        *,
        stdin: Input = b"",
        cwd: str | None = None,
        timeout: float | None = None,
        consumer: str | None = None,
        executable: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ExecStream:
        """Run `argv` and yield its output as it comes: ("stdout" | "stderr", bytes) pairs; the
        exit status is the stream's `.status` once the iteration has ended."""
        argv, stdin = checked_exec(
            argv, stdin, cwd=cwd, timeout=timeout, consumer=consumer, executable=executable, env=env
        )
        return ExecStream(
            lambda sink, cancelled, signals: self._execute(
                argv,
                sink,
                stdin=stdin,
                cwd=cwd,
                timeout=timeout,
                consumer=consumer,
                executable=executable,
                env=env,
                cancelled=cancelled,
                signals=signals,
            )
        )

    def _execute(
        self,
        argv: Sequence[str],
        sink: ExecSink,
        *,
        stdin: Stdin,
        cwd: str | None,
        timeout: float | None,
        consumer: str | None,
        executable: str | None,
        env: Mapping[str, str] | None = None,
        cancelled: Callable[[], bool] | None = None,
        signals: int | None = None,
    ) -> int:
        """The CLI's exec with pipes for stdio: its broker failures (status 125) raise ExecError;
        a command it cannot start ends with the CLI's status and line on stderr. A binary file as
        `stdin` is fed to the command through a pipe as it reads; `cancelled` saying yes kills
        the exec (status 137); `signals` is a pipe's read end whose bytes are signals for the
        command (sandboxer.execio.stdio.Program)."""

        try:
            request = ExecRequest.of(
                self.id, argv, cwd=cwd, consumer=consumer, executable=executable, timeout=timeout, env=env
            )
        except ExecUsage as exc:  # before any of `stdin` is read
            raise ExecError(str(exc)) from None
        with fed(stdin) as source:
            try:
                stdio = Program(source, sink, cancelled, signals)
                return execute.execute(
                    self.broker.dirs, request, stdio, backends=self.broker.backends, caller_env=self.broker.environ
                )
            except ExecUsage as exc:
                raise ExecError(str(exc)) from None
            except EntryError as exc:
                sink("stderr", f"sandboxer: exec: {exc.message}\n".encode())
                return exc.status

    def _require_known(self) -> None:
        """NotFoundError (4) when the broker has no such sandbox (any more)."""
        self.broker.sandbox(self.id)

    def prepare_export(self, format: str) -> Export:
        """The sandbox's work made and verified in the service's quarantine, within this caller's
        export budget (its grant checked again first); the front end delivers it, then calls
        `finish_export` (or `discard_export` when it could not)."""
        fmt = check_format(format)
        authority = self.broker.authority
        budget = authority.export_budget()
        backends = self.broker.backends
        return authority.checking(lambda: prepare(self.broker.dirs, self.id, fmt, backends=backends, budget=budget))

    def finish_export(self, made: Export) -> None:
        """The export was delivered whole: the record notes what it took out."""
        finished(self.broker.dirs, made)

    @staticmethod
    def discard_export(made: Export) -> None:
        """An export that was not delivered: its quarantine goes."""
        discard_quarantine(made)

    def export(self, format: str, destination: str) -> Exported:
        """Take the sandbox's work out to the new local `destination` (sandboxer.api.verbs)."""
        destination = checked_export("export", format, destination)
        made = self.prepare_export(format)
        try:
            deliver_to_path(made, destination)
        except BaseException:
            discard_quarantine(made)
            raise
        self.finish_export(made)
        return made.summary(destination)

    def network_log(self, *, last: int | None = None) -> NetworkLog:
        """What its egress proxy decided, each connection oldest first (logs --network --json)."""
        return network_log(self.broker.dirs, self.id, last=last)

    def inspect(self) -> Evidence:
        """The live sandbox observed against its plan (inspect --json)."""
        return inspect_sandbox(self.broker.dirs, self.id, services=self.broker.services)

    def usage(self) -> Usage:
        return usage(self.broker.dirs, self.id, backends=self.broker.backends)

    def work_state(self) -> WorkSummary:
        return work_summary(self.broker.dirs, self.id, backends=self.broker.backends)

    def extend(self, seconds: int) -> Lifetime:
        ceiling = self.broker.authority.ttl_ceiling(self.id)
        return self.broker.authority.checking(lambda: extend(self.broker.dirs, self.id, seconds, ceiling=ceiling))

    def dispatch_tool(self, lease: str, request_id: str, wait_seconds: int = 0) -> Dispatched:
        """Relay the request `request_id` from the spool of the tool-request lease `lease` to its
        endpoint, waiting up to `wait_seconds` (0-300) for the consumer to write it
        (docs/tool-requests.md); NotPendingError (75, retryable) when it is not there yet."""

        check_dispatch(lease, request_id, wait_seconds)
        return dispatch(
            self.broker.dirs.state,
            self.id,
            lease_id=lease,
            request_id=request_id,
            wait_seconds=wait_seconds,
            backends=self.broker.backends,
        )

    def teardown(self, *, discard: bool = False) -> Receipt:
        """Remove the sandbox. Once it is gone, later calls return the same receipt; residue
        raises ResidueError (6), which carries the receipt as `.receipt`. Work no export took out
        raises UnexportedWorkError (2) unless `discard`."""
        if self._receipt is not None:
            return self._receipt
        receipt = remove_sandbox(self.broker.dirs, self.id, services=self.broker.services, keep_work=not discard)
        if receipt.residue:
            raise residue_error(receipt)
        self._receipt = receipt
        return receipt


class Owner:
    """The owner's verbs: check, approve, revoke and list owner files; digest and pin a runtime.
    Each is refused (PolicyError, 3) to a granted caller."""

    def __init__(self, broker: Broker) -> None:
        self._broker = broker
        self.dirs = broker.dirs

    def _require(self, what: str) -> None:
        self._broker.authority.require_owner(what)

    def check(self, path: str) -> OwnerCheck:
        """Validate one owner file; its normalized meaning (ConfigError, 2, when invalid)."""
        return owner_commands.check(path)

    def approve(self, name: str) -> Approval:
        """Approve the exact current bytes of one owner file."""
        self._require("ext approve")
        return owner_commands.approve(self.dirs, name, backends=self._broker.backends)

    def revoke(self, name: str) -> Approval:
        """Withdraw an approval."""
        self._require("ext revoke")
        return owner_commands.revoke(self.dirs, name)

    def listing(self) -> OwnerListing:
        """Every owner file with its approval status (ext list --json)."""
        self._require("ext list")
        return owner_commands.list_entries(self.dirs)

    def list(self) -> list[OwnerEntry]:
        """The entries of `listing()`."""
        return list(self.listing().entries)

    def runtime_digest(self, path: str, *, full: bool = False) -> RuntimeDigest:
        """The tree digest v1 of the runtime directory `path` (read with the broker's rights: only
        for a caller of the broker's own account)."""
        self._require("runtime digest")
        self._broker.authority.require_own_files("runtime digest")
        return owner_commands.runtime_digest(self.dirs, path, full=full)

    def runtime_pin(self, path: str, extension: str) -> RuntimePin:
        """Write a runtime directory and its digest into an extension config, for the owner to
        review and approve."""
        self._require("runtime pin")
        self._broker.authority.require_own_files("runtime pin")
        return owner_commands.runtime_pin(self.dirs, path, extension)
