"""Escape probes: resource abuse. A sandbox exhausts what it was given — processes, memory (also
from a process an earlier exec left behind), /dev/shm, its private state, its workspace, its file
descriptors — and stops at its own limits, which it cannot leave, while the host and the next
exec are unaffected. Every probe here changes its sandbox, so each takes one of its own.

Limits are enforced by cgroups for a root bwrap broker (bwrap, its init and the holder start in
them; every exec joins them), by the Engine on Docker, and by rlimits for an unprivileged broker
(RLIMIT_AS per process, RLIMIT_NPROC per uid). The workspace is a sized filesystem of its own for
a root broker on both backends.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.integration.conftest import SandboxBroker
from tests.integration.test_escape_filesystem import teardown_clean
from tests.integration.test_escape_support import (
    Box,
    answer,
    host_pids_with_argv,
    limited_profile,
    own_box,
)


def limited_box(sbx: SandboxBroker, name: str, limits: str) -> Box:
    return own_box(sbx, limited_profile(sbx, name, limits))


FORK_FLOOD = """
import time
children = []
refusal = "none"
while len(children) < int(sys.argv[1]):
    try:
        pid = os.fork()
    except OSError as exc:
        refusal = name(exc.errno)
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    children.append(pid)
for pid in children:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
print(refusal, len(children) < int(sys.argv[2]))
"""


def test_process_flood_stops_at_the_pids_limit(sbx: SandboxBroker) -> None:
    own = limited_box(sbx, "escape-pids", "  pids: 32\n")
    assert answer(own.py(FORK_FLOOD, "500", "32")) == "EAGAIN True"
    after = own.sh("echo alive")
    assert (after.status, after.stdout) == (0, "alive\n")
    teardown_clean(sbx, own.sandbox_id)


GRAB = """
size = int(sys.argv[1]) * 2**20
try:
    block = bytearray(size)
    for offset in range(0, size, 4096):
        block[offset] = 1
except MemoryError:
    print("MemoryError")
else:
    print("allocated")
"""


def memory_refusal(own: Box) -> tuple[int, str]:
    """How a memory grab beyond the limit ends: killed by the OOM killer where a cgroup (or the
    Engine) enforces memory, a MemoryError where RLIMIT_AS does."""
    mechanism = own.record()["limits"]["mechanism"]
    return (0, "MemoryError\n") if mechanism == "rlimit" else (137, "")


def test_memory_grab_stops_at_the_memory_limit(sbx: SandboxBroker) -> None:
    own = limited_box(sbx, "escape-memory", "  memory_mib: 96\n")
    grabbed = own.py(GRAB, "256")
    assert (grabbed.status, grabbed.stdout) == memory_refusal(own), grabbed
    fits = own.py(GRAB, "16")
    assert (fits.status, fits.stdout) == (0, "allocated\n")


def test_background_process_is_held_to_the_memory_limit(sbx: SandboxBroker) -> None:
    """A process left running by one exec (as an injected holder would be) allocates past the
    limit: it is stopped like an exec's own command; the sandbox's own processes are in the same
    limits on the host."""
    own = limited_box(sbx, "escape-background", "  memory_mib: 96\n")
    started = own.sh(
        'nohup sh -c \'/usr/bin/python3 -c "$1" 256 > "$TMPDIR/hog.out"; echo $? > "$TMPDIR/hog.status"\' '
        'sh "$1" </dev/null >/dev/null 2>&1 & echo started',
        "import sys\n" + GRAB,
    )
    assert started.stdout == "started\n", started
    finished = own.sh(
        'for i in $(seq 300); do test -e "$TMPDIR/hog.status" && break; sleep 0.1; done; '
        'cat "$TMPDIR/hog.status" "$TMPDIR/hog.out"'
    )
    status, printed = memory_refusal(own)
    assert finished.stdout == f"{status}\n{printed}", finished
    record = own.record()
    if own.backend == "docker":
        return  # the Engine owns the container's cgroup; its pid 1 is in it by construction
    for key in ("bwrap_pid", "init_pid", "holder_pid"):
        pid = record[key]
        if record["limits"]["mechanism"].startswith("cgroup"):
            assert f"sandboxer/{own.sandbox_id}" in Path(f"/proc/{pid}/cgroup").read_text(), key
        else:
            limits = Path(f"/proc/{pid}/limits").read_text().splitlines()
            line = next(line for line in limits if line.startswith("Max address space"))
            assert int(line.split()[3]) == 96 * 2**20, (key, line)


FILL = """
path = os.path.expandvars(sys.argv[1])
chunk = b"x" * 2**20
written = 0
refusal = "none"
with open(path, "wb", buffering=0) as out:
    while written < int(sys.argv[2]):
        try:
            written += out.write(chunk) // 2**20
        except OSError as exc:
            refusal = name(exc.errno)
            break
print(refusal, written <= int(sys.argv[3]))
"""


def test_dev_shm_stops_at_64_mib(sbx: SandboxBroker) -> None:
    own = own_box(sbx)
    assert answer(own.py(FILL, "/dev/shm/fill", "200", "64")) == "ENOSPC True"


def test_private_state_stops_at_256_mib_in_all(sbx: SandboxBroker) -> None:
    """The five state directories share one 256 MiB tmpfs: filling HOME leaves only the rest."""
    own = own_box(sbx)
    assert answer(own.py(FILL, "$HOME/fill", "200", "200")) == "none True"
    assert answer(own.py(FILL, "$TMPDIR/fill", "200", "56")) == "ENOSPC True"


def test_tmp_and_state_are_private_tmpfs_of_the_profiles_sizes(sbx: SandboxBroker) -> None:
    """/tmp and /var/tmp: writable, 1777, each a tmpfs of limits.tmp_mib; the state tmpfs of
    limits.state_mib; inspect says both, and a second sandbox sees nothing of the first's."""
    own = limited_box(sbx, "escape-tmpfs", "  state_mib: 24\n  tmp_mib: 16\n")
    inspected = sbx.run("inspect", own.sandbox_id, "--json")
    assert inspected.status == 0, inspected.stderr
    evidence = json.loads(inspected.stdout)
    assert (evidence["limits"]["state_mib"], evidence["limits"]["tmp_mib"], evidence["matches_plan"]) == (24, 16, True)
    assert answer(own.sh("stat -c '%a %F' /tmp /var/tmp")) == "1777 directory\n1777 directory"
    assert answer(own.py(FILL, "/tmp/fill", "64", "16")) == "ENOSPC True"
    if own.backend == "docker" or not own.broker.as_user:  # an unprivileged broker cannot look inside
        failed = own.sh("printf 'more data' > /tmp/more")
        assert failed.status != 0
        said = [line for line in failed.stderr.splitlines() if line.startswith("sandboxer:")]
        assert said == ["sandboxer: exec: /tmp is full (limits.tmp_mib: 16 MiB)"], failed.stderr
    assert answer(own.py(FILL, "/var/tmp/fill", "64", "16")) == "ENOSPC True"
    assert answer(own.py(FILL, "$HOME/fill", "64", "24")) == "ENOSPC True"
    other = own_box(sbx)
    assert answer(other.sh("ls -A /tmp /var/tmp; echo end")) == "/tmp:\n\n/var/tmp:\nend"


def test_workspace_stops_at_its_size(sbx: SandboxBroker) -> None:
    own = limited_box(sbx, "escape-workspace", "  workspace_mib: 32\n")
    inspected = sbx.run("inspect", own.sandbox_id, "--json")
    assert inspected.status == 0, inspected.stderr
    limits = json.loads(inspected.stdout)["limits"]
    assert (limits["workspace_mib"], limits["workspace_enforced"]) == (32, True)
    assert answer(own.py(FILL, "/workspace/fill", "128", "32")) == "ENOSPC True"


DESCRIPTORS = """
import resource
soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
opened = []
refusal = "none"
while len(opened) < 1_000_000:
    try:
        opened.append(os.open("/dev/null", os.O_RDONLY))
    except OSError as exc:
        refusal = name(exc.errno)
        break
print(refusal, len(opened) < soft)
"""


def test_descriptor_flood_stops_at_the_nofile_limit(sbx: SandboxBroker) -> None:
    own = own_box(sbx)
    assert answer(own.py(DESCRIPTORS)) == "EMFILE True"
    after = own.sh("echo alive")
    assert (after.status, after.stdout) == (0, "alive\n")


def test_a_daemonized_process_dies_at_teardown(sbx: SandboxBroker) -> None:
    own = own_box(sbx)
    seconds = "777.123"
    started = own.sh(f"setsid sh -c 'nohup /usr/bin/sleep {seconds} </dev/null >/dev/null 2>&1 &' & echo started")
    assert started.stdout == "started\n", started
    found = []
    for _ in range(50):
        found = host_pids_with_argv(["/usr/bin/sleep", seconds])
        if found:
            break
        time.sleep(0.1)
    assert len(found) == 1, found
    teardown_clean(sbx, own.sandbox_id)
    assert host_pids_with_argv(["/usr/bin/sleep", seconds]) == []
