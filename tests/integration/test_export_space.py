"""The exports directory as a shared resource: one budget per caller across its exports under
way and what is kept for it, and an export's quarantine that outlives its exporter.

Real accounts, a real root service, real sandboxes, real signals (docs/service.md, "Exports").
"""

from __future__ import annotations

import json
import os
import pwd
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import SandboxBroker
from tests.integration.services import Service
from tests.integration.test_service import _as_account, callers  # noqa: F401 - a fixture
from tests.integration.test_service_cli import _cli_as

MIB = 1024 * 1024
BUDGET_MIB = 128
WORK_MIB = 70  # one tree's tar: one export fits the budget, two do not


def _exports_bytes(state: Path) -> int:
    """The bytes of every file under <state>/exports (quarantines under way and kept exports)."""
    total = 0
    for top, _, files in os.walk(state / "exports"):
        for name in files:
            try:
                total += os.lstat(os.path.join(top, name)).st_size
            except OSError:
                continue
    return total


class Sampler:
    """The largest total of <state>/exports seen, looked at every few milliseconds."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.most = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.most = max(self.most, _exports_bytes(self.state))
            time.sleep(0.005)


def _quarantines(state: Path) -> list[str]:
    exports = state / "exports"
    return sorted(name for name in os.listdir(exports) if name.startswith(".export-")) if exports.is_dir() else []


# An HTTP export by the account that reads the answer's head (the export is verified and held in
# its quarantine), says so, and reads the body only when told to, then writes it at argv[3].
HOLDER = """
import http.client, json, socket, sys
class Conn(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(sys.argv[1])
conn = Conn("localhost")
conn.request("POST", f"/v1/sandboxes/{sys.argv[2]}/export", body=json.dumps({"format": "tar"}),
             headers={"Content-Type": "application/json"})
response = conn.getresponse()
print(response.status, flush=True)
sys.stdin.readline()
with open(sys.argv[3], "xb") as out:
    while chunk := response.read(1 << 20):
        out.write(chunk)
print("done", flush=True)
"""


def _as(account: pwd.struct_passwd, socket_path: Path, *argv: str) -> subprocess.Popen[str]:
    """`argv` started as the account, its CLI a client of the service at `socket_path`."""
    ids = [str(account.pw_uid), str(account.pw_gid)]
    command = ["setpriv", "--reuid", ids[0], "--regid", ids[1], "--clear-groups", "--", *argv]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/", "LANG": "C.UTF-8", "PYTHONPATH": str(Path(__file__).parents[2])}
    env["SANDBOXER_SOCKET"] = str(socket_path)
    return subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd="/"
    )


@pytest.fixture
def budgeted(
    sb_root: SandboxBroker,
    callers: tuple[pwd.struct_passwd, pwd.struct_passwd],  # noqa: F811 - the fixture
) -> Iterator[tuple[SandboxBroker, pwd.struct_passwd, Service, Path]]:
    """A root service that grants account A the profile with an export budget of BUDGET_MIB, and
    a directory of A's to export into."""
    a, _ = callers
    grants = f"grants:\n  - users: [{a.pw_name}]\n    profiles: [{sb_root.profile}]\n"
    grants += f"    max_sandboxes: 2\n    max_ttl_seconds: 3600\n    max_exports_mib: {BUDGET_MIB}\n"
    (sb_root.config / "grants.yaml").write_text(grants)
    sb_root.approve("grants")
    home = sb_root.root / "home-a"
    home.mkdir()
    os.chown(home, a.pw_uid, a.pw_gid)
    started = Service(sb_root, sb_root.state / "broker.sock").start()
    try:
        yield sb_root, a, started, home
    finally:
        started.stop()


def _sandbox_with_work(broker: SandboxBroker, account: pwd.struct_passwd, socket_path: Path, mib: int) -> str:
    created = _cli_as(account, socket_path, "create", "--profile", broker.profile)
    assert created.returncode == 0, created.stderr
    sandbox_id = created.stdout.strip()
    broker.created.append(sandbox_id)
    script = f"head -c {mib}M /dev/urandom > big.bin"
    made = _cli_as(account, socket_path, "exec", sandbox_id, "--", "sh", "-c", script)
    assert made.returncode == 0, made.stderr
    return sandbox_id


def test_a_callers_exports_at_once_stay_within_its_budget(
    budgeted: tuple[SandboxBroker, pwd.struct_passwd, Service, Path],
) -> None:
    """Account A holds one export of WORK_MIB in flight (an HTTP export it has not read yet: its
    quarantine is verified and waiting) and starts three more of the same at once through the
    CLI: together they would pass A's budget of BUDGET_MIB. The bytes under <state>/exports,
    sampled throughout, never pass the budget; each of the three is refused with the line that
    names the budget, what holds it and what to do (status 3), and leaves nothing (no quarantine,
    not the file its client made); gc keeps the held quarantine (its exporter lives). Once the
    held export is read, A's next export fits again."""
    broker, a, started, home = budgeted
    sandbox_id = _sandbox_with_work(broker, a, started.socket, WORK_MIB)
    with Sampler(broker.state) as sampler:
        holder = _as(
            a, started.socket, sys.executable, "-c", HOLDER, str(started.socket), sandbox_id, str(home / "held.tar")
        )
        try:
            assert holder.stdout is not None
            assert holder.stdin is not None
            assert holder.stdout.readline() == "200\n"
            assert len(_quarantines(broker.state)) == 1
            assert broker.run("gc", "--json").status == 0
            assert len(_quarantines(broker.state)) == 1  # its exporter holds it: not gc's

            runs = [
                _as(
                    a,
                    started.socket,
                    sys.executable,
                    "-m",
                    "sandboxer",
                    "export",
                    sandbox_id,
                    "--tar",
                    str(home / f"{n}.tar"),
                )
                for n in range(3)
            ]
            ended = [run.communicate(timeout=300) for run in runs]
            holder.stdin.write("\n")
            holder.stdin.flush()
            assert holder.stdout.readline() == "done\n"
            assert holder.wait(timeout=60) == 0
        finally:
            holder.kill()
            holder.communicate()
    refusal = re.compile(
        rf"sandboxer: export: uid {a.pw_uid}'s export budget of {BUDGET_MIB} MiB \(max_exports_mib\) has no room: "
        r"\d+ MiB held by exports under way, 0 MiB by kept exports \(hint: wait for the exports under way to end, "
        r"or remove kept ones \(sandboxer exports lists them, sandboxer exports rm ID removes one\)\)\n"
    )
    for run, (_, stderr) in zip(runs, ended, strict=True):
        assert run.returncode == 3, stderr
        assert refusal.fullmatch(stderr), stderr
    assert sampler.most <= BUDGET_MIB * MIB, f"{sampler.most / MIB:.1f} MiB under exports/"
    assert sampler.most >= WORK_MIB * MIB  # it saw the held export
    assert sorted(os.listdir(home)) == ["held.tar"]
    assert (home / "held.tar").stat().st_size > WORK_MIB * MIB
    assert _quarantines(broker.state) == []

    again = _cli_as(a, started.socket, "export", sandbox_id, "--tar", str(home / "again.tar"))
    assert again.returncode == 0, again.stderr
    assert _quarantines(broker.state) == []


def _until(condition: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_gc_takes_the_quarantine_of_an_export_killed_mid_way(sb_root: SandboxBroker) -> None:
    """kill -9 of the process doing an export — an in-process CLI, and a root service answering
    an HTTP export — leaves its quarantine behind; gc removes it at once (its exporter's lock died
    with it) and says so, and the sandbox's export then works as before."""
    sandbox_id = sb_root.create()
    assert sb_root.exec(sandbox_id, "sh", "-c", "head -c 300M /dev/zero > big.bin").status == 0

    exporting = subprocess.Popen(
        sb_root.argv("export", sandbox_id, "--tar", str(sb_root.root / "killed.tar")),
        env={**sb_root.env(), "SANDBOXER_NO_SERVICE": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _until(lambda: _exports_bytes(sb_root.state) > 8 * MIB, 120, "the export never wrote into its quarantine")
    exporting.send_signal(signal.SIGKILL)
    exporting.wait(timeout=30)
    left = _quarantines(sb_root.state)
    assert len(left) == 1
    _gc_takes(sb_root, left)

    started = Service(sb_root, sb_root.state / "broker.sock").start()
    try:
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(started.socket), sandbox_id, str(sb_root.root / "held.tar")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert holder.stdout is not None
        assert holder.stdout.readline() == "200\n"
        started.stop(signal.SIGKILL)
        holder.kill()
        holder.communicate()
    finally:
        started.stop()
    left = _quarantines(sb_root.state)
    assert len(left) == 1
    _gc_takes(sb_root, left)
    assert sb_root.run("export", sandbox_id, "--tar", str(sb_root.root / "after.tar")).status == 0
    assert _quarantines(sb_root.state) == []


def _gc_takes(broker: SandboxBroker, left: list[str]) -> None:
    """gc (in-process: no service answers) removes the quarantines `left` and names them."""
    collected = subprocess.run(
        broker.argv("gc", "--json"),
        env={**broker.env(), "SANDBOXER_NO_SERVICE": "1"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert collected.returncode == 0, collected.stderr
    assert _quarantines(broker.state) == []
    assert sorted(json.loads(collected.stdout)["exports"]) == left
