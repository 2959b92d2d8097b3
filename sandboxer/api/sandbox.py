"""One live sandbox of the embedded API (`Broker.create`, `Broker.sandbox`): its verbs run the
commands of the CLI for the broker's caller, whose rights the broker holds."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from sandboxer.api.caller import Authority
from sandboxer.api.exec_stream import ExecSink, ExecStream, fed
from sandboxer.api.results import (
    Created,
    Dispatched,
    Evidence,
    ExecResult,
    Exported,
    Lifetime,
    NetworkLog,
    Receipt,
    Stream,
    Usage,
    WorkSummary,
)
from sandboxer.api.verbs import Input, SandboxBase, Stdin, check_dispatch, checked_exec, checked_export
from sandboxer.backends import Backends
from sandboxer.commands import execute
from sandboxer.commands.dispatch import dispatch
from sandboxer.commands.export import Export, check_format, discard_quarantine, finished, prepare
from sandboxer.commands.export_delivery import deliver_to_path
from sandboxer.commands.inspect import inspect as inspect_sandbox
from sandboxer.commands.logs import network_log
from sandboxer.commands.services import Services
from sandboxer.commands.teardown import residue_error
from sandboxer.commands.teardown import teardown as remove_sandbox
from sandboxer.commands.usage import extend, usage, work_summary
from sandboxer.core.exec_request import ExecRequest
from sandboxer.dirs import Dirs
from sandboxer.errors import EntryError, ExecError, ExecUsage
from sandboxer.execio.stdio import Program

__all__ = ["Sandbox"]


class Holder(Protocol):
    """What a Sandbox uses of the broker that made it (sandboxer.api.broker.Broker): its
    directories and engines, and its caller's rights and environment."""

    dirs: Dirs
    services: Services
    environ: Mapping[str, str]
    authority: Authority

    @property
    def backends(self) -> Backends: ...

    def sandbox(self, sandbox_id: str, *, unknown: Exception | None = None) -> object: ...


class Sandbox(SandboxBase):
    """One live sandbox, as its caller reaches it. As a context manager it is torn down when the
    block ends."""

    def __init__(self, broker: Holder, created: Created | None, *, sandbox_id: str | None = None) -> None:
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
        """What the running sandbox uses now: memory, processes, CPU time, disk (usage --json)."""
        return usage(self.broker.dirs, self.id, backends=self.broker.backends)

    def work_state(self) -> WorkSummary:
        """Its work as its git reports it, and what no export took out (work --json)."""
        return work_summary(self.broker.dirs, self.id, backends=self.broker.backends)

    def extend(self, seconds: int) -> Lifetime:
        """Its lifetime ends `seconds` from now, within the profile's and the grant's maximum."""
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
