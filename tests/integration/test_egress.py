"""Enforced egress end to end (issue 33): a sandbox whose profile lists network.egress reaches
the listed names through the service's proxy, and nothing else.

Loopback only: every upstream is this test's own server on the host's 127.0.0.1, and the profile
pins each test name to 127.0.0.1 explicitly (`addresses`), which is also how a name that resolves
to loopback without that entry is shown refused. Inside, the sandbox has `lo` alone; the proxy's
listener on its 127.0.0.1:3128 was made there by the broker. Each variant runs through a service:
bwrap as root, bwrap as an ordinary user (its private service), Docker as root.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import os
import ssl
import subprocess
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from tests.conftest import settled
from tests.integration.conftest import (
    SandboxBroker,
    _ready,
    _require_tools,
    _serve,
    add_docker,
    backend_profile_text,
    make_broker,
)
from tests.integration.warm_pool import set_warm, wait_warm

pytestmark = pytest.mark.integration

SECRET = "sk-canary-7f3e9d1c-never-inside"  # the routed credential: must never be found inside
PLACEHOLDER = "sandboxer-route:model"


class Upstream:
    """An HTTP(S) server on the host's 127.0.0.1 that answers what it was asked (path and the
    Authorization header it got), and remembers each request's headers."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.seen: list[dict[str, str]] = []
        seen = self.seen

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                seen.append({key.lower(): value for key, value in self.headers.items()})
                # Whether the secret came, never the secret: the answer reaches the sandbox.
                authorized = self.headers.get("Authorization") == f"Bearer {SECRET}"
                body = json.dumps({"path": self.path, "authorized": authorized}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                return

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    served = Upstream()
    yield served
    served.close()


def _egress_profile(broker: SandboxBroker, name: str, network: str) -> str:
    text = backend_profile_text(broker, name, broker.repo).replace("network:\n  default: deny\n  egress: []\n", network)
    assert network in text, text
    broker.write_profile(name, text)
    broker.approve(name)
    return name


def _rules(port: int) -> str:
    return (
        "network:\n  default: deny\n  egress:\n"
        f"    - host: upstream.test\n      ports: [{port}]\n      addresses: [127.0.0.1]\n"
        f"    - host: localhost\n      ports: [{port}]\n"
    )


def _curl(broker: SandboxBroker, sandbox_id: str, *args: str) -> subprocess.CompletedProcess[str]:
    ran = broker.exec(sandbox_id, "curl", "-sS", "--max-time", "20", "-w", "\n%{http_code}", *args)
    return subprocess.CompletedProcess(args, ran.status, ran.stdout, ran.stderr)


def test_a_listed_name_is_reached_through_the_proxy_and_everything_else_is_refused(
    eb: SandboxBroker, upstream: Upstream
) -> None:
    sandbox_id = eb.create(_egress_profile(eb, "egress", _rules(upstream.port)))
    env = eb.exec(sandbox_id, "env").stdout
    assert "HTTP_PROXY=http://127.0.0.1:3128" in env
    assert "SANDBOXER_NETWORK=proxy" in env

    allowed = _curl(eb, sandbox_id, f"http://upstream.test:{upstream.port}/hello")
    assert allowed.returncode == 0, allowed.stderr
    assert allowed.stdout.endswith("\n200"), allowed.stdout
    assert json.loads(allowed.stdout.rsplit("\n", 1)[0])["path"] == "/hello"

    # Refused by the proxy, each with 403 and a line in the report: a name not listed, an IP
    # literal (sent to the proxy: NO_PROXY would send it direct, where nothing listens), a listed
    # name on another port, and a name that resolves to loopback without an explicit address.
    for url, extra in (
        (f"http://other.test:{upstream.port}/", ()),
        (f"http://127.0.0.1:{upstream.port}/", ("--noproxy", "")),
        (f"http://upstream.test:{upstream.port + 1}/", ()),
        (f"http://localhost:{upstream.port}/", ("--noproxy", "")),
    ):
        refused = _curl(eb, sandbox_id, *extra, url)
        assert refused.stdout.endswith("\n403"), (url, refused.stdout, refused.stderr)
    assert len(upstream.seen) == 1  # only the allowed request arrived

    # A CONNECT tunnel to a listed name works; one to a name not listed is refused.
    tunnel = _curl(eb, sandbox_id, "--proxytunnel", f"http://upstream.test:{upstream.port}/tunnel")
    assert tunnel.stdout.endswith("\n200"), (tunnel.stdout, tunnel.stderr)
    no_tunnel = _curl(eb, sandbox_id, "--proxytunnel", f"http://other.test:{upstream.port}/")
    assert no_tunnel.returncode != 0 or not no_tunnel.stdout.endswith("\n200")

    logged = eb.run("logs", sandbox_id, "--network", "--json")
    assert logged.status == 0, logged.stderr
    entries = json.loads(logged.stdout)["entries"]
    decisions = [(e["host"], e["port"], e["decision"]) for e in entries]
    assert ("upstream.test", upstream.port, "allowed") in decisions
    assert ("other.test", upstream.port, "refused") in decisions
    assert ("127.0.0.1", upstream.port, "refused") in decisions
    assert ("upstream.test", upstream.port + 1, "refused") in decisions
    assert ("localhost", upstream.port, "refused") in decisions
    # The CONNECT to other.test repeats the first refusal within a second: it is counted, and the
    # count written when that second ends.
    deadline = time.monotonic() + 10
    while True:
        inspected = json.loads(eb.run("inspect", sandbox_id, "--json").stdout)["network"]["egress"]
        if inspected["refused"] >= 5 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert inspected["proxy"] == "up"
    assert inspected["allowed"] >= 2
    assert inspected["refused"] >= 5


def test_inside_there_is_no_resolver_and_no_way_out_but_the_proxy(eb: SandboxBroker, upstream: Upstream) -> None:
    sandbox_id = eb.create(_egress_profile(eb, "egress", _rules(upstream.port)))
    probe = (
        "import socket\n"
        "try:\n    socket.getaddrinfo('upstream.test', 80); print('resolved')\n"
        "except OSError as e:\n    print('no-dns')\n"
        f"s = socket.socket(); s.settimeout(5)\n"
        f"try:\n    s.connect(('127.0.0.1', {upstream.port})); print('connected')\n"
        "except OSError as e:\n    print('refused', e.errno)\n"
        "print(sorted(name for _, name in socket.if_nameindex()))\n"
    )
    ran = eb.exec(sandbox_id, "python3", "-c", probe)
    assert ran.status == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[0] == "no-dns"
    assert lines[1].startswith("refused")  # the host's server is not on the sandbox's loopback
    assert lines[2] == "['lo']"


def test_a_smuggling_attempt_is_refused(eb: SandboxBroker, upstream: Upstream) -> None:
    sandbox_id = eb.create(_egress_profile(eb, "egress", _rules(upstream.port)))
    smuggle = (
        "import socket\n"
        "s = socket.create_connection(('127.0.0.1', 3128), timeout=10)\n"
        f"s.sendall(b'POST http://upstream.test:{upstream.port}/ HTTP/1.1\\r\\n"
        f"Host: upstream.test:{upstream.port}\\r\\n"
        "Content-Length: 4\\r\\nTransfer-Encoding: chunked\\r\\n\\r\\n0\\r\\n\\r\\nGET /admin HTTP/1.1\\r\\n\\r\\n')\n"
        "print(s.recv(200).split(b'\\r\\n')[0].decode())\n"
    )
    ran = eb.exec(sandbox_id, "python3", "-c", smuggle)
    assert ran.status == 0, ran.stderr
    assert ran.stdout.startswith("HTTP/1.1 400"), ran.stdout
    assert upstream.seen == []


@pytest.fixture
def model_upstream() -> Iterator[tuple[Upstream, trustme.CA]]:
    """An HTTPS upstream named api.model.test, its certificate from a test CA."""
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("api.model.test").configure_cert(context)
    served = Upstream(tls=context)
    yield served, ca
    served.close()


@pytest.mark.parametrize("backend", ["bwrap", "docker"])
def test_a_routed_request_carries_the_secret_that_is_nowhere_inside(
    request: pytest.FixtureRequest, backend: str, runtime_dir: Path, model_upstream: tuple[Upstream, trustme.CA]
) -> None:
    """The route's secret is set on the request by the proxy (TLS terminated with the sandbox's
    own CA); inside, only the placeholder exists: not in any environment, file, or the memory of
    the client that made the request. Revoking the route refuses the next request."""
    _require_tools()
    upstream, ca = model_upstream
    broker = make_broker(runtime_dir, as_user=False)
    if backend == "docker":
        add_docker(broker, request.getfixturevalue("base_image"))
    trust = broker.root / "upstream-ca.pem"
    ca.cert_pem.write_to_path(str(trust))
    secret_file = broker.root / "model.secret"
    secret_file.write_text(SECRET + "\n")
    secret_file.chmod(0o600)
    extension = broker.config / "extensions" / f"ext.{backend}.yaml"
    extension.write_text(
        extension.read_text()
        + "  routes:\n    model:\n      host: api.model.test\n      header: Authorization\n"
        + f'      format: "Bearer {{secret}}"\n      secret_file: {secret_file}\n'
    )
    broker.approve(f"ext.{backend}")
    rules = (
        "network:\n  default: deny\n  egress:\n"
        f"    - host: api.model.test\n      ports: [{upstream.port}]\n      addresses: [127.0.0.1]\n"
        "  routes: [model]\n"
    )
    # The service verifies upstreams against the host's trust store: here the test CA's.
    broker.service_env = {"SSL_CERT_FILE": str(trust)}
    _serve(broker)
    with _ready(broker):
        sandbox_id = broker.create(_egress_profile(broker, "routed", rules))
        # The client makes the routed request and stays alive; a second process then reads the
        # client's whole memory for the secret (the scanner builds its needle at run time, and
        # only ever looks at the client's memory, never its own).
        client = (
            "import json, sys, time, urllib.request\n"
            f"req = urllib.request.Request('https://api.model.test:{upstream.port}/v1/messages',"
            f" headers={{'Authorization': 'Bearer {PLACEHOLDER}'}})\n"
            "got = json.load(urllib.request.urlopen(req, timeout=20))\n"
            "print(got['authorized'], flush=True)\n"
            "time.sleep(60)\n"
        )
        scanner = (
            "import sys\n"
            "pid = sys.argv[1]\n"
            "needle = '-'.join(['7f3e9d1c', 'never', 'inside']).encode()\n"
            "found = False\n"
            "with open(f'/proc/{pid}/maps') as maps, open(f'/proc/{pid}/mem', 'rb', 0) as mem:\n"
            "    for line in maps:\n"
            "        span, perms = line.split()[:2]\n"
            "        if 'r' not in perms: continue\n"
            "        lo, hi = (int(x, 16) for x in span.split('-'))\n"
            "        try:\n            mem.seek(lo); found = found or needle in mem.read(hi - lo)\n"
            "        except (OSError, OverflowError, ValueError): pass\n"
            "print('in-memory' if found else 'not-in-memory')\n"
        )
        script = (
            'python3 -c "$1" > /tmp/client.out & pid=$!\n'
            "for i in $(seq 200); do [ -s /tmp/client.out ] && break; sleep 0.1; done\n"
            'cat /tmp/client.out; python3 -c "$2" $pid; kill $pid\n'
        )
        ran = broker.exec(sandbox_id, "sh", "-c", script, "sh", client, scanner)
        assert ran.status == 0, ran.stderr
        assert ran.stdout.split() == ["True", "not-in-memory"], (ran.stdout, ran.stderr)
        assert upstream.seen[-1]["authorization"] == f"Bearer {SECRET}"

        search = broker.sh(
            sandbox_id,
            "grep -rls 7f3e9d1c-never / --exclude-dir=proc --exclude-dir=sys 2>/dev/null; "
            "cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n' | grep -c 7f3e9d1c-never; true",
        )
        assert search.stdout.split() == ["0"], search.stdout

        # The owner revokes the extension (and with it its route): the next request fails and
        # the secret is not sent again.
        count = len(upstream.seen)
        revoked = broker.run("ext", "revoke", f"ext.{backend}")
        assert revoked.status == 0, revoked.stderr
        again = broker.exec(sandbox_id, "python3", "-c", client.replace("time.sleep(60)", "pass"))
        assert again.stdout.split()[:1] != ["True"], again.stdout
        assert len(upstream.seen) == count

        for path in (broker.state / "audit.log", *broker.state.rglob("*.json*")):
            if path.is_file():
                assert SECRET not in path.read_text(errors="replace"), path


def _listener_inode(broker: SandboxBroker, sandbox_id: str) -> str:
    """The inode of the socket listening on 127.0.0.1:3128 inside the sandbox (its /proc/net/tcp)."""
    listing = broker.exec(sandbox_id, "cat", "/proc/net/tcp").stdout.splitlines()[1:]
    found = [line.split()[9] for line in listing if line.split()[1] == "0100007F:0C38" and line.split()[3] == "0A"]
    assert len(found) == 1, listing
    return found[0]


def _holds(pid: int, inode: str) -> bool:
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd) == f"socket:[{inode}]":
                return True
        except OSError:
            continue
    return False


def test_egress_survives_a_service_restart_and_ends_with_its_sandbox(runtime_dir: Path, upstream: Upstream) -> None:
    """Sandboxes outlive their service: the next `serve` makes each live sandbox's listener again
    and its egress works. A teardown done elsewhere (here in-process, not through the service)
    is noticed: the service lets go of the listener, so no namespace outlives its sandbox."""
    _require_tools()
    broker = make_broker(runtime_dir, as_user=False)
    _serve(broker)
    with _ready(broker):
        sandbox_id = broker.create(_egress_profile(broker, "egress", _rules(upstream.port)))
        assert _curl(broker, sandbox_id, f"http://upstream.test:{upstream.port}/one").stdout.endswith("\n200")
        assert broker.service is not None
        broker.service.stop()
        # In-process, so that no service is started on demand: nothing listens while none runs.
        down = subprocess.run(
            broker.argv(
                "exec", sandbox_id, "--", "curl", "-sS", "-w", "%{http_code}", f"http://upstream.test:{upstream.port}/"
            ),
            env={**broker.env(), "SANDBOXER_NO_SERVICE": "1"},
            capture_output=True,
            text=True,
            check=False,
        )
        assert down.returncode != 0
        assert "Failed to connect" in down.stderr or "Couldn't connect" in down.stderr, down.stderr
        _serve(broker)
        again = _curl(broker, sandbox_id, f"http://upstream.test:{upstream.port}/two")
        assert again.stdout.endswith("\n200"), (again.stdout, again.stderr)
        assert json.loads(broker.run("inspect", sandbox_id, "--json").stdout)["network"]["egress"]["proxy"] == "up"

        inode = _listener_inode(broker, sandbox_id)
        service_pid = broker.service.process.pid if broker.service and broker.service.process else 0
        assert _holds(service_pid, inode)
        elsewhere = subprocess.run(
            broker.argv("teardown", "--discard", sandbox_id),
            env={**broker.env(), "SANDBOXER_NO_SERVICE": "1"},
            capture_output=True,
            text=True,
            check=False,
        )
        assert elsewhere.returncode == 0, elsewhere.stderr
        held = settled(lambda: _holds(service_pid, inode), False)
        assert not held, broker.service.log.read_text() if broker.service else ""


def _wheel(directory: Path) -> Path:
    """A pure-Python wheel made here, by hand (zip of the package, METADATA, WHEEL, RECORD)."""

    files = {
        "demo_pkg/__init__.py": b"ANSWER = 42\n",
        "demo_pkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: demo-pkg\nVersion: 1.0\n",
        "demo_pkg-1.0.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = ""
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record += f"{name},sha256={digest},{len(data)}\n"
    record += "demo_pkg-1.0.dist-info/RECORD,,\n"
    wheel = directory / "demo_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        archive.writestr("demo_pkg-1.0.dist-info/RECORD", record)
    return wheel


def test_pip_installs_from_a_loopback_index_allowed_by_name(eb: SandboxBroker, tmp_path: Path) -> None:
    """A package index (a directory of this test's, served on the host's 127.0.0.1) is listed by
    name: pip inside the sandbox installs from it through the proxy."""
    index = tmp_path / "index"
    (index / "simple" / "demo-pkg").mkdir(parents=True)
    wheel = _wheel(index)
    (index / "simple" / "demo-pkg" / "index.html").write_text(f'<a href="/{wheel.name}">{wheel.name}</a>\n')

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=str(index), **kwargs)  # type: ignore[arg-type]

        def log_message(self, *args: object) -> None:
            return

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        rules = (
            "network:\n  default: deny\n  egress:\n"
            f"    - host: index.test\n      ports: [{port}]\n      addresses: [127.0.0.1]\n"
        )
        sandbox_id = eb.create(_egress_profile(eb, "pip", rules))
        installed = eb.sh(
            sandbox_id,
            f"/usr/bin/python3 -m pip install --quiet --no-cache-dir --disable-pip-version-check --target /tmp/pkgs "
            f"--index-url http://index.test:{port}/simple --trusted-host index.test demo-pkg "
            "&& PYTHONPATH=/tmp/pkgs /usr/bin/python3 -c 'import demo_pkg; print(demo_pkg.ANSWER)'",
        )
        assert installed.status == 0, installed.stderr
        assert installed.stdout.strip().splitlines()[-1] == "42"
    finally:
        server.shutdown()
        server.server_close()


def test_revoking_a_host_closes_its_open_tunnels_within_a_second(runtime_dir: Path, upstream: Upstream) -> None:
    """A tunnel open through the proxy is closed once the owner approves a profile that no longer
    lists its host (the service's watch on the owner's files), not only refused next time."""
    _require_tools()
    broker = make_broker(runtime_dir, as_user=False)
    _serve(broker)
    with _ready(broker):
        name = _egress_profile(broker, "egress", _rules(upstream.port))
        sandbox_id = broker.create(name)
        holder = (
            "import socket, sys, time\n"
            "s = socket.create_connection(('127.0.0.1', 3128), timeout=30)\n"
            f"s.sendall(b'CONNECT upstream.test:{upstream.port} HTTP/1.1\\r\\n"
            f"Host: upstream.test:{upstream.port}\\r\\n\\r\\n')\n"
            "print(s.recv(100).split(b'\\r\\n')[0].decode(), flush=True)\n"
            "sys.stdin.readline()\n"  # the test has revoked the host
            "start = time.monotonic(); left = s.recv(100)\n"
            "print('closed' if left == b'' else 'open', round(time.monotonic() - start, 2), flush=True)\n"
        )
        inside = subprocess.Popen(
            broker.argv("exec", sandbox_id, "--", "python3", "-c", holder),
            env=broker.env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert inside.stdin is not None
        assert inside.stdout is not None
        assert inside.stdout.readline().strip() == "HTTP/1.1 200 Connection established"
        text = (broker.config / "profiles" / f"{name}.yaml").read_text()
        broker.write_profile(name, text.replace("upstream.test", "other.test"))
        broker.approve(name)
        inside.stdin.write("go\n")
        inside.stdin.flush()
        verdict, seconds = inside.stdout.readline().split()
        assert verdict == "closed"
        assert float(seconds) < 3.0  # the watch looks every 0.5 s; a loaded machine gets slack
        assert inside.wait(timeout=30) == 0
        inside.stdout.close()
        inside.stdin.close()
        entries = json.loads(broker.run("logs", sandbox_id, "--network", "--json").stdout)["entries"]
        assert [e["reason"] for e in entries if e["host"] == "upstream.test"][-1] == "closed: revoked (host not listed)"


def test_a_warm_sandbox_gets_its_listener_when_a_create_takes_it(runtime_dir: Path, upstream: Upstream) -> None:
    """A warm namespace has no listener (nothing of a caller's runs in it yet); the create that
    takes it makes one before the sandbox is handed over, and its egress works."""
    _require_tools()
    broker = make_broker(runtime_dir, as_user=False)
    _serve(broker)
    with _ready(broker):
        name = _egress_profile(broker, "egress", _rules(upstream.port))
        set_warm(broker, "ext.bwrap", 1)
        filled = broker.run("warm", name, "--json")
        assert filled.status == 0, filled.stderr
        (warm_id,) = wait_warm(broker, 1)
        sandbox_id = broker.create(name)
        assert sandbox_id == warm_id  # the warm one was taken
        allowed = _curl(broker, sandbox_id, f"http://upstream.test:{upstream.port}/warm")
        assert allowed.stdout.endswith("\n200"), (allowed.stdout, allowed.stderr)
        set_warm(broker, "ext.bwrap", 0)
        broker.run("warm", name)
