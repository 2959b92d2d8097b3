"""The sandbox lifecycle through the real CLI: create, list, teardown, refusals, gc, concurrency.

What the contract defines independently of the backend runs on bwrap (as root and as a user) and on
Docker (fixtures `sbx`, `sbx_root`); gc after a killed create or a dead init, the pid namespace and
cgroups are bwrap's own and run on bwrap only (fixtures `sb`, `sb_root`).

Every refusal is checked for its documented exit status, a single `sandboxer:` line on stderr and
for leaving nothing behind: no sandbox directory, an unchanged approvals ledger, no process, and
(on Docker) no container.
Processes are tracked exactly: the CLI runs under a small wrapper that is a child subreaper, so any
process the CLI leaves running (even one in a new session) is re-parented to the wrapper and seen.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import psutil
import pytest

from sandboxer.host.registry import new_id
from tests.conftest import Result, make_repository
from tests.integration.conftest import PROFILE, UNPRIVILEGED_UID, SandboxBroker, backend_profile_text

ID_RE = re.compile(r"[0-9a-f]{24}")

# Runs ARGV as a child subreaper; after ARGV exits, writes the processes it left behind (as JSON) to
# the file named by the first argument, kills and reaps them, and exits with ARGV's status.
TRACKER = r"""
import ctypes, json, os, subprocess, sys, time
import psutil
if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
    sys.exit(120)
status = subprocess.run(sys.argv[2:], check=False).returncode
time.sleep(0.05)
left = []
for child in psutil.Process().children(recursive=True):
    try:
        if child.status() != psutil.STATUS_ZOMBIE:
            left.append([child.pid, " ".join(child.cmdline())])
            child.kill()
    except psutil.Error:
        pass
with open(sys.argv[1], "w") as out:
    json.dump(left, out)
while True:
    try:
        os.waitpid(-1, 0)
    except ChildProcessError:
        break
sys.exit(status if status >= 0 else 128 - status)
"""


def run_tracked(argv: list[str], env: dict[str, str]) -> tuple[Result, list[list[Any]]]:
    """Run `argv` under the tracker; returns its result and the processes it left running."""
    with tempfile.NamedTemporaryFile(prefix="sbx-tracker-", suffix=".json") as out:
        proc = subprocess.run(
            [sys.executable, "-c", TRACKER, out.name, *argv], capture_output=True, env=env, check=False, timeout=120
        )
        leftovers = json.loads(Path(out.name).read_text() or "null")
    assert leftovers is not None, f"the tracker failed: {proc.stderr.decode(errors='replace')}"
    result = Result(proc.returncode, proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace"))
    return result, leftovers


def containers(sb: SandboxBroker) -> dict[str, str]:
    """The Docker containers labelled with this broker's state dir (sandbox id -> container id);
    always empty for a bwrap broker."""
    if sb.backend != "docker":
        return {}

    client = docker.from_env(timeout=30)
    try:
        found = client.api.containers(all=True, filters={"label": f"io.sandboxer.state-dir={sb.state}"})
    finally:
        client.close()
    return {c["Labels"]["io.sandboxer.sandbox"]: c["Id"] for c in found}


@dataclass(frozen=True)
class Snapshot:
    """What a refused command must not change."""

    entries: frozenset[str]
    ledger: bytes | None
    containers: frozenset[str]


def snapshot(sb: SandboxBroker) -> Snapshot:
    registry = sb.state / "sandboxes"
    entries = frozenset(os.listdir(registry)) - {".lock"} if registry.is_dir() else frozenset()
    ledger = sb.config / "approvals.json"
    return Snapshot(
        entries=entries,
        ledger=ledger.read_bytes() if ledger.exists() else None,
        containers=frozenset(containers(sb).values()),
    )


def refused(
    sb: SandboxBroker, *args: str, status: int, needles: Iterable[str] = (), argv: list[str] | None = None
) -> Result:
    """Run a command that must fail with `status`, one stderr line, and nothing left behind."""
    if sb.through_service:
        sb.run("list")  # the private service runs already: the command under test starts nothing
    before = snapshot(sb)
    result, leftovers = run_tracked(argv or sb.argv(*args), sb.env())
    after = snapshot(sb)
    assert result.status == status, result
    lines = result.stderr.splitlines()
    assert len(lines) == 1, f"expected one stderr line: {result.stderr!r}"
    assert lines[0].startswith("sandboxer: "), lines
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)
    assert leftovers == [], f"processes left running: {leftovers}"
    assert after.entries == before.entries, f"registry changed: {sorted(after.entries ^ before.entries)}"
    assert after.ledger == before.ledger, "the approvals ledger changed"
    assert after.containers == before.containers, f"containers changed: {sorted(after.containers ^ before.containers)}"
    return result


def processes_naming(ids: Iterable[str]) -> list[tuple[int, str]]:
    """Live (non-zombie) processes whose command line or environment names one of `ids`."""
    wanted = set(ids)
    found: list[tuple[int, str]] = []
    for proc in psutil.process_iter(["pid", "status", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.pid == os.getpid():
                continue
            text = "\0".join(proc.info["cmdline"] or [])
            with contextlib.suppress(psutil.Error):
                text += "\0" + "\0".join(f"{k}={v}" for k, v in proc.environ().items())
            found.extend((proc.pid, sandbox_id) for sandbox_id in wanted if sandbox_id in text)
    return found


def cgroups_of(sandbox_id: str) -> list[str]:
    return glob.glob(f"/sys/fs/cgroup/*/sandboxer/{sandbox_id}") + glob.glob(f"/sys/fs/cgroup/sandboxer/{sandbox_id}")


def listed(sb: SandboxBroker) -> dict[str, dict[str, Any]]:
    result = sb.run("list", "--json")
    assert result.status == 0, result.stderr
    return {entry["id"]: entry for entry in result.json()["sandboxes"]}


def own(sb: SandboxBroker, path: Path) -> None:
    if sb.as_user:
        os.chown(path, UNPRIVILEGED_UID, UNPRIVILEGED_UID)


def approve(sb: SandboxBroker, name: str) -> None:
    result = sb.run("ext", "approve", name)
    assert result.status == 0, result.stderr


# --- the tracker itself ---------------------------------------------------------------------------


def test_tracker_sees_a_process_left_in_a_new_session() -> None:
    env = {"PATH": "/usr/bin:/bin"}
    result, leftovers = run_tracked(["/bin/sh", "-c", "setsid sleep 30 & exit 3"], env)
    assert result.status == 3
    assert [cmd for _, cmd in leftovers] == ["sleep 30"]


# --- create, list, teardown -----------------------------------------------------------------------


def test_create_json_list_and_teardown_receipt(sbx: SandboxBroker) -> None:
    sb = sbx
    digest = sb.run("runtime", "digest", str(sb.runtime))
    assert digest.status == 0, digest.stderr
    created = sb.run("create", "--profile", sb.profile, "--json")
    assert created.status == 0, created.stderr
    document = created.json()
    sandbox_id = document["id"]
    sb.created.append(sandbox_id)
    assert ID_RE.fullmatch(sandbox_id)
    assert document["profile"] == sb.profile
    assert document["backend"] == sb.backend
    assert document["runtime_sha256"] == digest.stdout.strip()

    entry = listed(sb)[sandbox_id]
    assert (entry["status"], entry["profile"], entry["backend"]) == ("running", sb.profile, sb.backend)
    if sb.backend == "docker":
        assert list(containers(sb)) == [sandbox_id]

    receipt = sb.run("teardown", sandbox_id, "--json")
    assert receipt.status == 0, receipt.stderr
    body = receipt.json()
    assert body["id"] == sandbox_id
    assert body["residue"] == []
    assert body["removed"], "the receipt lists nothing removed"
    assert all(isinstance(item, str) for item in body["removed"])
    assert any("sandbox dir" in item for item in body["removed"]), body["removed"]
    assert sandbox_id not in listed(sb)
    assert not sb.sandbox_dir(sandbox_id).exists()
    assert processes_naming([sandbox_id]) == []
    assert cgroups_of(sandbox_id) == []
    assert containers(sb) == {}


# --- bad input ------------------------------------------------------------------------------------


def _check_unknown_and_malformed(sb: SandboxBroker, unknown: str, malformed: list[str]) -> None:
    result = refused(sb, "inspect", unknown, "--json", status=4, needles=["no such sandbox"])
    assert result.json()["error"]["kind"] == "not-found"
    refused(sb, "teardown", unknown, status=4, needles=["no such sandbox"])
    refused(sb, "exec", unknown, "--", "true", status=125, needles=["no such sandbox"])
    for bad in malformed:
        refused(sb, "inspect", bad, "--json", status=4)
        refused(sb, "teardown", bad, status=4)
        refused(sb, "exec", bad, "--", "true", status=125)


MALFORMED = ["../x", "0123456789ABCDEF01234567", "0123456789abcdef0123456", "0123456789abcdef012345678"]


def test_unknown_and_malformed_ids(sbx: SandboxBroker) -> None:
    sb = sbx
    # Before any sandbox exists (no registry yet) ...
    _check_unknown_and_malformed(sb, new_id(), MALFORMED)
    assert not (sb.state / "sandboxes").exists() or snapshot(sb).entries == frozenset()
    # ... and beside a live one, which a path that leads to it must not reach.
    live = sb.create()
    _check_unknown_and_malformed(sb, new_id(), [f"../sandboxes/{live}", f"./{live}", live.upper()])
    assert listed(sb)[live]["status"] == "running"
    assert sb.exec(live, "true").status == 0


def test_unapproved_changed_and_revoked_configuration_is_refused(sbx: SandboxBroker) -> None:
    sb = sbx
    extension = f"ext.{sb.backend}"
    path = sb.write_profile("second", backend_profile_text(sb, "second", sb.repo))
    refused(sb, "create", "--profile", "second", status=3, needles=["second is not approved"])

    approve(sb, "second")
    path.write_bytes(path.read_bytes() + b"\n")  # one more byte, still a valid profile
    refused(sb, "create", "--profile", "second", status=3, needles=["second changed since it was approved"])

    revoked = sb.run("ext", "revoke", extension)
    assert revoked.status == 0, revoked.stderr
    refused(sb, "create", "--profile", sb.profile, status=3, needles=[f"{extension} is not approved"])


def test_runtime_digest_mismatch_is_refused(sbx: SandboxBroker) -> None:
    sb = sbx
    # A private copy: the session runtime is shared by every test and must not change.
    private = sb.root / "private-runtime"
    private.mkdir(mode=0o755)
    runtime = private / "runtime"
    shutil.copytree(sb.runtime, runtime, symlinks=True)
    for directory, _, _ in os.walk(runtime):
        Path(directory).chmod(0o755)
    digest = sb.run("runtime", "digest", str(runtime))
    assert digest.status == 0, digest.stderr
    # The broker's extension config (ext.docker also names its image), pinned to the private copy.
    ext = sb.config / "extensions" / f"ext.{sb.backend}.yaml"
    text = ext.read_text()
    pinned = re.sub(r"(?m)^    sha256: .*$", f"    sha256: {digest.stdout.strip()}", text)
    pinned = pinned.replace(f"    path: {sb.runtime}\n", f"    path: {runtime}\n")
    assert f"    path: {runtime}\n" in pinned, pinned
    ext.write_text(pinned)
    own(sb, ext)
    approve(sb, f"ext.{sb.backend}")
    added = runtime / "bin" / "added-later"
    added.write_text("#!/bin/sh\n")
    added.chmod(0o644)
    refused(sb, "create", "--profile", sb.profile, status=3, needles=["config.runtime.sha256", str(runtime)])


def _approved_then_changed(sb: SandboxBroker, name: str, repository: Path, change: Callable[[], None]) -> Path:
    """A profile approved while its repository was fine, which then changes under it (approval
    checks the repository too: ext approve refuses one that is not fit from the start)."""
    path = sb.write_profile(name, backend_profile_text(sb, name, repository))
    approve(sb, name)
    change()
    return path


def test_workspace_repository_that_is_not_a_repository(sbx: SandboxBroker) -> None:
    sb = sbx
    empty = sb.root / "not-a-repo"
    empty.mkdir(mode=0o755)
    sb.write_profile("nogit", backend_profile_text(sb, "nogit", empty))
    refusal = sb.run("ext", "approve", "nogit")
    assert (refusal.status, "workspace.repository: not a Git repository" in refusal.stderr) == (2, True)
    gone = make_repository(sb.root / "was-a-repo", {"README.md": b"x\n"})
    path = _approved_then_changed(sb, "nogit", gone, lambda: shutil.rmtree(gone / ".git"))
    refused(
        sb,
        "create",
        "--profile",
        "nogit",
        status=2,
        needles=["workspace.repository: not a Git repository", str(path)],
    )


def test_workspace_repository_inside_a_repository_is_not_a_repository(sbx: SandboxBroker) -> None:
    """A directory inside a Git work tree is not a repository either: invalid input (2), not a backend failure."""
    sb = sbx
    inner = make_repository(sb.repo / "docs", {"README.md": b"inner\n"})  # a repository of its own, at first
    path = _approved_then_changed(sb, "inner", inner, lambda: shutil.rmtree(inner / ".git"))
    refused(
        sb,
        "create",
        "--profile",
        "inner",
        status=2,
        needles=["workspace.repository: not a Git repository", str(path)],
    )


def test_workspace_ref_that_does_not_exist(sbx: SandboxBroker) -> None:
    sb = sbx
    text = backend_profile_text(sb, "badref", sb.repo).replace("ref: main", "ref: no-such-branch")
    sb.write_profile("badref", text)
    refusal = sb.run("ext", "approve", "badref")
    assert (refusal.status, "workspace.ref: not in the repository" in refusal.stderr) == (2, True)
    path = sb.write_profile("badref", backend_profile_text(sb, "badref", sb.repo).replace("ref: main", "ref: gone"))
    git = ["git", "-C", str(sb.repo)]
    subprocess.run([*git, "branch", "gone"], check=True, capture_output=True)
    approve(sb, "badref")
    subprocess.run([*git, "branch", "-D", "gone"], check=True, capture_output=True)
    refused(sb, "create", "--profile", "badref", status=2, needles=["workspace.ref", str(path)])


def test_network_allow_is_refused(sbx: SandboxBroker) -> None:
    sb = sbx
    text = backend_profile_text(sb, "open", sb.repo).replace("default: deny", "default: allow")
    sb.write_profile("open", text)
    refused(sb, "ext", "approve", "open", status=3, needles=["network.default"])
    refused(sb, "create", "--profile", "open", status=3, needles=["network.default"])


def test_a_manifest_or_bootstrap_that_cannot_be_read_is_bad_input(sbx: SandboxBroker) -> None:
    sb = sbx
    missing = sb.root / "absent.json"
    refused(sb, "create", "--profile", sb.profile, "--manifest", str(missing), status=2, needles=[str(missing)])
    refused(sb, "create", "--profile", sb.profile, "--bootstrap", str(missing), status=2, needles=[str(missing)])
    real, link = sb.root / "real.json", sb.root / "link.json"
    real.write_text("{}")
    real.chmod(0o600)
    link.symlink_to(real)
    own(sb, real)
    os.lchown(link, *((UNPRIVILEGED_UID, UNPRIVILEGED_UID) if sb.as_user else (0, 0)))
    refused(sb, "create", "--profile", sb.profile, "--bootstrap", str(link), status=2, needles=["symlink"])


def test_missing_bwrap_is_a_backend_failure_with_install_hint(sb_root: SandboxBroker) -> None:
    sb = sb_root
    if os.geteuid() != 0:
        pytest.skip("covering /usr/bin/bwrap in a private mount namespace needs root")
    found = shutil.which("bwrap", path="/usr/bin:/bin:/usr/local/bin")
    if found is None or shutil.which("unshare") is None:
        pytest.skip(f"bwrap at {found}, unshare at {shutil.which('unshare')}: cannot cover bwrap")
    covered = sorted(
        {os.path.realpath(d + "/bwrap") for d in ("/usr/bin", "/bin", "/usr/local/bin") if os.path.exists(d + "/bwrap")}
    )
    mounts = " && ".join(f"mount --bind /dev/null {p}" for p in covered)
    argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", f'{mounts} && exec "$@"', "sh"]
    refused(
        sb,
        status=5,
        needles=["bwrap", "apt-get install -y bubblewrap"],
        argv=[*argv, *sb.argv("create", "--profile", PROFILE)],
    )
    assert shutil.which("bwrap", path="/usr/bin:/bin:/usr/local/bin") == found, "the host's bwrap was touched"


# --- gc -------------------------------------------------------------------------------------------


def _record(sb: SandboxBroker, sandbox_id: str) -> dict[str, Any] | None:
    try:
        record: dict[str, Any] = json.loads((sb.sandbox_dir(sandbox_id) / "record.json").read_text())
    except (OSError, ValueError):
        return None
    return record


def _reached(sb: SandboxBroker, sandbox_id: str, point: str) -> bool:
    if point == "dir":
        return True
    if point == "cgroup":  # limits are set up just before bwrap starts
        return bool(cgroups_of(sandbox_id))
    record = _record(sb, sandbox_id)  # "pids": bwrap runs; the probe and the plan check follow
    return record is not None and "holder_pid" in record


def _kill_create(sb: SandboxBroker, point: str, delay: float) -> tuple[int, str, set[str]]:
    """Start a create and SIGKILL it `delay` s after it starts or reaches `point`."""
    registry = sb.state / "sandboxes"
    before = set(os.listdir(registry)) if registry.is_dir() else set()
    proc = subprocess.Popen(
        sb.argv("create", "--profile", PROFILE), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=sb.env()
    )
    deadline = time.monotonic() + 10
    while point != "start" and proc.poll() is None and time.monotonic() < deadline:
        new = set(os.listdir(registry)) - before - {".lock"} if registry.is_dir() else set()
        if new and _reached(sb, min(new), point):
            break
        time.sleep(0.0005)
    time.sleep(delay)
    proc.kill()
    out, _ = proc.communicate(timeout=30)
    after = set(os.listdir(registry)) if registry.is_dir() else set()
    return proc.returncode, out.decode().strip(), after - before - {".lock"}


# When to kill a create: fixed delays after it starts, and at each phase it reaches.
KILL_POINTS = [
    *(("start", d) for d in (0.0, 0.03, 0.08, 0.15)),
    ("dir", 0.0),  # its directory exists: record, clone
    ("dir", 0.02),
    ("cgroup", 0.0),  # limits made, bwrap starting
    ("cgroup", 0.005),
    ("pids", 0.0),  # bwrap runs: joining limits, probing, comparing with the plan
    ("pids", 0.005),
]


def test_gc_collects_creates_killed_at_any_point_and_spares_healthy(sb_root: SandboxBroker) -> None:
    sb = sb_root
    healthy = sb.create()
    killed: dict[str, str] = {}  # sandbox id -> when it was killed
    completed: list[str] = []
    for point, delay in KILL_POINTS:
        status, out, new = _kill_create(sb, point, delay)
        label = f"{point}+{delay}s"
        if status == 0:  # finished before the kill: a healthy sandbox
            assert new == {out}
            completed.append(out)
            continue
        assert status == -signal.SIGKILL, (label, status)
        for sandbox_id in new:
            record = _record(sb, sandbox_id)
            if record is not None and record.get("state") == "ready":
                completed.append(sandbox_id)  # killed between "ready" and printing its id
            else:
                killed[sandbox_id] = label
    sb.created.extend(completed)
    assert killed, "no kill landed mid-create; the test proves nothing"

    result = sb.run("gc", "--json")
    assert result.status == 0, result.stderr
    document = result.json()
    collected = {receipt["id"]: receipt for receipt in document["collected"]}
    assert set(collected) == set(killed), (sorted(collected), killed)
    for sandbox_id, receipt in collected.items():
        assert receipt["residue"] == [], (killed[sandbox_id], receipt)
        assert not sb.sandbox_dir(sandbox_id).exists(), killed[sandbox_id]
        assert cgroups_of(sandbox_id) == [], killed[sandbox_id]
    assert processes_naming(killed) == []
    assert set(document["healthy"]) == {healthy, *completed}
    assert document["busy"] == []

    entries = listed(sb)
    assert entries[healthy]["status"] == "running"
    assert not set(killed) & set(entries)
    assert sb.exec(healthy, "true").status == 0
    for sandbox_id in completed:
        receipt = sb.run("teardown", sandbox_id, "--json")
        assert receipt.status == 0, receipt.stderr
        assert receipt.json()["residue"] == []


def _wait_gone(pids: list[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
        if not alive:
            return
        time.sleep(0.01)
    raise AssertionError(f"processes {pids} did not die")


def test_gc_collects_a_sandbox_whose_init_died(sb: SandboxBroker) -> None:
    sandbox_id = sb.create()
    record = _record(sb, sandbox_id)
    assert record is not None
    # Hold the dead sandbox's pid namespace open until gc is done: otherwise the kernel may give its
    # inode number to the next namespace made on this host (see the reuse test below).
    namespace = os.open(f"/proc/{record['holder_pid']}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    try:
        assert os.fstat(namespace).st_ino == record["pid_namespace"]
        os.kill(record["init_pid"], signal.SIGKILL)
        _wait_gone([record["init_pid"], record["holder_pid"]])

        assert listed(sb)[sandbox_id]["status"] == "dead"
        failed = sb.exec(sandbox_id, "true")
        assert failed.status == 125, failed
        assert failed.stderr.startswith("sandboxer: ")
        assert len(failed.stderr.splitlines()) == 1
        # Every verb says it in the same words, naming what its caller can do (gc is the owners').
        gone = f"sandbox {sandbox_id} is not running: its processes are gone "
        gone += f"(sandboxer teardown {sandbox_id} removes it)"
        assert failed.stderr == f"sandboxer: exec: {gone}\n"
        for verb in ("usage", "work", "inspect"):
            said = sb.run(verb, sandbox_id)
            assert said.status in (2, 5), (verb, said)
            assert gone in said.stderr, (verb, said.stderr)
            assert "gc" not in said.stderr.replace(gone, ""), (verb, said.stderr)

        result = sb.run("gc", "--json")
    finally:
        os.close(namespace)
    assert result.status == 0, result.stderr
    document = result.json()
    assert [receipt["id"] for receipt in document["collected"]] == [sandbox_id]
    assert document["collected"][0]["residue"] == []
    assert document["healthy"] == []
    assert not sb.sandbox_dir(sandbox_id).exists()
    assert sandbox_id not in listed(sb)
    assert processes_naming([sandbox_id]) == []
    assert cgroups_of(sandbox_id) == []
    refused(sb, "teardown", sandbox_id, status=4, needles=["no such sandbox"])


def test_gc_of_a_dead_sandbox_spares_a_live_one_that_reuses_its_pid_namespace_inode(sb_root: SandboxBroker) -> None:
    """Namespace inode numbers are recycled: once a dead sandbox's pid namespace is freed, the next
    namespace made on the host may get the same number (plain `create A; kill -9 A's init; create B`
    gives B exactly A's number on this kernel). A record's pid_namespace therefore names *some*
    namespace, not necessarily the sandbox's, and gc must not kill what lives in it.

    To stay deterministic (and not touch namespaces of other processes on the host), the reuse is
    written into the dead sandbox's record rather than awaited from the kernel.
    """
    sb = sb_root
    dead, live = sb.create(), sb.create()
    dead_record, live_record = _record(sb, dead), _record(sb, live)
    assert dead_record is not None
    assert live_record is not None
    os.kill(dead_record["init_pid"], signal.SIGKILL)
    _wait_gone([dead_record["init_pid"], dead_record["holder_pid"]])
    record_file = sb.sandbox_dir(dead) / "record.json"
    record_file.write_text(json.dumps({**dead_record, "pid_namespace": live_record["pid_namespace"]}, indent=1))

    result = sb.run("gc", "--json")
    assert result.status == 0, result.stderr
    document = result.json()
    status = listed(sb).get(live, {}).get("status")
    assert status == "running", f"gc of the dead sandbox killed the healthy one (now {status}): {document}"
    assert sb.exec(live, "true").status == 0
    assert [receipt["id"] for receipt in document["collected"]] == [dead]


# --- concurrency ----------------------------------------------------------------------------------


def test_twenty_concurrent_sandboxes(sbx_root: SandboxBroker) -> None:
    sb = sbx_root
    count = 20
    with ThreadPoolExecutor(max_workers=count) as pool:
        creates = list(pool.map(lambda _: sb.run("create", "--profile", sb.profile), range(count)))
        ids = [r.stdout.strip() for r in creates if r.status == 0]
        sb.created.extend(ids)
        assert [r.stderr for r in creates if r.status != 0] == []
        assert len(set(ids)) == count
        assert all(ID_RE.fullmatch(i) for i in ids)

        execs = list(pool.map(lambda i: sb.exec(i, "true"), ids))
        assert [(i, r.status, r.stderr) for i, r in zip(ids, execs, strict=True) if r.status != 0] == []
        whoami = list(pool.map(lambda i: sb.sh(i, 'printf %s "$SANDBOXER_SANDBOX_ID"'), ids))
        assert [r.stdout for r in whoami] == ids, "an exec ran in another sandbox"
        if sb.backend == "docker":
            assert sorted(containers(sb)) == sorted(ids)

        receipts = list(pool.map(lambda i: sb.run("teardown", i, "--json"), ids))
    assert [(i, r.status, r.stderr) for i, r in zip(ids, receipts, strict=True) if r.status != 0] == []
    assert all(r.json()["residue"] == [] for r in receipts)
    assert listed(sb) == {}
    assert snapshot(sb).entries == frozenset()
    assert processes_naming(ids) == []
    assert [g for i in ids for g in cgroups_of(i)] == []
    assert containers(sb) == {}
