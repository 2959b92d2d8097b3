"""The HTTP API's conventions, shared by its routes: errors as `{"error": {kind, message, hint,
status}}` with the CLI's exit status and an HTTP status for it, strict JSON bodies, and blocking
work off the event loop."""

from __future__ import annotations

import asyncio
import functools
import json
import re
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from sandboxer.api.broker import Broker
from sandboxer.api.sandbox import Sandbox
from sandboxer.commands.services import Services
from sandboxer.dirs import Dirs
from sandboxer.errors import BackendError, SandboxerError, UnexportedWorkError, UsageError
from sandboxer.service.audit import AuditLog
from sandboxer.service.peer import peer_of

HTTP_STATUS = {2: 400, 3: 403, 4: 404, 5: 500, 6: 409, 75: 409, 125: 500}
# A client slower than this is dropped, so that a slow sender (slow-loris) holds nothing for long:
# the head of each request (aiohttp's keep-alive timer, which runs from the connection's start
# and from each response, and closes a connection that has not sent a whole head by then), and a
# JSON body. Streams (exec's stdin, put's archive) go at their sender's pace, within the caller's
# share of requests (CallerSlots).
HEAD_SECONDS = 10.0
BODY_SECONDS = 10.0

# What the application holds for its routes.
DIRS = web.AppKey("dirs", Dirs)  # the config and state directories it answers for
SERVICES = web.AppKey("services", Services)  # its engines and warm fills
AUDIT = web.AppKey("audit", AuditLog)
EXECS = web.AppKey("execs", set[threading.Event])  # each running exec's `gone`: set when the service stops
WORKERS = web.AppKey("workers", Executor)  # the pool commands, execs and route work run in


class PendingExports(dict[str, tuple[int, str, tuple[str, str]]]):
    """Exports sent whole to an HTTP client and not confirmed yet: token -> (the caller's uid, the
    sandbox, what the export took out). A token not confirmed within CONFIRM_SECONDS goes."""

    CONFIRM_SECONDS = 600.0

    def __init__(self) -> None:
        super().__init__()
        self._sent: dict[str, float] = {}

    def __setitem__(self, token: str, entry: tuple[int, str, tuple[str, str]]) -> None:

        super().__setitem__(token, entry)
        self._sent[token] = time.monotonic()

    def expire(self) -> None:

        now = time.monotonic()
        for token, sent in list(self._sent.items()):
            if now - sent > self.CONFIRM_SECONDS or token not in self:
                self._sent.pop(token, None)
                super().pop(token, None)


PENDING_EXPORTS = web.AppKey("pending_exports", PendingExports)


def error_document(error: SandboxerError) -> dict[str, Any]:
    """An error as the API sends it: the class, the one line, the hint, the CLI's exit status."""
    return {"kind": type(error).__name__, "message": error.message, "hint": error.hint, "status": error.status}


def error_response(error: SandboxerError, *, http_status: int | None = None, **extra: Any) -> web.Response:
    """The error envelope; its HTTP status follows from the exit status unless `http_status`."""
    status = http_status or HTTP_STATUS.get(error.status, 500)
    return web.json_response({"error": error_document(error), **extra}, status=status)


# UnexportedWorkError's two messages (sandboxer/commands/teardown.py, sandboxer/commands/work.py):
# what would be lost, joined by " and " (no item has " and " in it: git names have no spaces), or
# why the work could not be checked.
_LOST = re.compile(r"holds work no export took out: (?P<lost>.+); export it first")
_UNCHECKED = re.compile(r": (?P<why>its work cannot be checked \(.*\)); teardown --discard")


def unexported_answer(error: UnexportedWorkError, sandbox_id: str) -> dict[str, Any]:
    """What a teardown's UnexportedWorkError answers beside the envelope: `unexported`, each thing
    that would be lost (the error's own list when it carries one, else read from its message);
    `export`, the requests that take it out in one call each (a bundle for commits, a tar for
    changes not committed; none when the work cannot be checked); `discard`, the teardown that
    loses it."""
    path = f"/v1/sandboxes/{sandbox_id}"
    lost = _LOST.search(error.message)
    unchecked = _UNCHECKED.search(error.message)
    if error.unexported:
        items = list(error.unexported)
    elif lost is not None:
        items = lost["lost"].split(" and ")
    elif unchecked is not None:
        items = [unchecked["why"]]
    else:
        items = [error.message]
    answer: dict[str, Any] = {"unexported": items}
    if unchecked is None:
        formats = sorted({"tar" if item == "changes not committed" else "bundle" for item in items})
        answer["export"] = [
            {"method": "POST", "path": f"{path}/export?confirm=1", "body": {"format": fmt}} for fmt in formats
        ]
    answer["discard"] = {"method": "DELETE", "path": f"{path}?discard=true"}
    return answer


def internal_error(exc: BaseException, request: web.BaseRequest) -> SandboxerError:
    """A request that failed on what no SandboxerError names (a bug of ours): the API's envelope
    (BackendError, 5: HTTP 500) saying "internal error" as the CLI does, and one line in the
    service's log naming the route — never a traceback, never the request's content."""
    what = f"{request.method[:16]} {request.path[:200]}"
    sys.stderr.write(f"sandboxer: internal error ({type(exc).__name__}) answering {what}\n")
    return BackendError(f"internal error ({type(exc).__name__})")


async def in_thread(function: Callable[..., Any], *args: Any) -> Any:
    """A short blocking step off the event loop (admission, the audit line): the service's default
    pool, which no command holds."""
    return await asyncio.get_running_loop().run_in_executor(None, function, *args)


async def in_worker(request: web.Request, function: Callable[..., Any], *args: Any) -> Any:
    """A route's command off the event loop, in the pool commands run in (as long as they take:
    a dispatch may wait minutes), so that admission and the reaper never wait behind them."""
    return await asyncio.get_running_loop().run_in_executor(request.app[WORKERS], function, *args)


def broker_of(request: web.Request) -> Broker:
    """The core API for the request's caller (as the kernel reported it when it connected)."""
    return Broker.serving(request.app[DIRS], request["caller"], request.app[SERVICES])


async def sandbox_of(request: web.Request, unknown: Exception | None = None) -> Sandbox:
    """The sandbox the route names (`{id}`), when the caller may name it (a registry lookup: a
    worker's step); else NotFoundError, or `unknown`."""
    broker, sandbox_id = broker_of(request), request.match_info["id"]
    sandbox: Sandbox = await in_worker(request, lambda: broker.sandbox(sandbox_id, unknown=unknown))
    return sandbox


async def json_body(request: web.Request, allowed: set[str], required: set[str]) -> dict[str, Any]:
    """The request's JSON object: no other fields than `allowed`, all of `required`. The body is
    read as UTF-8 JSON whatever its Content-Type says (a charset nobody has is no error of ours)."""
    try:
        async with asyncio.timeout(BODY_SECONDS):
            data = await request.read()
    except TimeoutError:
        raise UsageError(f"the request body took longer than {BODY_SECONDS:g} s to arrive") from None
    except (aiohttp.ClientPayloadError, ConnectionError):
        raise UsageError("the request body ended before its length (Content-Length, or its last chunk)") from None
    return checked(parse_json(data, "the request body is not JSON"), allowed, required)


def strings(body: dict[str, Any], *names: str) -> None:
    """Refuse a body whose fields `names` are not strings (when present)."""
    for name in names:
        if name in body and not isinstance(body[name], str):
            raise UsageError(f"{name}: must be a string")


def parse_json(data: bytes, refusal: str) -> object:
    """`data` as UTF-8 JSON; UsageError(`refusal`) when it is not (or nests past what the parser
    takes: RecursionError)."""
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise UsageError(refusal) from None


def checked(body: object, allowed: set[str], required: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise UsageError("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise UsageError(f"{unknown[0]}: unknown field (allowed: {', '.join(sorted(allowed))})")
    missing = sorted(required - set(body))
    if missing:
        raise UsageError(f"{missing[0]}: required")
    return body


class Protocol(RequestHandler):
    """aiohttp's handler of one connection, answering what does not parse as HTTP (a request
    line, a header, a chunk) with the API's error envelope and an audit line (verb "unknown"), as
    every other refusal, instead of aiohttp's text answer and a traceback in the service's log."""

    __slots__ = ("_audit",)

    def __init__(self, manager: web.Server, audit: AuditLog, **options: Any) -> None:
        super().__init__(manager, **options)
        self._audit = audit

    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp's: an answer under way cannot become another
            raise ConnectionError("the answer was under way already")
        name = type(exc).__name__ if exc is not None else "no exception"
        error: SandboxerError
        if status < 500:
            error = UsageError(f"the request is not HTTP/1.1 as the service reads it ({name})")
        else:
            error = internal_error(exc or RuntimeError(), request)
        response = error_response(error, http_status=status)
        response.force_close()
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is not None:
            peer = peer_of(sock)
            record = functools.partial(
                self._audit.record,
                uid=peer.uid,
                pid=peer.pid,
                verb="unknown",
                sandbox=None,
                outcome=type(error).__name__,
                status=error.status,
            )
            asyncio.get_running_loop().run_in_executor(None, record)
        return response


def flag(request: web.Request, name: str, *, default: bool = False) -> bool:
    """A yes-or-no query parameter: 1 or true, 0 or false; `default` when it is not given."""
    value = request.query.get(name)
    if value is None:
        return default
    if value not in ("1", "true", "0", "false"):
        raise UsageError(f"{name}: must be 1 or 0 (true or false)")
    return value in ("1", "true")
