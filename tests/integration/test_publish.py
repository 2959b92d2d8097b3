"""Published ports (docs/publish.md): a lease manifest's `published_ports` answer on the host's
127.0.0.1 only and reach a server on 127.0.0.1 inside the sandbox, through the service, on bwrap
(root and an ordinary user) and Docker; refusals leave nothing; teardown and a restarted service
do what they must. Loopback only: every connection here is to the host's 127.0.0.1 or made inside
the sandbox."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests.conftest import Result
from tests.integration.conftest import (
    SandboxBroker,
    _ready,
    _require_tools,
    _serve,
    backend_profile_text,
    make_broker,
)
from tests.integration.services import UNPRIVILEGED_UID

pytestmark = pytest.mark.integration

RUNTIME_PORT = 8000
# Serves `count` connections on 127.0.0.1:PORT inside, answering each with "pong:" and what it got.
SERVER = (
    "import socket, sys\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(8); s.settimeout(60)\n"
    "print('listening', flush=True)\n"
    "for _ in range(int(sys.argv[2])):\n"
    "    c, _ = s.accept(); data = c.recv(64); c.sendall(b'pong:' + data); c.close()\n"
)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _publishing_profile(broker: SandboxBroker, name: str = "pub", publish: str = "loopback") -> str:
    text = backend_profile_text(broker, name, broker.repo)
    text = text.replace("network:\n  default: deny\n", f"network:\n  default: deny\n  publish: {publish}\n")
    assert f"publish: {publish}" in text, text
    broker.write_profile(name, text)
    broker.approve(name)
    return name


def _manifest(broker: SandboxBroker, ports: list[tuple[int, int]]) -> Path:
    """A version-1 assignment with no leases, publishing `ports`, in a run directory of its own
    (owned by the broker's user)."""
    run_id = f"run-{uuid.uuid4().hex[:12]}"
    run_dir = broker.root / "managed" / run_id
    run_dir.mkdir(parents=True, mode=0o700)
    head = subprocess.run(
        ["git", "-C", str(broker.repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    document = {
        "version": "1",
        "run_id": run_id,
        "lease_id": "assignment-1",
        "outer_runtime_id": "outer-1",
        "workspace": "/srv/work/published",
        "repository": {"path": str(broker.repo), "revision": head},
        "task_branch": "task/published",
        "tunnel_placement": "outer",
        "published_ports": [{"host": host, "runtime": runtime} for host, runtime in ports],
        "leases": [],
    }
    path = run_dir / "assignment.json"
    path.write_text(json.dumps(document))
    path.chmod(0o600)
    if broker.as_user:
        for owned in (run_dir.parent, run_dir, path):
            os.chown(owned, UNPRIVILEGED_UID, UNPRIVILEGED_UID)
    return path


def _create(broker: SandboxBroker, profile: str, manifest: Path) -> Result:
    result = broker.run("create", "--profile", profile, "--manifest", str(manifest))
    if result.status == 0:
        broker.created.append(result.stdout.strip())
    return result


def _serve_inside(broker: SandboxBroker, sandbox_id: str, count: int) -> threading.Thread:
    """Start the test server inside (an exec, on a thread of its own) and wait until it listens."""
    ran: list[Result] = []
    thread = threading.Thread(
        target=lambda: ran.append(broker.exec(sandbox_id, "python3", "-c", SERVER, str(RUNTIME_PORT), str(count))),
        daemon=True,
    )
    thread.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        probe = broker.exec(
            sandbox_id, "python3", "-c", f"import socket; socket.create_connection(('127.0.0.1', {RUNTIME_PORT}), 2)"
        )
        if probe.status == 0:  # the probe took one of its connections
            return thread
        time.sleep(0.2)
    raise AssertionError(f"the server inside never listened: {ran}")


def _ask(port: int, payload: bytes = b"ping") -> bytes:
    """Connect to the host's 127.0.0.1:`port`, send `payload`, read the answer until the end."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(payload)
        answer = b""
        while data := conn.recv(4096):
            answer += data
        return answer


def _in_process(broker: SandboxBroker, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI in its own process, with no service (none is started on demand)."""
    env = {**broker.env(), "SANDBOXER_NO_SERVICE": "1"}
    return subprocess.run(broker.argv(*args), env=env, capture_output=True, text=True, check=False, timeout=120)


def _listening(port: int) -> list[str]:
    """Every address of the host that has a TCP listener on `port` (this namespace's)."""
    return sorted(
        str(conn.laddr.ip)
        for conn in psutil.net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port
    )


def _create_until_reserved(
    broker: SandboxBroker, profile: str, manifest: Path, host_port: int
) -> subprocess.Popen[str]:
    """A create under way, returned once it has reserved the host's port (before its sandbox runs)."""
    client = subprocess.Popen(
        broker.argv("create", "--profile", profile, "--manifest", str(manifest)),
        env=broker.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while _listening(host_port) != ["127.0.0.1"]:
        assert client.poll() is None, client.communicate()
        assert time.monotonic() < deadline, "the port was never reserved"
        time.sleep(0.005)
    return client


def test_a_published_port_answers_on_the_hosts_loopback_only_and_closes_at_teardown(eb: SandboxBroker) -> None:
    host_port = _free_port()
    sandbox_id_result = _create(eb, _publishing_profile(eb), _manifest(eb, [(host_port, RUNTIME_PORT)]))
    assert sandbox_id_result.status == 0, sandbox_id_result.stderr
    sandbox_id = sandbox_id_result.stdout.strip()
    assert _listening(host_port) == ["127.0.0.1"]  # absent from every other host address

    server = _serve_inside(eb, sandbox_id, count=3)  # the readiness probe, then two requests
    assert _ask(host_port, b"one") == b"pong:one"
    assert _ask(host_port, b"two") == b"pong:two"
    server.join(timeout=30)

    inspected = json.loads(eb.run("inspect", sandbox_id, "--json").stdout)["network"]["published"]
    (mapping,) = inspected
    assert mapping["host"] == f"127.0.0.1:{host_port}"
    assert (mapping["runtime"], mapping["forwarder"], mapping["listening"]) == (RUNTIME_PORT, "up", True)
    assert mapping["forwarded"] >= 2

    # Nothing listens inside any more: the connection is closed without an answer (a reset when
    # our bytes had arrived, as a closed port's would be).
    try:
        unanswered = _ask(host_port)
    except ConnectionResetError:
        unanswered = b""
    assert unanswered == b""

    torn = eb.run("teardown", "--discard", sandbox_id)
    assert torn.status == 0, torn.stderr
    eb.created.remove(sandbox_id)
    assert _listening(host_port) == []
    with pytest.raises(ConnectionRefusedError):
        _ask(host_port)


def test_a_taken_host_port_refuses_the_create_and_leaves_nothing(eb: SandboxBroker) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        free = _free_port()
        refused = _create(eb, _publishing_profile(eb), _manifest(eb, [(free, 80), (port, 81)]))
    assert refused.status == 3, refused.stderr
    assert f"published_ports[1].host: 127.0.0.1:{port} is taken" in refused.stderr
    assert json.loads(eb.run("list", "--json").stdout)["sandboxes"] == []
    assert _listening(free) == []  # the port reserved before it was let go


def test_without_consent_below_1024_or_onto_the_egress_proxy_nothing_is_published(eb: SandboxBroker) -> None:
    closed = _create(eb, _publishing_profile(eb, "closed", publish="none"), _manifest(eb, [(_free_port(), 80)]))
    assert closed.status == 3
    assert "published_ports: the profile does not publish ports" in closed.stderr
    assert "network.publish: loopback" in closed.stderr  # the hint names the owner's key
    low = _create(eb, _publishing_profile(eb), _manifest(eb, [(80, 80)]))
    assert low.status == 3
    assert "published_ports[0].host: must be 1024 or above" in low.stderr
    proxy = _create(eb, _publishing_profile(eb), _manifest(eb, [(_free_port(), 8000), (_free_port(), 3128)]))
    assert proxy.status == 3
    assert "published_ports[1].runtime: 3128 is the sandbox's egress proxy, never published" in proxy.stderr
    assert json.loads(eb.run("list", "--json").stdout)["sandboxes"] == []


def test_published_ports_survive_a_service_restart(runtime_dir: Path) -> None:
    """Sandboxes outlive their service: the next `serve` binds each live sandbox's ports again."""
    _require_tools()
    broker = make_broker(runtime_dir, as_user=False)
    _serve(broker)
    with _ready(broker):
        host_port = _free_port()
        created = _create(broker, _publishing_profile(broker), _manifest(broker, [(host_port, RUNTIME_PORT)]))
        assert created.status == 0, created.stderr
        sandbox_id = created.stdout.strip()
        assert broker.service is not None
        broker.service.stop()
        assert _listening(host_port) == []  # the forwarders went with the service
        _serve(broker)
        assert _listening(host_port) == ["127.0.0.1"]
        server = _serve_inside(broker, sandbox_id, count=2)
        assert _ask(host_port, b"again") == b"pong:again"
        server.join(timeout=30)


def test_a_service_killed_mid_create_leaves_no_listener_after_gc(runtime_dir: Path) -> None:
    """SIGKILL of the service once the host's port is reserved (the create under way), then `gc`
    in-process: no sandbox, no listener."""
    _require_tools()
    broker = make_broker(runtime_dir, as_user=False)
    _serve(broker)
    with _ready(broker):
        host_port = _free_port()
        profile, assignment = _publishing_profile(broker), _manifest(broker, [(host_port, RUNTIME_PORT)])
        client = _create_until_reserved(broker, profile, assignment, host_port)
        assert broker.service is not None
        assert broker.service.process is not None
        broker.service.process.kill()
        broker.service.process.wait(timeout=30)
        client.communicate(timeout=60)
        broker.service = None  # killed: _ready has no service to find running
        assert _listening(host_port) == []
        collected = _in_process(broker, "gc", "--json")
        assert collected.returncode == 0, collected.stderr
        assert all(receipt["residue"] == [] for receipt in json.loads(collected.stdout)["collected"])
        assert json.loads(_in_process(broker, "list", "--json").stdout)["sandboxes"] == []
        assert _listening(host_port) == []


def test_a_profile_edited_during_the_create_publishes_nothing(runtime_dir: Path) -> None:
    """The owner edits the profile once the create has reserved its port, before the sandbox
    runs: whether the watch saw the edit before the ports opened or after, they are not served
    (the create may also be refused by its own later checks; either way nothing listens)."""
    _require_tools()
    broker = make_broker(runtime_dir, as_user=False)
    _serve(broker)
    with _ready(broker):
        host_port = _free_port()
        profile, assignment = _publishing_profile(broker), _manifest(broker, [(host_port, RUNTIME_PORT)])
        client = _create_until_reserved(broker, profile, assignment, host_port)
        path = broker.config / "profiles" / f"{profile}.yaml"
        broker.write_profile(profile, path.read_text() + "# edited, not approved again\n")
        out, _ = client.communicate(timeout=120)
        if client.returncode == 0:
            broker.created.append(out.strip())
        deadline = time.monotonic() + 10
        while _listening(host_port) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _listening(host_port) == []
        if client.returncode == 0:
            inspected = json.loads(broker.run("inspect", out.strip(), "--json").stdout)["network"]["published"]
            assert [mapping["forwarder"] for mapping in inspected] == [
                f"down (revoked: profile {profile} is not approved as it is now)"
            ]


def test_more_than_sixteen_ports_are_refused(eb: SandboxBroker) -> None:
    many = [(20000 + index, 8000 + index) for index in range(17)]
    refused = _create(eb, _publishing_profile(eb), _manifest(eb, many))
    assert refused.status == 3
    assert "published_ports: at most 16 ports are published per sandbox" in refused.stderr
    assert all(_listening(host) == [] for host, _ in many)


def test_the_owner_closing_the_profile_unpublishes_a_live_sandbox(eb: SandboxBroker) -> None:
    host_port = _free_port()
    created = _create(eb, _publishing_profile(eb), _manifest(eb, [(host_port, RUNTIME_PORT)]))
    assert created.status == 0, created.stderr
    sandbox_id = created.stdout.strip()
    assert _listening(host_port) == ["127.0.0.1"]
    text = (eb.config / "profiles" / "pub.yaml").read_text().replace("publish: loopback", "publish: none")
    eb.write_profile("pub", text)  # edited, not approved again: revoked until it is
    deadline = time.monotonic() + 10
    while _listening(host_port) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _listening(host_port) == []
    mapping = json.loads(eb.run("inspect", sandbox_id, "--json").stdout)["network"]["published"][0]
    assert mapping["forwarder"].startswith("down (revoked: ")
    assert mapping["listening"] is False
