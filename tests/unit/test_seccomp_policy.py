"""The syscall policy's definition and its two renderings agree.

The BPF program is checked by running it here, in a small classic-BPF interpreter, against the
definition's own reading of each rule (`seccomp.refusal`): every rule, the i386 and x32 ABIs, and
random arguments with high bits set. tests/integration/test_seccomp_kernel.py runs it in the kernel.
"""

from __future__ import annotations

import errno
import hashlib
import json
import struct
import subprocess
import sys
from collections.abc import Sequence

import pyseccomp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxer.core import seccomp, seccomp_rules
from sandboxer.core.seccomp_types import Condition, Op, Rule
from tests.conftest import REPO

AUDIT_ARCH_X86_64 = 0xC000_003E
AUDIT_ARCH_I386 = 0x4000_0003
X32_SYSCALL_BIT = 0x4000_0000
RET_ALLOW = 0x7FFF_0000
RET_ERRNO = 0x0005_0000
U64 = (1 << 64) - 1
PTRACE_FAMILY = {"ptrace", "process_vm_readv", "process_vm_writev"}


def run_filter(program: bytes, nr: int, args: Sequence[int], *, arch: int = AUDIT_ARCH_X86_64) -> int:  # noqa: PLR0912 - one branch per BPF instruction class
    """What the kernel's seccomp would return for this call: classic BPF over struct seccomp_data."""
    data = struct.pack("<iIQ6Q", nr, arch, 0x401000, *(a & U64 for a in args))
    insns = [struct.unpack("=HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    a = x = 0
    mem = [0] * 16
    pc = 0
    while True:
        code, jt, jf, k = insns[pc]
        pc += 1
        cls = code & 0x07
        if cls == 0x00:  # BPF_LD
            mode = code & 0xE0
            if mode == 0x20:  # BPF_ABS, word loads only (seccomp allows no other size)
                assert code & 0x18 == 0x00, f"load size {code:#x}"
                a = struct.unpack_from("<I", data, k)[0]
            elif mode == 0x00:  # BPF_IMM
                a = k
            elif mode == 0x60:  # BPF_MEM
                a = mem[k]
            else:
                raise AssertionError(f"unsupported load {code:#x}")
        elif cls == 0x01:  # BPF_LDX
            x = k if code & 0xE0 == 0x00 else mem[k]
        elif cls == 0x02:  # BPF_ST
            mem[k] = a
        elif cls == 0x03:  # BPF_STX
            mem[k] = x
        elif cls == 0x04:  # BPF_ALU
            operand = x if code & 0x08 else k
            a = _alu(code & 0xF0, a, operand)
        elif cls == 0x05:  # BPF_JMP
            op = code & 0xF0
            if op == 0x00:  # BPF_JA
                pc += k
                continue
            operand = x if code & 0x08 else k
            taken = {0x10: a == operand, 0x20: a > operand, 0x30: a >= operand, 0x40: bool(a & operand)}[op]
            pc += jt if taken else jf
        elif cls == 0x06:  # BPF_RET
            return a if code & 0x18 == 0x10 else k
        elif cls == 0x07:  # BPF_MISC: TAX / TXA
            if code & 0xF8 == 0x00:
                x = a
            else:
                a = x
        else:
            raise AssertionError(f"unsupported instruction {code:#x}")


def _alu(op: int, a: int, operand: int) -> int:
    match op:
        case 0x00:
            return (a + operand) & 0xFFFF_FFFF
        case 0x10:
            return (a - operand) & 0xFFFF_FFFF
        case 0x40:
            return a | operand
        case 0x50:
            return a & operand
        case 0x60:
            return (a << operand) & 0xFFFF_FFFF if operand < 32 else 0
        case 0x70:
            return a >> operand
        case 0xA0:
            return a ^ operand
    raise AssertionError(f"unsupported ALU operation {op:#x}")


def verdict(ret: int) -> int | None:
    """The errno a seccomp return value means, or None for allow."""
    if ret == RET_ALLOW:
        return None
    assert ret & 0xFFFF_0000 == RET_ERRNO, f"unexpected action {ret:#x}"
    return ret & 0xFFFF


def witness(rule: Rule) -> list[int]:
    """Six arguments that satisfy every condition of `rule`."""
    args = [0] * 6
    for condition in rule.conditions:
        args[condition.index] = {
            Op.NE: condition.value ^ 1,
            Op.LT: condition.value - 1,
            Op.LE: condition.value,
            Op.EQ: condition.value,
            Op.GE: condition.value,
            Op.GT: condition.value + 1,
            Op.MASKED_EQ: condition.value,
        }[condition.op]
    assert rule.matches(args)
    return args


@pytest.mark.parametrize("allow_ptrace", [False, True])
def test_every_rule_refuses_its_call_in_the_program(allow_ptrace: bool) -> None:
    program = seccomp.bpf(allow_ptrace=allow_ptrace)
    for rule in seccomp.rules(allow_ptrace=allow_ptrace):
        args = witness(rule)
        assert verdict(run_filter(program, rule.number, args)) == rule.errno, rule
        assert seccomp.refusal(rule.number, args, allow_ptrace=allow_ptrace) == rule.errno


def test_ordinary_calls_pass_the_program() -> None:
    program = seccomp.bpf(allow_ptrace=False)
    for nr in (0, 1, 2, 3, 9, 39, 57, 59, 60, 231, 257, 334):  # read … execve, exit_group, openat, rseq
        assert verdict(run_filter(program, nr, [0, 1, 2, 3, 4, 5])) is None


def test_i386_and_x32_calls_get_enosys() -> None:
    program = seccomp.bpf(allow_ptrace=False)
    assert verdict(run_filter(program, 20, [0] * 6, arch=AUDIT_ARCH_I386)) == errno.ENOSYS  # i386 getpid
    assert verdict(run_filter(program, X32_SYSCALL_BIT | 39, [0] * 6)) == errno.ENOSYS  # x32 getpid
    assert verdict(run_filter(program, X32_SYSCALL_BIT | 101, [0] * 6)) == errno.ENOSYS  # x32 ptrace


INTERESTING = [0, 1, 2, 3, 8, 9, 10, 15, 16, 17, 38, 40, 0x5412, 0x541C, 0x2_0000, 0x2_0008, 0x4_0000, 0xFFFF_FFFF]
INTERESTING += [value | 1 << 32 for value in INTERESTING] + [U64, 1 << 63, 0x7E02_0000, 0x1000_0011]
ARGUMENT = st.one_of(st.sampled_from(INTERESTING), st.integers(0, 0xFFFF_FFFF), st.integers(0, U64))
NUMBERS = sorted({rule.number for rule in seccomp_rules.RULES} | {0, 39, 57, 59})


@settings(max_examples=2000, deadline=None)
@given(st.sampled_from(NUMBERS), st.lists(ARGUMENT, min_size=6, max_size=6), st.booleans())
def test_program_decides_as_the_definition(nr: int, args: list[int], allow_ptrace: bool) -> None:
    program = seccomp.bpf(allow_ptrace=allow_ptrace)
    assert verdict(run_filter(program, nr, args)) == seccomp.refusal(nr, args, allow_ptrace=allow_ptrace)


def _personality_cases() -> list[int]:
    bits = [1 << bit for bit in range(32)]
    cases = [*seccomp_rules.PERSONALITY_ALLOWED, *bits, *(0xFFFF_FFFF ^ bit for bit in bits)]
    cases += [allowed | bit for allowed in seccomp_rules.PERSONALITY_ALLOWED[:4] for bit in bits]
    return cases


def test_personality_allows_exactly_the_default_set() -> None:
    program = seccomp.bpf(allow_ptrace=False)
    for value in _personality_cases():
        for high in (0, 0xDEAD << 32):  # the kernel reads an unsigned int: high bits change nothing
            expected = None if value in seccomp_rules.PERSONALITY_ALLOWED else errno.EPERM
            assert verdict(run_filter(program, 135, [value | high, 0, 0, 0, 0, 0])) == expected, hex(value | high)


def test_tiocsti_is_matched_on_the_low_32_bits() -> None:
    program = seccomp.bpf(allow_ptrace=False)
    for request in (seccomp_rules.TIOCSTI, seccomp_rules.TIOCLINUX):
        for high in (0, 1 << 32, 0xFFFF_FFFF << 32):
            assert verdict(run_filter(program, 16, [0, request | high, 0, 0, 0, 0])) == errno.EPERM
    assert verdict(run_filter(program, 16, [0, 0x5413, 0, 0, 0, 0])) is None  # TIOCGWINSZ


def test_socket_families() -> None:
    program = seccomp.bpf(allow_ptrace=False)

    def socket(family: int, protocol: int = 0) -> int | None:
        return verdict(run_filter(program, 41, [family, 1, protocol, 0, 0, 0]))

    for family in (1, 2, 10):
        assert socket(family) is None
        assert socket(family | 1 << 32) == errno.EAFNOSUPPORT  # the kernel would read `family`
    assert socket(16, 0) is None
    assert socket(16, 9) == errno.EPROTONOSUPPORT
    assert socket(16, 1 << 32) == errno.EPROTONOSUPPORT
    for family in (0, 3, 4, 5, 9, 11, 15, 17, 31, 38, 40, 45, 0xFFFF_FFFF):
        assert socket(family) == errno.EAFNOSUPPORT, family


def test_allow_ptrace_lifts_exactly_the_ptrace_family() -> None:
    lifted = set(seccomp.rules(allow_ptrace=False)) - set(seccomp.rules(allow_ptrace=True))
    assert {rule.syscall for rule in lifted} == PTRACE_FAMILY
    assert set(seccomp.rules(allow_ptrace=True)) < set(seccomp.rules(allow_ptrace=False))
    names = {
        allow: {name for entry in seccomp.docker_profile(allow_ptrace=allow)["syscalls"] for name in entry["names"]}
        for allow in (False, True)
    }
    assert names[False] - names[True] == PTRACE_FAMILY
    program = seccomp.bpf(allow_ptrace=True)
    assert verdict(run_filter(program, 101, [0] * 6)) is None  # PTRACE_TRACEME
    assert verdict(run_filter(program, 312, [0] * 6)) == errno.EPERM  # kcmp stays refused


# What the issue names, and what Docker's default profile refuses on x86_64 to a container
# without added capabilities (its allow list, read from moby's seccomp/default.json).
REQUIRED = {
    "add_key", "request_key", "keyctl", "unshare", "setns", "mount", "umount2", "pivot_root", "chroot",
    "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "clone3", "ptrace",
    "process_vm_readv", "process_vm_writev", "perf_event_open", "personality", "userfaultfd", "io_uring_setup",
    "io_uring_enter", "io_uring_register", "init_module", "finit_module", "delete_module", "create_module",
    "kexec_load", "kexec_file_load", "bpf", "syslog", "acct", "open_by_handle_at", "name_to_handle_at", "kcmp",
    "iopl", "ioperm", "lookup_dcookie", "quotactl", "reboot", "swapon", "swapoff", "settimeofday",
    "clock_settime", "uselib", "ustat", "sysfs", "_sysctl", "ioctl", "socket", "clone",
}  # fmt: skip
DOCKER_DEFAULT_REFUSES = {
    "syslog", "uselib", "ustat", "sysfs", "vhangup", "pivot_root", "_sysctl", "chroot", "acct", "settimeofday",
    "mount", "umount2", "swapon", "swapoff", "reboot", "sethostname", "setdomainname", "iopl", "ioperm",
    "create_module", "init_module", "delete_module", "get_kernel_syms", "query_module", "quotactl",
    "nfsservctl", "getpmsg", "putpmsg", "afs_syscall", "tuxcall", "security", "lookup_dcookie", "clock_settime",
    "vserver", "mbind", "set_mempolicy", "get_mempolicy", "kexec_load", "add_key", "request_key", "keyctl",
    "migrate_pages", "unshare", "move_pages", "perf_event_open", "fanotify_init", "open_by_handle_at", "setns",
    "kcmp", "finit_module", "kexec_file_load", "bpf", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "clone3",
    "pidfd_getfd", "process_madvise", "mount_setattr", "quotactl_fd", "set_mempolicy_home_node",
    "lsm_get_self_attr", "lsm_set_self_attr", "lsm_list_modules", "open_tree_attr", "file_getattr",
    "file_setattr",
}  # fmt: skip


def test_the_definition_covers_the_issue_and_dockers_default() -> None:
    names = {rule.syscall for rule in seccomp_rules.RULES}
    assert names >= REQUIRED
    unconditional = {rule.syscall for rule in seccomp.rules(allow_ptrace=True) if not rule.conditions}
    assert unconditional >= DOCKER_DEFAULT_REFUSES


def test_rule_numbers_are_x86_64s() -> None:

    for rule in seccomp_rules.RULES:
        assert 0 <= rule.number <= seccomp_rules.REVIEWED_THROUGH
        known = pyseccomp.resolve_syscall(pyseccomp.Arch.X86_64, rule.syscall)
        if known >= 0:  # libseccomp 2.5 does not know the newest calls by name
            assert known == rule.number, rule.syscall
    by_name = {}
    for rule in seccomp_rules.RULES:
        assert by_name.setdefault(rule.syscall, rule.number) == rule.number


def test_each_rule_reads_as_documented() -> None:
    for rule in seccomp_rules.RULES:
        assert rule.errno in (errno.EPERM, errno.ENOSYS, errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT)
        assert rule.reason
        assert "\n" not in rule.reason
    doc = (REPO / "docs" / "seccomp.md").read_text(encoding="utf-8")
    for rule in seccomp_rules.RULES:
        assert f"`{rule.syscall}`" in doc, f"docs/seccomp.md does not list {rule.syscall}"


def test_a_rule_takes_one_condition_per_argument() -> None:
    twice = (Condition(index=0, op=Op.GE, value=3), Condition(index=0, op=Op.LE, value=9))
    with pytest.raises(ValueError, match="one condition per argument"):
        Rule(syscall="socket", number=41, errno=errno.EPERM, reason="r", conditions=twice)
    with pytest.raises(ValueError, match="only MASKED_EQ takes a mask"):
        Condition(index=0, op=Op.EQ, value=1, mask=1)
    with pytest.raises(ValueError, match="arguments 0 to 5"):
        Condition(index=6, op=Op.EQ, value=1)


def _rendered(condition: Condition) -> dict[str, object]:
    if condition.op is Op.MASKED_EQ:
        return {
            "index": condition.index,
            "op": "SCMP_CMP_MASKED_EQ",
            "value": condition.mask,
            "valueTwo": condition.value,
        }
    return {"index": condition.index, "op": f"SCMP_CMP_{condition.op.name}", "value": condition.value, "valueTwo": 0}


@pytest.mark.parametrize("allow_ptrace", [False, True])
def test_docker_profile_holds_exactly_the_rules(allow_ptrace: bool) -> None:
    profile = seccomp.docker_profile(allow_ptrace=allow_ptrace)
    assert profile["defaultAction"] == "SCMP_ACT_ALLOW"
    assert profile["architectures"] == ["SCMP_ARCH_X86_64"]
    rendered = []
    for entry in profile["syscalls"]:
        assert entry["action"] == "SCMP_ACT_ERRNO"
        for name in entry["names"]:
            rendered.append((name, entry["errnoRet"], json.dumps(entry.get("args", []), sort_keys=True)))
    expected = [
        (rule.syscall, rule.errno, json.dumps([_rendered(c) for c in rule.conditions], sort_keys=True))
        for rule in seccomp.rules(allow_ptrace=allow_ptrace)
    ]
    assert rendered == expected


def test_docker_profile_json_is_canonical() -> None:
    text = seccomp.docker_profile_json(allow_ptrace=False)
    assert json.loads(text) == seccomp.docker_profile(allow_ptrace=False)
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    for name in ("keyctl", "clone3", "io_uring_setup", "open_by_handle_at", "ptrace", "personality"):
        assert f'"{name}"' in text
    assert '"ptrace"' not in seccomp.docker_profile_json(allow_ptrace=True)


def test_digest_is_the_programs_sha256() -> None:
    for allow in (False, True):
        program = seccomp.bpf(allow_ptrace=allow)
        assert len(program) % 8 == 0
        assert seccomp.digest(allow_ptrace=allow) == hashlib.sha256(program).hexdigest()
    assert seccomp.digest(allow_ptrace=False) != seccomp.digest(allow_ptrace=True)


def test_digest_is_the_same_in_every_run() -> None:
    code = (
        "from sandboxer.core import seccomp; "
        "print(seccomp.digest(allow_ptrace=False), seccomp.digest(allow_ptrace=True))"
    )
    runs = {
        subprocess.run(
            [sys.executable, "-c", code], env={"PYTHONHASHSEED": seed}, capture_output=True, text=True, check=True
        ).stdout
        for seed in ("1", "2", "random")
    }
    assert runs == {f"{seccomp.digest(allow_ptrace=False)} {seccomp.digest(allow_ptrace=True)}\n"}


def test_loading_the_policy_module_does_not_load_libseccomp() -> None:
    code = "import sys, sandboxer.core.seccomp, sandboxer.host.seccomp_install; print('pyseccomp' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env={}).stdout
    assert out == "False\n"
