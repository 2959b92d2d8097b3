"""The service's HTTP/JSON API (aiohttp): `/v1/...` routes over the core's commands.

Every request is first answered by who is calling (peer.py): owners only, until grants admit
callers. A route runs the same command the CLI runs (sandboxer.commands), in a worker thread, and
answers with the same JSON document; an error is `{"error": {kind, message, hint, status}}` with
the CLI's exit status and an HTTP status for it. Exec answers with a stream of frames
(frames.py), or NDJSON or text for a simple client (exec_answers.py); an export is noted when
its client confirms it, or in its one call with `?confirm=1` (docs/service.md, "Simple
clients"). The routes are the table in routes/; `GET /v1/openapi.json` serves their OpenAPI document.
"""

from __future__ import annotations

import base64
import binascii
import functools
import os
import socket
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor

from aiohttp import web

from sandboxer import __version__
from sandboxer.api.results import JsonResult, KeptExports, Receipt, SandboxList, Version
from sandboxer.commands.export_delivery import CHUNK
from sandboxer.commands.services import Services
from sandboxer.core.reading import CallerFile
from sandboxer.dirs import Dirs
from sandboxer.errors import (
    NotFoundError,
    PolicyError,
    ResidueError,
    SandboxerError,
    UnexportedWorkError,
    UsageError,
)
from sandboxer.host.registry import ID_PATTERN
from sandboxer.service import watch_route
from sandboxer.service.admission import CALLS_PER_CALLER, CallerSlots, Refused, admit, owner_by_uid
from sandboxer.service.audit import AuditLog
from sandboxer.service.exec_route import SIGNALLING, exec_command, signal_exec
from sandboxer.service.export_route import export, export_confirm
from sandboxer.service.http import (
    AUDIT,
    DIRS,
    EXECS,
    PENDING_EXPORTS,
    SERVICES,
    WORKERS,
    PendingExports,
    broker_of,
    error_document,
    error_response,
    flag,
    in_thread,
    in_worker,
    internal_error,
    json_body,
    sandbox_of,
    strings,
    unexported_answer,
)
from sandboxer.service.peer import Peer, peer_of
from sandboxer.service.routes import ROUTES, body_fields, document_bytes

MAX_BODY = 16 * 1024 * 1024  # a request body larger than this is refused (413); exec's stdin is streamed
CREATE_FIELDS = body_fields("create")
DISPATCH_FIELDS = body_fields("dispatch-tool")
DIGEST_FIELDS = body_fields("runtime-digest")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def make_app(dirs: Dirs, *, services: Services, workers: Executor, slots: CallerSlots) -> web.Application:
    """The application for one config dir and state dir, on `services` (its engines and warm
    fills). `workers` runs execs (for as long as
    their commands run); `slots` is each account's share of the requests under way, shared with
    the CLI clients."""

    @web.middleware
    async def callers(request: web.Request, handler: Handler) -> web.StreamResponse:
        sock = request.transport.get_extra_info("socket") if request.transport else None
        if sock is None:
            return error_response(PolicyError("the caller's credentials cannot be read"))
        peer = peer_of(sock)
        if request.match_info.route.name == "exec-signal":  # short, and for execs that hold the slots
            return await admitted(request, handler, sock, peer)
        if not slots.take(peer.uid):
            busy = PolicyError(
                f"uid {peer.uid} has {CALLS_PER_CALLER} requests under way (the service's limit per caller)"
            )
            verb = request.match_info.route.name or "unknown"
            await in_thread(
                lambda: audit.record(uid=peer.uid, pid=peer.pid, verb=verb, sandbox=None, outcome="Busy", status=3)
            )
            return web.json_response({"error": error_document(busy)}, status=429)
        try:
            return await admitted(request, handler, sock, peer)
        finally:
            slots.give(peer.uid)

    async def admitted(request: web.Request, handler: Handler, sock: socket.socket, peer: Peer) -> web.StreamResponse:
        try:
            caller = owner_by_uid(peer) or await in_thread(admit, dirs, sock)
        except Refused as refusal:
            await in_thread(
                lambda: audit.record(
                    uid=peer.uid, pid=peer.pid, verb="refused", sandbox=None, outcome="PolicyError", status=3
                )
            )
            return error_response(refusal)
        request["caller"] = caller
        response, outcome, status = await _answer(request, handler)
        verb = request.match_info.route.name or "unknown"
        sandbox = request.get("sandbox_id") or request.match_info.get("id")
        if sandbox is not None and not ID_PATTERN.fullmatch(sandbox):
            sandbox = None  # an id, never other text the caller put in the path
        await in_thread(
            lambda: audit.record(uid=peer.uid, pid=peer.pid, verb=verb, sandbox=sandbox, outcome=outcome, status=status)
        )
        return response

    audit = AuditLog(dirs.state, exempt=(0, os.geteuid()))  # refusals rate-limited per account but the owners'
    app = web.Application(middlewares=[callers], client_max_size=MAX_BODY)
    app[DIRS] = dirs
    app[SERVICES] = services
    app[AUDIT] = audit
    app[EXECS] = set()  # each running exec's `gone`: set when the service stops (serve.py)
    app[SIGNALLING] = {}
    app[WORKERS] = workers
    app[PENDING_EXPORTS] = PendingExports()
    _add_routes(app)
    return app


async def _answer(request: web.Request, handler: Handler) -> tuple[web.StreamResponse, str, int | None]:
    """The route's answer, its outcome for the audit log ("ok" or the error's class) and status —
    however it ended: every refusal is the API's envelope."""
    try:
        response = await handler(request)
    except SandboxerError as exc:
        return error_response(exc), type(exc).__name__, exc.status
    except web.HTTPException as exc:  # aiohttp's own refusals: no such route, method, a body too large
        error = _http_refusal(request, exc)
        response = error_response(error, http_status=exc.status if exc.status != 413 else None)
        return response, type(error).__name__, error.status
    except ConnectionError:  # the client went away mid-answer: the log has a line, the service no traceback
        if request.transport is not None:
            request.transport.close()  # what part of an answer went stays the only part
        return web.Response(status=499), "ClientGone", request.get("exit_status")
    except Exception as exc:  # a bug of ours: still the envelope and an audit line, not aiohttp's text 500
        error = internal_error(exc, request)
        return error_response(error), type(error).__name__, error.status
    return response, "ok", request.get("exit_status", 0)


def _http_refusal(request: web.Request, exc: web.HTTPException) -> SandboxerError:
    """aiohttp's refusal as the API's: an unknown route is not found, a method the route does not
    answer and a body too large are usage errors. (The path is the caller's own, cut short.)"""

    path = request.path[:200]
    if isinstance(exc, web.HTTPNotFound):
        return NotFoundError(f"no such route: {request.method[:16]} {path}", hint="GET /v1/openapi.json lists them")
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        return UsageError(f"{request.method[:16]} {path}: not a method of this route (allowed: {allowed})")
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return UsageError(f"the request body is larger than {MAX_BODY} bytes")
    return UsageError(f"the request was refused ({exc.status} {exc.reason})")


def _add_routes(app: web.Application) -> None:
    """The API's routes: the table in routes/, each answered by its handler (HANDLERS), named for the audit log."""
    for route in ROUTES:
        app.router.add_route(route.method, route.path, HANDLERS[route.name], name=route.name)


async def version(request: web.Request) -> web.Response:

    return _json(Version(version=__version__, api="v1"))


def _json(result: JsonResult, status: int = 200) -> web.Response:
    """A result as the response: its one JSON shape (sandboxer.api.results)."""
    return web.json_response(result.to_json(), status=status)


async def whoami(request: web.Request) -> web.Response:
    """What the calling account may do: owner, or its granted profiles."""
    return _json(await in_thread(broker_of(request).whoami))


async def openapi(request: web.Request) -> web.Response:
    """The OpenAPI document of the routes (made by the first request that asks)."""
    return web.Response(body=await in_thread(document_bytes), content_type="application/json")


async def list_sandboxes(request: web.Request) -> web.Response:
    """list; `?work=0` leaves out each sandbox's work (no command runs in it)."""
    broker, work = broker_of(request), flag(request, "work", default=True)
    return _json(SandboxList(sandboxes=tuple(await in_worker(request, lambda: broker.list(work=work)))))


async def create(request: web.Request) -> web.Response:
    """create: a profile, a TTL, a lease manifest by absolute path (the service's own account
    only: the broker binds and removes what it names), a bootstrap file as its caller read it."""
    body = await json_body(request, CREATE_FIELDS, {"profile"})
    profile, ttl, manifest = body["profile"], body.get("ttl"), body.get("manifest")
    if not isinstance(profile, str):
        raise UsageError("profile: must be a profile name")
    if manifest is not None and (not isinstance(manifest, str) or not manifest.startswith("/")):
        raise UsageError("manifest: must be an absolute path")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int | float)):
        raise UsageError("ttl: must be a number of seconds")
    bootstrap = None if body.get("bootstrap") is None else _sent_file(body["bootstrap"], "bootstrap")
    strings(body, "ref", "branch")
    broker = broker_of(request)

    def gone() -> bool:  # the client went away while the create ran: it would never learn the id
        return request.transport is None or request.transport.is_closing()

    sandbox = await in_worker(
        request,
        lambda: broker.create(
            profile,
            manifest=manifest,
            bootstrap=bootstrap,
            ttl=ttl,
            ref=body.get("ref"),
            branch=body.get("branch"),
            abandoned=gone,
        ),
    )
    request["sandbox_id"] = sandbox.id
    return _json(sandbox.created, status=201)


def _sent_file(value: object, field: str) -> CallerFile:
    """A file its caller read and sent: {"path": the absolute path it read (for messages),
    "content": its bytes in base64}."""

    if not isinstance(value, dict) or set(value) != {"path", "content"}:
        raise UsageError(f"{field}: must be an object of exactly path and content")
    path, content = value["path"], value["content"]
    if not isinstance(path, str) or not path.startswith("/"):
        raise UsageError(f"{field}.path: must be an absolute path")
    if not isinstance(content, str):
        raise UsageError(f"{field}.content: must be base64 text")
    try:
        return CallerFile(path, data=base64.b64decode(content, validate=True))
    except binascii.Error:
        raise UsageError(f"{field}.content: must be base64 text") from None


async def inspect(request: web.Request) -> web.Response:
    sandbox = await sandbox_of(request)
    return _json(await in_worker(request, sandbox.inspect))


async def network_log(request: web.Request) -> web.Response:
    """logs --network; `?last=N` for the last N entries."""
    sandbox = await sandbox_of(request)
    raw = request.query.get("last")
    if raw is not None and not (raw.isascii() and raw.isdigit() and len(raw) <= 9):
        raise UsageError("last: must be a whole number of entries")
    last = None if raw is None else int(raw)
    return _json(await in_worker(request, functools.partial(sandbox.network_log, last=last)))


async def teardown(request: web.Request) -> web.Response:
    """teardown; `?discard=true` removes work no export took out (else refused: 2)."""

    discard = request.query.get("discard", "false")
    if discard not in ("true", "false"):
        raise UsageError("discard: must be true or false")
    sandbox = await sandbox_of(request)
    try:
        receipt = await in_worker(request, lambda: sandbox.teardown(discard=discard == "true"))
    except ResidueError as exc:  # the envelope, with the receipt the core attached
        return error_response(exc, receipt=exc.receipt.to_json() if isinstance(exc.receipt, Receipt) else None)
    except UnexportedWorkError as exc:  # the envelope, with what would be lost and how to keep or lose it
        return error_response(exc, **unexported_answer(exc, sandbox.id))
    return _json(receipt)


async def kept_exports(request: web.Request) -> web.Response:
    """exports: the work the reaper kept of the caller's expired sandboxes."""
    broker = broker_of(request)
    return _json(KeptExports(exports=tuple(await in_worker(request, broker.exports))))


async def kept_export_file(request: web.Request) -> web.StreamResponse:
    """exports get: a kept export's bundle (`bundle`) or tree's tar (`tar`), as the body."""

    broker, export_id, fmt = broker_of(request), request.match_info["id"], request.match_info["format"]
    path = await in_worker(request, broker.kept_export_file, export_id, fmt)
    stream = await in_worker(request, open, path, "rb")
    try:
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        await response.prepare(request)
        while chunk := await in_worker(request, stream.read, CHUNK):
            await response.write(chunk)
        await response.write_eof()
    finally:
        stream.close()
    return response


async def kept_export_remove(request: web.Request) -> web.Response:
    """exports rm: remove a kept export (its room in the caller's budget is free at once)."""
    broker = broker_of(request)
    return _json(await in_worker(request, broker.remove_export, request.match_info["id"]))


async def dispatch_tool(request: web.Request) -> web.Response:
    """dispatch-tool: relay one request from the sandbox's spool to its lease's endpoint."""
    body = await json_body(request, DISPATCH_FIELDS, {"lease", "request_id"})
    strings(body, "lease", "request_id")
    wait = body.get("wait_seconds", 0)
    if isinstance(wait, bool) or not isinstance(wait, int):
        raise UsageError("wait_seconds: must be a whole number of seconds")
    sandbox = await sandbox_of(request)
    return _json(await in_worker(request, lambda: sandbox.dispatch_tool(body["lease"], body["request_id"], wait)))


async def owner_entries(request: web.Request) -> web.Response:
    """ext list: every owner file with its approval status."""
    return _json(await in_worker(request, broker_of(request).owner.listing))


async def owner_approve(request: web.Request) -> web.Response:
    """ext approve: approve the exact current bytes of one owner file."""
    body = await json_body(request, {"name"}, {"name"})
    strings(body, "name")
    return _json(await in_worker(request, broker_of(request).owner.approve, body["name"]))


async def owner_revoke(request: web.Request) -> web.Response:
    """ext revoke: withdraw an approval."""
    body = await json_body(request, {"name"}, {"name"})
    strings(body, "name")
    return _json(await in_worker(request, broker_of(request).owner.revoke, body["name"]))


async def runtime_digest(request: web.Request) -> web.Response:
    """runtime digest: the tree digest of a directory the service reads with its own rights, so
    only for an owner of the service's own account, and only by an absolute path."""
    body = await json_body(request, DIGEST_FIELDS, {"path"})
    strings(body, "path")
    path, full = body["path"], body.get("full", False)
    if not path.startswith("/"):
        raise UsageError("path: must be an absolute path")
    if not isinstance(full, bool):
        raise UsageError("full: must be true or false")
    owner = broker_of(request).owner
    return _json(await in_worker(request, lambda: owner.runtime_digest(path, full=full)))


async def gc(request: web.Request) -> web.Response:
    return _json(await in_worker(request, broker_of(request).gc))


# Each route's handler, by its name in the table of routes/.
HANDLERS: dict[str, Handler] = {
    "version": version,
    "openapi": openapi,
    "whoami": whoami,
    "list": list_sandboxes,
    "create": create,
    "inspect": inspect,
    "logs-network": network_log,
    "usage": watch_route.usage,
    "work": watch_route.work,
    "extend": watch_route.extend,
    "teardown": teardown,
    "exec": exec_command,
    "exec-signal": signal_exec,
    "dispatch-tool": dispatch_tool,
    "export": export,
    "export-confirm": export_confirm,
    "exports": kept_exports,
    "exports-get": kept_export_file,
    "exports-rm": kept_export_remove,
    "gc": gc,
    "ext-list": owner_entries,
    "ext-approve": owner_approve,
    "ext-revoke": owner_revoke,
    "runtime-digest": runtime_digest,
}
