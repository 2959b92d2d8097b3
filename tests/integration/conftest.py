"""Fixtures for sandbox tests: a real runtime, a real Git repository, an approved config, and a
broker driven through the real CLI — as root, and as an unprivileged user (uid 65534 via setpriv)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import docker
import pytest

from sandboxer.api.broker import Broker
from sandboxer.api.owner import Owner
from sandboxer.errors import SandboxerError
from tests.conftest import REPO, Result, make_repository
from tests.integration.services import UNPRIVILEGED_UID, Service
from tests.samples import profile_yaml

PROFILE = "bwrap-local"


def _require_tools() -> None:
    for tool in ("bwrap", "git"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (CI installs it; run make check)")


@pytest.fixture(scope="session")
def runtime_dir() -> Iterator[Path]:
    """A real runtime (venv --copies from /usr/bin/python3), readable by every uid."""
    root = Path(tempfile.mkdtemp(prefix="sbx-rt-", dir="/tmp"))
    root.chmod(0o755)
    runtime = root / "runtime"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--copies", "--without-pip", str(runtime)], check=True)
    yield runtime
    shutil.rmtree(root, ignore_errors=True)


@dataclass
class SandboxBroker:
    """A broker with an approved bwrap profile, run as root or as an unprivileged user."""

    root: Path
    config: Path
    state: Path
    repo: Path
    runtime: Path
    as_user: bool
    profile: str = PROFILE
    backend: str = "bwrap"
    created: list[str] = field(default_factory=list)
    # The CLI's commands go to the service for the state dir (an unprivileged user's client starts
    # its private one); otherwise they run in the CLI's own process (SANDBOXER_NO_SERVICE=1).
    through_service: bool = False
    service: Service | None = None  # the service a fixture started for the CLI (its state dir's socket)
    service_env: dict[str, str] = field(default_factory=dict)  # more variables for the services it starts

    def argv(self, *args: str) -> list[str]:
        """The full command line of one CLI run."""
        return self.python("-m", "sandboxer", "--config-dir", str(self.config), "--state-dir", str(self.state), *args)

    def python(self, *args: str) -> list[str]:
        """A command line running this interpreter as the broker's user."""
        base = [sys.executable, *args]
        if self.as_user:
            uid = str(UNPRIVILEGED_UID)
            base = ["setpriv", "--reuid", uid, "--regid", uid, "--clear-groups", "--", *base]
        return base

    def env(self) -> dict[str, str]:
        """The environment of the CLI: minimal, with a HOME the user owns."""
        env = {"PATH": "/usr/bin:/bin", "HOME": str(self.root / "home"), "LANG": "C.UTF-8"}
        if not self.through_service:
            env["SANDBOXER_NO_SERVICE"] = "1"
        return env

    def run(self, *args: str, stdin: bytes | None = None, timeout: float = 120) -> Result:
        """Run the CLI and collect its result."""
        proc = subprocess.run(
            self.argv(*args), input=stdin, capture_output=True, env=self.env(), check=False, timeout=timeout
        )
        return Result(proc.returncode, proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace"))

    def create(self, profile: str | None = None) -> str:
        """Create a sandbox and return its id (torn down at the end of the test)."""
        result = self.run("create", "--profile", profile or self.profile)
        assert result.status == 0, result.stderr
        sandbox_id = result.stdout.strip()
        self.created.append(sandbox_id)
        return sandbox_id

    def exec(self, sandbox_id: str, *argv: str, stdin: bytes | None = None, options: tuple[str, ...] = ()) -> Result:
        """`sandboxer exec ID OPTIONS -- ARGV`."""
        return self.run("exec", sandbox_id, *options, "--", *argv, stdin=stdin)

    def sh(self, sandbox_id: str, script: str, stdin: bytes | None = None) -> Result:
        """Run a shell script inside the sandbox."""
        return self.exec(sandbox_id, "/bin/sh", "-c", script, stdin=stdin)

    def runtime_sha256(self) -> str:
        """The runtime's digest, as the owner gets it (the CLI as the broker's user; root's
        through the owner API in this process: set-up, not the thing under test)."""
        if not self.as_user:
            return self._owner().runtime_digest(str(self.runtime)).sha256
        digest = self.run("runtime", "digest", str(self.runtime))
        assert digest.status == 0, digest.stderr
        return digest.stdout.strip()

    def approve(self, *names: str) -> None:
        """Approve owner files, as the broker's user (root's through the owner API here)."""
        for name in names:
            if not self.as_user:
                self._owner().approve(name)
                continue
            approved = self.run("ext", "approve", name)
            assert approved.status == 0, approved.stderr

    def _owner(self) -> Owner:
        return Broker(config_dir=str(self.config), state_dir=str(self.state)).owner

    def write_profile(self, name: str, text: str) -> Path:
        """Write (but do not approve) a profile."""
        path = self.config / "profiles" / f"{name}.yaml"
        path.write_text(text)
        self._own(path)
        return path

    def _own(self, path: Path) -> None:
        if self.as_user:
            os.chown(path, UNPRIVILEGED_UID, UNPRIVILEGED_UID)

    def sandbox_dir(self, sandbox_id: str) -> Path:
        """The sandbox's directory in the registry."""
        return self.state / "sandboxes" / sandbox_id

    def workspace_dir(self, sandbox_id: str) -> Path:
        """Where the host reaches the sandbox's /workspace: the clone in its directory, or (an
        unprivileged broker's, a tmpfs of the sandbox's own) through its holder's root."""
        record = json.loads((self.sandbox_dir(sandbox_id) / "record.json").read_text())
        if record.get("workspace_fs", {}).get("kind") == "tmpfs":
            return Path(f"/proc/{record['holder_pid']}/root/workspace")
        return self.sandbox_dir(sandbox_id) / "workspace"


def profile_text(name: str, repo: Path, extra: str = "") -> str:
    """A bwrap profile for `repo`."""
    return profile_yaml(name, str(repo), extra)


def make_broker(runtime: Path, *, as_user: bool) -> SandboxBroker:
    """Lay out config, state, repository; pin and approve through the real CLI."""
    root = Path(tempfile.mkdtemp(prefix="sbx-", dir="/tmp"))
    root.chmod(0o755)
    broker = SandboxBroker(
        root=root,
        config=root / "config",
        state=root / "state",
        repo=root / "repo",
        runtime=runtime,
        as_user=as_user,
    )
    for directory in (broker.config / "extensions", broker.config / "profiles", root / "home"):
        directory.mkdir(parents=True)
    broker.config.chmod(0o700)
    make_repository(broker.repo, {"README.md": b"workspace\n"})
    if as_user:
        for path in (root, root / "home", broker.config, broker.config / "extensions", broker.config / "profiles"):
            os.chown(path, UNPRIVILEGED_UID, UNPRIVILEGED_UID)
    ext = broker.config / "extensions" / "ext.bwrap.yaml"
    ext.write_text(
        f"extension: ext.bwrap\nconfig:\n  runtime:\n    path: {runtime}\n    sha256: {broker.runtime_sha256()}\n"
    )
    broker._own(ext)
    broker.write_profile(PROFILE, profile_text(PROFILE, broker.repo))
    broker.approve("ext.bwrap", PROFILE)
    return broker


def _cleanup(broker: SandboxBroker) -> None:
    """Tear down every sandbox the broker still has (a failed test may leave ones it never
    recorded), then gc: it also removes containers whose sandbox directory is gone."""
    registry = broker.state / "sandboxes"
    present = {p.name for p in registry.iterdir() if not p.name.startswith(".")} if registry.is_dir() else set()
    for sandbox_id in sorted(present | set(broker.created)):
        if broker.sandbox_dir(sandbox_id).exists():
            broker.run("teardown", "--discard", sandbox_id)
    if broker.as_user:
        broker.run("gc")
    else:  # root's through the API in this process: clean-up, not the thing under test
        with contextlib.suppress(SandboxerError):
            Broker(config_dir=str(broker.config), state_dir=str(broker.state)).gc()
    for pid in services_of(broker.state):  # a private service the CLI started
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    shutil.rmtree(broker.root, ignore_errors=True)


def services_of(state: Path) -> list[int]:
    """The `serve` processes for a state dir."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and str(state).encode() in argv:
            found.append(int(pid))
    return found


MODES = ["root", "user"]


def _bwrap_broker(runtime_dir: Path, *, as_user: bool) -> SandboxBroker:
    """A bwrap broker run as root, or as an unprivileged user (uid 65534 via setpriv).

    The root broker's CLI runs each command in-process (SANDBOXER_NO_SERVICE=1); the user's is
    what an unprivileged user gets by default: a client of the private service it starts. So the
    behaviour every test checks on both holds for the embedded CLI and the CLI client alike. (A
    fixture may make the root broker's CLI a client of a root service too: `_serve`.)"""
    if os.geteuid() != 0:
        if not as_user:
            pytest.skip("the root broker variant needs root (CI runs as root)")
        as_user = False  # already unprivileged: run the broker as ourselves
    if as_user and shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is needed to run the broker unprivileged")
    broker = make_broker(runtime_dir, as_user=as_user)
    broker.through_service = as_user
    return broker


def _serve(broker: SandboxBroker) -> None:
    """Make the broker's CLI a client of a root service on its state dir's socket, started here."""
    broker.service = Service(broker, broker.state / "broker.sock").start()
    broker.through_service = True


@contextlib.contextmanager
def _ready(broker: SandboxBroker) -> Iterator[SandboxBroker]:
    """The broker for one test; afterwards its service (unless a test's own took its place) must
    still be running — it answered the whole test — and everything the test made is removed."""
    try:
        yield broker
        if broker.service is not None:
            assert broker.service.process is not None
            assert broker.service.process.poll() is None, broker.service.log.read_text()
    finally:
        if broker.service is not None:
            broker.service.stop()
        _cleanup(broker)


@pytest.fixture(params=["root-service", "user"])
def sb(request: pytest.FixtureRequest, runtime_dir: Path) -> Iterator[SandboxBroker]:
    """A ready bwrap broker, once as root, its CLI a client of a root service (the one root runs
    from contrib/), and once as an unprivileged user, its CLI a client of the private service it
    starts."""
    _require_tools()
    broker = _bwrap_broker(runtime_dir, as_user=request.param == "user")
    if request.param == "root-service":
        _serve(broker)
    with _ready(broker):
        yield broker


@pytest.fixture
def sb_root(runtime_dir: Path) -> Iterator[SandboxBroker]:
    """A ready broker run as whatever user runs the tests (root in CI)."""
    _require_tools()
    broker = make_broker(runtime_dir, as_user=False)
    try:
        yield broker
    finally:
        _cleanup(broker)


DOCKER_PROFILE = "docker-local"


def docker_skip_reason() -> str | None:
    """Why the Docker variant cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "the Docker backend needs a root broker"
    try:
        client = docker.from_env(timeout=30)
        try:
            client.ping()
        finally:
            client.close()
    except ImportError:
        return "the docker SDK is not installed (make check installs it with the dev extra)"
    except Exception as exc:  # any reason the daemon cannot be reached
        return f"no Docker daemon answers ({type(exc).__name__}); scripts/start-dockerd says why"
    return None


@pytest.fixture(scope="session")
def base_image() -> str:
    """The local base image, built from the host's files (never pulled)."""
    reason = docker_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    script = [sys.executable, str(Path(__file__).resolve().parents[2] / "scripts" / "build-base-image")]
    built = subprocess.run(script, capture_output=True, text=True, check=False)
    assert built.returncode == 0, built.stderr
    return built.stdout.strip()


def add_docker(broker: SandboxBroker, image: str) -> None:
    """An approved ext.docker config on the broker's runtime, and a Docker profile as its default."""
    digest = broker.runtime_sha256()
    (broker.config / "extensions" / "ext.docker.yaml").write_text(
        f'extension: ext.docker\nconfig:\n  image: "{image}"\n  runtime:\n'
        f"    path: {broker.runtime}\n    sha256: {digest}\n"
    )
    broker.write_profile(DOCKER_PROFILE, profile_text(DOCKER_PROFILE, broker.repo).replace("ext.bwrap", "ext.docker"))
    broker.approve("ext.docker", DOCKER_PROFILE)
    broker.profile = DOCKER_PROFILE
    broker.backend = "docker"


@pytest.fixture
def docker_root(runtime_dir: Path, base_image: str) -> Iterator[SandboxBroker]:
    """A root broker with an approved Docker profile."""
    broker = make_broker(runtime_dir, as_user=False)
    add_docker(broker, base_image)
    try:
        yield broker
    finally:
        _cleanup(broker)


@pytest.fixture(params=["bwrap-root", "bwrap-user", "docker-service"])
def sbx(request: pytest.FixtureRequest, runtime_dir: Path) -> Iterator[SandboxBroker]:
    """A ready broker for the behaviour both backends share, each variant through another front:
    bwrap as root (the CLI in-process), bwrap as a user (the CLI a client of the private service
    it starts), and Docker (the CLI a client of a root service on the state dir's socket)."""
    _require_tools()
    variant = request.param
    if variant == "docker-service":
        image = request.getfixturevalue("base_image")
        broker = make_broker(runtime_dir, as_user=False)
        add_docker(broker, image)
        _serve(broker)
    else:
        broker = _bwrap_broker(runtime_dir, as_user=variant == "bwrap-user")
    with _ready(broker):
        yield broker


@pytest.fixture(params=["bwrap-root", "docker"])
def sbx_root(request: pytest.FixtureRequest, runtime_dir: Path) -> Iterator[SandboxBroker]:
    """A ready root broker on each backend: bwrap run as whatever user runs the tests (root in CI),
    like `sb_root`, and Docker, like `sbx`'s Docker variant."""
    _require_tools()
    image = request.getfixturevalue("base_image") if request.param == "docker" else None
    broker = make_broker(runtime_dir, as_user=False)
    if image is not None:
        add_docker(broker, image)
    try:
        yield broker
    finally:
        _cleanup(broker)


@pytest.fixture(params=["bwrap-root-service", "bwrap-user", "docker-service"])
def eb(request: pytest.FixtureRequest, runtime_dir: Path) -> Iterator[SandboxBroker]:
    """A broker whose CLI is a client of a service (egress and published ports need one), on
    each backend: bwrap as root, bwrap as an ordinary user (its private service), Docker."""
    _require_tools()
    if request.param == "docker-service":
        image = request.getfixturevalue("base_image")
        broker = make_broker(runtime_dir, as_user=False)
        add_docker(broker, image)
        _serve(broker)
    else:
        broker = _bwrap_broker(runtime_dir, as_user=request.param == "bwrap-user")
        if request.param == "bwrap-root-service":
            _serve(broker)
    with _ready(broker):
        yield broker


def backend_profile_text(broker: SandboxBroker, name: str, repo: Path, extra: str = "") -> str:
    """A profile for `repo` on the broker's backend (`ext.bwrap` or `ext.docker`)."""
    return profile_text(name, repo, extra).replace("ext.bwrap", f"ext.{broker.backend}")


# --- lease manifests and tool requests -----------------------------------------------------------

ENDPOINT_SCRIPT = REPO / "examples" / "tool-endpoint" / "endpoint.py"


def log_lines(log: Path) -> list[str]:
    return log.read_text().splitlines()


class Endpoints:
    """The reference endpoint on the run's delivery socket, started and stopped by the test;
    each start logs to a file of its own."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.socket: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.logs: list[Path] = []

    def start(self, socket_path: Path, mode: str = "echo") -> Path:
        """Unlink the socket path, start the endpoint on it, wait for "ready"; its log file."""
        self.stop()
        self.socket = socket_path
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)
        log = self.directory / f"endpoint-{len(self.logs)}-{mode}.log"
        log.touch()
        self.logs.append(log)
        argv = [sys.executable, str(ENDPOINT_SCRIPT), "--socket", str(socket_path), "--log", str(log), "--mode", mode]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.proc = proc
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 15)
        line = proc.stdout.readline() if ready else b""
        assert line == b"ready\n", (line, proc.poll())
        info = os.lstat(socket_path)
        assert info.st_mode & 0o077 == 0, f"the endpoint socket is not owner-only: {oct(info.st_mode)}"
        return log

    def stop(self) -> None:
        """Kill the running endpoint (by its pid); the socket file stays, stale."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(timeout=15)
            for stream in (self.proc.stdout, self.proc.stderr):
                if stream is not None:
                    stream.close()
            self.proc = None

    @property
    def log(self) -> Path:
        return self.logs[-1]

    def total_lines(self) -> int:
        return sum(len(log_lines(log)) for log in self.logs)


@pytest.fixture
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short directory for a run (a Unix socket path must stay under 108 bytes)."""
    return tmp_path_factory.mktemp("run")


@pytest.fixture
def endpoints(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoints]:
    manager = Endpoints(tmp_path_factory.mktemp("ep"))
    try:
        yield manager
    finally:
        manager.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test below tests/integration uses real tools: `pytest -m "not integration"` is the
    fast loop (the unit tests alone)."""
    here = Path(__file__).resolve().parent
    for item in items:
        if here in item.path.resolve().parents:
            item.add_marker(pytest.mark.integration)
