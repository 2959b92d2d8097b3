"""The service's HTTP/JSON API (aiohttp): `/v1/...` routes over the core's commands.

Every request is first answered by who is calling (peer.py): owners only, until grants admit
callers. A route runs the same command the CLI runs (sandboxer.commands), in a worker thread, and
answers with the same JSON document; an error is `{"error": {kind, message, hint, status}}` with
the CLI's exit status and an HTTP status for it. Exec answers with a stream of frames
(frames.py). The routes are listed in openapi.json, which `GET /v1/openapi.json` serves.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from aiohttp import web

from sandboxer.core.reading import CallerFile
from sandboxer.dirs import Dirs
from sandboxer.errors import PolicyError, SandboxerError, UsageError
from sandboxer.host.registry import ID_PATTERN
from sandboxer.service.access import CALLS_PER_CALLER, Access, CallerSlots, Refused, admit, owner_by_uid, visible
from sandboxer.service.audit import AuditLog
from sandboxer.service.exec_route import SIGNALLING, exec_command, signal_exec
from sandboxer.service.http import (
    AUDIT,
    DIRS,
    EXECS,
    PENDING_EXPORTS,
    WORKERS,
    PendingExports,
    error_document,
    error_response,
    in_thread,
    in_worker,
    internal_error,
    json_body,
    require_own,
)
from sandboxer.service.peer import Peer, peer_of

API_DOCUMENT = Path(__file__).with_name("openapi.json")
MAX_BODY = 16 * 1024 * 1024  # a request body larger than this is refused (413); exec's stdin is streamed
CREATE_FIELDS = {"profile", "ttl", "manifest", "bootstrap", "ref", "branch"}
DISPATCH_FIELDS = {"lease", "request_id", "wait_seconds"}
DIGEST_FIELDS = {"path", "full"}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def make_app(dirs: Dirs, *, workers: Executor, slots: CallerSlots) -> web.Application:
    """The application for one config dir and state dir. `workers` runs execs (for as long as
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
            access = owner_by_uid(dirs, peer) or await in_thread(admit, dirs, sock)
        except Refused as refusal:
            await in_thread(
                lambda: audit.record(
                    uid=peer.uid, pid=peer.pid, verb="refused", sandbox=None, outcome="PolicyError", status=3
                )
            )
            return error_response(refusal)
        request["access"] = access
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
    from sandboxer.errors import NotFoundError

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
    """The API's routes (openapi.json lists them), each named for the audit log."""
    app.router.add_get("/v1/version", version, name="version")
    app.router.add_get("/v1/openapi.json", openapi, name="openapi")
    app.router.add_get("/v1/me", whoami, name="whoami")
    app.router.add_get("/v1/sandboxes", list_sandboxes, name="list")
    app.router.add_post("/v1/sandboxes", create, name="create")
    app.router.add_get("/v1/sandboxes/{id}", inspect, name="inspect")
    app.router.add_delete("/v1/sandboxes/{id}", teardown, name="teardown")
    app.router.add_post("/v1/sandboxes/{id}/exec", exec_command, name="exec")
    app.router.add_post("/v1/sandboxes/{id}/exec/{exec}/signal", signal_exec, name="exec-signal")
    app.router.add_post("/v1/sandboxes/{id}/dispatch", dispatch_tool, name="dispatch-tool")
    app.router.add_post("/v1/sandboxes/{id}/export", export, name="export")
    app.router.add_post("/v1/sandboxes/{id}/export/confirm", export_confirm, name="export-confirm")
    app.router.add_get("/v1/exports", kept_exports, name="exports")
    app.router.add_get("/v1/exports/{id}/{format}", kept_export_file, name="exports-get")
    app.router.add_delete("/v1/exports/{id}", kept_export_remove, name="exports-rm")
    app.router.add_post("/v1/gc", gc, name="gc")
    app.router.add_get("/v1/owner/entries", owner_entries, name="ext-list")
    app.router.add_post("/v1/owner/approve", owner_approve, name="ext-approve")
    app.router.add_post("/v1/owner/revoke", owner_revoke, name="ext-revoke")
    app.router.add_post("/v1/runtime/digest", runtime_digest, name="runtime-digest")


async def version(request: web.Request) -> web.Response:
    from sandboxer import __version__

    return web.json_response({"version": __version__, "api": "v1"})


async def whoami(request: web.Request) -> web.Response:
    """What the calling account may do: owner, or its granted profiles (service/whoami.py)."""
    from sandboxer.service.whoami import caller_view

    access: Access = request["access"]
    return web.json_response(await in_thread(caller_view, access))


async def openapi(request: web.Request) -> web.Response:
    return web.Response(body=API_DOCUMENT.read_bytes(), content_type="application/json")


async def list_sandboxes(request: web.Request) -> web.Response:
    from sandboxer.commands.teardown import list_sandboxes as listing

    access: Access = request["access"]
    document = await in_worker(request, listing, request.app[DIRS])
    return web.json_response(visible(document, await in_worker(request, access.own_ids)))


async def create(request: web.Request) -> web.Response:
    """create: a profile, a TTL, a lease manifest by absolute path (the service's own account
    only: the broker binds and removes what it names), a bootstrap file as its caller read it."""
    from sandboxer.cli.options import MANIFEST_PATHS
    from sandboxer.commands.create import create as make

    body = await json_body(request, CREATE_FIELDS, {"profile"})
    profile, ttl, manifest = body["profile"], body.get("ttl"), body.get("manifest")
    if not isinstance(profile, str):
        raise UsageError("profile: must be a profile name")
    if manifest is not None and (not isinstance(manifest, str) or not manifest.startswith("/")):
        raise UsageError("manifest: must be an absolute path")
    bootstrap = None if body.get("bootstrap") is None else _sent_file(body["bootstrap"], "bootstrap")
    _strings(body, "ref", "branch")
    ref, branch = body.get("ref"), body.get("branch")
    dirs = request.app[DIRS]
    access: Access = request["access"]
    if manifest is not None:
        access.require_own_files("manifest", why=MANIFEST_PATHS)

    def made(uid: int | None, lifetime: float | None) -> dict[str, Any]:
        return make(
            dirs,
            profile,
            manifest_path=manifest,
            bootstrap=bootstrap,
            caller_uid=uid,
            ttl=lifetime,
            ref=ref,
            branch=branch,
        )

    created = await in_worker(request, lambda: access.create(profile, ttl, made))
    request["sandbox_id"] = created["id"]
    if request.transport is None or request.transport.is_closing():
        # The client went away while the create ran: it never learns the id, so nothing is left
        # (as when a CLI client's create is interrupted).
        from sandboxer.commands.teardown import teardown as remove

        await in_worker(request, remove, dirs, created["id"])
        request["exit_status"] = 130
    return web.json_response(created, status=201)


def _sent_file(value: object, field: str) -> CallerFile:
    """A file its caller read and sent: {"path": the absolute path it read (for messages),
    "content": its bytes in base64}."""
    import base64
    import binascii

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


def _unknown(request: web.Request) -> SandboxerError:
    from sandboxer.errors import NotFoundError

    return NotFoundError(f"no such sandbox: {request.match_info['id']}")


async def inspect(request: web.Request) -> web.Response:
    from sandboxer.commands.inspect import inspect as observe

    await require_own(request, request.match_info["id"], _unknown(request))
    return web.json_response(await in_worker(request, observe, request.app[DIRS], request.match_info["id"]))


async def teardown(request: web.Request) -> web.Response:
    """teardown; `?discard=true` removes work no export took out (else refused: 2)."""
    from sandboxer.commands.teardown import teardown as remove
    from sandboxer.errors import ResidueError

    discard = request.query.get("discard", "false")
    if discard not in ("true", "false"):
        raise UsageError("discard: must be true or false")
    await require_own(request, request.match_info["id"], _unknown(request))
    dirs, sandbox_id = request.app[DIRS], request.match_info["id"]
    receipt = await in_worker(request, lambda: remove(dirs, sandbox_id, keep_work=discard == "false"))
    if receipt["residue"]:
        error = ResidueError(f"teardown of {receipt['id']} left residue: {'; '.join(receipt['residue'])}")
        return error_response(error, receipt=receipt)
    return web.json_response(receipt)


async def export(request: web.Request) -> web.StreamResponse:
    """export: the sandbox's work, verified by the service, as the response's body — a bundle's
    or a tar's bytes, a patch series as a tar of its files; the summary (export --json, with a
    `token`) in the `Sandboxer-Export` header. Only the client knows whether it wrote all of it:
    the record notes the export when the client confirms it with that token (export_confirm)."""
    import json
    import secrets

    from sandboxer.commands.export import check_format, discard_quarantine, prepare
    from sandboxer.commands.export_delivery import stream_of

    body = await json_body(request, {"format"}, {"format"})
    _strings(body, "format")
    fmt = check_format(body["format"])
    dirs, sandbox_id = request.app[DIRS], request.match_info["id"]
    await require_own(request, sandbox_id, _unknown(request))
    budget = request["access"].export_budget()
    made = await in_worker(request, request["access"].checking(lambda: prepare(dirs, sandbox_id, fmt, budget=budget)))
    token = secrets.token_hex(16)
    pending = request.app[PENDING_EXPORTS]
    sent = False
    try:
        summary = json.dumps({**made.summary(), "token": token})
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream", "Sandboxer-Export": summary})
        await response.prepare(request)
        # Confirmable from the start: a client may have all it needs (a tar's end) before the
        # body's last write returns here. Its confirmation is its own word on its own export.
        pending.expire()
        pending[token] = (request["access"].peer.uid, sandbox_id, made.taken)
        chunks = stream_of(made)
        while (chunk := await in_worker(request, next, chunks, None)) is not None:
            await response.write(chunk)
        await response.write_eof()
        sent = True
    finally:
        if not sent:
            pending.pop(token, None)  # a body that broke off is nothing to confirm
        await in_worker(request, discard_quarantine, made)
    return response


async def export_confirm(request: web.Request) -> web.Response:
    """The client wrote the whole export it was sent: the record notes what it took out (teardown
    then loses nothing of it). A token is good once, for the account it was sent to."""
    from sandboxer.commands.export import note_exported

    body = await json_body(request, {"token"}, {"token"})
    _strings(body, "token")
    sandbox_id = request.match_info["id"]
    await require_own(request, sandbox_id, _unknown(request))
    entry = request.app[PENDING_EXPORTS].pop(body["token"], None)
    if entry is None or entry[:2] != (request["access"].peer.uid, sandbox_id):
        raise UsageError("token: not an export of this sandbox awaiting its confirmation")
    noted = await in_worker(request, note_exported, request.app[DIRS], sandbox_id, entry[2])
    return web.json_response({"id": sandbox_id, "noted": noted})


def _kept_viewer(request: web.Request) -> int | None:
    """Whose kept exports the caller sees: a granted caller's own (by the kernel's uid), an
    owner's every one."""
    access: Access = request["access"]
    return None if access.owner else access.peer.uid


async def kept_exports(request: web.Request) -> web.Response:
    """exports: the work the reaper kept of the caller's expired sandboxes."""
    from sandboxer.commands.kept import list_kept

    return web.json_response(await in_worker(request, list_kept, request.app[DIRS], _kept_viewer(request)))


async def kept_export_file(request: web.Request) -> web.StreamResponse:
    """exports get: a kept export's bundle (`bundle`) or tree's tar (`tar`), as the body."""
    from sandboxer.commands.export_delivery import CHUNK
    from sandboxer.commands.kept import kept_file

    export_id, fmt = request.match_info["id"], request.match_info["format"]
    path = await in_worker(request, kept_file, request.app[DIRS], export_id, fmt, _kept_viewer(request))
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
    from sandboxer.commands.kept import remove_kept

    dirs, export_id = request.app[DIRS], request.match_info["id"]
    return web.json_response(await in_worker(request, remove_kept, dirs, export_id, _kept_viewer(request)))


def _strings(body: dict[str, Any], *names: str) -> None:
    """Refuse a body whose fields `names` are not strings (when present)."""
    for name in names:
        if name in body and not isinstance(body[name], str):
            raise UsageError(f"{name}: must be a string")


async def dispatch_tool(request: web.Request) -> web.Response:
    """dispatch-tool: relay one request from the sandbox's spool to its lease's endpoint."""
    from sandboxer.commands.dispatch import dispatch

    body = await json_body(request, DISPATCH_FIELDS, {"lease", "request_id"})
    _strings(body, "lease", "request_id")
    wait = body.get("wait_seconds", 0)
    if isinstance(wait, bool) or not isinstance(wait, int):
        raise UsageError("wait_seconds: must be a whole number of seconds")
    sandbox_id = request.match_info["id"]
    await require_own(request, sandbox_id, _unknown(request))
    state = request.app[DIRS].state
    document = await in_worker(
        request,
        lambda: dispatch(state, sandbox_id, lease_id=body["lease"], request_id=body["request_id"], wait_seconds=wait),
    )
    return web.json_response(document)


async def owner_entries(request: web.Request) -> web.Response:
    """ext list: every owner file with its approval status."""
    from sandboxer.commands.owner import list_entries

    request["access"].require_owner("ext list")
    return web.json_response(await in_worker(request, list_entries, request.app[DIRS]))


async def owner_approve(request: web.Request) -> web.Response:
    """ext approve: approve the exact current bytes of one owner file."""
    from sandboxer.commands.owner import approve

    request["access"].require_owner("ext approve")
    body = await json_body(request, {"name"}, {"name"})
    _strings(body, "name")
    return web.json_response(await in_worker(request, approve, request.app[DIRS], body["name"]))


async def owner_revoke(request: web.Request) -> web.Response:
    """ext revoke: withdraw an approval."""
    from sandboxer.commands.owner import revoke

    request["access"].require_owner("ext revoke")
    body = await json_body(request, {"name"}, {"name"})
    _strings(body, "name")
    return web.json_response(await in_worker(request, revoke, request.app[DIRS], body["name"]))


async def runtime_digest(request: web.Request) -> web.Response:
    """runtime digest: the tree digest of a directory the service reads with its own rights, so
    only for an owner of the service's own account, and only by an absolute path."""
    from sandboxer.commands.owner import runtime_digest as digest

    access: Access = request["access"]
    access.require_owner("runtime digest")
    access.require_own_files("runtime digest")
    body = await json_body(request, DIGEST_FIELDS, {"path"})
    _strings(body, "path")
    path, full = body["path"], body.get("full", False)
    if not path.startswith("/"):
        raise UsageError("path: must be an absolute path")
    if not isinstance(full, bool):
        raise UsageError("full: must be true or false")
    return web.json_response(await in_worker(request, lambda: digest(request.app[DIRS], path, full=full)))


async def gc(request: web.Request) -> web.Response:
    from sandboxer.commands.teardown import gc as collect

    request["access"].require_owner("gc")
    return web.json_response(await in_worker(request, collect, request.app[DIRS]))
