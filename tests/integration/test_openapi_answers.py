"""Real answers of a real service validate against the OpenAPI document it serves.

One `sandboxer serve` and two sandboxes (one kept by the reaper when its TTL runs out): every
route that answers JSON is called, successes and refusals alike (an unknown route, a bad body, a
sandbox that is not there, a policy refusal), and each body is validated (jsonschema, draft
2020-12) against the schema the document gives the route for that status — `default` (the error
envelope) for a status it does not name, never for a success. An exec's frames, an export's
header and a kept export's bytes are checked as the document describes them.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandboxer.service import frames
from sandboxer.service.openapi import Body, Raw
from sandboxer.service.routes import BY_NAME, ROUTES, document_bytes
from tests.integration.conftest import SandboxBroker, profile_text
from tests.integration.services import Service, UnixConnection
from tests.openapi_schemas import errors

NO_SUCH_ID = "0" * 24
# Routes whose success this test does not make: a dispatch needs a lease and its endpoint
# (test_dispatch_tool.py). (Nor does it make teardown's residue, 409: the unit test validates a
# ResidueError envelope against the document.)
NOT_MADE_HERE = {"dispatch-tool"}


class Api:
    """Requests to the service, each answer validated against its document."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.document: dict[str, Any] = {}
        self.answered: set[tuple[str, int]] = set()  # (route name, status) of each answer validated
        self._connections: list[UnixConnection] = []

    def close(self) -> None:
        """Close every connection made."""
        for connection in self._connections:
            connection.close()

    def send(self, method: str, path: str, body: object = None) -> http.client.HTTPResponse:
        """The answer's head (its body still to read). `body`: JSON, or bytes as they are."""
        connection = UnixConnection(self.path)
        self._connections.append(connection)
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        connection.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        return connection.getresponse()

    def call(self, name: str, path: str, body: object = None, *, method: str | None = None) -> tuple[int, Any]:
        """Route `name` at `path`: its status and JSON document, validated."""
        route = BY_NAME[name]
        answer = self.send(method or route.method, path, body)
        document = json.loads(answer.read())
        self.validate(name, answer.status, document, answer.getheader("Content-Type"))
        return answer.status, document

    def validate(self, name: str, status: int, document: object, content_type: str | None = None) -> None:
        """Check one JSON answer of route `name` against the document's schema for `status`."""
        route = BY_NAME[name]
        responses = self.document["paths"][route.path][route.method.lower()]["responses"]
        if 200 <= status < 300:
            assert str(status) in responses, f"{name} answered {status}, which its document does not name"
        response = responses.get(str(status), responses["default"])
        media = response["content"]["application/json"]
        assert content_type is None or content_type.startswith("application/json")
        assert errors(self.document, media["schema"], document) == [], (name, status, document)
        self.answered.add((name, status))

    def refusal(self, method: str, path: str, body: object = None) -> tuple[int, dict[str, Any]]:
        """An answer of no route: the error envelope."""
        answer = self.send(method, path, body)
        document = json.loads(answer.read())
        assert errors(self.document, {"$ref": "#/components/schemas/Error"}, document) == []
        return answer.status, document

    def request_is_valid(self, name: str, body: object) -> bool:
        """Whether the document says `body` is one the route takes."""
        route = BY_NAME[name]
        schema = self.document["paths"][route.path][route.method.lower()]["requestBody"]["content"]
        return errors(self.document, schema["application/json"]["schema"], body) == []

    def exec(self, sandbox_id: str, argv: list[str]) -> dict[str, Any]:
        """Run `argv` in the sandbox; its end frame's document (validated as ExecEnd)."""
        answer = self.send("POST", f"/v1/sandboxes/{sandbox_id}/exec", json.dumps({"argv": argv}).encode() + b"\n")
        assert answer.status == 200
        return self.frames(answer)

    def frames(self, answer: http.client.HTTPResponse) -> dict[str, Any]:
        """The end frame of an exec's answer, its head and frames checked."""
        assert answer.getheader("Content-Type") == frames.CONTENT_TYPE
        header = self.document["paths"]["/v1/sandboxes/{id}/exec"]["post"]["responses"]["200"]["headers"]
        name = answer.getheader(frames.EXEC_HEADER)
        assert errors(self.document, header[frames.EXEC_HEADER]["schema"], name) == []
        found = frames.FrameReader().feed(answer.read())
        assert [kind for kind, _ in found][-1:] == [frames.END]
        end = json.loads(found[-1][1])
        assert errors(self.document, {"$ref": "#/components/schemas/ExecEnd"}, end) == []
        self.answered.add(("exec", 200))
        return dict(end)


@pytest.fixture
def api(sb_root: SandboxBroker) -> Iterator[Api]:
    directory = sb_root.root / "svc"
    directory.mkdir(exist_ok=True)
    started = Service(sb_root, directory / "broker.sock", "--keep-exports", "600").start()
    try:
        api = Api(started.socket)
        yield api
        api.close()
    finally:
        started.stop()


def test_every_answer_validates_against_the_served_document(api: Api, sb_root: SandboxBroker) -> None:
    answer = api.send("GET", "/v1/openapi.json")
    assert answer.status == 200
    served = answer.read()
    api.document = json.loads(served)
    assert api.document == json.loads(document_bytes())  # what this process makes of the same routes
    api.validate("openapi", 200, api.document)

    # A sandbox the reaper will keep the work of: its TTL runs out while the rest runs.
    status, expiring = api.call("create", "/v1/sandboxes", {"profile": sb_root.profile, "ttl": 6})
    assert status == 201
    commit = "echo kept > kept.txt && git add kept.txt && git commit -qm Keep"
    assert api.exec(expiring["id"], ["sh", "-c", commit]) == {"status": 0}

    assert api.call("version", "/v1/version")[0] == 200
    assert api.call("whoami", "/v1/me")[1]["owner"] is True
    status, created = api.call("create", "/v1/sandboxes", {"profile": sb_root.profile})
    assert status == 201
    sandbox = f"/v1/sandboxes/{created['id']}"
    assert created["id"] in {item["id"] for item in api.call("list", "/v1/sandboxes")[1]["sandboxes"]}
    status, evidence = api.call("inspect", sandbox)
    assert (status, evidence["matches_plan"]) == (200, True), evidence
    status, logged = api.call("logs-network", f"{sandbox}/logs/network?last=5")
    assert (status, logged) == (200, {"id": created["id"], "entries": []})
    assert api.call("logs-network", f"{sandbox}/logs/network?last=x")[0] == 400
    assert api.call("list", "/v1/sandboxes?work=maybe")[0] == 400
    assert api.call("list", "/v1/sandboxes?work=0")[1]["sandboxes"][0]["work"] is None
    status, used = api.call("usage", f"{sandbox}/usage")
    assert (status, used["source"]) == (200, "cgroup")
    status, work = api.call("work", f"{sandbox}/work")
    assert (status, work["commits"], work["dirty"]) == (200, 0, False)
    assert api.call("usage", f"/v1/sandboxes/{NO_SUCH_ID}/usage")[0] == 404
    assert api.call("extend", f"{sandbox}/extend", {"seconds": 60})[0] == 400  # made with no end
    assert api.call("extend", f"/v1/sandboxes/{expiring['id']}/extend", {"seconds": 1.5})[0] == 400
    status, lifetime = api.call("extend", f"/v1/sandboxes/{expiring['id']}/extend", {"seconds": 1})
    assert (status, lifetime["expires_at"]) == (200, expiring["expires_at"])  # never earlier: the reaper's end
    assert api.call("extend", f"/v1/sandboxes/{expiring['id']}/extend", {"secs": 60})[0] == 400

    assert api.exec(created["id"], ["sh", "-c", "echo out; exit 3"]) == {"status": 3}
    running = api.send("POST", f"{sandbox}/exec", json.dumps({"argv": ["sleep", "30"]}).encode() + b"\n")
    exec_name = running.getheader(frames.EXEC_HEADER)
    assert api.call("exec-signal", f"{sandbox}/exec/{exec_name}/signal", {"signal": "SIGTERM"}) == (
        200,
        {"signal": "SIGTERM"},
    )
    assert "status" in api.frames(running)
    assert api.call("exec-signal", f"{sandbox}/exec/{exec_name}/signal", {"signal": "SIGTERM"})[0] == 404
    no_sandbox = api.send("POST", f"/v1/sandboxes/{NO_SUCH_ID}/exec", b'{"argv": ["true"]}\n')
    api.validate("exec", no_sandbox.status, json.loads(no_sandbox.read()))

    exported = api.send("POST", f"{sandbox}/export", {"format": "tar"})
    assert exported.status == 200, exported.read()
    assert exported.getheader("Content-Type") == "application/octet-stream"
    header = api.document["paths"]["/v1/sandboxes/{id}/export"]["post"]["responses"]["200"]["headers"]
    summary = json.loads(exported.getheader("Sandboxer-Export") or "")
    assert errors(api.document, header["Sandboxer-Export"]["schema"]["contentSchema"], summary) == []
    assert exported.read()[257:262] == b"ustar"
    confirm = f"{sandbox}/export/confirm"
    noted = api.call("export-confirm", confirm, {"token": summary["token"]})
    assert noted == (200, {"id": created["id"], "noted": True})
    assert api.call("export-confirm", confirm, {"token": summary["token"]})[0] == 400  # good once
    assert api.call("dispatch-tool", f"{sandbox}/dispatch", {"lease": "none", "request_id": "r1"})[0] >= 400

    assert api.call("gc", "/v1/gc")[0] == 200
    assert api.call("runtime-digest", "/v1/runtime/digest", {"path": str(sb_root.runtime)})[0] == 200
    unapproved = "unapproved-here"
    sb_root.write_profile(unapproved, profile_text(unapproved, sb_root.repo))
    status, refused = api.call("create", "/v1/sandboxes", {"profile": unapproved})
    assert (status, refused["error"]["status"]) == (403, 3), refused
    entries = api.call("ext-list", "/v1/owner/entries")[1]["entries"]
    assert {"name": unapproved, "status": "unapproved"}.items() <= next(
        entry for entry in entries if entry["name"] == unapproved
    ).items()
    assert api.call("ext-approve", "/v1/owner/approve", {"name": unapproved})[1]["status"] == "approved"
    assert api.call("ext-revoke", "/v1/owner/revoke", {"name": unapproved})[1]["revoked"] is True

    assert api.call("teardown", f"{sandbox}?discard=maybe")[0] == 400
    # Work no export took out: the refusal names it; one export with ?confirm=1 takes it out.
    assert api.exec(created["id"], ["sh", "-c", commit.replace("kept", "work")]) == {"status": 0}
    status, refused = api.call("teardown", sandbox)
    assert (status, refused["unexported"]) == (400, ["1 new commit on main (made from main)"])
    assert api.send("POST", f"{sandbox}/export?confirm=1", {"format": "bundle"}).read().startswith(b"# v2 git")
    lines = api.send("POST", f"{sandbox}/exec?format=ndjson", json.dumps({"argv": ["echo", "hi"]}).encode() + b"\n")
    media = api.document["paths"]["/v1/sandboxes/{id}/exec"]["post"]["responses"]["200"]["content"]
    for line in lines.read().splitlines():
        assert errors(api.document, media["application/x-ndjson"]["x-itemSchema"], json.loads(line)) == []
    status, receipt = api.call("teardown", sandbox)
    assert (status, receipt["residue"]) == (200, [])
    assert api.call("teardown", sandbox)[0] == 404
    assert api.call("inspect", f"/v1/sandboxes/{NO_SUCH_ID}")[0] == 404

    # The reaper kept the expired sandbox's commit: list it, fetch its bundle, remove it.
    deadline = time.monotonic() + 60
    while not (kept := [i for i in api.call("exports", "/v1/exports")[1]["exports"] if i["id"] == expiring["id"]]):
        assert time.monotonic() < deadline, "the reaper kept no export of the expired sandbox"
        time.sleep(0.3)
    assert kept[0]["ahead"] == 1
    bundle = api.send("GET", f"/v1/exports/{expiring['id']}/bundle")
    assert (bundle.status, bundle.getheader("Content-Type")) == (200, "application/octet-stream")
    assert bundle.read().startswith(b"# v2 git bundle")
    assert api.call("exports-get", f"/v1/exports/{NO_SUCH_ID}/bundle")[0] == 404
    status, removed = api.call("exports-rm", f"/v1/exports/{expiring['id']}")
    assert (status, removed["id"]) == (200, expiring["id"])
    assert api.call("exports-rm", f"/v1/exports/{expiring['id']}")[0] == 404

    # No such route, a method the route does not answer, a body that is not JSON: the envelope.
    status, unknown = api.refusal("GET", "/v1/no-such-route")
    assert (status, unknown["error"]["kind"]) == (404, "NotFoundError")
    assert api.call("version", "/v1/version", method="PUT")[0] == 405
    assert api.call("create", "/v1/sandboxes", b"{nope")[0] == 400

    successes = {name for name, status in api.answered if status < 300}
    json_routes = {route.name for route in ROUTES if not isinstance(route.answer, Raw)}
    assert json_routes - NOT_MADE_HERE <= successes


def test_a_bodys_fields_are_those_the_document_names(api: Api) -> None:
    """Every JSON body route refuses a field its document does not name, listing those it does,
    and wants the ones the document requires: the handlers and the document agree."""
    api.document = json.loads(api.send("GET", "/v1/openapi.json").read())
    for route in ROUTES:
        if not isinstance(route.body, Body):
            continue
        path = route.path.format(id=NO_SUCH_ID, exec="0" * 32)
        stray = {"zz-stray": 1}
        assert not api.request_is_valid(route.name, stray)
        status, refused = api.call(route.name, path, stray)
        assert status == 400
        allowed = ", ".join(sorted(route.body.names))
        assert refused["error"]["message"] == f"zz-stray: unknown field (allowed: {allowed})"
        if route.body.required:
            assert not api.request_is_valid(route.name, {})
            status, refused = api.call(route.name, path, {})
            assert (status, refused["error"]["message"]) == (400, f"{min(route.body.required)}: required")
