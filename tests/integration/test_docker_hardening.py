"""What an attacker's probes of the Docker backend found, proved closed on a real daemon: a
sandbox is never a host account (the daemon remaps user namespaces), a request spool is a
bounded tmpfs, and every exec runs under the project's own syscall policy."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from sandboxer.backends.docker import execs
from sandboxer.backends.docker.render import verify
from sandboxer.core import seccomp
from sandboxer.core.record_reading import read_record
from tests.integration.conftest import SandboxBroker, backend_profile_text
from tests.integration.test_manifest_sandboxes import SPOOL, create, make_run, record_of


@pytest.fixture
def dk(docker_root: SandboxBroker) -> SandboxBroker:
    """A root broker with an approved Docker profile."""
    return docker_root


def _docker_info(template: str) -> str:
    return subprocess.run(
        ["docker", "info", "--format", template], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()


def _remapped_root() -> tuple[int, int]:
    """The host ids of a container's root, from the daemon itself: a remapping daemon keeps its
    storage in <root>/<uid>.<gid>."""
    uid, gid = os.path.basename(_docker_info("{{.DockerRootDir}}")).split(".")
    return int(uid), int(gid)


def _accounts(path: str) -> set[int]:
    return {int(line.split(":")[2]) for line in Path(path).read_text().splitlines() if line.count(":") >= 2}


def _engine_inspect(container: str) -> dict[str, Any]:
    out = subprocess.run(["docker", "inspect", container], capture_output=True, text=True, check=True, timeout=60)
    document: dict[str, Any] = json.loads(out.stdout)[0]
    return document


def _host_status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}


def _container_processes(pid: int) -> list[int]:
    """Every process in the pids cgroup of the container whose pid 1 is `pid` (cgroup v1)."""
    line = next(line for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines() if ":pids:" in line)
    procs = Path("/sys/fs/cgroup/pids" + line.split(":", 2)[2]) / "cgroup.procs"
    return [int(member) for member in procs.read_text().split()]


# --------------------------------------------------------------- 1. never a host account


def test_the_daemon_remaps_user_namespaces() -> None:
    assert "name=userns" in _docker_info("{{json .SecurityOptions}}"), "scripts/start-dockerd must remap"


def test_a_docker_sandbox_is_uid_1000_inside_and_no_account_on_the_host(dk: SandboxBroker) -> None:
    sandbox_id = dk.create()
    root_uid, root_gid = _remapped_root()
    host_uid, host_gid = root_uid + 1000, root_gid + 1000
    assert host_uid >= 65536
    assert host_uid not in _accounts("/etc/passwd")
    assert host_gid >= 65536
    assert host_gid not in _accounts("/etc/group")

    evidence = dk.run("inspect", sandbox_id, "--json")
    assert evidence.status == 0, evidence.stderr
    seen = evidence.json()
    assert seen["matches_plan"] is True, seen["differences"]
    assert seen["user"]["uid"] == 1000
    assert seen["user"]["gid"] == 1000
    assert (seen["docker"]["host_uid"], seen["docker"]["host_gid"]) == (host_uid, host_gid)

    # Observed on the host, not taken from the broker: the container's pid 1 and every process
    # an exec starts run as the remapped ids.
    record = record_of(dk, sandbox_id)
    pid = _engine_inspect(record["container_id"])["State"]["Pid"]
    status = _host_status(pid)
    assert status["Uid"].split() == [str(host_uid)] * 4
    assert status["Gid"].split() == [str(host_gid)] * 4
    inside = dk.sh(sandbox_id, "id -u; id -g; sleep 30 >/dev/null 2>&1 &")
    assert inside.status == 0, inside.stderr
    assert inside.stdout.splitlines() == ["1000", "1000"]
    members = _container_processes(pid)
    assert len(members) >= 2, members  # pid 1 and the exec's sleep, left running
    assert {_host_status(member)["Uid"] for member in members} == {f"{host_uid}\t{host_uid}\t{host_uid}\t{host_uid}"}

    # What the broker prepared on the host belongs to the remapped ids: the clone is the sandbox
    # user's, the generated /etc files the container root's; what the sandbox writes is its own.
    clone = dk.sandbox_dir(sandbox_id) / "workspace"
    assert (clone.stat().st_uid, clone.stat().st_gid) == (host_uid, host_gid)
    assert {(p.stat().st_uid, p.stat().st_gid) for p in clone.rglob("*") if not p.is_symlink()} == {
        (host_uid, host_gid)
    }
    passwd = dk.sandbox_dir(sandbox_id) / "etc" / "passwd"
    assert (passwd.stat().st_uid, passwd.stat().st_gid) == (root_uid, root_gid)
    wrote = dk.sh(sandbox_id, "echo made > /workspace/made-inside && stat -c '%u %g' /etc/passwd /workspace")
    assert wrote.status == 0, wrote.stderr
    assert wrote.stdout.splitlines() == ["0 0", "1000 1000"]
    made = clone / "made-inside"
    assert (made.stat().st_uid, made.stat().st_gid) == (host_uid, host_gid)
    # The host's /usr and the runtime stay readable (the host's root owns them: "others" bits).
    ran = dk.exec(sandbox_id, "python3", "-c", "import json, ssl, sqlite3; print('ok')")
    assert ran.status == 0, ran.stderr
    assert ran.stdout == "ok\n"


# --------------------------------------------------------------- 2. a bounded spool


def _mounted_at(point: str) -> list[str]:
    return [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if line.split()[4] == point]


def test_a_docker_spool_is_a_bounded_tmpfs_over_its_volume(dk: SandboxBroker, base: Path) -> None:
    run = make_run(base, dk)
    sandbox_id = create(dk, run)
    (spool,) = record_of(dk, sandbox_id)["manifest"]["spools"]
    volume = json.loads(
        subprocess.run(
            ["docker", "volume", "inspect", spool["source"]], capture_output=True, text=True, check=True
        ).stdout
    )[0]
    mountpoint = volume["Mountpoint"]
    host_view = _mounted_at(mountpoint)
    assert len(host_view) == 1, host_view
    assert " - tmpfs " in host_view[0]
    assert all(flag in host_view[0].split()[5].split(",") for flag in ("nosuid", "nodev", "noexec"))
    # The consumer (uid 1000 inside, the remapped uid on the host) owns requests/ only.
    requests = Path(mountpoint) / "requests"
    assert requests.stat().st_uid == _remapped_root()[0] + 1000
    assert (Path(mountpoint) / ".capability").stat().st_uid == 0

    docker_root = _docker_info("{{.DockerRootDir}}")
    before = os.statvfs(docker_root)
    filled = dk.sh(sandbox_id, f"head -c 80M /dev/zero > {SPOOL}/requests/big; echo $?; df -k {SPOOL} | tail -1")
    after = os.statvfs(docker_root)
    lines = filled.stdout.splitlines()
    assert lines[0] != "0", filled.stdout
    assert "No space left on device" in filled.stderr
    assert int(lines[1].split()[1]) == 64 * 1024  # the tmpfs's size, in KiB
    big = requests / "big"
    assert big.stat().st_size <= 64 * 1024 * 1024
    assert big.stat().st_dev == os.stat(mountpoint).st_dev != os.stat(docker_root).st_dev
    grown = (before.f_bavail - after.f_bavail) * after.f_frsize
    assert grown < 48 * 1024 * 1024, f"the Engine's filesystem grew by {grown} bytes"

    evidence = dk.run("inspect", sandbox_id, "--json")
    assert evidence.status == 0, evidence.stderr
    assert evidence.json()["matches_plan"] is True, evidence.json()["differences"]
    torn = dk.run("teardown", sandbox_id, "--json")
    assert torn.status == 0, torn.stderr
    assert _mounted_at(mountpoint) == []
    gone = subprocess.run(["docker", "volume", "inspect", spool["source"]], capture_output=True, check=False)
    assert gone.returncode != 0


# --------------------------------------------------------------- 3. the project's syscall policy

# Each call is one the policy refuses, made harmlessly: socket() alone (never a connect, bind or
# send on a vsock), a keyring look-up that creates nothing, a ptrace of the probe's own child,
# TIOCSTI on the probe's own pty (its controlling terminal, so only the filter can refuse it) with
# the request's high bits clear and set, and TIOCGWINSZ as the control that the same descriptor
# and the same high bits reach the kernel. Results are errno values (0: the call succeeded).
PROBE = r"""
import ctypes, json, os, socket, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def call(number, *args):
    ctypes.set_errno(0)
    result = libc.syscall(ctypes.c_long(number), *(ctypes.c_long(a) for a in args))
    return 0 if result >= 0 else ctypes.get_errno()

out = {}
try:
    socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM).close()
    out["vsock"] = 0
except OSError as exc:
    out["vsock"] = exc.errno
out["keyctl"] = call(250, 0, -3, 0)
child = os.fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
out["ptrace"] = call(101, 0x4206, child, 0, 0)
os.kill(child, 9)
os.waitpid(child, 0)
r, w = os.pipe()
pid, master = os.forkpty()
if pid == 0:
    buf = ctypes.create_string_buffer(b"x", 16)
    requests = (0x5412, 0x5412 | 1 << 32, 0x5413, 0x5413 | 1 << 32)
    os.write(w, json.dumps([call(16, 0, request, ctypes.addressof(buf)) for request in requests]).encode())
    os._exit(0)
os.close(w)
out["tiocsti"], out["tiocsti_high"], out["tiocgwinsz"], out["tiocgwinsz_high"] = json.loads(os.read(r, 4096))
os.waitpid(pid, 0)
os.close(master)
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
out["seccomp"] = int(status["Seccomp"])
print(json.dumps(out))
"""


def _probe(broker: SandboxBroker, sandbox_id: str) -> dict[str, int]:
    ran = broker.exec(sandbox_id, "python3", "-c", PROBE)
    assert ran.status == 0, ran.stderr
    result: dict[str, int] = json.loads(ran.stdout)
    return result


def _expected(*, allow_ptrace: bool) -> dict[str, int]:
    """What the policy's own definition says each probe call gets (0: allowed)."""

    def errno_of(number: int, *args: int) -> int:
        return seccomp.refusal(number, [*args, 0, 0, 0, 0, 0, 0][:6], allow_ptrace=allow_ptrace) or 0

    return {
        "vsock": errno_of(41, 40, 1, 0),
        "keyctl": errno_of(250, 0, 0xFFFF_FFFF_FFFF_FFFD, 0),  # -3: the session keyring
        "ptrace": errno_of(101, 0x4206),
        "tiocsti": errno_of(16, 0, 0x5412),
        "tiocsti_high": errno_of(16, 0, 0x5412 | 1 << 32),
        "tiocgwinsz": 0,
        "tiocgwinsz_high": 0,
        "seccomp": 2,
    }


def test_a_docker_exec_runs_under_the_projects_syscall_policy(dk: SandboxBroker) -> None:

    expected = _expected(allow_ptrace=False)
    # The policy refuses each of these (the test would pass on nothing that allows them).
    assert expected["vsock"] == errno.EAFNOSUPPORT
    assert expected["keyctl"] == expected["ptrace"] == expected["tiocsti"] == expected["tiocsti_high"] == errno.EPERM
    sandbox_id = dk.create()
    assert _probe(dk, sandbox_id) == expected


def test_allow_ptrace_lifts_only_the_ptrace_rules_on_docker(dk: SandboxBroker) -> None:
    name = "docker-ptrace"
    dk.write_profile(name, backend_profile_text(dk, name, dk.repo, "security:\n  allow_ptrace: true\n"))
    assert dk.run("ext", "approve", name).status == 0
    sandbox_id = dk.create(name)
    expected = _expected(allow_ptrace=True)
    assert expected["ptrace"] == 0
    assert _probe(dk, sandbox_id) == expected
    evidence = dk.run("inspect", sandbox_id, "--json")
    assert evidence.status == 0, evidence.stderr
    assert evidence.json()["matches_plan"] is True, evidence.json()["differences"]
    assert evidence.json()["seccomp"]["allow_ptrace"] is True


def test_the_engine_holds_exactly_the_projects_profile_and_inspect_reports_it(dk: SandboxBroker) -> None:

    sandbox_id = dk.create()
    record = record_of(dk, sandbox_id)
    attrs = _engine_inspect(record["container_id"])
    options = attrs["HostConfig"]["SecurityOpt"]
    assert len(options) == 2
    assert options[0].replace("=", ":") == "no-new-privileges:true"
    assert options[1].startswith("seccomp=")
    assert json.loads(options[1][len("seccomp=") :]) == seccomp.docker_profile(allow_ptrace=False)
    assert _host_status(attrs["State"]["Pid"])["Seccomp"] == "2"

    evidence = dk.run("inspect", sandbox_id, "--json")
    assert evidence.status == 0, evidence.stderr
    seen = evidence.json()
    assert seen["matches_plan"] is True, seen["differences"]
    assert seen["seccomp"] == {"mode": 2, "sha256": seccomp.digest(allow_ptrace=False), "allow_ptrace": False}

    # Any other profile — Docker's default, one rule fewer, ptrace allowed — is a difference.
    plan = read_record(record).plan_for(str(dk.sandbox_dir(sandbox_id) / "workspace"))
    etc_dir = str(dk.sandbox_dir(sandbox_id) / "etc")
    assert verify(attrs, plan, etc_dir=etc_dir) == []
    fewer = seccomp.docker_profile(allow_ptrace=False)
    fewer["syscalls"] = fewer["syscalls"][1:]
    for other in (
        ["no-new-privileges:true"],
        ["no-new-privileges:true", "seccomp=unconfined"],
        ["no-new-privileges:true", "seccomp=" + json.dumps(fewer)],
        ["no-new-privileges:true", "seccomp=" + seccomp.docker_profile_json(allow_ptrace=True)],
        [*options, "apparmor=unconfined"],
    ):
        altered = {**attrs, "HostConfig": {**attrs["HostConfig"], "SecurityOpt": other}}
        assert any("security options" in problem for problem in verify(altered, plan, etc_dir=etc_dir)), other


# --------------------------------------------------------------- the exec's way into its domain

# What PERL5OPT=-d makes Perl run before its script (and the debugger hook it then calls).
PERL_HOOK = 'BEGIN { print STDERR "perl5db ran\\n" } sub DB::DB {}'


def test_no_variable_of_the_container_reaches_the_perl_that_makes_the_domain(base_image: str) -> None:
    """A plain Docker exec enters its Landlock domain with Perl. PERL5OPT and PERL5DB in the
    container's environment (a plan's, say through a project-env lease) would run code in it
    before the domain exists — outside it, able to ptrace every other exec. They never reach that
    Perl, yet the command still has them; and the command is in a domain of its own."""

    started = subprocess.run(
        [
            *("docker", "run", "-d", "--network", "none", "--user", "1000:1000", "--volume", "/usr:/usr:ro"),
            *("--security-opt", "no-new-privileges", "--env", "PERL5OPT=-d", "--env", f"PERL5DB={PERL_HOOK}"),
            *(base_image, "/usr/bin/sleep", "300"),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    container = started.stdout.strip()
    try:
        env = {"PATH": "/usr/bin:/bin", "PERL5OPT": "-d", "PERL5DB": PERL_HOOK}
        script = 'echo "$PERL5OPT"; cat /proc/1/environ >/dev/null 2>&1 && echo pid1-readable || echo pid1-refused'
        exec_id = execs.create_exec(container, ["sh", "-c", script], env=env, user="1000:1000", cwd="/")
        read_out, write_out = os.pipe()
        read_err, write_err = os.pipe()
        with open(os.devnull, "rb") as null:
            assert execs.run(exec_id, stdin=null.fileno(), output=execs.to_fds(write_out, write_err), timeout=60)
        os.close(write_out)
        os.close(write_err)
        with os.fdopen(read_out) as out, os.fdopen(read_err) as err:
            stdout, stderr = out.read(), err.read()
        assert "perl5db ran" not in stdout + stderr, stderr
        assert stdout.splitlines() == ["-d", "pid1-refused"], (stdout, stderr)
        # Control: the same container without the domain reads pid 1's environment, so the
        # refusal above is the domain's, and the hook is what Perl runs when it is let through.
        bare = subprocess.run(
            ["docker", "exec", "-u", "1000:1000", container, "sh", "-c", "cat /proc/1/environ >/dev/null && perl -e 1"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert bare.returncode == 0, bare.stderr
        assert "perl5db ran" in bare.stderr
    finally:
        subprocess.run(["docker", "rm", "-f", container], capture_output=True, check=False, timeout=120)
