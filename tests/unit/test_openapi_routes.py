"""The OpenAPI document the service serves lists every route it answers, with its method."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sandboxer.dirs import Dirs
from sandboxer.service.admission import CallerSlots
from sandboxer.service.app import API_DOCUMENT, make_app


def test_every_route_is_in_the_document(tmp_path: Path) -> None:
    with ThreadPoolExecutor(max_workers=1) as workers:
        app = make_app(Dirs(config=str(tmp_path), state=str(tmp_path)), workers=workers, slots=CallerSlots())
        answered = {
            (route.method.lower(), re.sub(r"\{id\}", "{id}", route.resource.canonical))
            for route in app.router.routes()
            if route.resource is not None and route.method != "HEAD"
        }
    paths = json.loads(API_DOCUMENT.read_text())["paths"]
    documented = {(method, path) for path, item in paths.items() for method in item if method != "parameters"}
    assert answered == documented
