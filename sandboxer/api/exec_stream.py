"""The embedded API's exec on threads: an exec's output as an iterator while the exec runs on a
thread of its own (ExecStream), and its input fed from a binary file through a pipe (fed).

The service streams an exec over its connection instead (sandboxer.service.exec_route); both run
the one core exec (sandboxer.commands.execute).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable, Iterator

from sandboxer.api.results import Stream
from sandboxer.api.verbs import InputChunks, Stdin, checked_signal
from sandboxer.errors import BackendError

__all__ = ["ExecSink", "ExecStream", "fed"]

ExecSink = Callable[[Stream, bytes], None]  # where an exec's output goes as it arrives


@contextlib.contextmanager
def fed(stdin: Stdin) -> Iterator[bytes | int]:
    """An exec's input as the core takes it: bytes as they are; a binary file through a pipe that
    a thread fills from it as the command reads (the pipe is closed after the exec, which ends the
    thread if the command stopped reading)."""
    if isinstance(stdin, bytes):
        yield stdin
        return
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    chunks = InputChunks(stdin)

    def copy() -> None:
        try:
            for chunk in chunks:
                view = memoryview(chunk)
                while view:
                    view = view[os.write(write_end, view) :]
        except OSError:
            pass  # the command stopped reading, and the exec ended
        finally:
            os.close(write_end)

    feeder = threading.Thread(target=copy, name="sandboxer-exec-stdin", daemon=True)
    feeder.start()
    try:
        yield read_end
    finally:
        os.close(read_end)  # a feeder writing ends (EPIPE) ...
        chunks.stop()  # ... and one waiting for the caller's input
        feeder.join()
        chunks.close()
    if chunks.failure is not None:
        raise chunks.failure  # the command ran on the input read before it


class ExecStream:
    """An exec's output as an iterator of ("stdout" | "stderr", bytes); `.status` is its exit
    status once the iteration has ended. The exec runs in a thread of its own meanwhile; leaving
    the iteration early kills it (as the service does when its client stops listening), and
    `signal` sends its command a signal while it runs (as a CLI client's Ctrl-C does)."""

    def __init__(self, run: Callable[[ExecSink, Callable[[], bool], int], int]) -> None:
        self._run = run
        self.status: int | None = None
        self._signals: int | None = None  # the write end of the exec's signals while it runs
        self._lock = threading.Lock()

    def signal(self, signum: int) -> bool:
        """Send SIGINT, SIGTERM or SIGHUP to the command and its session (on Docker it ends the
        exec, status 128+N, as a CLI client's does); False when the exec is not running."""
        checked_signal(signum)
        with self._lock:
            if self._signals is None:
                return False
            try:
                os.write(self._signals, bytes([signum]))
            except BlockingIOError:
                raise BackendError("signal: the exec has not taken the signals sent before it yet") from None
            return True

    def __iter__(self) -> Iterator[tuple[Stream, bytes]]:
        chunks: queue.Queue[tuple[Stream, bytes] | None] = queue.Queue()
        failure: list[BaseException] = []
        left = threading.Event()  # the iteration ended before the exec did
        # The exec reads the signals' end as a CLI client's connection: its end is the caller's
        # going away, so the write end is closed only after the exec.
        signals, sender = os.pipe2(os.O_CLOEXEC)
        worker: threading.Thread | None = None
        try:
            os.set_blocking(sender, False)
            worker = threading.Thread(
                target=self._work, args=(chunks, failure, left, signals), name="sandboxer-exec", daemon=True
            )
            worker.start()
            with self._lock:
                self._signals = sender
            while (item := chunks.get()) is not None:
                yield item
        finally:
            left.set()  # no effect once the exec has ended
            if worker is not None and worker.ident is not None:  # it started
                worker.join()
            with self._lock:
                self._signals = None
            os.close(sender)
            os.close(signals)
        if failure:
            raise failure[0]

    def _work(
        self,
        chunks: queue.Queue[tuple[Stream, bytes] | None],
        failure: list[BaseException],
        left: threading.Event,
        signals: int,
    ) -> None:
        """The exec, on its own thread: its output into `chunks`, then None."""
        try:
            self.status = self._run(lambda stream, chunk: chunks.put((stream, chunk)), left.is_set, signals)
        except BaseException as exc:  # handed to the iterating thread
            failure.append(exc)
        finally:
            chunks.put(None)
