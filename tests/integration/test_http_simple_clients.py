"""HTTP for simple clients (docs/service.md, "Simple clients: curl"): a real service on its real
socket, spoken to with the standard library's http.client and raw sockets, and with curl itself.

- An export is one call with `?confirm=1`: noted before the body's last chunk goes, so a client
  that read the whole body may tear down at once; a body cut short is not noted. The two-step
  flow (token, then export/confirm) still works, and still needs its confirmation.
- A teardown refused for work no export took out names that work in `unexported`, with the
  requests that keep it (`export`) or lose it (`discard`).
- An exec answers NDJSON or plain text when `?format=` or Accept asks; frames stay the default;
  an unknown format is one 400 line naming the parameter, and nothing runs.

Every JSON answer is validated against the OpenAPI document the service serves.
"""

from __future__ import annotations

import base64
import http.client
import json
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandboxer.errors import UnexportedWorkError
from sandboxer.service import exec_answers, frames
from sandboxer.service.http import unexported_answer
from sandboxer.service.routes import BY_NAME
from tests.integration.conftest import SandboxBroker
from tests.integration.services import Service, UnixConnection
from tests.openapi_schemas import errors

COMMIT = "echo new > new.txt && git add new.txt && git commit -qm 'Add new.txt'"
BAD_FORMAT = "format: must be one of frames, ndjson, text (or left out: what Accept names, else frames)"


class Http:
    """Requests to one service; JSON answers validated against the document it serves."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._connections: list[UnixConnection] = []
        self.document: dict[str, Any] = json.loads(self.send("GET", "/v1/openapi.json").read())

    def close(self) -> None:
        for connection in self._connections:
            connection.close()

    def send(
        self, method: str, path: str, body: object = None, headers: dict[str, str] | None = None
    ) -> http.client.HTTPResponse:
        """The answer's head (its body still to read). `body`: JSON, or bytes as they are."""
        connection = UnixConnection(self.path)
        self._connections.append(connection)
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        connection.request(method, path, body=data, headers=headers or {})
        return connection.getresponse()

    def call(self, name: str, path: str, body: object = None) -> tuple[int, Any]:
        """Route `name` at `path`: its status and JSON document, validated against the document's
        schema for that status (its `default`, the envelope, for a status it does not name)."""
        route = BY_NAME[name]
        answer = self.send(route.method, path, body)
        document = json.loads(answer.read())
        self.validate(name, answer.status, document)
        return answer.status, document

    def validate(self, name: str, status: int, document: object) -> None:
        route = BY_NAME[name]
        responses = self.document["paths"][route.path][route.method.lower()]["responses"]
        schema = responses.get(str(status), responses["default"])["content"]["application/json"]["schema"]
        assert errors(self.document, schema, document) == [], (name, status, document)

    def exec(
        self, sandbox_id: str, argv: list[str], *, query: str = "", accept: str | None = None, stdin: bytes = b""
    ) -> http.client.HTTPResponse:
        """Start an exec; the answer's head."""
        headers = {} if accept is None else {"Accept": accept}
        body = json.dumps({"argv": argv}).encode() + b"\n" + stdin
        return self.send("POST", f"/v1/sandboxes/{sandbox_id}/exec{query}", body, headers)

    def item_schema(self) -> dict[str, Any]:
        """The schema of each line of an exec's NDJSON answer, as the document gives it."""
        content = self.document["paths"]["/v1/sandboxes/{id}/exec"]["post"]["responses"]["200"]["content"]
        schema: dict[str, Any] = content[exec_answers.MEDIA_TYPES["ndjson"]]["x-itemSchema"]
        return schema


@pytest.fixture
def served(sb_root: SandboxBroker) -> Iterator[tuple[Http, SandboxBroker]]:
    directory = sb_root.root / "svc"
    directory.mkdir(exist_ok=True)
    started = Service(sb_root, directory / "broker.sock").start()
    try:
        http_ = Http(started.socket)
        yield http_, sb_root
        http_.close()
    finally:
        started.stop()


def _create(http_: Http, broker: SandboxBroker) -> str:
    status, created = http_.call("create", "/v1/sandboxes", {"profile": broker.profile})
    assert status == 201, created
    broker.created.append(created["id"])
    return str(created["id"])


def _ndjson(http_: Http, answer: http.client.HTTPResponse) -> list[dict[str, Any]]:
    """The lines of an NDJSON exec answer, each validated as the document's ExecLine."""
    assert answer.status == 200
    assert answer.getheader("Content-Type") == "application/x-ndjson"
    assert len(answer.getheader(frames.EXEC_HEADER) or "") == 32  # its signals work as in every shape
    body = answer.read()
    assert body.endswith(b"\n")
    lines = [json.loads(line) for line in body.split(b"\n")[:-1]]
    for line in lines:
        assert errors(http_.document, http_.item_schema(), line) == [], line
    return lines


def _streams(lines: list[dict[str, Any]]) -> dict[str, bytes]:
    """What each stream carried, its text and base64 lines put together again."""
    out = {"stdout": b"", "stderr": b""}
    for line in lines[:-1]:
        data = line["data"]
        out[line["stream"]] += base64.b64decode(data) if line.get("encoding") == "base64" else data.encode()
    return out


def _exec_status(http_: Http, sandbox_id: str, script: str) -> int:
    lines = _ndjson(http_, http_.exec(sandbox_id, ["sh", "-c", script], query="?format=ndjson"))
    return int(lines[-1]["exit_status"])


# --- export in one call, and teardown naming what it would lose ---------------------------------


def test_teardown_names_the_unexported_work_and_one_confirmed_export_keeps_it(
    served: tuple[Http, SandboxBroker], tmp_path: Path
) -> None:
    http_, broker = served
    sandbox = _create(http_, broker)
    path = f"/v1/sandboxes/{sandbox}"
    assert _exec_status(http_, sandbox, f"{COMMIT} && echo more >> new.txt") == 0

    status, refused = http_.call("teardown", path)
    assert status == 400
    assert refused["error"]["kind"] == "UnexportedWorkError"
    assert refused["error"]["status"] == 2
    lost = ["1 new commit on main (made from main)", "changes not committed"]
    assert refused["unexported"] == lost
    assert " and ".join(lost) in refused["error"]["message"]  # the CLI's line, unchanged
    assert refused["export"] == [
        {"method": "POST", "path": f"{path}/export?confirm=1", "body": {"format": "bundle"}},
        {"method": "POST", "path": f"{path}/export?confirm=1", "body": {"format": "tar"}},
    ]
    assert refused["discard"] == {"method": "DELETE", "path": f"{path}?discard=true"}

    # One call: the body's end arrives only once the record notes it, so the next request sees it.
    exported = http_.send("POST", f"{path}/export?confirm=1", {"format": "bundle"})
    assert exported.status == 200
    summary = json.loads(exported.getheader("Sandboxer-Export") or "")
    assert "token" not in summary  # nothing to confirm
    assert (summary["format"], summary["ahead"]) == ("bundle", 1)
    assert exported.read().startswith(b"# v2 git bundle")
    status, refused = http_.call("teardown", path)
    assert (status, refused["unexported"]) == (400, ["changes not committed"])
    assert [request["body"] for request in refused["export"]] == [{"format": "tar"}]

    # The two-step flow as before: sent whole is not noted until the client confirms it.
    exported = http_.send("POST", f"{path}/export", {"format": "tar"})
    token = json.loads(exported.getheader("Sandboxer-Export") or "")["token"]
    assert exported.read()[257:262] == b"ustar"
    assert http_.call("teardown", path)[1]["unexported"] == ["changes not committed"]
    assert http_.call("export-confirm", f"{path}/export/confirm", {"token": token}) == (
        200,
        {"id": sandbox, "noted": True},
    )
    status, receipt = http_.call("teardown", path)
    assert (status, receipt["id"], receipt["residue"]) == (200, sandbox, [])


def test_a_confirmed_export_cut_short_is_not_noted(served: tuple[Http, SandboxBroker]) -> None:
    """8 MiB of changes: more than a socket holds, so the service cannot hand all of it over to a
    client that reads a little and leaves; the body never ends and nothing is noted."""
    http_, broker = served
    sandbox = _create(http_, broker)
    path = f"/v1/sandboxes/{sandbox}"
    assert _exec_status(http_, sandbox, "head -c 8388608 /dev/urandom > big.bin") == 0

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(http_.path))
    body = b'{"format": "tar"}'
    head = f"POST {path}/export?confirm=1 HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    sock.sendall(head.encode() + body)
    got = b""
    while b"\r\n\r\n" not in got:
        got += sock.recv(4096)
    assert got.startswith(b"HTTP/1.1 200")
    sock.close()  # the client leaves with a few KiB of 8 MiB

    audit = broker.state / "audit.log"
    deadline = time.monotonic() + 30
    while not any(
        json.loads(line)["verb"] == "export" and json.loads(line)["outcome"] == "ClientGone"
        for line in audit.read_text().splitlines()
    ):
        assert time.monotonic() < deadline, audit.read_text()
        time.sleep(0.1)
    status, refused = http_.call("teardown", path)
    assert (status, refused["unexported"]) == (400, ["changes not committed"])
    assert http_.call("teardown", f"{path}?discard=true")[0] == 200


def test_the_refusal_reads_each_form_of_the_error() -> None:
    """What the core's two messages say (the real service's answer is above), and a list the
    error carries itself, which wins over its message."""
    sandbox = "a" * 24
    unchecked = UnexportedWorkError(
        f"teardown: sandbox {sandbox}: its work cannot be checked (git took longer than 30 s); "
        "teardown --discard removes it anyway"
    )
    assert unexported_answer(unchecked, sandbox) == {
        "unexported": ["its work cannot be checked (git took longer than 30 s)"],
        "discard": {"method": "DELETE", "path": f"/v1/sandboxes/{sandbox}?discard=true"},
    }
    lost = UnexportedWorkError(
        f"teardown: sandbox {sandbox} holds work no export took out: new commits on HEAD (made from v1.2); "
        "export it first (sandboxer export), or teardown --discard"
    )
    assert unexported_answer(lost, sandbox)["unexported"] == ["new commits on HEAD (made from v1.2)"]
    lost.unexported = ("changes not committed",)
    answer = unexported_answer(lost, sandbox)
    assert answer["unexported"] == ["changes not committed"]
    assert [request["body"] for request in answer["export"]] == [{"format": "tar"}]


def test_confirm_takes_one_and_zero_only_and_http_1_1(served: tuple[Http, SandboxBroker]) -> None:
    http_, broker = served
    sandbox = _create(http_, broker)
    path = f"/v1/sandboxes/{sandbox}/export"
    status, refused = http_.call("export", f"{path}?confirm=maybe", {"format": "tar"})
    assert (status, refused["error"]["message"]) == (400, "confirm: must be 1 or 0 (true or false)")

    body = b'{"format": "tar"}'
    request = f"POST {path}?confirm=1 HTTP/1.0\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(http_.path))
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, answer = data.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"400"
    document = json.loads(answer)
    http_.validate("export", 400, document)
    assert document["error"]["message"].startswith("confirm: needs HTTP/1.1")


# --- exec for simple clients --------------------------------------------------------------------

# stdout, stderr, a euro sign cut in two between writes, and bytes that are not UTF-8.
OUTPUTS = (
    "printf 'out\\n'; printf 'err\\n' >&2; printf '\\342\\202'; sleep 0.3; printf '\\254\\n'; printf '\\377\\376' >&2"
)


@pytest.fixture
def sbx_served(sbx_root: SandboxBroker) -> Iterator[tuple[Http, SandboxBroker]]:
    directory = sbx_root.root / "svc"
    directory.mkdir(exist_ok=True)
    started = Service(sbx_root, directory / "broker.sock").start()
    try:
        http_ = Http(started.socket)
        yield http_, sbx_root
        http_.close()
    finally:
        started.stop()


def test_exec_answers_ndjson_and_text_as_asked(sbx_served: tuple[Http, SandboxBroker]) -> None:
    """On each backend: NDJSON by Accept or ?format=, text the same way; the frames without either."""
    http_, broker = sbx_served
    sandbox = _create(http_, broker)

    for query, accept in (("", "application/x-ndjson"), ("?format=ndjson", None), ("?format=ndjson", "text/plain")):
        lines = _ndjson(http_, http_.exec(sandbox, ["sh", "-c", f"{OUTPUTS}; exit 3"], query=query, accept=accept))
        assert lines[-1] == {"exit_status": 3}
        assert _streams(lines) == {"stdout": b"out\n\xe2\x82\xac\n", "stderr": b"err\n\xff\xfe"}
        assert {"stream": "stdout", "data": "\u20ac\n"} in lines  # the cut character, whole and as text
        assert {"stream": "stderr", "data": "//4=", "encoding": "base64"} in lines

    # The input streams in as before.
    lines = _ndjson(http_, http_.exec(sandbox, ["wc", "-c"], accept="application/x-ndjson", stdin=b"hello"))
    assert lines == [{"stream": "stdout", "data": "5\n"}, {"exit_status": 0}]

    for query, accept in (("", "text/plain"), ("?format=text", None), ("", "application/x-ndjson;q=0.5, text/plain")):
        answer = http_.exec(
            sandbox, ["sh", "-c", "printf out; sleep 0.3; printf err >&2; exit 4"], query=query, accept=accept
        )
        assert (answer.status, answer.getheader("Content-Type")) == (200, "text/plain")
        assert answer.read() == b"outerr\nsandboxer: exit status 4\n"  # a newline of its own before the status
    answer = http_.exec(sandbox, ["sh", "-c", "echo done"], accept="text/plain")
    assert answer.read() == b"done\nsandboxer: exit status 0\n"  # none needed
    # What the sandbox's entry refuses is the command's stderr and status, as the CLI prints it.
    answer = http_.send(
        "POST",
        f"/v1/sandboxes/{sandbox}/exec?format=text",
        json.dumps({"argv": ["true"], "cwd": "/workspace/nowhere"}).encode() + b"\n",
    )
    *said, last = answer.read().decode().splitlines()
    assert said
    assert all(line.startswith("sandboxer: exec: ") for line in said)
    assert last == "sandboxer: exit status 125"

    # The frames, as sandboxer's clients read them: with no Accept, */*, one naming none of the
    # three, and ?format=frames over any Accept.
    for query, accept in (("", None), ("", "*/*"), ("", "application/json"), ("?format=frames", "text/plain")):
        answer = http_.exec(sandbox, ["sh", "-c", "echo hi; exit 5"], query=query, accept=accept)
        assert answer.getheader("Content-Type") == frames.CONTENT_TYPE
        found = frames.FrameReader().feed(answer.read())
        assert found == [(frames.STDOUT, b"hi\n"), (frames.END, b'{"status": 5}')]


def test_an_unknown_exec_format_is_one_line_and_nothing_runs(served: tuple[Http, SandboxBroker]) -> None:
    http_, broker = served
    sandbox = _create(http_, broker)
    for query in ("?format=json", "?format=", "?format=NDJSON"):
        answer = http_.exec(sandbox, ["sh", "-c", "touch /workspace/ran"], query=query, accept="application/x-ndjson")
        assert (answer.status, answer.getheader("Content-Type")) == (400, "application/json; charset=utf-8")
        document = json.loads(answer.read())
        http_.validate("exec", 400, document)
        assert document["error"] == {"kind": "UsageError", "message": BAD_FORMAT, "hint": None, "status": 2}
    assert _exec_status(http_, sandbox, "test ! -e /workspace/ran") == 0
    # Refused before the head: the envelope, whatever shape was asked for.
    answer = http_.exec("0" * 24, ["true"], query="?format=text")
    assert answer.status == 500
    assert json.loads(answer.read())["error"]["kind"] == "ExecError"


def test_the_end_of_an_exec_the_broker_could_not_run_in_each_shape() -> None:
    """After its head an exec can still fail as a whole (ExecError, 125): each shape's last line
    says so. (The route's answer is made by these; the service's tests reach them through it.)"""
    error = {"kind": "ExecError", "message": "exec: the service could not run it", "hint": None, "status": 125}
    ndjson = exec_answers.answer("ndjson")
    assert ndjson.output("stdout", b"a\xe2") == b'{"stream": "stdout", "data": "a"}\n'
    assert ndjson.end({"error": error}) == (
        b'{"stream": "stdout", "data": "4g==", "encoding": "base64"}\n'
        + json.dumps({"exit_status": 125, "error": error}, ensure_ascii=False).encode()
        + b"\n"
    )
    text = exec_answers.answer("text")
    assert text.output("stdout", b"partial") == b"partial"
    assert text.end({"error": {**error, "hint": "try again"}}) == (
        b"\nsandboxer: exit status 125: exec: the service could not run it (hint: try again)\n"
    )
    assert exec_answers.chosen(None, "text/plain;q=0, application/x-ndjson;q=0.1") == "ndjson"
    assert exec_answers.chosen(None, "text/plain;q=x") == "frames"  # not acceptable: no q it can read


# --- curl, as docs/service.md shows it ----------------------------------------------------------


def _curl(socket_path: Path, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    argv = ["curl", "-sS", "--unix-socket", str(socket_path), *args]
    return subprocess.run(argv, input=stdin, capture_output=True, check=False, timeout=120)


def test_curl_runs_a_whole_sandbox_life(served: tuple[Http, SandboxBroker], tmp_path: Path) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed (scripts/install-system-deps installs it)")
    http_, broker = served
    base = "http://localhost/v1/sandboxes"
    created = _curl(http_.path, "-d", json.dumps({"profile": broker.profile}), base)
    assert created.returncode == 0, created.stderr
    sandbox = json.loads(created.stdout)["id"]
    broker.created.append(sandbox)

    ran = _curl(
        http_.path,
        "-H",
        "Accept: text/plain",
        "--data-binary",
        json.dumps({"argv": ["sh", "-c", COMMIT + " && git log --format=%s"]}) + "\n",
        f"{base}/{sandbox}/exec",
    )
    assert (ran.returncode, ran.stdout) == (0, b"Add new.txt\ninit\nsandboxer: exit status 0\n"), ran.stderr
    streamed = _curl(
        http_.path,
        "-X", "POST", "-T", "-", "-H", "Accept: application/x-ndjson", f"{base}/{sandbox}/exec",
        stdin=json.dumps({"argv": ["wc", "-c"]}).encode() + b"\nhello",
    )  # fmt: skip
    assert streamed.stdout == b'{"stream": "stdout", "data": "5\\n"}\n{"exit_status": 0}\n', streamed.stderr

    refused = _curl(http_.path, "-X", "DELETE", f"{base}/{sandbox}")
    assert json.loads(refused.stdout)["unexported"] == ["1 new commit on main (made from main)"]
    bundle = tmp_path / "work.bundle"
    exported = _curl(
        http_.path, "--fail", "-o", str(bundle), "-d", '{"format": "bundle"}', f"{base}/{sandbox}/export?confirm=1"
    )
    assert exported.returncode == 0, exported.stderr
    assert bundle.read_bytes().startswith(b"# v2 git bundle")
    torn = _curl(http_.path, "--fail", "-X", "DELETE", f"{base}/{sandbox}")
    assert (torn.returncode, json.loads(torn.stdout)["id"]) == (0, sandbox), torn.stdout
