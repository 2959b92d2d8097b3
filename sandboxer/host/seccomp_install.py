"""Install a compiled syscall policy (`seccomp.bpf()`) on the calling thread: the exec hot path.

Standard library and ctypes only, so a joined exec pays for no libseccomp binding: the program
was compiled when the sandbox was created, and the caller reads its bytes from the sandbox's
directory. The caller must have set no_new_privs first (`prctl(PR_SET_NO_NEW_PRIVS, 1)`):
`install` checks and refuses otherwise, because a root caller would not be stopped by the
kernel, which asks for no_new_privs only from callers without CAP_SYS_ADMIN.

No flags: the filter goes on the calling thread alone, without SECCOMP_FILTER_FLAG_TSYNC. The
caller installs it just before execve, and execve leaves only the calling thread, whose filter
the new program inherits. No SECCOMP_FILTER_FLAG_SPEC_ALLOW either: the kernel's speculative
store bypass default for filtered tasks applies as under bwrap and Docker, which load theirs
without it.
"""

from __future__ import annotations

import ctypes
import errno
import os

_SYS_SECCOMP = 317  # x86_64
_SECCOMP_SET_MODE_FILTER = 1
_PR_GET_NO_NEW_PRIVS = 39
_BPF_MAXINSNS = 4096
_INSTRUCTION = 8  # sizeof(struct sock_filter)


class _SockFprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def install(program: bytes) -> None:
    """Install `program` (struct sock_filter entries) as a seccomp filter; OSError on failure."""
    count, rest = divmod(len(program), _INSTRUCTION)
    if rest or not 0 < count <= _BPF_MAXINSNS:
        raise OSError(errno.EINVAL, f"not a seccomp program: {len(program)} bytes")
    if _libc.prctl(_PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0) != 1:
        raise OSError(errno.EPERM, "no_new_privs must be set before the syscall policy is installed")
    instructions = (ctypes.c_char * len(program)).from_buffer_copy(program)
    fprog = _SockFprog(count, ctypes.addressof(instructions))
    result = _libc.syscall(
        ctypes.c_long(_SYS_SECCOMP),
        ctypes.c_ulong(_SECCOMP_SET_MODE_FILTER),
        ctypes.c_ulong(0),
        ctypes.byref(fprog),
    )
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"seccomp(SET_MODE_FILTER): {os.strerror(code)}")
