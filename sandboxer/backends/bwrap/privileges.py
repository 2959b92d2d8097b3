"""The system calls that take a process into a live sandbox and strip it of every privilege on
the way (sandboxer.backends.bwrap.joiner runs them between fork and exec): setns, prctl, the
capability sets, the sandbox's session keyring, a Landlock domain of its own.

Only `os`, `resource` and ctypes system calls: this code runs in a child forked from a threaded
broker, where a lock another thread held at the fork would never be released (docs/api.md).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import resource
from collections.abc import Sequence

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

NS_GET_USERNS = 0xB701  # ioctl: the user namespace that owns a namespace
PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_SYS_CAPSET = 126  # x86_64
_SYS_KEYCTL = 250
_KEYCTL_JOIN_SESSION_KEYRING = 1
_KEYCTL_SETPERM = 5
_KEY_SPEC_SESSION_KEYRING = -3
_KEYRING_PERM = 0x3F1B0000  # possessor: all; owner uid: view, read, search, link
_SYS_LANDLOCK_CREATE_RULESET = 444
_SYS_LANDLOCK_RESTRICT_SELF = 446
# Handled by the domain (and so denied, as they already are without CAP_MKNOD): making device
# nodes. The domain exists for its ptrace scoping, not to restrict the filesystem.
_LANDLOCK_ACCESS_FS_MAKE_CHAR = 1 << 6
_LANDLOCK_ACCESS_FS_MAKE_BLOCK = 1 << 11
_CAP_LAST_FALLBACK = 63

_libc = ctypes.CDLL(None, use_errno=True)
_libc.prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)


def _cap_last() -> int:
    """The highest capability this kernel knows (read once, before any fork: a child between fork
    and exec does as little as it can)."""
    try:
        fd = os.open("/proc/sys/kernel/cap_last_cap", os.O_RDONLY | os.O_CLOEXEC)
        try:
            return int(os.read(fd, 16))
        finally:
            os.close(fd)
    except (OSError, ValueError):
        return _CAP_LAST_FALLBACK


_CAP_LAST = _cap_last()


class _CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _CapData(ctypes.Structure):
    _fields_ = (("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32))


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def setns(fd: int, nstype: int) -> None:
    """Join the namespace `fd` refers to."""
    _check(_libc.setns(fd, nstype), "setns")


def prctl(option: int, arg2: int = 0, arg3: int = 0) -> None:
    """prctl(2) with integer arguments."""
    _check(_libc.prctl(option, ctypes.c_ulong(arg2), ctypes.c_ulong(arg3), 0, 0), "prctl")


def drop_all_capabilities() -> None:
    """Empty the bounding and ambient sets, then the effective, permitted and inheritable sets."""
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    for cap in range(_CAP_LAST + 1):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != errno.EINVAL:
            _check(-1, "drop bounding capability")
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(_libc.syscall(_SYS_CAPSET, ctypes.byref(header), ctypes.byref(data)), "capset")


def new_session_keyring(name: str) -> None:
    """Join the sandbox's own session keyring `name` (made on first use): nothing of the
    broker's or the caller's keys follows a process in. One per sandbox, not one per exec: each
    keyring counts against its owner's key quota (an unprivileged broker's own)."""
    if _libc.syscall(_SYS_KEYCTL, _KEYCTL_JOIN_SESSION_KEYRING, ctypes.c_char_p(name.encode())) < 0:
        _check(-1, "keyctl(join session keyring)")
    # The kernel finds a keyring by name only where its owner may search it; without that, every
    # process would make a keyring of its own.
    if _libc.syscall(_SYS_KEYCTL, _KEYCTL_SETPERM, _KEY_SPEC_SESSION_KEYRING, _KEYRING_PERM) < 0:
        _check(-1, "keyctl(setperm)")


def keyring_name(sandbox_id: str) -> str:
    """The session keyring of a sandbox's processes."""
    return f"_ses.sandboxer.{sandbox_id}"


def own_landlock_domain() -> None:
    """Enter a Landlock domain of our own (needs no_new_privs): from now on, the kernel refuses
    ptrace access to any process outside this process and its descendants."""
    handled = ctypes.c_uint64(_LANDLOCK_ACCESS_FS_MAKE_CHAR | _LANDLOCK_ACCESS_FS_MAKE_BLOCK)
    ruleset = _libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(handled), ctypes.sizeof(handled), 0)
    if ruleset < 0:
        _check(-1, "landlock_create_ruleset")
    try:
        _check(_libc.syscall(_SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")
    finally:
        os.close(ruleset)


def confine(cgroups: Sequence[int], rlimits: Sequence[tuple[int, int]], keyring: str) -> None:
    """In a child about to execute bwrap: join the sandbox's cgroups (descriptors opened by the
    broker), take its rlimits and the sandbox's own session keyring."""
    for fd in cgroups:
        os.write(fd, b"0")
    for which, limit in rlimits:
        resource.setrlimit(which, (limit, limit))
    new_session_keyring(keyring)


def owning_user_namespace(ns_fd: int) -> int:
    """A new close-on-exec fd of the user namespace that owns the namespace `ns_fd` refers to."""
    owner = fcntl.ioctl(ns_fd, NS_GET_USERNS)
    os.set_inheritable(owner, False)
    return owner
