"""The sandbox's syscall policy, compiled to classic BPF and rendered for Docker.

The policy is `seccomp_rules.RULES` (each rule is a `seccomp_types.Rule`); `rules()` gives those
in force for a profile and `refusal()` reads them as the filter does. Anything no rule matches is
allowed. Calls from the i386 and x32 ABIs never run: they fail with ENOSYS.

The same rules become
- `bpf()`: the classic-BPF program libseccomp compiles (bwrap's `--seccomp FD`; each joined exec
  installs it with `seccomp_install.install` just before execve; the broker keeps it between
  runs with host/seccomp_cache.py, by `cache_key()`), and `digest()`, its sha256;
- `docker_profile()`: a Docker seccomp profile (`--security-opt seccomp=<json>`).

Both renderings need one condition per argument in a rule (see `seccomp_types`).
docs/seccomp.md lists every rule and the attack it stops.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Sequence
from errno import ENOSYS
from typing import Any

from sandboxer.core.seccomp_rules import RULES
from sandboxer.core.seccomp_types import Condition, Op, Rule
from sandboxer.errors import BackendError


def rules(*, allow_ptrace: bool) -> tuple[Rule, ...]:
    """The rules in force for a profile: all of them, less the ptrace family when it is allowed."""
    return tuple(rule for rule in RULES if not (allow_ptrace and rule.ptrace))


def refusal(number: int, args: Sequence[int], *, allow_ptrace: bool) -> int | None:
    """The errno an x86_64 call with these six arguments gets from the policy, or None if allowed."""
    for rule in rules(allow_ptrace=allow_ptrace):
        if rule.number == number and rule.matches(args):
            return rule.errno
    return None


def bpf(*, allow_ptrace: bool) -> bytes:
    """The policy as a classic-BPF program: `struct sock_filter` entries, 8 bytes each, host order."""
    return _compile(allow_ptrace)


_COMPILE_VERSION = 1  # raise it whenever _compile emits a different program for the same rules


def cache_key(*, allow_ptrace: bool) -> str:
    """What names the compiled program in a cache (host/seccomp_cache.py): the definition itself,
    so that a changed rule is a new entry, never a stale program."""
    return hashlib.sha256(f"{_COMPILE_VERSION}|{rules(allow_ptrace=allow_ptrace)!r}".encode()).hexdigest()


def digest(*, allow_ptrace: bool) -> str:
    """The sha256 (hex) of the BPF program: what `inspect` reports as the policy's identity."""
    return hashlib.sha256(_compile(allow_ptrace)).hexdigest()


@functools.lru_cache(maxsize=2)  # bytes, never changed: threads share them (two may compile the same)
def _compile(allow_ptrace: bool) -> bytes:
    try:
        # Here, not at the top: a missing libseccomp becomes the policy's own error.
        import pyseccomp  # type: ignore[import-untyped]  # noqa: PLC0415
    except (ImportError, RuntimeError) as exc:  # RuntimeError: libseccomp.so.2 is not installed
        raise BackendError(
            f"the syscall policy cannot be compiled: {exc}", hint="install libseccomp2 and the pyseccomp package"
        ) from exc
    if pyseccomp.system_arch() != pyseccomp.Arch.X86_64:
        raise BackendError("the syscall policy is written for x86_64 only")
    try:
        policy = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
        # i386 (int 0x80) and x32 (numbers with bit 0x40000000) calls are not in the filter's
        # architecture; both reach this action, ENOSYS as on a kernel built without those ABIs.
        policy.set_attr(pyseccomp.Attr.ACT_BADARCH, pyseccomp.ERRNO(ENOSYS))
        policy.set_attr(pyseccomp.Attr.CTL_OPTIMIZE, 2)  # a binary tree: an allowed call costs ~log2(n) jumps
        for rule in rules(allow_ptrace=allow_ptrace):
            args = [pyseccomp.Arg(c.index, int(c.op), *_datums(c)) for c in rule.conditions]
            # Numbers, not names: the program no longer depends on libseccomp's syscall table,
            # which lacks the newest calls in older releases.
            policy.add_rule_exactly(pyseccomp.ERRNO(rule.errno), rule.number, *args)
        with os.fdopen(os.memfd_create("sandboxer-seccomp", os.MFD_CLOEXEC), "w+b") as stream:
            policy.export_bpf(stream)
            stream.seek(0)
            program = stream.read()
    except OSError as exc:
        raise BackendError(f"libseccomp refused the syscall policy: {exc.strerror or exc}") from exc
    if not program or len(program) % 8:
        raise BackendError(f"libseccomp exported a malformed program ({len(program)} bytes)")
    return program


def _datums(condition: Condition) -> tuple[int, int]:
    """libseccomp's (datum_a, datum_b): the mask comes first for MASKED_EQ."""
    if condition.op is Op.MASKED_EQ:
        return condition.mask, condition.value
    return condition.value, 0


def docker_profile(*, allow_ptrace: bool) -> dict[str, Any]:
    """The policy as a Docker seccomp profile: allow by default, x86_64 only, one entry per group."""
    entries: list[dict[str, Any]] = []
    previous: Rule | None = None
    for rule in rules(allow_ptrace=allow_ptrace):
        if previous is not None and _same_entry(previous, rule):
            entries[-1]["names"].append(rule.syscall)
        else:
            entries.append(_docker_entry(rule))
        previous = rule
    return {"defaultAction": "SCMP_ACT_ALLOW", "architectures": ["SCMP_ARCH_X86_64"], "syscalls": entries}


def docker_profile_json(*, allow_ptrace: bool) -> str:
    """`docker_profile` as canonical compact JSON (sorted keys), for `--security-opt seccomp=`."""
    return json.dumps(docker_profile(allow_ptrace=allow_ptrace), sort_keys=True, separators=(",", ":"))


def _same_entry(a: Rule, b: Rule) -> bool:
    return (a.errno, a.reason, a.conditions) == (b.errno, b.reason, b.conditions)


def _docker_entry(rule: Rule) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "names": [rule.syscall],
        "action": "SCMP_ACT_ERRNO",
        "errnoRet": rule.errno,
        "comment": rule.reason,
    }
    if rule.conditions:
        entry["args"] = [_docker_arg(condition) for condition in rule.conditions]
    return entry


def _docker_arg(condition: Condition) -> dict[str, Any]:
    """Docker's form: for SCMP_CMP_MASKED_EQ `value` is the mask and `valueTwo` the value (runc passes
    them to libseccomp as datum_a and datum_b)."""
    value, value_two = _datums(condition)
    return {"index": condition.index, "op": f"SCMP_CMP_{condition.op.name}", "value": value, "valueTwo": value_two}
