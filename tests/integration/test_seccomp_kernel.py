"""The compiled syscall policy in the real kernel: each probe runs in a forked child that sets
no_new_privs, installs the program with `seccomp_install.install` and reports the errno back.

Every probe's arguments are chosen so that, without the policy, the kernel answers differently
(EINVAL, EBADF, ENOENT, EFAULT or success) and does nothing lasting even as root:
`test_probes_answer_otherwise_without_the_policy` checks that on this kernel, so each refusal
asserted below is the filter's. No probe connects, binds or sends on any socket.
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from sandboxer.core import seccomp, seccomp_rules
from sandboxer.host.seccomp_install import install

pytestmark = pytest.mark.integration

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
U64 = (1 << 64) - 1
PR_SET_NO_NEW_PRIVS = 38
MISSING = ctypes.create_string_buffer(b"/nonexistent-sandboxer-seccomp-probe")
NO_SUCH_FS = ctypes.create_string_buffer(b"nonexistent-sandboxer-fs")
TMPFS = ctypes.create_string_buffer(b"tmpfs")
ONE_BYTE = ctypes.create_string_buffer(b"x")


def addr(buffer: ctypes.Array[ctypes.c_char]) -> int:
    """The address of a buffer made before the fork (the child has the same memory)."""
    return ctypes.addressof(buffer)


def syscall(nr: int, *args: int) -> int:
    """Make a raw x86_64 syscall: 0 if it succeeded, else its errno."""
    ctypes.set_errno(0)
    result = _libc.syscall(ctypes.c_long(nr), *(ctypes.c_ulong(arg & U64) for arg in args))
    return 0 if result >= 0 else ctypes.get_errno()


def in_child(probe: Callable[[], object], *, program: bytes | None) -> object:
    """Run `probe` in a forked child (its own session, so no controlling terminal), under `program`."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe and never returns
        try:
            os.close(read_end)
            os.setsid()
            if program is not None:
                if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
                    raise OSError(ctypes.get_errno(), "prctl")
                install(program)
            report: object = {"result": probe()}
        except BaseException as exc:  # everything goes back to the test
            report = {"raised": repr(exc)}
        os.write(write_end, json.dumps(report).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as stream:
        ready, _, _ = select.select([stream], [], [], 60)
        if not ready:
            os.kill(pid, signal.SIGKILL)  # our own child, stuck: the test fails below
        data = stream.read() if ready else b'{"stuck": true}'
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"probe child ended with status {status:#x}"
    report = json.loads(data)
    assert "result" in report, report
    return report["result"]


def under_policy(probe: Callable[[], object], *, allow_ptrace: bool = False) -> object:
    """Run `probe` under the policy compiled for this profile setting."""
    return in_child(probe, program=seccomp.bpf(allow_ptrace=allow_ptrace))


@dataclass(frozen=True)
class Probe:
    """One call the policy refuses: the rule's syscall, how to make it, and the errno expected."""

    name: str
    syscall: str
    call: Callable[[], int]
    refused: int


def _ioctl(request: int) -> Callable[[], int]:
    def call() -> int:
        fd = os.open("/dev/null", os.O_RDWR)  # never a terminal: nothing to inject into either way
        return syscall(16, fd, request, addr(ONE_BYTE))

    return call


def _call(nr: int, *args: int) -> Callable[[], int]:
    return lambda: syscall(nr, *args)


NOTHING = 0
SELF = os.getpid  # evaluated in the child
CLONE_THREAD = 0x0001_0000  # without CLONE_SIGHAND the kernel answers EINVAL: no process is made

EPERM, ENOSYS = errno.EPERM, errno.ENOSYS
PROBES = [
    Probe("keyctl", "keyctl", _call(250, 0, -3, 0), EPERM),  # KEYCTL_GET_KEYRING_ID of the session keyring
    Probe("add_key", "add_key", _call(248, 0, 0, 0, 0, 0), EPERM),
    Probe("request_key", "request_key", _call(249, 0, 0, 0, 0), EPERM),
    Probe("unshare-user", "unshare", _call(272, 0x1000_0000), EPERM),  # CLONE_NEWUSER
    Probe("setns", "setns", _call(308, -1, 0), EPERM),
    *(
        Probe(f"clone-{name}", "clone", _call(56, flag | CLONE_THREAD, 0, 0, 0, 0), EPERM)
        for name, flag in seccomp_rules.CLONE_NEW_FLAGS
    ),
    Probe("clone-newns-high-bits", "clone", _call(56, 1 << 40 | 0x0002_0000 | CLONE_THREAD, 0, 0, 0, 0), EPERM),
    Probe("clone3", "clone3", _call(435, 0, 0), ENOSYS),
    Probe("mount", "mount", _call(165, addr(MISSING), addr(MISSING), addr(TMPFS), 0, 0), EPERM),
    Probe("umount2", "umount2", _call(166, addr(MISSING), 0), EPERM),
    Probe("pivot_root", "pivot_root", _call(155, addr(MISSING), addr(MISSING)), EPERM),
    Probe("chroot", "chroot", _call(161, addr(MISSING)), EPERM),
    Probe("open_tree", "open_tree", _call(428, -1, addr(MISSING), 0), ENOSYS),
    Probe("move_mount", "move_mount", _call(429, -1, addr(MISSING), -1, addr(MISSING), 0), ENOSYS),
    Probe("fsopen", "fsopen", _call(430, addr(NO_SUCH_FS), 0), ENOSYS),
    Probe("fsconfig", "fsconfig", _call(431, -1, 0, 0, 0, 0), ENOSYS),
    Probe("fsmount", "fsmount", _call(432, -1, 0, 0), ENOSYS),
    Probe("fspick", "fspick", _call(433, -1, addr(MISSING), 0), ENOSYS),
    Probe("mount_setattr", "mount_setattr", _call(442, -1, addr(MISSING), 0, 0, 0), ENOSYS),
    Probe("open_tree_attr", "open_tree_attr", _call(467, -1, addr(MISSING), 0, 0, 0), ENOSYS),
    Probe("ptrace-traceme", "ptrace", _call(101, 0, 0, 0, 0), EPERM),
    Probe("process_vm_readv", "process_vm_readv", lambda: syscall(310, SELF(), 0, 0, 0, 0, 0), EPERM),
    Probe("process_vm_writev", "process_vm_writev", lambda: syscall(311, SELF(), 0, 0, 0, 0, 0), EPERM),
    Probe("kcmp", "kcmp", lambda: syscall(312, SELF(), SELF(), 0xFF, 0, 0), EPERM),
    Probe("pidfd_getfd", "pidfd_getfd", _call(438, -1, 0, 0), EPERM),
    Probe("process_madvise", "process_madvise", _call(440, -1, 0, 0, 0, 0), EPERM),
    Probe("perf_event_open", "perf_event_open", _call(298, 0, 0, -1, -1, 0), EPERM),
    *(
        Probe(f"personality-{value:#x}", "personality", _call(135, value), EPERM)
        for value in (0x0004_0000, 0x0004_0001, 0x0040_0000, 0x0010_0000, 0x1, 0x0004_0008, 0xFFFF_FFFE, 0xFFFD_FFFF)
    ),
    Probe("userfaultfd", "userfaultfd", _call(323, 0xFFFF_FFFF), EPERM),
    Probe("io_uring_setup", "io_uring_setup", _call(425, 0, 0), EPERM),
    Probe("io_uring_enter", "io_uring_enter", _call(426, -1, 0, 0, 0, 0, 0), EPERM),
    Probe("io_uring_register", "io_uring_register", _call(427, -1, 0, 0, 0), EPERM),
    Probe("init_module", "init_module", _call(175, 0, 0, 0), EPERM),
    Probe("finit_module", "finit_module", _call(313, -1, 0, 0), EPERM),
    Probe("delete_module", "delete_module", _call(176, 0, 0), EPERM),
    Probe("create_module", "create_module", _call(174, 0, 0), EPERM),
    Probe("get_kernel_syms", "get_kernel_syms", _call(177, 0), EPERM),
    Probe("query_module", "query_module", _call(178, 0, 0, 0, 0, 0), EPERM),
    Probe("kexec_load", "kexec_load", _call(246, 0, 1000, 0, 0x8000), EPERM),  # too many segments, unknown flag
    Probe("kexec_file_load", "kexec_file_load", _call(320, -1, -1, 0, 0, 0xFFFF), EPERM),
    Probe("bpf", "bpf", _call(321, 0xFFFF, 0, 0), EPERM),
    Probe("syslog", "syslog", _call(103, 10, 0, 0), EPERM),  # SYSLOG_ACTION_SIZE_BUFFER: a read
    Probe("acct", "acct", _call(163, addr(MISSING)), EPERM),
    Probe("reboot", "reboot", _call(169, 0, 0, 0, 0), EPERM),  # no magic numbers: EINVAL unfiltered
    Probe("swapon", "swapon", _call(167, addr(MISSING), 0), EPERM),
    Probe("swapoff", "swapoff", _call(168, addr(MISSING)), EPERM),
    Probe("settimeofday", "settimeofday", _call(164, 1, 0), EPERM),  # a bad pointer: EFAULT unfiltered
    Probe("clock_settime", "clock_settime", _call(227, 0x7FFF_FFFF, 1), EPERM),  # no such clock
    Probe("sethostname", "sethostname", _call(170, 0, 1000), EPERM),
    Probe("setdomainname", "setdomainname", _call(171, 0, 1000), EPERM),
    Probe("iopl", "iopl", _call(172, 4), EPERM),
    Probe("ioperm", "ioperm", _call(173, 0x10000, 1, 1), EPERM),
    Probe("quotactl", "quotactl", _call(179, 0, 0, 0, 0), EPERM),
    Probe("quotactl_fd", "quotactl_fd", _call(443, -1, 0, 0, 0), EPERM),
    Probe("open_by_handle_at", "open_by_handle_at", _call(304, -1, 0, 0), EPERM),
    Probe("name_to_handle_at", "name_to_handle_at", _call(303, -1, addr(MISSING), 0, 0, 0), EPERM),
    Probe("fanotify_init", "fanotify_init", _call(300, 0xFFFF_FFFF, 0), EPERM),
    Probe("vhangup", "vhangup", _call(153), EPERM),  # the child has no controlling terminal to hang up
    Probe("mbind", "mbind", _call(237, 0, 0, 0, 0, 0, 0), EPERM),
    Probe("set_mempolicy", "set_mempolicy", _call(238, 0, 0, 0), EPERM),
    Probe("get_mempolicy", "get_mempolicy", _call(239, 0, 0, 0, 0, 0), EPERM),
    Probe("migrate_pages", "migrate_pages", _call(256, 0, 0, 0, 0), EPERM),
    Probe("move_pages", "move_pages", _call(279, 0, 0, 0, 0, 0, 0), EPERM),
    Probe("set_mempolicy_home_node", "set_mempolicy_home_node", _call(450, 0, 0, 0, 0), EPERM),
    Probe("lookup_dcookie", "lookup_dcookie", _call(212, 0, 0, 0), EPERM),
    Probe("uselib", "uselib", _call(134, addr(MISSING)), EPERM),
    Probe("ustat", "ustat", _call(136, 0, 0), EPERM),
    Probe("sysfs", "sysfs", _call(139, 999), EPERM),
    Probe("_sysctl", "_sysctl", _call(156, 0), EPERM),
    Probe("lsm_get_self_attr", "lsm_get_self_attr", _call(459, 0, 0, 0, 0), ENOSYS),
    Probe("lsm_set_self_attr", "lsm_set_self_attr", _call(460, 0, 0, 0, 0), ENOSYS),
    Probe("lsm_list_modules", "lsm_list_modules", _call(461, 0, 0, 0), ENOSYS),
    Probe("file_getattr", "file_getattr", _call(468, -1, 0, 0, 0, 0), ENOSYS),
    Probe("file_setattr", "file_setattr", _call(469, -1, 0, 0, 0, 0), ENOSYS),
    Probe("ioctl-TIOCSTI", "ioctl", _ioctl(seccomp_rules.TIOCSTI), EPERM),
    Probe("ioctl-TIOCSTI-high-bits", "ioctl", _ioctl(1 << 32 | seccomp_rules.TIOCSTI), EPERM),
    Probe("ioctl-TIOCLINUX", "ioctl", _ioctl(seccomp_rules.TIOCLINUX), EPERM),
    Probe("ioctl-TIOCLINUX-high-bits", "ioctl", _ioctl(0xFFFF_FFFF << 32 | seccomp_rules.TIOCLINUX), EPERM),
]
SOCKET_PROBES = [  # no baseline run: an unfiltered socket() would load protocol modules on the host
    Probe("socket-AF_VSOCK", "socket", _call(41, 40, socket.SOCK_STREAM, 0), errno.EAFNOSUPPORT),
    Probe("socket-AF_PACKET", "socket", _call(41, 17, socket.SOCK_RAW, 0), errno.EAFNOSUPPORT),
    Probe("socket-AF_BLUETOOTH", "socket", _call(41, 31, socket.SOCK_STREAM, 0), errno.EAFNOSUPPORT),
    Probe("socket-AF_ALG", "socket", _call(41, 38, socket.SOCK_SEQPACKET, 0), errno.EAFNOSUPPORT),
    Probe("socket-AF_INET-high-bits", "socket", _call(41, 1 << 32 | 2, socket.SOCK_STREAM, 0), errno.EAFNOSUPPORT),
    Probe("socket-NETLINK_AUDIT", "socket", _call(41, 16, socket.SOCK_RAW, 9), errno.EPROTONOSUPPORT),
    Probe("socket-NETLINK_KOBJECT_UEVENT", "socket", _call(41, 16, socket.SOCK_RAW, 15), errno.EPROTONOSUPPORT),
    Probe("socketpair-AF_INET", "socketpair", _call(53, 2, socket.SOCK_STREAM, 0, 0), errno.EAFNOSUPPORT),
]
# Never implemented on x86_64: the kernel answers ENOSYS with or without the policy, so a kernel
# probe could not fail. tests/unit/test_seccomp_policy.py runs their rules in the BPF interpreter.
UNPROBED = {"nfsservctl", "getpmsg", "putpmsg", "afs_syscall", "tuxcall", "security", "vserver"}
PTRACE_FAMILY = {"ptrace", "process_vm_readv", "process_vm_writev"}


def _ids(probes: list[Probe]) -> list[str]:
    return [probe.name for probe in probes]


def test_every_rule_has_a_kernel_probe() -> None:
    probed = {probe.syscall for probe in PROBES + SOCKET_PROBES}
    assert probed | UNPROBED == {rule.syscall for rule in seccomp_rules.RULES}


@pytest.mark.parametrize("probe", PROBES + SOCKET_PROBES, ids=_ids(PROBES + SOCKET_PROBES))
def test_policy_refuses(probe: Probe) -> None:
    assert under_policy(probe.call) == probe.refused


@pytest.mark.parametrize(
    "probe",
    [probe for probe in PROBES + SOCKET_PROBES if probe.syscall not in PTRACE_FAMILY],
    ids=_ids([probe for probe in PROBES + SOCKET_PROBES if probe.syscall not in PTRACE_FAMILY]),
)
def test_allow_ptrace_keeps_every_other_refusal(probe: Probe) -> None:
    assert under_policy(probe.call, allow_ptrace=True) == probe.refused


def test_allow_ptrace_lets_a_debugger_work() -> None:
    def debugger_calls() -> list[int]:
        iov = (ctypes.c_char * 8)()
        local = (ctypes.c_void_p * 2)(ctypes.addressof(iov), 8)
        remote = (ctypes.c_void_p * 2)(ctypes.addressof(ONE_BYTE), 1)
        return [
            syscall(310, os.getpid(), ctypes.addressof(local), 1, ctypes.addressof(remote), 1, 0),
            syscall(311, os.getpid(), ctypes.addressof(remote), 1, ctypes.addressof(local), 1, 0),
            syscall(101, 0, 0, 0, 0),  # PTRACE_TRACEME: the test process becomes this child's tracer
        ]

    assert under_policy(debugger_calls, allow_ptrace=True) == [0, 0, 0]
    assert under_policy(debugger_calls, allow_ptrace=False) == [EPERM, EPERM, EPERM]


@pytest.mark.skipif(os.geteuid() != 0, reason="the unfiltered answers assumed here are root's (CI runs as root)")
@pytest.mark.parametrize("probe", PROBES, ids=_ids(PROBES))
def test_probes_answer_otherwise_without_the_policy(probe: Probe) -> None:
    assert in_child(probe.call, program=None) != probe.refused


def test_allowed_personalities_still_work() -> None:
    for value in (*seccomp_rules.PERSONALITY_ALLOWED, 1 << 32):  # the kernel reads 1<<32 as 0
        assert under_policy(_call(135, value)) == 0, hex(value)


def test_allowed_sockets_still_open() -> None:
    families = [
        (1, socket.SOCK_STREAM, 0),
        (2, socket.SOCK_STREAM, 0),
        (2, socket.SOCK_DGRAM, 0),
        (16, socket.SOCK_RAW, 0),
    ]
    if Path("/proc/net/if_inet6").exists():
        families.append((10, socket.SOCK_STREAM, 0))
    for family, kind, protocol in families:
        assert under_policy(_call(41, family, kind, protocol)) == 0, (family, kind, protocol)
    pair = (ctypes.c_int * 2)()
    assert under_policy(lambda: syscall(53, 1, socket.SOCK_STREAM, 0, ctypes.addressof(pair))) == 0


def test_ordinary_work_goes_on() -> None:
    def ordinary() -> list[object]:
        child = os.fork()
        if child == 0:
            os._exit(7)
        _, status = os.waitpid(child, 0)
        started = []
        thread = threading.Thread(target=lambda: started.append(True))  # glibc tries clone3, falls back on ENOSYS
        thread.start()
        thread.join()
        ran = subprocess.run(["/bin/sh", "-c", "exit 3"], check=False).returncode
        return [syscall(39), os.waitstatus_to_exitcode(status), started, ran, syscall(16, 0, 0x5413, 0) != EPERM]

    assert under_policy(ordinary) == [0, 7, [True], 3, True]


def test_process_status_shows_a_filter() -> None:
    def seccomp_mode() -> str:
        return next(
            line.split(":")[1].strip()
            for line in Path("/proc/self/status").read_text().splitlines()
            if line.startswith("Seccomp:")
        )

    assert under_policy(seccomp_mode) == "2"
    assert in_child(seccomp_mode, program=None) == "0"


def test_x32_calls_are_refused() -> None:
    # Kernels built or booted without x32 answer ENOSYS as well; the BPF unit test proves the rule.
    assert under_policy(_call(0x4000_0000 | 39)) == ENOSYS  # x32 getpid


def _i386_getpid() -> int:
    """getpid through the i386 ABI (int 0x80) from this 64-bit process: eax as returned."""
    code = bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3])  # mov eax, 20 (i386 getpid); int 0x80; ret
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(code)
    function = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
    return int(function())


def test_i386_calls_are_refused() -> None:
    unfiltered = in_child(lambda: _i386_getpid() > 0, program=None)
    if unfiltered is not True:
        pytest.skip("this kernel runs no i386 calls at all (no IA32 emulation): nothing for the policy to refuse")
    assert under_policy(_i386_getpid) == -ENOSYS


def test_install_refuses_without_no_new_privs_and_malformed_programs() -> None:
    def attempts() -> list[object]:
        answers: list[object] = []
        for program in (seccomp.bpf(allow_ptrace=False), b"\0" * 7, b""):
            try:
                install(program)
                answers.append("installed")
            except OSError as exc:
                answers.append(exc.errno)
        return answers

    assert in_child(attempts, program=None) == [EPERM, errno.EINVAL, errno.EINVAL]


PROBE_SCRIPT = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(nr, *args):
    ctypes.set_errno(0)
    result = libc.syscall(ctypes.c_long(nr), *(ctypes.c_ulong(a & (2**64 - 1)) for a in args))
    return 0 if result >= 0 else ctypes.get_errno()
null = os.open("/dev/null", os.O_RDWR)
mode = [l.split(":")[1].strip() for l in open("/proc/self/status") if l.startswith("Seccomp:")][0]
print(json.dumps({
    "mode": mode,
    "keyctl": call(250, 0, -3, 0),
    "clone3": call(435, 0, 0),
    "tiocsti": call(16, null, 1 << 32 | 0x5412, 0),
    "vsock": call(41, 40, 1, 0),
    "personality": call(135, 0x40000),
    "ptrace": call(101, 0, 0, 0, 0),
    "getpid": call(39),
}))
"""
EXPECTED_INSIDE = {
    "mode": "2",
    "keyctl": EPERM,
    "clone3": ENOSYS,
    "tiocsti": EPERM,
    "vsock": errno.EAFNOSUPPORT,
    "personality": EPERM,
    "ptrace": EPERM,
    "getpid": 0,
}


def test_bwrap_applies_the_program(tmp_path: Path) -> None:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        pytest.skip("bwrap is not installed (CI installs it; run make check)")
    program = tmp_path / "seccomp.bpf"
    program.write_bytes(seccomp.bpf(allow_ptrace=False))
    with program.open("rb") as stream:
        fd = stream.fileno()
        argv = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-pid"]
        argv += ["--seccomp", str(fd), "--", sys.executable, "-c", PROBE_SCRIPT]
        ran = subprocess.run(argv, pass_fds=(fd,), capture_output=True, text=True, check=False, timeout=60)
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout) == EXPECTED_INSIDE


def test_docker_applies_the_profile(base_image: str, tmp_path: Path) -> None:
    profile = tmp_path / "seccomp.json"
    profile.write_text(seccomp.docker_profile_json(allow_ptrace=False))
    argv = ["docker", "run", "--rm", "--network", "none", "--security-opt", "no-new-privileges:true"]
    argv += ["--security-opt", f"seccomp={profile}", "--mount", "type=bind,source=/usr,target=/usr,readonly"]
    argv += [base_image, "/usr/bin/python3", "-c", PROBE_SCRIPT]
    ran = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout) == EXPECTED_INSIDE
