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

from sandboxer.dirs import Dirs, require_state_dir, resolve_dirs
from sandboxer.errors import EntryError, ExecError, NotFoundError, ResidueError
from sandboxer.exec_threads import ExecSink, ExecStream, fed
from sandboxer.results import (
    Approval,
    Created,
    Dispatched,
    Evidence,
    ExecResult,
    Exported,
    GcReport,
    KeptExport,
    OwnerEntry,
    Receipt,
    RuntimeDigest,
    SandboxInfo,
    Stream,
    owner_entries,
)
from sandboxer.verbs import SandboxBase, Stdin

__all__ = ["Broker", "ExecStream", "Owner", "Sandbox"]


class Broker:
    """The broker for one config directory and one state directory.

    Unset directories resolve as the CLI resolves them: SANDBOXER_CONFIG / SANDBOXER_STATE, then
    the defaults for the calling user (/etc/sandboxer and /var/lib/sandboxer for root). A state
    dir another account could have written in is refused here (PolicyError, 3), as the CLI
    refuses it (sandboxer.dirs.state_dir_problem).
    """

    def __init__(self, *, config_dir: str | None = None, state_dir: str | None = None) -> None:
        self.dirs: Dirs = resolve_dirs(
            config_dir=config_dir,
            state_dir=state_dir,
            environ=os.environ,
            euid=os.geteuid(),
            home=os.path.expanduser("~"),
        )
        require_state_dir(self.dirs.state)
        self.owner = Owner(self.dirs)

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
        bootstrap: str | None = None,
        ttl: float | None = None,
        ref: str | None = None,
        branch: str | None = None,
    ) -> Sandbox:
        """A new sandbox from the approved `profile` (with a lease manifest and a runtime
        bootstrap file, by path, if given; its workspace at `ref`, on a new `branch`, if given).
        Nothing is left behind when it fails."""
        from sandboxer.commands.create import create

        document = create(
            self.dirs, profile, manifest_path=manifest, bootstrap=bootstrap, ttl=ttl, ref=ref, branch=branch
        )
        return Sandbox(self, Created.from_json(document))

    def sandbox(self, sandbox_id: str) -> Sandbox:
        """The sandbox `sandbox_id` of this state directory (NotFoundError, 4, when there is none)."""
        from sandboxer.host.registry import Registry, check_id

        check_id(sandbox_id)
        record = Registry(self.dirs.state).read_or_none(sandbox_id)
        if record is None or record.hidden:
            raise NotFoundError(f"no such sandbox: {sandbox_id}")
        return Sandbox(self, None, sandbox_id=sandbox_id)

    def list(self) -> list[SandboxInfo]:
        """Every sandbox of this state directory with its status."""
        from sandboxer.commands.teardown import list_sandboxes

        return [SandboxInfo.from_json(entry) for entry in list_sandboxes(self.dirs)["sandboxes"]]

    def gc(self) -> GcReport:
        """Finish what crashed creates and teardowns left; healthy and busy sandboxes stay."""
        from sandboxer.commands.teardown import gc

        return GcReport.from_json(gc(self.dirs))

    def exports(self) -> builtins.list[KeptExport]:
        """The work a service's reaper kept of expired sandboxes of this state directory."""
        from sandboxer.commands.kept import list_kept

        return [KeptExport.from_json(entry) for entry in list_kept(self.dirs, None)["exports"]]

    def get_export(self, export_id: str, destination: str, *, format: str = "bundle") -> None:
        """Write a kept export's commits (`format` "bundle") or changed tree ("tar") to the new
        local file `destination`."""
        from sandboxer.commands.export_delivery import copy_to_path
        from sandboxer.commands.kept import kept_file

        copy_to_path(kept_file(self.dirs, export_id, format, None), destination)

    def remove_export(self, export_id: str) -> tuple[str, ...]:
        """Remove a kept export; the files it held."""
        from sandboxer.commands.kept import remove_kept

        return tuple(remove_kept(self.dirs, export_id, None)["removed"])


class Sandbox(SandboxBase):
    """One live sandbox. As a context manager it is torn down when the block ends."""

    def __init__(self, broker: Broker, created: Created | None, *, sandbox_id: str | None = None) -> None:
        super().__init__(created, sandbox_id)
        self.broker = broker

    def exec(
        self,
        argv: Sequence[str],
        *,
        stdin: Stdin = b"",
        cwd: str | None = None,
        timeout: float | None = None,
        consumer: str | None = None,
        executable: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        """Run `argv` in the sandbox and wait for it: its status and all of its output (collected
        in this thread: in-process there is no need for exec_stream's)."""
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
        stdin: Stdin = b"",
        cwd: str | None = None,
        timeout: float | None = None,
        consumer: str | None = None,
        executable: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ExecStream:
        """Run `argv` and yield its output as it comes: ("stdout" | "stderr", bytes) pairs; the
        exit status is the stream's `.status` once the iteration has ended."""
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
        command (sandboxer.host.stdio.Program)."""
        from sandboxer.commands import execute
        from sandboxer.errors import ExecUsage
        from sandboxer.host.stdio import Program

        if not argv:
            raise ExecError("exec: no command")
        options = {"id": self.id}
        for name, value in (("cwd", cwd), ("consumer", consumer), ("executable", executable)):
            if value is not None:
                options[name] = value
        if timeout is not None:
            options["timeout"] = repr(float(timeout))
        with fed(stdin) as source:
            try:
                program = Program(source, sink, cancelled, signals)
                return execute.execute(self.broker.dirs, options, list(argv), program, exec_env=env)
            except ExecUsage as exc:
                raise ExecError(str(exc)) from None
            except EntryError as exc:
                sink("stderr", f"sandboxer: exec: {exc.message}\n".encode())
                return exc.status

    def _require_known(self) -> None:
        """NotFoundError (4) when the broker has no such sandbox (any more)."""
        self.broker.sandbox(self.id)

    def export(self, format: str, destination: str) -> Exported:
        """Take the sandbox's work out to the new local `destination` (sandboxer.verbs)."""
        from sandboxer.commands.export import check_format, discard_quarantine, finished, prepare
        from sandboxer.commands.export_delivery import deliver_to_path
        from sandboxer.commands.export_space import default_budget

        made = prepare(self.broker.dirs, self.id, check_format(format), budget=default_budget())
        try:
            deliver_to_path(made, destination)
        except BaseException:
            discard_quarantine(made)
            raise
        finished(self.broker.dirs, made)
        return Exported.from_json(made.summary(destination))

    def inspect(self) -> Evidence:
        """The live sandbox observed against its plan (inspect --json)."""
        from sandboxer.commands.inspect import inspect

        return Evidence.from_json(inspect(self.broker.dirs, self.id))

    def dispatch_tool(self, lease: str, request_id: str, wait_seconds: int = 0) -> Dispatched:
        """Relay the request `request_id` from the spool of the tool-request lease `lease` to its
        endpoint, waiting up to `wait_seconds` (0-300) for the consumer to write it
        (docs/tool-requests.md); NotPendingError (75, retryable) when it is not there yet."""
        from sandboxer.commands.dispatch import dispatch

        document = dispatch(
            self.broker.dirs.state, self.id, lease_id=lease, request_id=request_id, wait_seconds=wait_seconds
        )
        return Dispatched.from_json(document)

    def teardown(self, *, discard: bool = False) -> Receipt:
        """Remove the sandbox. Once it is gone, later calls return the same receipt; residue
        raises ResidueError (6), which carries the receipt as `.receipt`. Work no export took out
        raises UnexportedWorkError (2) unless `discard`."""
        if self._receipt is not None:
            return self._receipt
        from sandboxer.commands.teardown import teardown

        receipt = Receipt.from_json(teardown(self.broker.dirs, self.id, keep_work=not discard))
        if receipt.residue:
            error = ResidueError(f"teardown of {receipt.id} left residue: {'; '.join(receipt.residue)}")
            error.receipt = receipt
            raise error
        self._receipt = receipt
        return receipt


class Owner:
    """The owner's verbs: check, approve, revoke and list owner files; digest a runtime."""

    def __init__(self, dirs: Dirs) -> None:
        self.dirs = dirs

    def check(self, path: str) -> dict[str, object]:
        """Validate one owner file; its normalized meaning (ConfigError, 2, when invalid)."""
        from sandboxer.commands.owner import check

        return check(path)

    def approve(self, name: str) -> Approval:
        from sandboxer.commands.owner import approve

        return Approval.from_json(approve(self.dirs, name))

    def revoke(self, name: str) -> Approval:
        from sandboxer.commands.owner import revoke

        return Approval.from_json(revoke(self.dirs, name))

    def list(self) -> list[OwnerEntry]:
        from sandboxer.commands.owner import list_entries

        return owner_entries(list_entries(self.dirs))

    def runtime_digest(self, path: str, *, full: bool = False) -> RuntimeDigest:
        from sandboxer.commands.owner import runtime_digest

        return RuntimeDigest.from_json(runtime_digest(self.dirs, path, full=full))
