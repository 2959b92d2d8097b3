"""The HTTP API's conventions, shared by its routes: errors as `{"error": {kind, message, hint,
status}}` with the CLI's exit status and an HTTP status for it, strict JSON bodies, and blocking
work off the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from aiohttp import web

from sandboxer.dirs import Dirs
from sandboxer.errors import SandboxerError, UsageError
from sandboxer.service.audit import AuditLog

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
        import time

        super().__setitem__(token, entry)
        self._sent[token] = time.monotonic()

    def expire(self) -> None:
        import time

        now = time.monotonic()
        for token, sent in list(self._sent.items()):
            if now - sent > self.CONFIRM_SECONDS or token not in self:
                self._sent.pop(token, None)
                super().pop(token, None)


PENDING_EXPORTS = web.AppKey("pending_exports", PendingExports)


def error_document(error: SandboxerError) -> dict[str, Any]:
    """An error as the API sends it: the class, the one line, the hint, the CLI's exit status."""
    return {"kind": type(error).__name__, "message": error.message, "hint": error.hint, "status": error.status}


def error_response(error: SandboxerError, **extra: Any) -> web.Response:
    return web.json_response({"error": error_document(error), **extra}, status=HTTP_STATUS.get(error.status, 500))


async def in_thread(function: Callable[..., Any], *args: Any) -> Any:
    """A short blocking step off the event loop (admission, the audit line): the service's default
    pool, which no command holds."""
    return await asyncio.get_running_loop().run_in_executor(None, function, *args)


async def in_worker(request: web.Request, function: Callable[..., Any], *args: Any) -> Any:
    """A route's command off the event loop, in the pool commands run in (as long as they take:
    a dispatch may wait minutes), so that admission and the reaper never wait behind them."""
    return await asyncio.get_running_loop().run_in_executor(request.app[WORKERS], function, *args)


async def require_own(request: web.Request, sandbox_id: str, unknown: SandboxerError) -> None:
    """Access.require_own for the request's caller: a granted caller's sandbox is looked up in
    the registry (a worker's step); an owner may name any sandbox."""
    access = request["access"]
    if not access.owner:
        await in_worker(request, access.require_own, sandbox_id, unknown)


async def json_body(request: web.Request, allowed: set[str], required: set[str]) -> dict[str, Any]:
    """The request's JSON object: no other fields than `allowed`, all of `required`."""
    try:
        async with asyncio.timeout(BODY_SECONDS):
            body = await request.json()
    except ValueError:
        raise UsageError("the request body is not JSON") from None
    except TimeoutError:
        raise UsageError(f"the request body took longer than {BODY_SECONDS:g} s to arrive") from None
    return checked(body, allowed, required)


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
