"""Escape probes: one exec reaching into another process of its sandbox — ptrace, /proc/PID/mem,
environ, fd, cwd, root, exe and namespace files — and the sandbox's own processes' streams.

The targets are the sandbox's init (pid 1: bwrap's reaper; on Docker the container's pid 1), the
holder whose namespaces every exec joins (pid 2 on bwrap, /run/sandboxer/holder; on Docker pid 1
holds the container), and a process another exec left running in the background with a secret in
its environment. Each exec is a Landlock domain of its own (joiner), so the kernel refuses it
ptrace access to every process outside its own tree whatever uid that process runs as; the
syscall policy refuses ptrace and process_vm_* besides. The control at the end proves the same
probes do reach a process of the exec's own tree.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import Result
from tests.integration.conftest import SandboxBroker
from tests.integration.test_escape_support import (
    Box,
    answer,
    box_fixture,
    host_pids_with_argv,
    own_box,
    variant_of,
)
from tests.integration.test_manifest_sandboxes import CONSUMER, INHERITED, create, make_run, run_env

box = box_fixture()

SECRET = "escape-victim-secret-5b0c9e"
VICTIM_SECONDS = "3600.417"  # a duration nothing else sleeps for: the victim is found by it

# A victim in the background: its environment carries the secret; the exec prints its pid.
START_VICTIM = (
    f"nohup env SANDBOXER_ESCAPE_SECRET={SECRET} /usr/bin/sleep {VICTIM_SECONDS} </dev/null >/dev/null 2>&1 & echo $!"
)


@pytest.fixture(scope="module")
def victim(box: Box) -> int:
    """The pid (inside the sandbox) of a process an earlier exec left running."""
    started = box.sh(START_VICTIM)
    assert started.status == 0, started.stderr
    pid = int(started.stdout.strip())
    alive = box.sh(f"test -e /proc/{pid} && cat /proc/{pid}/cmdline | tr '\\0' ' '")
    assert alive.stdout.strip() == f"/usr/bin/sleep {VICTIM_SECONDS}", alive
    return pid


def target_pid(box: Box, target: str, victim: int) -> int:
    """The pid inside the sandbox of a target role."""
    if target == "init":
        return 1
    if target == "holder":
        return 1 if box.backend == "docker" else 2
    return victim


TARGETS = ("init", "holder", "other-exec")

# (access, Python expression with T for the target pid, the refusal)
ACCESSES = [
    ("mem-read", "try_open(f'/proc/{T}/mem', os.O_RDONLY)", "EACCES"),
    ("mem-write", "try_open(f'/proc/{T}/mem', os.O_RDWR)", "EACCES"),
    ("environ", "try_open(f'/proc/{T}/environ')", "EACCES"),
    ("fd-readlink", "attempt(os.readlink, f'/proc/{T}/fd/0')", "EACCES"),
    ("cwd-readlink", "attempt(os.readlink, f'/proc/{T}/cwd')", "EACCES"),
    ("exe-readlink", "attempt(os.readlink, f'/proc/{T}/exe')", "EACCES"),
    ("root-listdir", "attempt(os.listdir, f'/proc/{T}/root/')", "EACCES"),
    ("mnt-namespace-open", "try_open(f'/proc/{T}/ns/mnt')", "EACCES"),
    ("ptrace-attach", "syscall(101, 16, T, 0, 0)", "EPERM"),
    ("ptrace-seize", "syscall(101, 0x4206, T, 0, 0)", "EPERM"),
    ("process_vm_readv", "vm_read(T)", "EPERM"),
    ("pidfd_getfd", "syscall(438, os.pidfd_open(T), 0, 0)", "EPERM"),
]

VM_READ = """
class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]
def vm_read(pid):
    buffer = ctypes.create_string_buffer(8)
    local = IoVec(ctypes.cast(buffer, ctypes.c_void_p), 8)
    remote = IoVec(0x400000, 8)
    return syscall(310, pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
"""


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(("expression", "refusal"), [pytest.param(e, r, id=a) for a, e, r in ACCESSES])
def test_exec_cannot_reach_another_process(box: Box, victim: int, target: str, expression: str, refusal: str) -> None:
    pid = target_pid(box, target, victim)
    assert answer(box.py(f"{VM_READ}\nT = {pid}\nprint({expression})")) == refusal


def test_victim_secret_is_never_read(box: Box, victim: int) -> None:
    """Every way of reading another process's environment, in one exec: none yields the secret."""
    code = f"""
found = []
for path in ("/proc/{victim}/environ", "/proc/{victim}/task/{victim}/environ"):
    try:
        with open(path, "rb") as stream:
            found.append(stream.read())
    except OSError:
        pass
print("leaked" if any(b"{SECRET}" in data for data in found) else "refused")
"""
    assert answer(box.py(code)) == "refused"


# The control: the very same probes reach a process of the exec's own tree.
CONTROL = f"""
{VM_READ}
import subprocess
child = subprocess.Popen(["/usr/bin/env", "SANDBOXER_ESCAPE_SECRET={SECRET}", "/usr/bin/sleep", "120"])
import time
# Until env has exec'd sleep and the kernel has laid out sleep's environment (the exe link
# changes a moment before: environ reads empty in between), seconds on a loaded machine.
def settled():
    return (os.readlink(f"/proc/{{child.pid}}/exe") == "/usr/bin/sleep"
            and open(f"/proc/{{child.pid}}/environ", "rb").read() != b"")
deadline = time.monotonic() + 60
while not settled() and time.monotonic() < deadline:
    time.sleep(0.01)
T = child.pid
print(try_open(f"/proc/{{T}}/mem", os.O_RDONLY), try_open(f"/proc/{{T}}/environ"),
      attempt(os.readlink, f"/proc/{{T}}/cwd"), b"{SECRET}" in open(f"/proc/{{T}}/environ", "rb").read())
child.kill()
"""


def test_control_an_exec_reaches_its_own_child(box: Box) -> None:
    assert answer(box.py(CONTROL)) == "ok ok ok True"


# --------------------------------------------------------------------------- the sandbox's streams

# The descriptors of pid 1 and pid 2 an exec could write through: bwrap's init and the holder
# hold no host file (bwrap's output goes to a pipe the broker reads); an exec cannot even open
# theirs. On Docker pid 1 is the container's shell, whose streams are /dev/null.
STREAMS = """
results = []
for path in sys.argv[1:]:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    except OSError as exc:
        results.append(name(exc.errno))
        continue
    mode = os.fstat(fd).st_mode
    results.append("regular-file" if stat.S_ISREG(mode) else "char-device" if stat.S_ISCHR(mode) else "other")
    os.close(fd)
print(" ".join(results))
"""


def test_exec_cannot_write_the_sandbox_processes_streams(box: Box) -> None:
    holder = target_pid(box, "holder", 0)
    paths = [f"/proc/1/fd/{n}" for n in (1, 2)] + [f"/proc/{holder}/fd/{n}" for n in (1, 2)]
    assert answer(box.py(STREAMS, *paths)) == "EACCES EACCES EACCES EACCES"


def test_there_is_no_host_bwrap_log(box: Box) -> None:
    """bwrap's output never goes to a host file a sandbox process keeps open: no bwrap.log."""
    directory = box.broker.sandbox_dir(box.sandbox_id)
    assert sorted(p.name for p in directory.iterdir() if p.name.endswith(".log")) == []
    # And no descriptor of the sandbox's own host processes names a file in the state dir.
    record = box.record()
    state = str(box.broker.state)
    for key in ("bwrap_pid", "init_pid", "holder_pid"):
        pid = record.get(key)
        if not isinstance(pid, int):
            continue
        fd_dir = Path(f"/proc/{pid}/fd")
        for fd in fd_dir.iterdir():
            try:
                target = fd.readlink()
            except OSError:
                continue
            assert not str(target).startswith(state), (key, fd.name, target)


# --------------------------------------------------------------------------- a provider launch


def _provider_run(sbx_root: SandboxBroker, base: Path) -> str:
    return create(sbx_root, make_run(base, sbx_root))


def _provider_launch(sbx_root: SandboxBroker, sandbox_id: str, script: str) -> Result:
    options = ("--consumer", CONSUMER, "--executable", "env")
    return run_env(sbx_root, "exec", sandbox_id, *options, "--", "env", "/bin/sh", "-c", script, extra_env=INHERITED)


def test_exec_cannot_read_a_provider_launchs_credentials(sbx_root: SandboxBroker, base: Path) -> None:
    """A provider launch (its environment holds the caller's provider values) runs in the
    background; a later plain exec cannot read its environment or memory."""
    sandbox_id = _provider_run(sbx_root, base)
    box = Box(broker=sbx_root, variant=variant_of(sbx_root), sandbox_id=sandbox_id)
    started = _provider_launch(
        sbx_root, sandbox_id, "nohup /usr/bin/sleep 600.913 </dev/null >/dev/null 2>&1 & echo $!"
    )
    assert started.status == 0, started.stderr
    pid = int(started.stdout.strip())
    token = INHERITED["MODEL_ACCESS_TOKEN"]
    code = f"""
leaked = False
try:
    leaked = b"{token}" in open("/proc/{pid}/environ", "rb").read()
    environ = "ok"
except OSError as exc:
    environ = name(exc.errno)
print(environ, try_open("/proc/{pid}/mem", os.O_RDONLY), syscall(101, 16, {pid}, 0, 0), leaked)
"""
    assert answer(box.py(code)) == "EACCES EACCES EPERM False"


def test_background_process_of_an_exec_is_in_the_sandbox_limits(sbx: SandboxBroker) -> None:
    """A process an exec leaves behind stays in the sandbox's cgroups (or under its rlimits): the
    host sees it in sandboxer/<id> (Docker: the container's group), and inside it is in the
    groups of the sandbox's init, as the holder is, or below them (an exec a service runs, or one
    with --timeout, gets a pids group of its own there, to find all it started)."""
    own = own_box(sbx)
    seconds = "900.771"
    started = own.sh(f"nohup /usr/bin/sleep {seconds} </dev/null >/dev/null 2>&1 & echo $!")
    assert started.status == 0, started.stderr
    inner = int(started.stdout.strip())
    holder = target_pid(own, "holder", 0)
    code = f"""
def groups(pid):
    lines = open(f"/proc/{{pid}}/cgroup").read().splitlines()
    return sorted(line.split(":", 1)[1] for line in lines if line.split(":")[1] in ("memory", "pids"))
def within(group, top):
    return group == top or group.startswith(top.rstrip("/") + "/")
init = groups(1)
below = [within(group, top) for pid in ({inner}, "self") for group, top in zip(groups(pid), init, strict=True)]
print(groups({holder}) == init, len(below) == 4 and all(below))
"""
    assert answer(own.py(code)) == "True True"
    pids = host_pids_with_argv(["/usr/bin/sleep", seconds])
    assert len(pids) == 1, pids
    cgroup = Path(f"/proc/{pids[0]}/cgroup").read_text()
    record = own.record()
    mechanism = record["limits"]["mechanism"]
    if own.backend == "docker":
        assert str(record["container_id"]) in cgroup, cgroup
    elif mechanism.startswith("cgroup"):
        assert f"sandboxer/{own.sandbox_id}" in cgroup, cgroup
    else:  # rlimits: the process carries the sandbox's address-space and process limits
        lines = Path(f"/proc/{pids[0]}/limits").read_text().splitlines()
        address_space = next(line for line in lines if line.startswith("Max address space"))
        soft, hard = address_space[len("Max address space") :].split()[:2]
        memory = record["limits"]["memory_mib"] * 1024 * 1024
        assert (int(soft), int(hard)) == (memory, memory), address_space
