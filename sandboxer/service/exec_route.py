"""The exec route, `POST /v1/sandboxes/{id}/exec`, and its signals,
`POST /v1/sandboxes/{id}/exec/{exec}/signal`.

The body is one line of JSON options, then the command's stdin, streamed into it as it comes;
the answer is frames (frames.py), or NDJSON or plain text for simple clients (exec_answers.py:
`?format=` or the Accept header chooses), streamed as the command writes — neither is ever held
whole.
The command's own cgroup, session and descendants are killed when the client goes away. The
answer's `Sandboxer-Exec` header names the exec for its signals, which only its caller may send.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import math
import os
import secrets
import threading
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from sandboxer.api.results import Signalled
from sandboxer.backends import Backends
from sandboxer.commands import execute
from sandboxer.core.exec_request import ExecRequest
from sandboxer.dirs import Dirs
from sandboxer.errors import BackendError, EntryError, ExecError, ExecUsage, NotFoundError, SandboxerError, UsageError
from sandboxer.execio.stdio import CANCEL_POLL, FORWARDED, Program
from sandboxer.service import exec_answers, frames
from sandboxer.service.http import (
    BODY_SECONDS,
    DIRS,
    EXECS,
    SERVICES,
    WORKERS,
    checked,
    error_document,
    json_body,
    parse_json,
    sandbox_of,
)

EXEC_FIELDS = {"argv", "cwd", "timeout", "consumer", "executable", "env"}
MAX_OPTIONS = 1024 * 1024  # exec's first line, its options
OUTPUT_FRAMES = 64  # exec output chunks (up to 64 KiB each) queued for a slow client before the command waits
_NOT_RUN: dict[str, Any] = {"error": error_document(ExecError("exec: the service could not run it"))}
SIGNAL_NAMES = {signum.name: signum for signum in FORWARDED}  # what a CLI client passes on, too


class ExecSignals:
    """A running exec's signals: a pipe the exec reads them from (a byte each, as from a CLI
    client), who may send them (the exec's caller), and its entry in the service's registry
    (SIGNALLING) from the answer's head to the exec's end. `read_end` is the exec's: its thread
    closes it once `taken`."""

    def __init__(self, request: web.Request, sandbox_id: str) -> None:
        self.token = secrets.token_hex(16)
        self.uid = request["caller"].uid
        self.sandbox_id = sandbox_id
        self.read_end, self.write_end = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self.taken = False
        self._registry = request.app[SIGNALLING]
        self._registry[self.token] = self

    def close(self) -> None:
        """No more signals: the write end goes (once the exec is over, or cancelled: its end is no
        kill then), and the read end too if no exec took it."""
        del self._registry[self.token]
        os.close(self.write_end)
        if not self.taken:
            os.close(self.read_end)


SIGNALLING = web.AppKey("signalling", dict[str, ExecSignals])  # exec token -> its signals, while it runs


async def exec_command(request: web.Request) -> web.StreamResponse:
    """The body is one line of JSON options, then the command's stdin, streamed to it as it comes;
    the answer is frames (or NDJSON, or text: exec_answers), streamed as the command writes
    (neither is ever held whole)."""
    shape = exec_answers.chosen(request.query.get("format"), request.headers.get("Accept"))
    head, rest = await _first_line(request)
    sandbox_id = request.match_info["id"]
    document = _exec_document(head)
    await sandbox_of(request, ExecError(f"exec: no such sandbox: {sandbox_id}"))
    exec_request = _exec_request(sandbox_id, document)

    signals = ExecSignals(request, sandbox_id)
    output = _Output(asyncio.get_running_loop(), exec_answers.answer(shape))
    running: set[threading.Event] = request.app[EXECS]
    running.add(output.gone)
    stdin_r: int | None = None
    feeding: asyncio.Task[None] | None = None
    try:
        content_type = output.answer.media_type
        response = web.StreamResponse(headers={"Content-Type": content_type, frames.EXEC_HEADER: signals.token})
        await response.prepare(request)
        stdin_r, stdin_w = os.pipe2(os.O_CLOEXEC)
        feeding = asyncio.create_task(_feed(request, rest, stdin_w))  # it closes stdin_w
        run = functools.partial(
            _run,
            request.app[DIRS],
            request.app[SERVICES].backends,
            exec_request,
            stdin=stdin_r,
            signals=signals.read_end,
            output=output,
        )
        done = output.loop.run_in_executor(request.app[WORKERS], run)  # as long as the command runs
        signals.taken, stdin_r = True, None  # the exec's thread closes its ends now
        try:
            result = await output.relay(request, response)
            request["exit_status"] = result.get("status", result.get("error", {}).get("status"))
            if not output.gone.is_set():
                await response.write(output.answer.end(result))
                await response.write_eof()
        except BaseException:  # the request was cancelled: the exec ends too
            output.gone.set()
            feeding.cancel()
            raise
        await done
        await feeding
        return response
    finally:
        running.discard(output.gone)
        signals.close()
        if stdin_r is not None:  # the exec's thread never began
            os.close(stdin_r)
            if feeding is not None:
                feeding.cancel()


def _run(
    dirs: Dirs, backends: Backends, exec_request: ExecRequest, *, stdin: int, signals: int, output: _Output
) -> None:
    """The exec, in a worker thread: its result (the end's document) goes to `output` last;
    it closes the command's `stdin` and `signals` read ends when it is done with them."""
    result = _NOT_RUN  # should _execute raise what no SandboxerError is
    try:
        status = _execute(
            dirs, backends, exec_request, stdin, output.sink, cancelled=output.gone.is_set, signals=signals
        )
        result = {"status": status}
    except SandboxerError as exc:
        result = {"error": error_document(exc)}
    finally:
        os.close(stdin)  # input the command never read is refused from now on
        os.close(signals)
        output.put(result)  # the end frame goes out as soon as the loop has it


async def signal_exec(request: web.Request) -> web.Response:
    """`{"signal": "SIGINT" | "SIGTERM" | "SIGHUP"}` for the running exec the path names, from
    its own caller; for anyone else, and once it has ended, it is not found."""
    body = await json_body(request, {"signal"}, {"signal"})
    name = body["signal"]
    if not isinstance(name, str) or name not in SIGNAL_NAMES:
        raise UsageError(f"signal: must be one of {', '.join(SIGNAL_NAMES)}")
    token, sandbox_id = request.match_info["exec"], request.match_info["id"]
    entry = request.app[SIGNALLING].get(token)
    if entry is None or entry.sandbox_id != sandbox_id or entry.uid != request["caller"].uid:
        raise NotFoundError(f"no such exec: {token[:64]}")
    try:
        os.write(entry.write_end, bytes([SIGNAL_NAMES[name]]))
    except BlockingIOError:
        raise BackendError("signal: the exec has not taken the signals sent before it yet") from None
    except BrokenPipeError:  # it has just ended: its thread no longer reads them
        raise NotFoundError(f"no such exec: {token[:64]}") from None
    return web.json_response(Signalled(signal=name).to_json())


class _Output:
    """An exec's way to its client: output chunks queued by the exec's thread, then its result
    (the end's document) as the last item; written out by the event loop in the `answer`'s shape.
    A few chunks in flight: a client slower than the command holds the command up, never the
    service's memory."""

    def __init__(self, loop: asyncio.AbstractEventLoop, answer: exec_answers.Answer) -> None:
        self.loop = loop
        self.answer = answer
        self.chunks: asyncio.Queue[tuple[str, bytes] | dict[str, Any]] = asyncio.Queue(maxsize=OUTPUT_FRAMES)
        self.gone = threading.Event()  # the client went away (or the service stops): the exec is killed

    def put(self, item: tuple[str, bytes] | dict[str, Any]) -> None:
        """Queue output for the client (from the exec's thread), waiting while the queue is full —
        until the client goes away or the request ends."""
        future = asyncio.run_coroutine_threadsafe(self.chunks.put(item), self.loop)
        while not self.gone.is_set():
            try:
                future.result(timeout=CANCEL_POLL)
                return
            except concurrent.futures.TimeoutError:
                continue
        future.cancel()

    def sink(self, stream: str, chunk: bytes) -> None:
        self.put((stream, chunk))

    async def relay(self, request: web.Request, response: web.StreamResponse) -> dict[str, Any]:
        """Write the queued output to the client until the exec's end: its result. A client that
        went away sets `gone`, and the rest is drained unwritten."""
        while True:
            try:
                async with asyncio.timeout(0.5):
                    data = await self.chunks.get()
            except TimeoutError:
                if request.transport is None or request.transport.is_closing():
                    self.gone.set()
                continue
            if isinstance(data, dict):
                return data
            encoded = self.answer.output(*data)
            if encoded and not self.gone.is_set():
                try:
                    await response.write(encoded)
                except ConnectionError:
                    self.gone.set()


def _exec_document(head: bytes) -> dict[str, Any]:
    """The body's first line, the exec's options, as a JSON object of the right shape."""
    refusal = "exec: the first line of the body must be a JSON object of options"
    options = checked(parse_json(head, refusal), EXEC_FIELDS, {"argv"})
    argv = options["argv"]
    if not isinstance(argv, list) or not argv or not all(isinstance(arg, str) for arg in argv):
        raise UsageError("argv: must be a non-empty list of strings")
    if any("\0" in arg for arg in argv):
        raise UsageError("argv: must not hold a NUL character (no command line can)")
    for name in ("cwd", "consumer", "executable"):
        if options.get(name) is not None and (not isinstance(options[name], str) or "\0" in options[name]):
            raise UsageError(f"{name}: must be a string (without NUL)")
    timeout = options.get("timeout")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, int | float) or not math.isfinite(timeout)
    ):
        raise UsageError("timeout: must be a number of seconds")
    env = options.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise UsageError("env: must map names to strings")
    if any("\0" in k or "\0" in v for k, v in env.items()):
        raise UsageError("env: must not hold a NUL character")
    return options


def _exec_request(sandbox_id: str, options: dict[str, Any]) -> ExecRequest:
    """The exec the options ask for (refused with the CLI's line, status 125)."""
    try:
        return ExecRequest.of(
            sandbox_id,
            options["argv"],
            cwd=options.get("cwd"),
            consumer=options.get("consumer"),
            executable=options.get("executable"),
            timeout=options.get("timeout"),
            env=options.get("env"),
        )
    except ExecUsage as exc:
        raise ExecError(str(exc)) from None


async def _first_line(request: web.Request) -> tuple[bytes, bytes]:
    """The body's first line (the options), and what came after it in the same reads."""
    data = b""
    try:
        async with asyncio.timeout(BODY_SECONDS):
            while b"\n" not in data:
                if len(data) > MAX_OPTIONS:
                    raise UsageError(f"exec: the options line is longer than {MAX_OPTIONS} bytes")
                chunk = await request.content.readany()
                if not chunk:
                    break
                data += chunk
    except TimeoutError:
        raise UsageError(f"exec: the options line took longer than {BODY_SECONDS:g} s to arrive") from None
    except (aiohttp.ClientPayloadError, ConnectionError):
        raise UsageError("exec: the body ended before its options line did") from None
    head, _, rest = data.partition(b"\n")
    return head, rest


async def _feed(request: web.Request, first: bytes, fd: int) -> None:
    """Write the rest of the body into the command's stdin pipe as it arrives, then close it — on
    the event loop, the pipe non-blocking (no worker thread waits on it). A command that stops
    reading holds the body up (the pipe is full); one that ended refuses it."""
    os.set_blocking(fd, False)
    try:
        chunk = first
        while True:
            if chunk:
                await _write_all(fd, chunk)
            chunk = await request.content.readany()
            if not chunk:
                break
    except (OSError, aiohttp.ClientError, asyncio.CancelledError):
        pass  # the command ended, or the client went away: the exec sees its stdin end
    finally:
        os.close(fd)


async def _write_all(fd: int, data: bytes) -> None:
    """Write all of `data` to a non-blocking pipe, waiting for room as it needs."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            await _room(fd)


async def _room(fd: int) -> None:
    """Until the pipe `fd` takes writes again."""
    loop = asyncio.get_running_loop()
    room: asyncio.Future[None] = loop.create_future()

    def writable() -> None:
        if not room.done():
            room.set_result(None)

    loop.add_writer(fd, writable)
    try:
        await room
    finally:
        loop.remove_writer(fd)


def _execute(
    dirs: Dirs,
    backends: Backends,
    exec_request: ExecRequest,
    stdin: int,
    sink: Any,
    *,
    cancelled: Callable[[], bool],
    signals: int,
) -> int:
    """The core's exec with the program's stdio (as the embedded API runs it), killed once
    `cancelled` says the client went away; `signals` carries the client's for the command."""

    try:
        # An HTTP client sends no environment: a provider launch inherits nothing through it.
        program = Program(stdin, sink, cancelled, signals)
        return execute.execute(dirs, exec_request, program, backends=backends, caller_env={})
    except ExecUsage as exc:
        raise ExecError(str(exc)) from None
    except EntryError as exc:
        sink("stderr", f"sandboxer: exec: {exc.message}\n".encode())
        return exc.status
