"""Escape probes: the filesystem — device nodes and mknod, /sys and /proc/sys writes, read-only
mounts, host paths, the caller's output file, and what a sandbox can plant for the host's own
teardown (symlinks, FIFOs, deep or unreadable trees, Git hooks).

On bwrap /sys is not mounted and /dev holds only null, zero, full, random, urandom, tty and a
private devpts; device nodes cannot be made (no CAP_MKNOD, and each exec's Landlock domain
handles the make-device rights). On Docker /sys is read-only and the cgroup files are root's.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.integration.conftest import SandboxBroker
from tests.integration.test_escape_support import (
    PRELUDE,
    SYSTEM_PYTHON,
    Box,
    answer,
    box_fixture,
    loop_backing_files,
    mount_points,
    own_box,
    run_cli,
)

box = box_fixture()

# --------------------------------------------------------------------------------- device nodes

MKNOD = """
path = os.path.join(os.path.expandvars(sys.argv[1]), "escape-node")
kind = stat.S_IFBLK if sys.argv[2] == "block" else stat.S_IFCHR
print(attempt(os.mknod, path, kind | 0o666, os.makedev(int(sys.argv[3]), int(sys.argv[4]))))
"""


@pytest.mark.parametrize("place", ["$TMPDIR", "/workspace", "/dev/shm"])
@pytest.mark.parametrize(
    ("kind", "major", "minor"),
    [
        pytest.param("char", 1, 1, id="char-mem"),
        pytest.param("char", 1, 11, id="char-kmsg"),
        pytest.param("block", 254, 0, id="block-vda"),
    ],
)
def test_mknod_of_a_device_is_refused(box: Box, place: str, kind: str, major: int, minor: int) -> None:
    # Each exec's Landlock domain handles MAKE_CHAR and MAKE_BLOCK, and answers before the
    # missing CAP_MKNOD would (EPERM).
    assert answer(box.py(MKNOD, place, kind, str(major), str(minor))) == "EACCES"


HOST_DEVICES = [
    "/dev/mem",
    "/dev/kmem",
    "/dev/port",
    "/dev/kmsg",
    "/dev/vda",
    "/dev/sda",
    "/dev/loop0",
    "/dev/loop-control",
    "/dev/mapper/control",
    "/dev/fuse",
    "/dev/net/tun",
    "/dev/vsock",
    "/dev/vhost-vsock",
    "/dev/vhost-net",
    "/dev/kvm",
    "/dev/cpu/0/msr",
    "/dev/watchdog",
    "/dev/uinput",
    "/dev/rtc0",
    "/dev/userfaultfd",
    "/dev/btrfs-control",
    "/dev/hwrng",
]


@pytest.mark.parametrize("device", HOST_DEVICES)
def test_host_device_is_absent(box: Box, device: str) -> None:
    assert answer(box.py(f"print(try_open({device!r}, os.O_RDONLY | os.O_NONBLOCK))")) == "ENOENT"


DEVICES = """
found = []
for root, dirs, files in os.walk("/dev"):
    for entry in dirs + files:
        path = os.path.join(root, entry)
        info = os.lstat(path)
        if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode):
            kind = "b" if stat.S_ISBLK(info.st_mode) else "c"
            found.append(f"{kind}:{path}:{os.major(info.st_rdev)}:{os.minor(info.st_rdev)}")
print(" ".join(sorted(found)))
"""


def test_dev_holds_only_the_harmless_devices(box: Box) -> None:
    expected = "c:/dev/full:1:7 c:/dev/null:1:3 c:/dev/pts/ptmx:5:2 c:/dev/random:1:8 c:/dev/tty:5:0"
    assert answer(box.py(DEVICES)) == expected + " c:/dev/urandom:1:9 c:/dev/zero:1:5"


def test_dev_takes_no_new_files(box: Box) -> None:
    """/dev is the sandbox's own tmpfs with no size of its own: a file there is memory outside
    every planned cap (/dev/shm has 64 MiB, the state tmpfs 256 MiB)."""
    refusal = box.expect(bwrap="EROFS", docker="EACCES")
    assert answer(box.py("print(try_open('/dev/escape-file', os.O_WRONLY | os.O_CREAT))")) == refusal


# ------------------------------------------------------------------------------ /sys and /proc/sys

SYS_WRITES = [
    # (path, bwrap: /sys is not mounted, Docker: read-only sysfs and root's cgroup files)
    ("/sys/kernel/mm/transparent_hugepage/enabled", "ENOENT", "EROFS"),
    ("/sys/power/state", "ENOENT", "EROFS"),
    ("/sys/class/net/lo/mtu", "ENOENT", "EROFS"),
    ("/sys/fs/cgroup/memory/cgroup.procs", "ENOENT", "EACCES"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "ENOENT", "EACCES"),
    ("/sys/fs/cgroup/pids/pids.max", "ENOENT", "EACCES"),
    ("/sys/fs/cgroup/memory/notify_on_release", "ENOENT", "EACCES"),
    # CVE-2022-0492: release_agent exists only in a hierarchy's root, which no sandbox sees.
    ("/sys/fs/cgroup/memory/release_agent", "ENOENT", "ENOENT"),
]


@pytest.mark.parametrize(("path", "bwrap", "docker"), SYS_WRITES)
def test_sys_write_is_refused(box: Box, path: str, bwrap: str, docker: str) -> None:
    assert answer(box.py(f"print(try_open({path!r}, os.O_WRONLY))")) == box.expect(bwrap=bwrap, docker=docker)


def test_no_cgroup_can_be_made(box: Box) -> None:
    refusal = box.expect(bwrap="ENOENT", docker="EACCES")
    assert answer(box.py("print(attempt(os.mkdir, '/sys/fs/cgroup/memory/escape'))")) == refusal


PROC_SYS_WRITES = [
    "/proc/sys/kernel/core_pattern",
    "/proc/sys/kernel/hostname",
    "/proc/sys/kernel/randomize_va_space",
    "/proc/sys/vm/drop_caches",
    "/proc/sys/vm/overcommit_memory",
    "/proc/sys/net/ipv4/ip_forward",
    "/proc/sys/user/max_user_namespaces",
]


@pytest.mark.parametrize("path", PROC_SYS_WRITES)
def test_proc_sys_write_is_refused(box: Box, path: str) -> None:
    assert answer(box.py(f"print(try_open({path!r}, os.O_WRONLY))")) == "EACCES"


# --------------------------------------------------------------------------------- read-only mounts


@pytest.mark.parametrize("path", ["/x", "/etc/x", "/usr/x", "/opt/sandboxer/runtime/x", "/opt/sandboxer/runtime/bin/x"])
def test_no_file_can_be_made_outside_the_writable_places(box: Box, path: str) -> None:
    assert answer(box.py(f"print(try_open({path!r}, os.O_WRONLY | os.O_CREAT))")) == "EROFS"


@pytest.mark.parametrize("path", ["/etc/passwd", "/etc/hosts", "/etc/resolv.conf"])
def test_generated_etc_file_cannot_be_rewritten(box: Box, path: str) -> None:
    # bwrap's files are the sandbox user's, on a read-only bind; Docker's are root's.
    refusal = box.expect(bwrap="EROFS", docker="EACCES")
    assert answer(box.py(f"print(try_open({path!r}, os.O_WRONLY))")) == refusal


@pytest.mark.parametrize(
    "path", ["/usr/bin/python3", "/opt/sandboxer/runtime/bin/python3", "/usr/lib/x86_64-linux-gnu/libc.so.6"]
)
def test_host_binary_cannot_be_rewritten(box: Box, path: str) -> None:
    # A root broker's runtime is a read-only erofs image (host/staging.py): the filesystem
    # refuses before the file's permissions are asked; elsewhere they refuse first.
    image = path.startswith("/opt/sandboxer/runtime/") and box.variant != "bwrap-user"
    assert answer(box.py(f"print(try_open({path!r}, os.O_WRONLY))")) == ("EROFS" if image else "EACCES")


@pytest.mark.parametrize(
    "source", ["/usr/bin/su", "/opt/sandboxer/runtime/bin/python3", "/etc/passwd", "/usr/bin/passwd"]
)
def test_no_hard_link_into_the_workspace(box: Box, source: str) -> None:
    """A hard link would let a host file be changed, or outlive teardown, through the workspace."""
    assert answer(box.py(f"print(attempt(os.link, {source!r}, '/workspace/escape-link'))")) == "EXDEV"


def test_holder_program_cannot_be_read(box: Box) -> None:
    """bwrap's holder runs from an execute-only copy (so it is not dumpable); Docker has none."""
    refusal = box.expect(bwrap="EACCES", docker="ENOENT")
    assert answer(box.py("print(try_open('/run/sandboxer/holder'))")) == refusal


# ------------------------------------------------------------------------------------ host paths


def host_paths(box: Box) -> dict[str, str]:
    broker = box.broker
    return {
        "state-dir": str(broker.state),
        "config-dir": str(broker.config),
        "repository": str(broker.repo),
        "broker-root": str(broker.root),
        "sandbox-dir": str(broker.sandbox_dir(box.sandbox_id)),
    }


@pytest.mark.parametrize("which", ["state-dir", "config-dir", "repository", "broker-root", "sandbox-dir"])
def test_host_path_is_not_reachable(box: Box, which: str) -> None:
    path = host_paths(box)[which]
    assert answer(box.py(f"print(attempt(os.stat, {path!r}))")) == "ENOENT"


@pytest.mark.parametrize(
    "path",
    [
        "/var/run/docker.sock",
        "/run/docker.sock",
        "/run/containerd/containerd.sock",
        "/etc/shadow",
        "/root",
        "/home",
        "/var/lib/docker",
    ],
)
def test_host_secret_path_is_absent(box: Box, path: str) -> None:
    assert answer(box.py(f"print(attempt(os.stat, {path!r}))")) == "ENOENT"


def test_mountinfo_names_no_broker_path(box: Box) -> None:
    """A mount's root in /proc/self/mountinfo is its source path on the host: the sandbox learns
    where the broker keeps its state (the path runc's CVE-2024-21626 exploits needed), and where
    the owner keeps the runtime. A root broker's sandboxes see the runtime from its own image
    and Docker's /etc files from a tmpfs (host/staging.py); an unprivileged broker cannot mount,
    so its runtime's path still shows (docs/security.md, "Noted, not done yet")."""
    text = answer(box.py("print(open('/proc/self/mountinfo').read())"))
    paths = host_paths(box)
    if box.variant != "bwrap-user":
        paths["runtime"] = str(box.broker.runtime)
    naming = [line for line in text.splitlines() if any(path in line for path in paths.values())]
    assert naming == [], "\n".join(naming)


# ----------------------------------------------------------------------- the caller's output file

# What the exec can learn of its stdout or stderr: reopened through /proc/self/fd/N for reading,
# the file the caller redirected it to would hand over everything written there before.
REOPEN = """
fd = int(sys.argv[1])
info = os.fstat(fd)
try:
    reopened = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK)
except OSError as exc:
    content = name(exc.errno)
else:
    try:
        content = os.read(reopened, 4096).decode(errors="replace").replace("\\n", "|")
    except OSError as exc:
        content = name(exc.errno)
print(info.st_dev, info.st_ino, content, file=sys.stderr if fd == 1 else sys.stdout)
"""


@pytest.mark.parametrize("stream", [1, 2], ids=["stdout-file", "stderr-file"])
def test_callers_output_file_cannot_be_read_back(box: Box, tmp_path: Path, stream: int) -> None:
    """The caller sends the exec's output to its own log file (0644, in a private directory,
    holding earlier output): the exec can neither read it back nor see that file at all."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    log = private / "caller.log"
    secret = "caller-log-secret-9f3d"
    log.write_text(f"{secret}\n")
    log.chmod(0o644)
    if box.broker.as_user:
        for path in (tmp_path, private, log):
            os.chown(path, 65534, 65534)
    argv = ("exec", box.sandbox_id, "--", SYSTEM_PYTHON, "-c", PRELUDE + REOPEN, str(stream))
    with log.open("ab") as output:
        if stream == 1:
            done = run_cli(box.broker, *argv, stdout=output, stderr=subprocess.PIPE)
            said = done.stderr.decode()
        else:
            done = run_cli(box.broker, *argv, stdout=subprocess.PIPE, stderr=output)
            said = done.stdout.decode()
    assert done.returncode == 0, said
    dev, ino, content = said.strip().split(" ", 2)
    assert secret not in content, "the exec read the caller's log back"
    host = log.stat()
    assert (int(dev), int(ino)) != (host.st_dev, host.st_ino), "the exec holds the caller's own file"


# ------------------------------------------------------------ what a sandbox plants for teardown


def teardown_clean(broker: SandboxBroker, sandbox_id: str, *, timeout: float = 120) -> None:
    """Teardown succeeds with an empty residue, the sandbox's directory, mounts and loop device
    are gone (what the hostile sandbox wrote is nobody's work: --discard)."""
    done = run_cli(broker, "teardown", sandbox_id, "--discard", "--json", capture_output=True, timeout=timeout)
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert json.loads(done.stdout)["residue"] == []
    directory = str(broker.sandbox_dir(sandbox_id))
    assert not os.path.lexists(directory)
    assert [m for m in mount_points() if m.startswith(directory)] == []
    assert [f for f in loop_backing_files() if f.startswith(directory)] == []


def test_teardown_follows_no_symlink_out_of_the_workspace(sbx: SandboxBroker, tmp_path: Path) -> None:
    """Symlinks to host files and directories, planted in the workspace (and in place of .git),
    are removed as links: what they point at is untouched."""
    own = own_box(sbx)
    sentinel = tmp_path / "sentinel"
    (sentinel / "deep").mkdir(parents=True)
    (sentinel / "keep.txt").write_text("keep\n")
    (sentinel / "deep" / "keep.txt").write_text("keep\n")
    target = str(sentinel)
    planted = own.sh(
        'set -e; cd /workspace; ln -s "$1" dir-link; ln -s "$1/keep.txt" file-link; mkdir sub; '
        'ln -s "$1" sub/dir-link; ln -s "$1/deep" sub/deep-link; rm -rf .git; ln -s "$1" .git; '
        "ln -s / root-link; ln -s /workspace loop-link",
        target,
    )
    assert planted.status == 0, planted.stderr
    teardown_clean(sbx, own.sandbox_id)
    assert sorted(str(p.relative_to(sentinel)) for p in sentinel.rglob("*")) == ["deep", "deep/keep.txt", "keep.txt"]
    assert (sentinel / "keep.txt").read_text() == "keep\n"


def test_teardown_removes_a_very_deep_tree(sbx: SandboxBroker) -> None:
    """A tree 5,000 directories deep (far past Python's recursion limit and PATH_MAX)."""
    own = own_box(sbx)
    code = """
os.chdir("/workspace")
for _ in range(5000):
    os.mkdir("d")
    os.chdir("d")
open("bottom", "w").write("x")
print("deep")
"""
    assert answer(own.py(code)) == "deep"
    teardown_clean(sbx, own.sandbox_id)


def test_teardown_removes_unreadable_and_unwritable_directories(sbx: SandboxBroker) -> None:
    own = own_box(sbx)
    planted = own.sh(
        "set -e; cd /workspace; mkdir -p locked/inner open; echo x > locked/inner/f; echo y > open/f; "
        "chmod 000 locked/inner; chmod 000 locked; chmod 500 open; chmod 000 /workspace/README.md"
    )
    assert planted.status == 0, planted.stderr
    teardown_clean(sbx, own.sandbox_id)


def test_teardown_does_not_block_on_fifos(sbx: SandboxBroker) -> None:
    """FIFOs in place of the files host-side Git would read: teardown never opens them."""
    own = own_box(sbx)
    planted = own.sh(
        "set -e; cd /workspace/.git; for f in HEAD config index packed-refs; do rm -f $f; mkfifo $f; done; "
        "mkfifo /workspace/README.md.fifo"
    )
    assert planted.status == 0, planted.stderr
    teardown_clean(sbx, own.sandbox_id, timeout=60)


def test_git_hooks_planted_in_the_workspace_never_run_on_the_host(sbx: SandboxBroker, tmp_path: Path) -> None:
    """Hooks, a hooks path and an fsmonitor command planted in the clone's .git: the host never
    runs Git in a clone a sandbox has used — not for inspect, teardown or gc."""
    own = own_box(sbx)
    marker = tmp_path / "hook-ran"
    tmp_path.chmod(0o777)
    hook = f"#!/bin/sh\ntouch {marker}\n"
    script = f"""
set -e
cd /workspace/.git
mkdir -p hooks
for name in post-checkout pre-commit post-merge reference-transaction fsmonitor-watchman pre-auto-gc; do
    printf '%s' "$1" > hooks/$name
    chmod 755 hooks/$name
done
printf '[core]\\n\\tfsmonitor = touch {marker}\\n\\thooksPath = /workspace/.git/hooks\\n' >> config
printf '\\tsshCommand = touch {marker}\\n' >> config
"""
    planted = own.sh(script, hook)
    assert planted.status == 0, planted.stderr
    inspected = sbx.run("inspect", own.sandbox_id, "--json")
    assert inspected.status == 0, inspected.stderr
    teardown_clean(sbx, own.sandbox_id)
    gc = sbx.run("gc", "--json")
    assert gc.status == 0, gc.stderr
    assert not marker.exists(), "a hook planted in the sandbox ran on the host"


def test_workspace_permissions_cannot_reach_host_owner_bits(box: Box) -> None:
    """setuid and setgid bits set inside never mean anything on the host: the workspace is
    mounted nosuid, and the files are the sandbox's own uid's."""
    code = """
path = "/workspace/escape-suid"
open(path, "w").write("#!/bin/sh\\nid -u\\n")
os.chmod(path, 0o6755)
mode = os.stat(path).st_mode
flags = [line for line in open("/proc/self/mountinfo").read().splitlines() if line.split()[4] == "/workspace"]
print(stat.S_IMODE(mode) & 0o6000 != 0, "nosuid" in flags[-1].split()[5])
os.unlink(path)
"""
    assert answer(box.py(code)) == "True True"
    # On the host, the workspace is never root's.
    directory = box.broker.workspace_dir(box.sandbox_id)
    info = directory.stat()
    assert info.st_uid != 0
    assert not stat.S_IMODE(info.st_mode) & 0o6000
