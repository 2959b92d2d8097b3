"""The compiled syscall policy kept in the broker's owner-only parse cache between runs: compiling
it (sandboxer.core.seccomp.bpf) costs a create about 30 ms."""

from __future__ import annotations

import os

from sandboxer.core import seccomp
from sandboxer.host.fsutil import atomic_write, ensure_private_dir


def cached_bpf(cache_dir: str, *, allow_ptrace: bool) -> bytes:
    """`seccomp.bpf()`, from `cache_dir` when a program of the same definition is there (the
    broker's own file, owner-only, a whole number of BPF instructions), else compiled and kept."""
    path = os.path.join(cache_dir, f"seccomp-{seccomp.cache_key(allow_ptrace=allow_ptrace)}.bpf")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        fd = -1
    if fd >= 0:
        with os.fdopen(fd, "rb") as stream:
            info = os.fstat(stream.fileno())
            program = stream.read()
        if info.st_uid == os.geteuid() and not info.st_mode & 0o077 and program and not len(program) % 8:
            return program
    program = seccomp.bpf(allow_ptrace=allow_ptrace)
    ensure_private_dir(cache_dir, "parse cache")
    atomic_write(path, program, mode=0o600, durable=False)
    return program
