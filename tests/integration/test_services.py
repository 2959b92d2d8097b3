"""Service containers (docs/services.md): a lease manifest's `service_images` start sidecars beside a
Docker sandbox on a network of its own, hardened like the sandbox's container, reached by name,
with no way out; its published ports go through port proxies of `port_proxy_image`; teardown
and gc leave nothing. The images are built here from host files (scripts/build-service-images):
a TCP echo "database" on port 5432 and the socat port proxy. Loopback only: every connection is
to the host's 127.0.0.1 or made inside the sandbox's own network."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from tests.integration.conftest import (
    SandboxBroker,
    _ready,
    _require_tools,
    _serve,
    add_docker,
    make_broker,
)
from tests.integration.test_publish import (
    RUNTIME_PORT,
    _ask,
    _create,
    _free_port,
    _in_process,
    _listening,
    _manifest,
    _publishing_profile,
    _serve_inside,
)

pytestmark = pytest.mark.integration

PART_LABEL = "io.sandboxer.part-of"
# Inside the sandbox: send "hello" to database:5432 (the echo sidecar), print what comes back.
ASK_DATABASE = (
    "import socket, sys, time\n"
    "deadline = time.monotonic() + 20\n"
    "while True:\n"
    "    try:\n"
    "        c = socket.create_connection((sys.argv[1], 5432), 5); break\n"
    "    except OSError:\n"
    "        if time.monotonic() > deadline: raise\n"
    "        time.sleep(0.1)\n"
    "c.sendall(b'hello'); c.shutdown(socket.SHUT_WR)\n"
    "print(c.recv(64).decode())\n"
)


@pytest.fixture(scope="session")
def service_images(base_image: str) -> dict[str, str]:
    """The port proxy's and the test database's image ids, built from host files (never pulled)."""
    script = [sys.executable, str(Path(__file__).resolve().parents[2] / "scripts" / "build-service-images"), "--json"]
    built = subprocess.run(script, capture_output=True, text=True, check=False)
    assert built.returncode == 0, built.stderr
    return dict(json.loads(built.stdout), app=base_image)


@pytest.fixture
def sd(runtime_dir: Path, service_images: dict[str, str]) -> Iterator[SandboxBroker]:
    """A root broker on Docker whose CLI is a client of its service."""
    _require_tools()
    broker = make_broker(runtime_dir, as_user=False)
    add_docker(broker, service_images["app"])
    _serve(broker)
    with _ready(broker):
        yield broker


def _with_services(manifest: Path, images: dict[str, str], *, proxy: bool = False) -> Path:
    """The assignment at `manifest`, made version 2 with the app and database images (and the port
    proxy's)."""
    document = json.loads(manifest.read_text())
    document["version"] = "2"
    document["service_images"] = {"app": images["app"], "database": images["database"]}
    if proxy:
        document["port_proxy_image"] = images["proxy"]
    manifest.write_text(json.dumps(document))
    return manifest


def _engine() -> docker.DockerClient:
    return docker.from_env(timeout=60)


def _ours(broker: SandboxBroker) -> tuple[list[Any], list[Any]]:
    """The service containers and networks the broker's state dir has on the Engine."""
    client = _engine()
    try:
        label = f"io.sandboxer.state-dir={broker.state}"
        listed = client.api.containers(all=True, filters={"label": label})
        found = []
        for entry in listed:
            if PART_LABEL in (entry.get("Labels") or {}):
                with contextlib.suppress(docker.errors.NotFound):  # removed since it was listed
                    found.append(client.containers.get(entry["Id"]))
        return found, client.networks.list(filters={"label": label})
    finally:
        client.close()


def _inspect(broker: SandboxBroker, sandbox_id: str) -> dict[str, Any]:
    shown = broker.run("inspect", sandbox_id, "--json")
    assert shown.status == 0, shown.stderr
    return dict(json.loads(shown.stdout))


def test_the_sandbox_reaches_its_database_by_name_and_nothing_else(
    sd: SandboxBroker, service_images: dict[str, str]
) -> None:
    manifest = _with_services(_manifest(sd, []), service_images)
    created = _create(sd, sd.profile, manifest)
    assert created.status == 0, created.stderr
    sandbox_id = created.stdout.strip()

    answered = sd.exec(sandbox_id, "python3", "-c", ASK_DATABASE, "database")
    assert answered.status == 0, answered.stderr
    assert answered.stdout.strip() == "hello"

    # The Engine's view: the sidecar is hardened like the sandbox's container, on the sandbox's
    # internal network only, as the sandbox's user; the network has no address of the host's.
    (sidecar,), (network,) = _ours(sd)
    attrs = sidecar.attrs
    host = attrs["HostConfig"]
    assert host["ReadonlyRootfs"] is True
    assert host["CapDrop"] == ["ALL"]
    assert not host["CapAdd"]
    assert host["SecurityOpt"][0].startswith("no-new-privileges")
    assert host["SecurityOpt"][1].startswith("seccomp")
    assert attrs["Config"]["User"] == "1000:1000"
    assert attrs["Image"] == service_images["database"]
    assert list(attrs["NetworkSettings"]["Networks"]) == [network.name]
    assert network.attrs["Internal"] is True
    assert network.attrs["Options"]["com.docker.network.bridge.inhibit_ipv4"] == "true"
    bridge = network.attrs["Options"]["com.docker.network.bridge.name"]
    shown = subprocess.run(["ip", "-o", "addr", "show", "dev", bridge], capture_output=True, text=True, check=True)
    assert shown.stdout.strip() == "", shown.stdout  # the host has no address on it, IPv4 or IPv6

    # inspect shows them, and finds nothing amiss.
    report = _inspect(sd, sandbox_id)
    assert report["matches_plan"] is True, report["differences"]
    services = report["docker"]["services"]
    (entry,) = services["sidecars"]
    assert (entry["name"], entry["image"], entry["container"]) == ("database", service_images["database"], sidecar.id)
    assert services["network"] == network.name

    # No way out: the sandbox has lo and its network's interface; nothing answers at the
    # network's gateway address (the host has none there), and no name outside resolves.
    gateway = network.attrs["IPAM"]["Config"][0]["Gateway"]
    probe = (
        "import socket, sys\n"
        "try:\n"
        "    socket.create_connection((sys.argv[1], 22), 3); print('reached')\n"
        "except OSError as exc: print('unreachable', type(exc).__name__)\n"
        "try:\n"
        "    socket.getaddrinfo('sandboxer-test.invalid', 80); print('resolved')\n"
        "except OSError: print('unresolved')\n"
    )
    tried = sd.exec(sandbox_id, "python3", "-c", probe, gateway)
    assert tried.status == 0, tried.stderr
    assert tried.stdout.split("\n")[0].startswith("unreachable"), tried.stdout
    assert "unresolved" in tried.stdout
    routes = sd.exec(sandbox_id, "cat", "/proc/net/route")
    assert {line.split()[0] for line in routes.stdout.splitlines()[1:]} == {"eth0"}
    # Nor from the sidecar: its connection to the gateway address fails too.
    status, output = sidecar.exec_run(["/usr/bin/socat", "-u", "OPEN:/dev/null", f"TCP:{gateway}:22,connect-timeout=3"])
    assert status != 0, output
    inet6 = sd.exec(sandbox_id, "cat", "/proc/net/if_inet6")
    assert "eth0" not in inet6.stdout  # no IPv6 on the sandbox's network, not even link-local

    torn = sd.run("teardown", "--discard", sandbox_id, "--json")
    assert torn.status == 0, torn.stderr
    sd.created.remove(sandbox_id)
    removed = json.loads(torn.stdout)["removed"]
    assert any(item.startswith(f"service database container {sidecar.id[:12]}") for item in removed), removed
    assert f"network {network.name}" in removed
    assert _ours(sd) == ([], [])


def test_published_ports_with_services_go_through_the_port_proxy_image(
    sd: SandboxBroker, service_images: dict[str, str]
) -> None:
    host_port = _free_port()
    manifest = _with_services(_manifest(sd, [(host_port, RUNTIME_PORT)]), service_images, proxy=True)
    created = _create(sd, _publishing_profile(sd), manifest)
    assert created.status == 0, created.stderr
    sandbox_id = created.stdout.strip()
    assert _listening(host_port) == ["127.0.0.1"]  # absent from every other host address

    server = _serve_inside(sd, sandbox_id, count=2)
    assert _ask(host_port, b"one") == b"pong:one"
    server.join(timeout=30)

    containers, _ = _ours(sd)
    (proxy,) = [c for c in containers if c.labels["io.sandboxer.role"] == "port-proxy"]
    assert proxy.attrs["Image"] == service_images["proxy"]  # exactly that image
    assert proxy.attrs["HostConfig"]["NetworkMode"].startswith("container:")
    assert proxy.attrs["HostConfig"]["ReadonlyRootfs"] is True
    report = _inspect(sd, sandbox_id)
    assert report["matches_plan"] is True, report["differences"]
    assert report["docker"]["services"]["port_proxies"] == [{"runtime": RUNTIME_PORT, "container": proxy.id}]

    torn = sd.run("teardown", "--discard", sandbox_id)
    assert torn.status == 0, torn.stderr
    sd.created.remove(sandbox_id)
    assert _ours(sd) == ([], [])
    assert _listening(host_port) == []


def test_the_owner_may_let_a_sidecar_run_as_its_images_own_user(
    sd: SandboxBroker, service_images: dict[str, str]
) -> None:
    config = sd.config / "extensions" / "ext.docker.yaml"
    config.write_text(config.read_text().replace("config:\n", "config:\n  service_user: image\n"))
    sd.approve("ext.docker")
    created = _create(sd, sd.profile, _with_services(_manifest(sd, []), service_images))
    assert created.status == 0, created.stderr
    sandbox_id = created.stdout.strip()
    (sidecar,), _ = _ours(sd)
    assert sidecar.attrs["Config"]["User"] == "5432:5432"  # the database image's own
    pid = sidecar.attrs["State"]["Pid"]
    host_uid = int(Path(f"/proc/{pid}/status").read_text().split("Uid:")[1].split()[0])
    assert host_uid >= 65536  # remapped: no account's
    assert sd.exec(sandbox_id, "python3", "-c", ASK_DATABASE, "database").stdout.strip() == "hello"
    report = _inspect(sd, sandbox_id)
    assert report["matches_plan"] is True, report["differences"]
    assert report["docker"]["services"]["image_user"] is True


def test_a_missing_or_tag_only_image_refuses_before_any_container_starts(
    sd: SandboxBroker, service_images: dict[str, str]
) -> None:
    missing = dict(service_images, database="sha256:" + "0" * 64)
    refused = _create(sd, sd.profile, _with_services(_manifest(sd, []), missing))
    assert refused.status == 5, refused.stderr
    assert "service_images.database: image sha256:0000" in refused.stderr
    assert "not present in the Docker Engine" in refused.stderr
    tagged = dict(service_images, database="sandboxer-test-database:local")
    refused = _create(sd, sd.profile, _with_services(_manifest(sd, []), tagged))
    assert refused.status == 2, refused.stderr
    assert "service_images.database" in refused.stderr
    assert _ours(sd) == ([], [])
    assert json.loads(sd.run("list", "--json").stdout)["sandboxes"] == []


def test_a_service_killed_mid_create_leaves_no_container_network_or_listener(
    runtime_dir: Path, service_images: dict[str, str]
) -> None:
    """SIGKILL of the service once the sidecar runs (the create under way), then `gc` in-process:
    no sandbox, container, network or listener."""
    _require_tools()
    broker = make_broker(runtime_dir, as_user=False)
    add_docker(broker, service_images["app"])
    _serve(broker)
    with _ready(broker):
        host_port = _free_port()
        manifest = _with_services(_manifest(broker, [(host_port, RUNTIME_PORT)]), service_images, proxy=True)
        client = subprocess.Popen(
            broker.argv("create", "--profile", _publishing_profile(broker), "--manifest", str(manifest)),
            env=broker.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            deadline = time.monotonic() + 60
            while not _ours(broker)[0]:
                assert client.poll() is None, client.communicate()
                assert time.monotonic() < deadline, "no sidecar ever started"
                time.sleep(0.01)
            assert broker.service is not None
            assert broker.service.process is not None
            broker.service.process.kill()
            broker.service.process.wait(timeout=30)
        except BaseException:
            client.kill()  # no client left running (and its pipes open) past a failed test
            client.communicate(timeout=60)
            raise
        client.communicate(timeout=60)
        broker.service = None  # killed: _ready has no service to find running
        collected = _in_process(broker, "gc", "--json")
        assert collected.returncode == 0, collected.stderr
        receipts = json.loads(collected.stdout)["collected"]
        assert receipts, "gc collected nothing"
        assert all(receipt["residue"] == [] for receipt in receipts), receipts
        assert json.loads(_in_process(broker, "list", "--json").stdout)["sandboxes"] == []
        assert _ours(broker) == ([], [])
        assert _listening(host_port) == []
