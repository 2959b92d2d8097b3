"""The routes an orchestrator watches a sandbox by: `GET /v1/sandboxes/{id}/usage`, `GET
/v1/sandboxes/{id}/work` and `POST /v1/sandboxes/{id}/extend` (the core's sb.usage(),
sb.work_state() and sb.extend(seconds); docs/service.md)."""

from __future__ import annotations

import functools

from aiohttp import web

from sandboxer.service.http import in_worker, json_body, sandbox_of
from sandboxer.service.routes import body_fields

EXTEND_FIELDS = body_fields("extend")


async def usage(request: web.Request) -> web.Response:
    sandbox = await sandbox_of(request)
    return web.json_response((await in_worker(request, sandbox.usage)).to_json())


async def work(request: web.Request) -> web.Response:
    sandbox = await sandbox_of(request)
    return web.json_response((await in_worker(request, sandbox.work_state)).to_json())


async def extend(request: web.Request) -> web.Response:
    """extend: the lifetime ends `seconds` from now, within the profile's maximum."""
    body = await json_body(request, EXTEND_FIELDS, {"seconds"})
    sandbox = await sandbox_of(request)
    seconds = body["seconds"]  # the core checks it (a whole number of seconds, within bounds)
    return web.json_response((await in_worker(request, functools.partial(sandbox.extend, seconds))).to_json())
