"""Escape probes: regressions of known container and sandbox escapes.

- runc CVE-2019-5736: overwrite the runtime's binary through /proc/self/exe or /proc/PID/exe of a
  host process entering the sandbox (here: the broker's joiner before its execve, runc init).
- runc CVE-2024-21626 (and CVE-2016-9962): a descriptor of the host leaked into the command, or a
  working directory reached through /proc/self/fd.
- flatpak CVE-2021-41133: the new mount API (fsopen, open_tree, move_mount…) around a filter that
  only knew mount(2); CVE-2022-0185 (fsconfig) is the same surface.
- CVE-2022-0492: cgroup v1 release_agent through a new cgroup mount.
- /proc/sysrq-trigger, setuid binaries under no_new_privs, unprivileged user namespaces (bwrap
  and unshare inside the sandbox), chroot, abstract sockets of the host (CVE-2020-15257).
TIOCSTI (CVE-2017-5226) is in test_escape_terminals, keyrings in test_escape_keyrings, sockets
in test_escape_syscalls, mountinfo and the caller's output file in test_escape_filesystem.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_escape_support import Box, answer, box_fixture

box = box_fixture()

# ------------------------------------------------------------------------------ CVE-2019-5736


def test_own_exe_cannot_be_opened_for_writing(box: Box) -> None:
    assert answer(box.py("print(try_open('/proc/self/exe', os.O_WRONLY))")) == "EACCES"


def test_init_exe_cannot_be_opened_for_writing(box: Box) -> None:
    assert answer(box.py("print(try_open('/proc/1/exe', os.O_WRONLY))")) == "EACCES"


# In the background for a few seconds: open /proc/N/exe of every other process that appears —
# while the test starts execs, whose host-side entry (the broker's Python on bwrap, runc init on
# Docker) passes through the sandbox's pid namespace before its execve. Writes must never open;
# on bwrap (each exec a Landlock domain of its own) reads of other processes' exes neither.
WATCHER = r"""
import errno, os, sys, time
me, writes, reads, seen = os.getpid(), [], [], set()
deadline = time.monotonic() + float(sys.argv[1])
while time.monotonic() < deadline:
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        seen.add(entry)
        for flags, found in ((os.O_WRONLY, writes), (os.O_RDONLY, reads)):
            try:
                fd = os.open(f"/proc/{entry}/exe", flags)
            except OSError:
                continue
            try:
                found.append(f"{entry}:{os.readlink(f'/proc/self/fd/{fd}')}")
            except OSError:
                found.append(entry)
            os.close(fd)
with open(sys.argv[2], "w") as out:
    out.write(f"{len(seen)} {len(set(writes))} {len(set(reads))} {sorted(set(writes))}\n")
"""


def host_binaries() -> dict[str, str]:
    """sha256 of every host program that enters a sandbox: the broker's interpreter, bwrap and
    Docker's runtime pieces."""
    paths = {os.path.realpath(sys.executable)}
    for name in ("bwrap", "runc", "docker-init", "containerd-shim-runc-v2", "containerd-shim"):
        found = shutil.which(name, path="/usr/local/bin:/usr/bin:/usr/sbin:/bin:/sbin")
        if found:
            paths.add(os.path.realpath(found))
    return {path: hashlib.sha256(Path(path).read_bytes()).hexdigest() for path in sorted(paths)}


def test_no_exec_entry_exposes_a_host_binary_for_writing(box: Box) -> None:
    before = host_binaries()
    result_file = "$TMPDIR/exe-watch.txt"
    started = box.sh(
        f'rm -f "{result_file}"; nohup /usr/bin/python3 -c "$1" 6 "{result_file}" </dev/null >/dev/null 2>&1 &',
        WATCHER,
    )
    assert started.status == 0, started.stderr
    time.sleep(0.5)
    for _ in range(12):
        entered = box.sh("true")
        assert entered.status == 0, entered.stderr
    result = ""
    for _ in range(100):
        read = box.sh(f'cat "{result_file}" 2>/dev/null')
        result = read.stdout.strip()
        if result:
            break
        time.sleep(0.2)
    seen, writes, reads, written = result.split(" ", 3)
    assert int(seen) > 0, result
    assert (writes, written) == ("0", "[]"), result
    if box.backend == "bwrap":
        assert reads == "0", f"an exec opened another process's exe: {result}"
    assert host_binaries() == before


# ----------------------------------------------------------------------------- CVE-2024-21626


def test_a_fresh_exec_holds_only_its_three_streams(box: Box) -> None:
    assert answer(box.py("print(sorted(os.listdir('/proc/self/fd'), key=int))")) == "['0', '1', '2', '3']"


def test_stream_descriptors_name_nothing_on_the_host(box: Box) -> None:
    code = "print(' '.join(os.readlink(f'/proc/self/fd/{n}').split(':')[0] for n in range(3)))"
    # The streams are pipes (or /dev/null) whoever the caller is; never a host directory or file.
    assert answer(box.py(code, stdin=b"")) == "pipe pipe pipe"


@pytest.mark.parametrize("fd", [3, 4, 5, 6, 7, 8, 9])
def test_cwd_through_a_leaked_descriptor_is_refused(box: Box, fd: int) -> None:
    result = box.broker.exec(box.sandbox_id, "/bin/pwd", options=("--cwd", f"/proc/self/fd/{fd}"))
    assert result.status == 125, result
    assert result.stderr.startswith(f"sandboxer: exec: --cwd /proc/self/fd/{fd}: not a directory inside the sandbox")
    assert result.stdout == ""


def test_working_directory_is_inside_the_sandbox(box: Box) -> None:
    code = "print(os.getcwd(), os.readlink('/proc/self/cwd'), os.stat('.').st_ino == os.stat('/workspace').st_ino)"
    assert answer(box.py(code)) == "/workspace /workspace True"


def test_cwd_through_another_process_stays_inside(box: Box) -> None:
    """--cwd /proc/1/cwd resolves to pid 1's directory inside the sandbox, never a host one; on
    Docker the exec is already in its Landlock domain when it enters the cwd, so pid 1's is not
    its to follow at all."""
    code = "print(os.getcwd(), os.stat('.').st_ino == os.stat(os.getcwd()).st_ino)"
    result = box.py(code, options=("--cwd", "/proc/1/cwd"))
    if box.backend == "docker":
        assert result.status == 125, result
        assert result.stderr.startswith("sandboxer: exec: --cwd /proc/1/cwd: not a directory inside the sandbox")
        return
    assert answer(result) == "/ True"


# ---------------------------------------------------------------------------- CVE-2021-41133

NEW_MOUNT_API = [
    ("open_tree", "syscall(428, -100, b'/', 1)"),
    ("move_mount", "syscall(429, -1, b'', -100, b'/workspace', 0)"),
    ("fsopen", "syscall(430, b'tmpfs', 0)"),
    ("fsconfig", "syscall(431, -1, 0, 0, 0, 0)"),
    ("fsmount", "syscall(432, -1, 0, 0)"),
    ("fspick", "syscall(433, -100, b'/', 0)"),
    ("mount_setattr", "syscall(442, -100, b'/', 0, 0, 0)"),
    ("open_tree_attr", "syscall(467, -100, b'/', 1, 0, 0)"),
]


@pytest.mark.parametrize("expression", [pytest.param(e, id=n) for n, e in NEW_MOUNT_API])
def test_new_mount_api_is_refused(box: Box, expression: str) -> None:
    # Docker looks the profile's names up in the daemon's own libseccomp, which predates
    # open_tree_attr (Linux 6.15): that rule is dropped there, and the kernel itself refuses the
    # call (EPERM: no CAP_SYS_ADMIN). Refused either way; docs/seccomp.md says so.
    newer_than_the_daemon = box.backend == "docker" and "syscall(467," in expression
    assert answer(box.py(f"print({expression})")) == ("EPERM" if newer_than_the_daemon else "ENOSYS")


# ----------------------------------------------------------------------------- CVE-2022-0492


def test_cgroup_v1_mount_for_release_agent_is_refused(box: Box) -> None:
    assert answer(box.py("print(syscall(165, b'cgroup', b'/workspace', b'cgroup', 0, b'rdma'))")) == "EPERM"


# ------------------------------------------------------------------------- host control files


def test_sysrq_trigger_cannot_be_written(box: Box) -> None:
    refusal = "EACCES" if os.path.exists("/proc/sysrq-trigger") else "ENOENT"  # this kernel has none
    assert answer(box.py("print(try_open('/proc/sysrq-trigger', os.O_WRONLY))")) == refusal


def test_no_abstract_socket_of_the_host_is_visible(box: Box) -> None:
    """Abstract Unix sockets belong to a network namespace: containerd's shim sockets
    (CVE-2020-15257) and every other host listener are out of reach."""
    code = (
        "print([line.split()[-1] for line in open('/proc/net/unix').read().splitlines()[1:] if len(line.split()) > 7])"
    )
    assert answer(box.py(code)) == "[]"


# --------------------------------------------------------------------- setuid and no_new_privs

SETUID = ("su", "passwd", "chsh", "chfn", "newgrp", "gpasswd", "mount", "umount")

# Start a setuid-root program and read its credentials once it has executed (as a zombie too).
RUN_SETUID = """
import subprocess, time
program = sys.argv[1]
child = subprocess.Popen([program], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
for _ in range(500):
    if open(f"/proc/{child.pid}/comm").read().strip() == os.path.basename(program):
        break
    time.sleep(0.01)
fields = dict(line.split(":", 1) for line in open(f"/proc/{child.pid}/status").read().splitlines())
print(stat.S_IMODE(os.stat(program).st_mode) & 0o4000 != 0, fields["Uid"].split(), fields["Gid"].split(),
      fields["NoNewPrivs"].strip(), fields["CapEff"].strip())
child.kill()
child.wait()
"""


@pytest.mark.parametrize("program", SETUID)
def test_setuid_program_gains_nothing(box: Box, program: str) -> None:
    path = f"/usr/bin/{program}"
    if not Path(path).is_file():
        pytest.skip(f"{path} is not installed on this host")
    ids = "['1000', '1000', '1000', '1000']"
    assert answer(box.py(RUN_SETUID, path)) == f"True {ids} {ids} 1 0000000000000000"


# ------------------------------------------------------------------- user namespaces, chroot


@pytest.mark.parametrize(
    ("argv", "status", "message"),
    [
        pytest.param(
            ["unshare", "--user", "/bin/true"], 1, "unshare: unshare failed: Operation not permitted", id="unshare-user"
        ),
        pytest.param(
            ["unshare", "--map-root-user", "/bin/true"],
            1,
            "unshare: unshare failed: Operation not permitted",
            id="unshare-root",
        ),
        pytest.param(
            ["bwrap", "--ro-bind", "/", "/", "/bin/true"], 1, "bwrap: No permissions to create new", id="nested-bwrap"
        ),
        pytest.param(
            ["/usr/sbin/chroot", "/", "/bin/true"],
            125,
            "/usr/sbin/chroot: cannot change root directory to '/': Operation not permitted",
            id="chroot-command",
        ),
    ],
)
def test_no_new_user_namespace_or_root(box: Box, argv: list[str], status: int, message: str) -> None:
    result = box.broker.exec(box.sandbox_id, *argv)
    assert (result.status, result.stderr.startswith(message)) == (status, True), result


def test_chroot_syscall_is_refused(box: Box) -> None:
    assert answer(box.py("print(syscall(161, b'/'), syscall(161, b'/workspace'))")) == "EPERM EPERM"
