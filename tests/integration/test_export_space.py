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

from sandboxer import Broker
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
    # The service removes the held export's quarantine a moment after its client has all of it.
    _until(lambda: _quarantines(broker.state) == [], 30, "a quarantine outlived its export")

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


KEPT_BUDGET_MIB = 64


def test_kept_work_is_its_callers_to_list_fetch_and_remove(
    sbx_root: SandboxBroker,
    callers: tuple[pwd.struct_passwd, pwd.struct_passwd],  # noqa: F811 - the fixture
) -> None:
    """Account A's sandbox expires with a commit and 20 MiB not committed: the reaper keeps them
    as A's (the audit line says where and how to get it). A lists it (the CLI and Client), fetches
    the bundle and the tree's tar into files of its own, and is told where its work went when it
    names the expired sandbox. B, granted too, sees none of it and gets 'no such kept export' for
    its id. What is kept counts against A's budget: an export that would pass it is refused,
    naming the kept bytes, and fits once A has removed the kept one. An owner's Broker sees it."""
    a, b = callers
    broker = sbx_root
    entry = f"    profiles: [{broker.profile}]\n    max_sandboxes: 2\n    max_ttl_seconds: 3600\n"
    grants = f"grants:\n  - users: [{a.pw_name}]\n{entry}    max_exports_mib: {KEPT_BUDGET_MIB}\n"
    grants += f"  - users: [{b.pw_name}]\n{entry}"
    (broker.config / "grants.yaml").write_text(grants)
    broker.approve("grants")
    home = broker.root / "home-a"
    home.mkdir()
    os.chown(home, a.pw_uid, a.pw_gid)
    started = Service(broker, broker.state / "broker.sock", "--keep-exports", "3600").start()
    try:
        created = _cli_as(a, started.socket, "create", "--profile", broker.profile, "--ttl", "8")
        assert created.returncode == 0, created.stderr
        sandbox_id = created.stdout.strip()
        broker.created.append(sandbox_id)
        script = "echo kept > kept.txt && git add kept.txt && git commit -qm Keep && head -c 20M /dev/urandom > big.bin"
        assert _cli_as(a, started.socket, "exec", sandbox_id, "--", "sh", "-c", script).returncode == 0

        def listed(account: pwd.struct_passwd) -> list[dict[str, object]]:
            shown = _cli_as(account, started.socket, "exports", "--json")
            assert shown.returncode == 0, shown.stderr
            found: list[dict[str, object]] = json.loads(shown.stdout)["exports"]
            return found

        _until(lambda: bool(listed(a)), 60, "the reaper kept nothing of the expired sandbox")
        [kept] = listed(a)
        directory = broker.state / "exports" / sandbox_id
        assert (kept["id"], kept["uid"], kept["files"], kept["directory"]) == (
            sandbox_id,
            a.pw_uid,
            ["work.bundle", "tree.tar"],
            str(directory),
        )
        assert (kept["ahead"], kept["dirty"]) == (1, True)
        assert isinstance(kept["bytes"], int)
        assert kept["bytes"] > 20 * MIB

        def expiries() -> list[dict[str, object]]:
            lines = map(json.loads, (broker.state / "audit.log").read_text().splitlines())
            return [line for line in lines if line["verb"] == "expire"]

        _until(lambda: bool(expiries()), 60, "the expiry was never audited")  # after its teardown
        assert [(line["sandbox"], line["kept"], line["fetch"]) for line in expiries()] == [
            (sandbox_id, str(directory), f"sandboxer exports get {sandbox_id} FILE [--tar]")
        ]
        gone = _cli_as(a, started.socket, "inspect", sandbox_id)
        assert gone.returncode == 4
        assert gone.stderr.startswith(f"sandboxer: no such sandbox: {sandbox_id} (hint: it ended and its work is kept")
        assert f"sandboxer exports get {sandbox_id} FILE [--tar]" in gone.stderr

        # B sees none of it, and A's id is unknown to B.
        assert listed(b) == []
        for argv in (("get", sandbox_id, "/tmp/never"), ("rm", sandbox_id)):
            other = _cli_as(b, started.socket, "exports", *argv)
            assert (other.returncode, other.stderr) == (4, f"sandboxer: no such kept export: {sandbox_id}\n")
        assert not Path("/tmp/never").exists()
        inspected = _cli_as(b, started.socket, "inspect", sandbox_id)
        assert (inspected.returncode, inspected.stderr) == (4, f"sandboxer: no such sandbox: {sandbox_id}\n")

        # A takes it out, as files of its own.
        bundle = home / "work.bundle"
        got = _cli_as(a, started.socket, "exports", "get", sandbox_id, str(bundle))
        assert got.returncode == 0, got.stderr
        assert bundle.stat().st_uid == a.pw_uid
        clone = broker.root / "clone"
        subprocess.run(["git", "clone", "-q", str(broker.repo), str(clone)], check=True)
        subprocess.run(["git", "-C", str(clone), "fetch", "-q", str(bundle), "HEAD:kept"], check=True)
        shown = subprocess.run(["git", "-C", str(clone), "show", "kept:kept.txt"], capture_output=True, check=True)
        assert shown.stdout == b"kept\n"
        code = (
            "import json, sys\n"
            "from sandboxer import Client\n"
            f"client = Client({str(started.socket)!r})\n"
            f"client.get_export({sandbox_id!r}, {str(home / 'tree.tar')!r}, format='tar')\n"
            "print(json.dumps([[e.id, e.uid, list(e.files)] for e in client.exports()]))\n"
        )
        through_client = _as_account(a, code)
        assert through_client.returncode == 0, through_client.stderr
        assert json.loads(through_client.stdout) == [[sandbox_id, a.pw_uid, ["work.bundle", "tree.tar"]]]
        names = subprocess.run(["tar", "-tf", str(home / "tree.tar")], capture_output=True, text=True, check=True)
        assert {"big.bin", "kept.txt"} <= set(names.stdout.split())
        assert (home / "tree.tar").stat().st_uid == a.pw_uid

        # What is kept counts against A's budget until A removes it.
        second = _sandbox_with_work(broker, a, started.socket, 40)
        refused = _cli_as(a, started.socket, "export", second, "--tar", str(home / "second.tar"))
        assert refused.returncode == 3, refused.stderr
        assert re.match(
            rf"sandboxer: export: uid {a.pw_uid}'s export budget of {KEPT_BUDGET_MIB} MiB \(max_exports_mib\) "
            r"has no room: \d+ MiB held by exports under way, 2[0-9] MiB by kept exports",
            refused.stderr,
        ), refused.stderr
        assert not (home / "second.tar").exists()
        owner = Broker(config_dir=str(broker.config), state_dir=str(broker.state))
        assert [(e.id, e.uid) for e in owner.exports()] == [(sandbox_id, a.pw_uid)]
        removed = _cli_as(a, started.socket, "exports", "rm", sandbox_id, "--json")
        assert removed.returncode == 0, removed.stderr
        assert json.loads(removed.stdout) == {"id": sandbox_id, "removed": ["work.bundle", "tree.tar"]}
        assert not directory.exists()
        assert listed(a) == []
        fits = _cli_as(a, started.socket, "export", second, "--tar", str(home / "second.tar"))
        assert fits.returncode == 0, fits.stderr
    finally:
        started.stop()
