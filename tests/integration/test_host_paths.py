"""What a sandbox's mount table shows of the host (issue 31): as root, neither the runtime's host
path (bwrap, Docker) nor the state dir's (Docker's /etc files), read by an exec's own
/proc/self/mountinfo; the runtime still reads and stays read-only; teardown and gc leave no
mount or loop device behind (host/staging.py)."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
from pathlib import Path

import docker
import psutil
import pytest

from sandboxer.core.digest import tree_digest
from sandboxer.errors import PolicyError
from sandboxer.host import staging
from tests.conftest import settled
from tests.integration.conftest import SandboxBroker

SEEN = "cat /proc/self/mountinfo /proc/self/mounts /proc/self/cgroup /proc/1/mountinfo"


def _host_paths(broker: SandboxBroker) -> list[str]:
    return [str(broker.runtime), str(broker.runtime.parent), str(broker.state), str(broker.config), str(broker.root)]


def _mounts_below(directory: Path) -> list[str]:
    with open("/proc/self/mountinfo") as stream:
        points = [line.split()[4] for line in stream]
    return [p for p in points if p == str(directory) or p.startswith(f"{directory}/")]


def _loops_of(directory: Path) -> list[str]:
    """Loop devices whose backing file lies below `directory`."""
    found = []
    for path in glob.glob("/sys/block/loop*/loop/backing_file"):
        try:
            backing = Path(path).read_text().strip()
        except OSError:
            continue
        if backing.startswith(f"{directory}/"):
            found.append(f"{path.split('/')[3]} {backing}")
    return found


def test_an_exec_sees_no_host_path_and_the_runtime_works(sbx_root: SandboxBroker) -> None:
    sandbox_id = sbx_root.create()
    seen = sbx_root.sh(sandbox_id, SEEN)
    assert seen.status == 0, seen.stderr
    assert "/opt/sandboxer/runtime" in seen.stdout
    for path in _host_paths(sbx_root):
        assert path not in seen.stdout, f"{path} shows inside:\n{seen.stdout}"

    ran = sbx_root.exec(sandbox_id, "python3", "-c", "import sys, json; print(sys.prefix, json.dumps([1]))")
    assert (ran.status, ran.stdout.strip()) == (0, "/opt/sandboxer/runtime [1]"), ran.stderr
    written = sbx_root.sh(sandbox_id, "touch /opt/sandboxer/runtime/planted 2>&1; echo $?")
    assert written.stdout.strip().splitlines()[-1] != "0", written.stdout
    assert "Read-only file system" in written.stdout

    inspected = sbx_root.run("inspect", sandbox_id, "--json")
    assert inspected.status == 0, inspected.stderr
    evidence = inspected.json()
    assert (evidence["matches_plan"], evidence["differences"]) == (True, [])
    assert evidence["runtime"]["read_only"] is True

    sandboxes = sbx_root.state / "sandboxes"
    assert str(sbx_root.sandbox_dir(sandbox_id) / "runtime") in _mounts_below(sandboxes), "the runtime's image"
    torn = sbx_root.run("teardown", "--discard", sandbox_id)
    assert torn.status == 0, torn.stderr
    assert _mounts_below(sandboxes) == []
    assert settled(lambda: _loops_of(sbx_root.state), []) == []


def test_gc_unmounts_what_a_crashed_sandbox_left(sbx_root: SandboxBroker) -> None:
    sandbox_id = sbx_root.create()
    sandbox_dir = sbx_root.sandbox_dir(sandbox_id)
    assert str(sandbox_dir / "runtime") in _mounts_below(sandbox_dir)  # its image, staged for it
    if sbx_root.backend == "docker":
        client = docker.from_env(timeout=30)
        try:
            for container in client.containers.list(filters={"label": f"io.sandboxer.sandbox={sandbox_id}"}):
                container.kill()
        finally:
            client.close()
    else:  # every process carrying the sandbox's id, killed as a crash would leave them
        for process in psutil.process_iter(["pid"]):
            try:
                marked = process.environ().get("SANDBOXER_SANDBOX_ID") == sandbox_id
            except (psutil.Error, OSError):
                continue
            if marked:
                os.kill(process.pid, signal.SIGKILL)
    collected = sbx_root.run("gc")
    assert collected.status == 0, collected.stderr
    assert settled(lambda: _mounts_below(sbx_root.state / "sandboxes"), []) == []
    assert settled(lambda: _loops_of(sbx_root.state), []) == []
    assert not sandbox_dir.exists()


def test_an_image_of_another_tree_is_refused_and_leaves_nothing(tmp_path: Path, runtime_dir: Path) -> None:
    """An image whose content does not have the pin is never kept; and what a broker killed while
    it made one left (a partial image, a mounted check point) goes before the next is made."""
    if os.geteuid() != 0 or shutil.which("mkfs.erofs", path="/usr/sbin:/usr/bin:/sbin:/bin") is None:
        pytest.skip("runtime images are made by a root broker with mkfs.erofs (scripts/install-system-deps)")

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    with pytest.raises(PolicyError, match="changed while its image was made"):
        staging.runtime_image(str(state), str(runtime_dir), "0" * 64)
    images = state / staging.IMAGES
    assert sorted(p.name for p in images.iterdir()) == [".lock"]
    assert _mounts_below(state) == []

    (images / ".partial-killed.erofs").write_bytes(b"half")
    (images / ".check-killed").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(images / ".check-killed")], check=True)
    sha256 = tree_digest(str(runtime_dir)).sha256
    image = staging.runtime_image(str(state), str(runtime_dir), sha256)
    assert sorted(p.name for p in images.iterdir()) == [".lock", f"{sha256}.erofs"]
    assert image == str(images / f"{sha256}.erofs")
    assert _mounts_below(state) == []


def test_inspect_tells_a_runtime_that_is_not_its_image(sbx_root: SandboxBroker) -> None:
    """The evidence compares the runtime inside with the image the broker mounted for it: gone
    from the host (unmounted there), it is a difference."""
    sandbox_id = sbx_root.create()
    point = sbx_root.sandbox_dir(sandbox_id) / "runtime"
    subprocess.run(["umount", "-l", str(point)], check=True)
    inspected = sbx_root.run("inspect", sandbox_id, "--json")
    evidence = inspected.json()
    assert evidence["matches_plan"] is False, evidence
    assert "mount /opt/sandboxer/runtime: not the runtime's staged image" in evidence["differences"]
