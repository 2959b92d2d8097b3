"""The service's routes, one table: each route's method, path, name (the audit log's verb), its
request and its answer (openapi.Route), grouped by what they reach (sandboxes.py, running.py,
owner.py). app.py answers exactly these (a handler per name), and the OpenAPI document the
service serves is made of them, so no route is answered that the document does not describe.
`python -m sandboxer.service.routes` prints that document.

A JSON answer is a result type (sandboxer.api.results), whose schema is the document's; a body that
is bytes (exec's frames, an export) is `Raw`. Any route may also answer the error envelope
`{"error": {kind, message, hint, status}}`; `errors` lists the statuses worth a word.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Mapping
from types import MappingProxyType

from sandboxer.host.registry import ID_PATTERN
from sandboxer.service.openapi import Body, Route, Schema, document
from sandboxer.service.routes.owner import KEPT_AND_OWNER
from sandboxer.service.routes.running import RUNNING
from sandboxer.service.routes.sandboxes import SANDBOXES

_PATH = f"^{ID_PATTERN.pattern}$"
PATH_PARAMETERS: Mapping[str, Schema] = {
    "id": {
        "description": "a sandbox's id (a kept export's: its sandbox's)",
        "schema": {"type": "string", "pattern": _PATH},
    },
    "exec": {
        "description": "the exec's name, from its answer's Sandboxer-Exec header",
        "schema": {"type": "string"},
    },
    "format": {"description": "which file it kept", "schema": {"type": "string", "enum": ["bundle", "tar"]}},
}

ROUTES: tuple[Route, ...] = (*SANDBOXES, *RUNNING, *KEPT_AND_OWNER)

BY_NAME: Mapping[str, Route] = MappingProxyType({route.name: route for route in ROUTES})


def body_fields(name: str) -> set[str]:
    """The fields the JSON body of route `name` may have."""
    body = BY_NAME[name].body
    if not isinstance(body, Body):
        raise TypeError(f"route {name} takes no JSON body")
    return body.names


@functools.cache
def document_bytes() -> bytes:
    """The OpenAPI document of ROUTES as the service sends it, made once per process."""
    return json.dumps(document(ROUTES, PATH_PARAMETERS), indent=1).encode()


def main() -> None:
    """Print the document (what `GET /v1/openapi.json` answers)."""

    sys.stdout.buffer.write(document_bytes() + b"\n")
