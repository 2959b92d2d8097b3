"""Escape probes: system calls and sockets the sandbox's syscall policy refuses (docs/seccomp.md).

Each probe makes one call from inside a sandbox, on bwrap as root, as an unprivileged broker and
on Docker, and expects the policy's own answer. Where a call is harmless or fails differently
without the policy, the arguments are chosen so that the policy's errno is the only way to get
the expected answer (a bad descriptor that would give EBADF, a NULL that would give EFAULT): the
probe then proves the filter, not merely a missing capability.

Network probes never leave the sandbox: AF_VSOCK is proven refused by socket() alone, and the
non-loopback connects target documentation addresses in the sandbox's own network namespace,
which has no route to them.
"""

from __future__ import annotations

import pytest

from tests.integration.test_escape_support import Box, answer, box_fixture

box = box_fixture()

CLONE_NEWNS = 0x0002_0000
CLONE_NEWCGROUP = 0x0200_0000
CLONE_NEWUTS = 0x0400_0000
CLONE_NEWIPC = 0x0800_0000
CLONE_NEWUSER = 0x1000_0000
CLONE_NEWPID = 0x2000_0000
CLONE_NEWNET = 0x4000_0000
CLONE_NEWTIME = 0x0000_0080
SIGCHLD = 17

# (probe id, Python expression printed inside the sandbox, the policy's answer)
REFUSED_CALLS = [
    ("ptrace-traceme", "syscall(101, 0, 0, 0, 0)", "EPERM"),
    ("process_vm_readv-self", "syscall(310, os.getpid(), 0, 0, 0, 0, 0)", "EPERM"),
    ("process_vm_writev-self", "syscall(311, os.getpid(), 0, 0, 0, 0, 0)", "EPERM"),
    ("perf_event_open", "syscall(298, 0, 0, -1, -1, 0)", "EPERM"),
    ("userfaultfd", "syscall(323, 0)", "EPERM"),
    ("io_uring_setup", "syscall(425, 1, 0)", "EPERM"),
    ("io_uring_enter", "syscall(426, -1, 0, 0, 0, 0, 0)", "EPERM"),
    ("io_uring_register", "syscall(427, -1, 0, 0, 0)", "EPERM"),
    ("bpf-map-create", "syscall(321, 0, 0, 0)", "EPERM"),
    ("bpf-prog-load", "syscall(321, 5, 0, 0)", "EPERM"),
    ("unshare-user", f"syscall(272, {CLONE_NEWUSER})", "EPERM"),
    ("unshare-mount", f"syscall(272, {CLONE_NEWNS})", "EPERM"),
    ("unshare-net", f"syscall(272, {CLONE_NEWNET})", "EPERM"),
    ("unshare-pid", f"syscall(272, {CLONE_NEWPID})", "EPERM"),
    ("unshare-ipc", f"syscall(272, {CLONE_NEWIPC})", "EPERM"),
    ("unshare-uts", f"syscall(272, {CLONE_NEWUTS})", "EPERM"),
    ("unshare-cgroup", f"syscall(272, {CLONE_NEWCGROUP})", "EPERM"),
    ("unshare-time", f"syscall(272, {CLONE_NEWTIME})", "EPERM"),
    ("setns-bad-fd", "syscall(308, -1, 0)", "EPERM"),
    ("setns-own-net", f"syscall(308, os.open('/proc/self/ns/net', os.O_RDONLY), {CLONE_NEWNET})", "EPERM"),
    ("clone3", "syscall(435, 0, 0)", "ENOSYS"),
    ("mount-tmpfs", "syscall(165, b'none', b'/tmp', b'tmpfs', 0, 0)", "EPERM"),
    ("mount-bind-root", "syscall(165, b'/', b'/workspace', 0, 0x1000 | 0x4000, 0)", "EPERM"),
    ("mount-proc", "syscall(165, b'proc', b'/workspace', b'proc', 0, 0)", "EPERM"),
    ("umount2-proc", "syscall(166, b'/proc', 2)", "EPERM"),
    ("pivot_root", "syscall(155, b'.', b'.')", "EPERM"),
    ("personality-addr-no-randomize", "syscall(135, 0x0040000)", "EPERM"),
    ("personality-read-implies-exec", "syscall(135, 0x0400000)", "EPERM"),
    ("personality-mmap-page-zero", "syscall(135, 0x0100000)", "EPERM"),
    ("personality-linux32-no-randomize", "syscall(135, 0x0040008)", "EPERM"),
    ("init_module", "syscall(175, 0, 0, b'')", "EPERM"),
    ("finit_module", "syscall(313, -1, b'', 0)", "EPERM"),
    ("delete_module", "syscall(176, b'sandboxer_probe', 0)", "EPERM"),
    ("kexec_load", "syscall(246, 0, 0, 0, 0)", "EPERM"),
    ("kexec_file_load", "syscall(320, -1, -1, 0, b'', 0)", "EPERM"),
    ("syslog", "syscall(103, 10, 0, 0)", "EPERM"),
    ("acct", "syscall(163, 0)", "EPERM"),
    ("reboot", "syscall(169, 0, 0, 0, 0)", "EPERM"),
    ("swapon", "syscall(167, b'/nonexistent', 0)", "EPERM"),
    ("settimeofday", "syscall(164, 0, 0)", "EPERM"),
    ("clock_settime", "syscall(227, 0, 0)", "EPERM"),
    ("sethostname", "syscall(170, b'x', 1)", "EPERM"),
    ("iopl", "syscall(172, 3)", "EPERM"),
    ("ioperm", "syscall(173, 0x80, 1, 1)", "EPERM"),
    ("open_by_handle_at", "syscall(304, -1, 0, 0)", "EPERM"),
    ("name_to_handle_at", "syscall(303, -100, b'/', 0, 0, 0)", "EPERM"),
    ("fanotify_init", "syscall(300, 0, 0)", "EPERM"),
    ("kcmp", "syscall(312, os.getpid(), os.getpid(), 0, 0, 0)", "EPERM"),
    ("pidfd_getfd", "syscall(438, -1, 0, 0)", "EPERM"),
    ("process_madvise", "syscall(440, -1, 0, 0, 0, 0)", "EPERM"),
    ("quotactl", "syscall(179, 0, 0, 0, 0)", "EPERM"),
]


@pytest.mark.parametrize(
    ("expression", "refusal"),
    [pytest.param(expr, refusal, id=probe) for probe, expr, refusal in REFUSED_CALLS],
)
def test_refused_syscall(box: Box, expression: str, refusal: str) -> None:
    assert answer(box.py(f"print({expression})")) == refusal


# clone(2) with a namespace flag: the child (should the call ever succeed) leaves at once.
CLONE = """
ctypes.set_errno(0)
pid = _libc.syscall(ctypes.c_long(56), ctypes.c_ulong(int(sys.argv[1])), None, None, None, None)
if pid == 0:
    os._exit(0)
if pid > 0:
    os.waitpid(pid, 0)
print("ok" if pid > 0 else name(ctypes.get_errno()))
"""


@pytest.mark.parametrize(
    "flag",
    [
        pytest.param(CLONE_NEWUSER, id="clone-newuser"),
        pytest.param(CLONE_NEWNS, id="clone-newns"),
        pytest.param(CLONE_NEWNET, id="clone-newnet"),
        pytest.param(CLONE_NEWPID, id="clone-newpid"),
    ],
)
def test_clone_with_a_namespace_flag_is_refused(box: Box, flag: int) -> None:
    assert answer(box.py(CLONE, str(flag | SIGCHLD))) == "EPERM"


# An i386 system call through int 0x80 (getpid is 20 there): the policy knows only x86_64, and
# every other ABI gets ENOSYS. Without the policy the kernel answers with a pid.
INT80_GETPID = """
import mmap
code = bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3])  # mov eax, 20; int 0x80; ret
page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(code)
function = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
result = function()
print(name(-result) if result < 0 else f"pid {result}")
"""


def _refused_abi(box: Box, code: str) -> None:
    """A call of another ABI never runs: bwrap's filter answers ENOSYS; Docker's profile format
    has no errno for a foreign architecture, and runc kills the caller with SIGSYS instead."""
    result = box.py(code)
    if box.backend == "docker":
        assert result.status == 128 + 31, (result.status, result.stdout, result.stderr)
        assert "pid" not in result.stdout
    else:
        assert answer(result) == "ENOSYS"


def test_i386_abi_call_is_refused(box: Box) -> None:
    _refused_abi(box, INT80_GETPID)


def test_x32_abi_call_is_refused(box: Box) -> None:
    _refused_abi(box, "print(syscall(0x40000000 | 39))")


def test_personality_query_is_still_allowed(box: Box) -> None:
    """The control for the personality probes: reading the value (0xffffffff) is not refused."""
    assert answer(box.py("print(syscall(135, 0xFFFFFFFF))")) == "ok"


STATUS = """
fields = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
print(" ".join(fields[key].strip() for key in sys.argv[1:]))
"""


def test_every_exec_runs_under_a_filter_without_privileges(box: Box) -> None:
    keys = ("Seccomp", "NoNewPrivs", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")
    assert answer(box.py(STATUS, *keys)) == "2 1 " + " ".join(["0000000000000000"] * 5)


# --------------------------------------------------------------------------------------- sockets

AF_PACKET, AF_VSOCK = 17, 40
SOCK_STREAM, SOCK_DGRAM, SOCK_RAW, SOCK_SEQPACKET, SOCK_PACKET = 1, 2, 3, 5, 10

REFUSED_SOCKETS = [
    ("af_vsock-stream", AF_VSOCK, SOCK_STREAM, 0, "EAFNOSUPPORT"),
    ("af_vsock-dgram", AF_VSOCK, SOCK_DGRAM, 0, "EAFNOSUPPORT"),
    ("af_packet-raw", AF_PACKET, SOCK_RAW, 0x0300, "EAFNOSUPPORT"),
    ("af_packet-dgram", AF_PACKET, SOCK_DGRAM, 0x0300, "EAFNOSUPPORT"),
    ("af_alg", 38, SOCK_SEQPACKET, 0, "EAFNOSUPPORT"),
    ("af_key", 15, SOCK_RAW, 2, "EAFNOSUPPORT"),
    ("af_bluetooth", 31, SOCK_RAW, 0, "EAFNOSUPPORT"),
    ("af_can", 29, SOCK_RAW, 1, "EAFNOSUPPORT"),
    ("af_tipc", 30, 4, 0, "EAFNOSUPPORT"),  # SOCK_RDM
    ("af_rds", 21, SOCK_SEQPACKET, 0, "EAFNOSUPPORT"),
    ("af_xdp", 44, SOCK_RAW, 0, "EAFNOSUPPORT"),
    ("af_llc", 26, SOCK_DGRAM, 0, "EAFNOSUPPORT"),
    ("af_smc", 43, SOCK_STREAM, 0, "EAFNOSUPPORT"),
    ("af_appletalk", 5, SOCK_DGRAM, 0, "EAFNOSUPPORT"),
    ("af_ax25", 3, SOCK_SEQPACKET, 0, "EAFNOSUPPORT"),
    ("af_x25", 9, SOCK_SEQPACKET, 0, "EAFNOSUPPORT"),
    ("af_netlink-audit", 16, SOCK_RAW, 9, "EPROTONOSUPPORT"),
    ("af_netlink-uevent", 16, SOCK_DGRAM, 15, "EPROTONOSUPPORT"),
    ("af_netlink-sock-diag", 16, SOCK_RAW, 4, "EPROTONOSUPPORT"),
    ("af_netlink-generic", 16, SOCK_RAW, 16, "EPROTONOSUPPORT"),
    ("af_netlink-netfilter", 16, SOCK_RAW, 12, "EPROTONOSUPPORT"),
    ("af_netlink-xfrm", 16, SOCK_RAW, 6, "EPROTONOSUPPORT"),
    # Families the policy allows, refused for want of CAP_NET_RAW (which no exec has).
    ("af_inet-raw-icmp", 2, SOCK_RAW, 1, "EPERM"),
    ("af_inet-raw-tcp", 2, SOCK_RAW, 6, "EPERM"),
    ("af_inet-raw-ip", 2, SOCK_RAW, 255, "EPERM"),
    ("af_inet6-raw-icmpv6", 10, SOCK_RAW, 58, "EPERM"),
    ("af_inet-sock-packet", 2, SOCK_PACKET, 0x0300, "EPERM"),
]


@pytest.mark.parametrize(
    ("family", "kind", "proto", "refusal"),
    [pytest.param(f, k, p, r, id=probe) for probe, f, k, p, r in REFUSED_SOCKETS],
)
def test_refused_socket(box: Box, family: int, kind: int, proto: int, refusal: str) -> None:
    assert answer(box.py(f"print(try_socket({family}, {kind}, {proto}))")) == refusal


def test_af_packet_with_high_bits_in_the_family_is_refused(box: Box) -> None:
    """The kernel reads the family as an int: 1<<32 | AF_PACKET is AF_PACKET to it."""
    assert answer(box.py(f"print(syscall(41, (1 << 32) | {AF_PACKET}, {SOCK_RAW}, 0x0300))")) == "EAFNOSUPPORT"


def test_af_vsock_with_high_bits_in_the_family_is_refused(box: Box) -> None:
    assert answer(box.py(f"print(syscall(41, (1 << 32) | {AF_VSOCK}, {SOCK_STREAM}, 0))")) == "EAFNOSUPPORT"


@pytest.mark.parametrize(
    ("family", "kind"),
    [pytest.param(2, SOCK_STREAM, id="socketpair-inet"), pytest.param(16, SOCK_RAW, id="socketpair-netlink")],
)
def test_socketpair_of_another_family_is_refused(box: Box, family: int, kind: int) -> None:
    code = f"fds = (ctypes.c_int * 2)()\nprint(syscall(53, {family}, {kind}, 0, ctypes.byref(fds)))"
    assert answer(box.py(code)) == "EAFNOSUPPORT"


def test_local_ip_and_routing_sockets_still_work(box: Box) -> None:
    """The control for the socket probes: what the policy allows is really allowed."""
    code = "print(try_socket(1, 1), try_socket(2, 1), try_socket(10, 2), try_socket(16, 3, 0))"
    assert answer(box.py(code)) == "ok ok ok ok"


CONNECT = """
family = socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET
with socket.socket(family, socket.SOCK_STREAM) as sock:
    sock.settimeout(5)
    print(attempt(sock.connect, (sys.argv[1], 9)))
"""


def test_no_ipv4_route_leaves_the_sandbox(box: Box) -> None:
    assert answer(box.py(CONNECT, "192.0.2.1")) == "ENETUNREACH"


def test_no_ipv6_route_leaves_the_sandbox(box: Box) -> None:
    """Docker's `none` network disables IPv6 altogether: no source address, no route."""
    assert answer(box.py(CONNECT, "2001:db8::1")) == box.expect(bwrap="ENETUNREACH", docker="EADDRNOTAVAIL")


def test_loopback_is_the_only_interface(box: Box) -> None:
    assert answer(box.py("print(sorted(name for _, name in socket.if_nameindex()))")) == "['lo']"
