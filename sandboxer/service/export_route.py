"""The export routes, `POST /v1/sandboxes/{id}/export` and its confirmation,
`POST /v1/sandboxes/{id}/export/confirm`.

An export's body is the verified work; the record notes the export (so that teardown then loses
nothing of it) only once the client has all of it, which only the client knows: it confirms with
the token the answer's header carries, or gives its word up front with `?confirm=1`, and the
service notes the export once the whole body is in the client's socket, before the body's end is
sent (docs/service.md, "Simple clients").
"""

from __future__ import annotations

import asyncio
import json
import secrets

from aiohttp import HttpVersion11, web

from sandboxer.api.results import ExportNoted
from sandboxer.commands.export import check_format, discard_quarantine, note_exported
from sandboxer.commands.export_delivery import stream_of
from sandboxer.errors import BackendError, UsageError
from sandboxer.service.http import DIRS, PENDING_EXPORTS, flag, in_worker, json_body, sandbox_of, strings

HANDOVER_POLL = 0.01  # seconds between looks at whether an export's body is all in the client's socket


async def export(request: web.Request) -> web.StreamResponse:
    """export: the sandbox's work, verified by the service, as the response's body — a bundle's
    or a tar's bytes, a patch series as a tar of its files; the summary (export --json, with a
    `token`) in the `Sandboxer-Export` header. Only the client knows whether it wrote all of it:
    the record notes the export when the client confirms it with that token (export_confirm) —
    or, with `?confirm=1`, once the whole body is in the socket, before its last chunk goes (so a
    client that got the body's end knows it was noted; a body that breaks off never ends)."""

    confirm = flag(request, "confirm")
    if confirm and request.version < HttpVersion11:
        raise UsageError("confirm: needs HTTP/1.1 (only a chunked body's end tells the client the export was noted)")
    body = await json_body(request, {"format"}, {"format"})
    strings(body, "format")
    check_format(body["format"])
    sandbox = await sandbox_of(request)
    sandbox_id = sandbox.id
    made = await in_worker(request, lambda: sandbox.prepare_export(body["format"]))
    token = None if confirm else secrets.token_hex(16)
    pending = request.app[PENDING_EXPORTS]
    sent = False
    try:
        summary = made.summary().to_json() | ({} if token is None else {"token": token})
        headers = {"Content-Type": "application/octet-stream", "Sandboxer-Export": json.dumps(summary)}
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        try:
            if token is not None:
                # Confirmable from the start: a client may have all it needs (a tar's end) before
                # the body's last write returns here. Its confirmation is its own word on its own export.
                pending.expire()
                pending[token] = (request["caller"].uid, sandbox_id, made.taken)
            chunks = stream_of(made)
            while (chunk := await in_worker(request, next, chunks, None)) is not None:
                await response.write(chunk)
            if confirm:  # the client's word, given up front: noted once all of it is in its socket
                await _handed_over(request)
                if not await in_worker(request, note_exported, request.app[DIRS], sandbox_id, made.taken):
                    raise BackendError(f"export: sandbox {sandbox_id}: its record could not note the export")
            await response.write_eof()
            sent = True
        except BaseException:
            if request.transport is not None:
                request.transport.close()  # the body never ends: the client knows it did not get all of it
            raise
    finally:
        if token is not None and not sent:
            pending.pop(token, None)  # a body that broke off is nothing to confirm
        await in_worker(request, discard_quarantine, made)
    return response


async def _handed_over(request: web.Request) -> None:
    """Until everything written to the client is in its socket (the transport's buffer is empty);
    ConnectionResetError when the client went away first."""
    while True:
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client went away before all of the export reached its socket")
        if transport.get_write_buffer_size() == 0:
            return
        await asyncio.sleep(HANDOVER_POLL)


async def export_confirm(request: web.Request) -> web.Response:
    """The client wrote the whole export it was sent: the record notes what it took out (teardown
    then loses nothing of it). A token is good once, for the account it was sent to."""

    body = await json_body(request, {"token"}, {"token"})
    strings(body, "token")
    sandbox_id = (await sandbox_of(request)).id
    entry = request.app[PENDING_EXPORTS].pop(body["token"], None)
    if entry is None or entry[:2] != (request["caller"].uid, sandbox_id):
        raise UsageError("token: not an export of this sandbox awaiting its confirmation")
    noted = await in_worker(request, note_exported, request.app[DIRS], sandbox_id, entry[2])
    return web.json_response(ExportNoted(id=sandbox_id, noted=noted).to_json())
