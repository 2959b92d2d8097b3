"""The service's HTTP/JSON API (aiohttp): `/v1/...` routes over the core's commands.

Every request is first answered by who is calling (peer.py): owners only, until grants admit
callers. A route runs the same command the CLI runs (sandboxer.commands), in a worker thread, and
answers with the same JSON document; an error is `{"error": {kind, message, hint, status}}` with
the CLI's exit status and an HTTP status for it. Exec answers with a stream of frames
(frames.py). The routes are listed in openapi.json, which `GET /v1/openapi.json` serves.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from sandboxer.dirs import Dirs
from sandboxer.errors import ExecError, ExecUsage, PolicyError, SandboxerError, UsageError
from sandboxer.service import frames
from sandboxer.service.access import Access, Refused, admit, visible
from sandboxer.service.audit import AuditLog

API_DOCUMENT = Path(__file__).with_name("openapi.json")
MAX_BODY = 16 * 1024 * 1024  # a request body larger than this is refused (413); exec's stdin is streamed
MAX_OPTIONS = 1024 * 1024  # exec's first line, its options
OUTPUT_FRAMES = 16  # exec output frames queued for a slow client before the command waits
HTTP_STATUS = {2: 400, 3: 403, 4: 404, 5: 500, 6: 409, 75: 409, 125: 500}
CREATE_FIELDS = {"profile", "ttl"}
EXEC_FIELDS = {"argv", "cwd", "timeout", "consumer", "executable"}
DISPATCH_FIELDS = {"lease", "request_id", "wait_seconds"}
DIGEST_FIELDS = {"path", "full"}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_document(error: SandboxerError) -> dict[str, Any]:
    """An error as the API sends it: the class, the one line, the hint, the CLI's exit status."""
    return {"kind": type(error).__name__, "message": error.message, "hint": error.hint, "status": error.status}


def error_response(error: SandboxerError, **extra: Any) -> web.Response:
    return web.json_response({"error": error_document(error), **extra}, status=HTTP_STATUS.get(error.status, 500))


def make_app(dirs: Dirs) -> web.Application:
    """The application for one config dir and state dir."""

    @web.middleware
    async def callers(request: web.Request, handler: Handler) -> web.StreamResponse:
        sock = request.transport.get_extra_info("socket") if request.transport else None
        if sock is None:
            return error_response(PolicyError("the caller's credentials cannot be read"))
        try:
            access = await _in_thread(admit, dirs, sock)
        except Refused as refusal:
            peer = refusal.peer
            await _in_thread(
                lambda: audit.record(
                    uid=peer.uid, pid=peer.pid, verb="refused", sandbox=None, outcome="PolicyError", status=3
                )
            )
            return error_response(refusal)
        request["access"] = access
        peer = access.peer
        response: web.StreamResponse
        try:
            response = await handler(request)
            outcome, status = "ok", request.get("exit_status", 0)
        except SandboxerError as exc:
            response, outcome, status = error_response(exc), type(exc).__name__, exc.status
        except web.HTTPRequestEntityTooLarge:
            error = UsageError(f"the request body is larger than {MAX_BODY} bytes")
            response, outcome, status = error_response(error), type(error).__name__, error.status
        verb = request.match_info.route.name or "unknown"
        sandbox = request.get("sandbox_id") or request.match_info.get("id")
        await _in_thread(
            lambda: audit.record(uid=peer.uid, pid=peer.pid, verb=verb, sandbox=sandbox, outcome=outcome, status=status)
        )
        return response

    audit = AuditLog(dirs.state)
    app = web.Application(middlewares=[callers], client_max_size=MAX_BODY)
    app["dirs"] = dirs
    app["audit"] = audit
    app.router.add_get("/v1/version", version, name="version")
    app.router.add_get("/v1/openapi.json", openapi, name="openapi")
    app.router.add_get("/v1/sandboxes", list_sandboxes, name="list")
    app.router.add_post("/v1/sandboxes", create, name="create")
    app.router.add_get("/v1/sandboxes/{id}", inspect, name="inspect")
    app.router.add_delete("/v1/sandboxes/{id}", teardown, name="teardown")
    app.router.add_post("/v1/sandboxes/{id}/exec", exec_command, name="exec")
    app.router.add_post("/v1/sandboxes/{id}/dispatch", dispatch_tool, name="dispatch-tool")
    app.router.add_post("/v1/gc", gc, name="gc")
    app.router.add_get("/v1/owner/entries", owner_entries, name="ext-list")
    app.router.add_post("/v1/owner/approve", owner_approve, name="ext-approve")
    app.router.add_post("/v1/owner/revoke", owner_revoke, name="ext-revoke")
    app.router.add_post("/v1/runtime/digest", runtime_digest, name="runtime-digest")
    return app


async def _in_thread(function: Callable[..., Any], *args: Any) -> Any:
    """A blocking command, off the event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, function, *args)


async def _json_body(request: web.Request, allowed: set[str], required: set[str]) -> dict[str, Any]:
    """The request's JSON object: no other fields than `allowed`, all of `required`."""
    try:
        body = await request.json()
    except ValueError:
        raise UsageError("the request body is not JSON") from None
    return _checked(body, allowed, required)


def _checked(body: object, allowed: set[str], required: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise UsageError("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise UsageError(f"{unknown[0]}: unknown field (allowed: {', '.join(sorted(allowed))})")
    missing = sorted(required - set(body))
    if missing:
        raise UsageError(f"{missing[0]}: required")
    return body


async def version(request: web.Request) -> web.Response:
    from sandboxer import __version__

    return web.json_response({"version": __version__, "api": "v1"})


async def openapi(request: web.Request) -> web.Response:
    return web.Response(body=API_DOCUMENT.read_bytes(), content_type="application/json")


async def list_sandboxes(request: web.Request) -> web.Response:
    from sandboxer.commands.teardown import list_sandboxes as listing

    access: Access = request["access"]
    document = await _in_thread(listing, request.app["dirs"])
    return web.json_response(visible(document, await _in_thread(access.own_ids)))


async def create(request: web.Request) -> web.Response:
    from sandboxer.commands.create import create as make

    body = await _json_body(request, CREATE_FIELDS, {"profile"})
    profile, ttl = body["profile"], body.get("ttl")
    if not isinstance(profile, str):
        raise UsageError("profile: must be a profile name")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int | float)):
        raise UsageError("ttl: must be a number of seconds")
    dirs = request.app["dirs"]
    access: Access = request["access"]
    created = await _in_thread(
        lambda: access.create(profile, ttl, lambda uid, lifetime: make(dirs, profile, caller_uid=uid, ttl=lifetime))
    )
    request["sandbox_id"] = created["id"]
    return web.json_response(created, status=201)


def _unknown(request: web.Request) -> SandboxerError:
    from sandboxer.errors import NotFoundError

    return NotFoundError(f"no such sandbox: {request.match_info['id']}")


async def inspect(request: web.Request) -> web.Response:
    from sandboxer.commands.inspect import inspect as observe

    await _in_thread(request["access"].require_own, request.match_info["id"], _unknown(request))
    return web.json_response(await _in_thread(observe, request.app["dirs"], request.match_info["id"]))


async def teardown(request: web.Request) -> web.Response:
    from sandboxer.commands.teardown import teardown as remove
    from sandboxer.errors import ResidueError

    await _in_thread(request["access"].require_own, request.match_info["id"], _unknown(request))
    receipt = await _in_thread(remove, request.app["dirs"], request.match_info["id"])
    if receipt["residue"]:
        error = ResidueError(f"teardown of {receipt['id']} left residue: {'; '.join(receipt['residue'])}")
        return error_response(error, receipt=receipt)
    return web.json_response(receipt)


def _strings(body: dict[str, Any], *names: str) -> None:
    """Refuse a body whose fields `names` are not strings (when present)."""
    for name in names:
        if name in body and not isinstance(body[name], str):
            raise UsageError(f"{name}: must be a string")


async def dispatch_tool(request: web.Request) -> web.Response:
    """dispatch-tool: relay one request from the sandbox's spool to its lease's endpoint."""
    from sandboxer.host.dispatch import dispatch

    body = await _json_body(request, DISPATCH_FIELDS, {"lease", "request_id"})
    _strings(body, "lease", "request_id")
    wait = body.get("wait_seconds", 0)
    if isinstance(wait, bool) or not isinstance(wait, int):
        raise UsageError("wait_seconds: must be a whole number of seconds")
    sandbox_id = request.match_info["id"]
    await _in_thread(request["access"].require_own, sandbox_id, _unknown(request))
    state = request.app["dirs"].state
    document = await _in_thread(
        lambda: dispatch(state, sandbox_id, lease_id=body["lease"], request_id=body["request_id"], wait_seconds=wait)
    )
    return web.json_response(document)


async def owner_entries(request: web.Request) -> web.Response:
    """ext list: every owner file with its approval status."""
    from sandboxer.commands.owner import list_entries

    request["access"].require_owner("ext list")
    return web.json_response(await _in_thread(list_entries, request.app["dirs"]))


async def owner_approve(request: web.Request) -> web.Response:
    """ext approve: approve the exact current bytes of one owner file."""
    from sandboxer.commands.owner import approve

    request["access"].require_owner("ext approve")
    body = await _json_body(request, {"name"}, {"name"})
    _strings(body, "name")
    return web.json_response(await _in_thread(approve, request.app["dirs"], body["name"]))


async def owner_revoke(request: web.Request) -> web.Response:
    """ext revoke: withdraw an approval."""
    from sandboxer.commands.owner import revoke

    request["access"].require_owner("ext revoke")
    body = await _json_body(request, {"name"}, {"name"})
    _strings(body, "name")
    return web.json_response(await _in_thread(revoke, request.app["dirs"], body["name"]))


async def runtime_digest(request: web.Request) -> web.Response:
    """runtime digest: the tree digest of a directory the service reads with its own rights, so
    only for an owner of the service's own account, and only by an absolute path."""
    from sandboxer.commands.owner import runtime_digest as digest

    access: Access = request["access"]
    access.require_owner("runtime digest")
    access.require_own_files("runtime digest")
    body = await _json_body(request, DIGEST_FIELDS, {"path"})
    _strings(body, "path")
    path, full = body["path"], body.get("full", False)
    if not path.startswith("/"):
        raise UsageError("path: must be an absolute path")
    if not isinstance(full, bool):
        raise UsageError("full: must be true or false")
    return web.json_response(await _in_thread(lambda: digest(request.app["dirs"], path, full=full)))


async def gc(request: web.Request) -> web.Response:
    from sandboxer.commands.teardown import gc as collect

    request["access"].require_owner("gc")
    return web.json_response(await _in_thread(collect, request.app["dirs"]))


async def exec_command(request: web.Request) -> web.StreamResponse:
    """The body is one line of JSON options, then the command's stdin, streamed to it as it comes;
    the answer is frames, streamed as the command writes (neither is ever held whole)."""
    head, rest = await _first_line(request)
    sandbox_id = request.match_info["id"]
    argv, cli_options = _exec_options(head, sandbox_id)
    await _in_thread(request["access"].require_own, sandbox_id, ExecError(f"exec: no such sandbox: {sandbox_id}"))

    response = web.StreamResponse(headers={"Content-Type": frames.CONTENT_TYPE})
    await response.prepare(request)
    loop = asyncio.get_running_loop()
    # A few frames in flight: a client slower than the command holds the command up, never the
    # service's memory.
    chunks: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=OUTPUT_FRAMES)
    gone = threading.Event()  # the client went away: everything the exec started is killed

    def sink(stream: str, chunk: bytes) -> None:
        kind = frames.STDOUT if stream == "stdout" else frames.STDERR
        asyncio.run_coroutine_threadsafe(chunks.put(frames.frame(kind, chunk)), loop).result()

    stdin_r, stdin_w = os.pipe2(os.O_CLOEXEC)
    feeding = asyncio.create_task(_feed(request, rest, stdin_w))

    def run() -> dict[str, Any]:
        try:
            return {"status": _execute(request.app["dirs"], cli_options, argv, stdin_r, sink, cancelled=gone.is_set)}
        except SandboxerError as exc:
            return {"error": error_document(exc)}
        finally:
            os.close(stdin_r)  # input the command never read is refused from now on
            asyncio.run_coroutine_threadsafe(chunks.put(None), loop).result()

    done = loop.run_in_executor(None, run)
    while True:
        try:
            data = await asyncio.wait_for(chunks.get(), timeout=0.5)
        except TimeoutError:
            if request.transport is None or request.transport.is_closing():
                gone.set()
            continue
        if data is None:
            break
        if not gone.is_set():
            try:
                await response.write(data)
            except ConnectionError:
                gone.set()
    result = await done
    await feeding
    request["exit_status"] = result.get("status", result.get("error", {}).get("status"))
    if not gone.is_set():
        await response.write(frames.end(result))
        await response.write_eof()
    return response


def _exec_options(head: bytes, sandbox_id: str) -> tuple[list[str], dict[str, str]]:
    """The command and the CLI's exec options from the body's first line."""
    try:
        options = _checked(json.loads(head), EXEC_FIELDS, {"argv"})
    except ValueError:
        raise UsageError("exec: the first line of the body must be a JSON object of options") from None
    argv = options["argv"]
    if not isinstance(argv, list) or not argv or not all(isinstance(arg, str) for arg in argv):
        raise UsageError("argv: must be a non-empty list of strings")
    cli_options = {"id": sandbox_id}
    for name in ("cwd", "consumer", "executable"):
        if options.get(name) is not None:
            cli_options[name] = str(options[name])
    if options.get("timeout") is not None:
        cli_options["timeout"] = repr(float(options["timeout"]))
    return argv, cli_options


async def _first_line(request: web.Request) -> tuple[bytes, bytes]:
    """The body's first line (the options), and what came after it in the same reads."""
    data = b""
    while b"\n" not in data:
        if len(data) > MAX_OPTIONS:
            raise UsageError(f"exec: the options line is longer than {MAX_OPTIONS} bytes")
        chunk = await request.content.readany()
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\n")
    return head, rest


async def _feed(request: web.Request, first: bytes, fd: int) -> None:
    """Write the rest of the body into the command's stdin pipe as it arrives, then close it. A
    command that stops reading holds the body up (the pipe is full); one that ended refuses it."""
    loop = asyncio.get_running_loop()
    try:
        chunk = first
        while True:
            if chunk:
                await loop.run_in_executor(None, _write_all, fd, chunk)
            chunk = await request.content.readany()
            if not chunk:
                break
    except (OSError, aiohttp.ClientError, asyncio.CancelledError):
        pass  # the command ended, or the client went away: the exec sees its stdin end
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _execute(
    dirs: Dirs,
    options: dict[str, str],
    argv: list[str],
    stdin: int,
    sink: Any,
    *,
    cancelled: Callable[[], bool],
) -> int:
    """The CLI's exec with the program's stdio (as the embedded API runs it), killed once
    `cancelled` says the client went away."""
    from sandboxer.commands import execute
    from sandboxer.errors import EntryError
    from sandboxer.host.stdio import Program

    try:
        return execute.execute(dirs, options, argv, Program(stdin, sink, cancelled))
    except ExecUsage as exc:
        raise ExecError(str(exc)) from None
    except EntryError as exc:
        sink("stderr", f"sandboxer: exec: {exc.message}\n".encode())
        return exc.status
