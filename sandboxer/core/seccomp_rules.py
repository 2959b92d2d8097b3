"""The syscall policy's rules: `RULES`, every x86_64 syscall the sandbox refuses, and why.

Each rule names one syscall, the argument conditions under which it is refused (all must hold),
the errno the caller sees and the reason (`seccomp_types`). Anything no rule matches is allowed,
as flatpak does: a deny list keeps every ordinary program working and names each refusal with its
reason, where an allow list would break programs on every kernel that adds a syscall.
docs/seccomp.md lists every rule and the attack it stops; `seccomp` compiles them.
"""

from __future__ import annotations

from errno import EAFNOSUPPORT, ENOSYS, EPERM, EPROTONOSUPPORT

from sandboxer.core.seccomp_types import Condition, Op, Rule

_LOW32 = 0xFFFF_FFFF


def _each(*calls: tuple[str, int], errno: int, reason: str, ptrace: bool = False) -> tuple[Rule, ...]:
    return tuple(Rule(syscall=name, number=nr, errno=errno, reason=reason, ptrace=ptrace) for name, nr in calls)


def _cond(index: int, op: Op, value: int) -> Condition:
    return Condition(index=index, op=op, value=value)


def _masked(index: int, mask: int, value: int) -> Condition:
    return Condition(index=index, op=Op.MASKED_EQ, mask=mask, value=value)


# Namespace flags of clone(2). CLONE_NEWTIME (0x80) is absent: in clone's flags those bits are the
# exit signal, so the kernel takes CLONE_NEWTIME only from clone3 and unshare, both refused whole.
CLONE_NEW_FLAGS = (
    ("CLONE_NEWNS", 0x0002_0000),
    ("CLONE_NEWCGROUP", 0x0200_0000),
    ("CLONE_NEWUTS", 0x0400_0000),
    ("CLONE_NEWIPC", 0x0800_0000),
    ("CLONE_NEWUSER", 0x1000_0000),
    ("CLONE_NEWPID", 0x2000_0000),
    ("CLONE_NEWNET", 0x4000_0000),
)

# personality(2) values allowed, as in Docker's default profile: PER_LINUX, PER_LINUX32 (`linux32`),
# UNAME26, both, and 0xffffffff, which only reads the current value.
PERSONALITY_ALLOWED = (0x0000_0000, 0x0000_0008, 0x0002_0000, 0x0002_0008, 0xFFFF_FFFF)
_PERSONALITY_FLAGS = 0x0002_0008  # PER_LINUX32 | UNAME26


def _personality_rules() -> tuple[Rule, ...]:
    """Refuse every personality whose low 32 bits (all the kernel reads) are not allowed.

    Refused means: some bit outside PER_LINUX32|UNAME26 is set, and some bit is clear (which spares
    the query 0xffffffff). With one condition per argument that is a union of masked tests, each
    "bit b set and bit c clear": a cycle through the 30 other bits (b set, the next one clear) plus
    "bit 0 set and bit 3 clear" and "bit 0 set and bit 17 clear" covers it. A value with some of
    the 30 bits set either misses one of them (the cycle steps from a set to a clear bit) or has
    them all and misses bit 3 or 17; the allowed values have none of the 30 set, or no bit clear.
    """
    others = [bit for bit in range(32) if not _PERSONALITY_FLAGS >> bit & 1]
    pairs = [(bit, others[(i + 1) % len(others)]) for i, bit in enumerate(others)]
    pairs += [(others[0], bit) for bit in range(32) if _PERSONALITY_FLAGS >> bit & 1]
    reason = "execution-domain flags (ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC…) weaken a program's defences"
    return tuple(
        Rule(
            syscall="personality",
            number=135,
            errno=EPERM,
            reason=reason,
            conditions=(_masked(0, (1 << set_bit) | (1 << clear_bit), 1 << set_bit),),
        )
        for set_bit, clear_bit in pairs
    )


AF_UNIX, AF_INET, AF_INET6, AF_NETLINK = 1, 2, 10, 16
NETLINK_ROUTE = 0


def _socket_rules() -> tuple[Rule, ...]:
    """socket(2) for AF_UNIX, AF_INET, AF_INET6 and AF_NETLINK only; netlink for NETLINK_ROUTE only.

    Each refused family below AF_NETLINK is one EQ test; one GE test takes every family above it,
    and any value with high bits set (the kernel reads an int, so 1<<32|AF_PACKET is AF_PACKET).
    """
    allowed = (AF_UNIX, AF_INET, AF_INET6, AF_NETLINK)
    reason = "only local, IP and routing-netlink sockets: other families (AF_VSOCK, AF_PACKET, AF_ALG…) reach the host"
    gaps = [family for family in range(AF_NETLINK) if family not in allowed]
    rules = [
        Rule(syscall="socket", number=41, errno=EAFNOSUPPORT, reason=reason, conditions=(_cond(0, Op.EQ, family),))
        for family in gaps
    ]
    rules.append(
        Rule(
            syscall="socket",
            number=41,
            errno=EAFNOSUPPORT,
            reason=reason,
            conditions=(_cond(0, Op.GE, AF_NETLINK + 1),),
        )
    )
    rules.append(
        Rule(
            syscall="socket",
            number=41,
            errno=EPROTONOSUPPORT,
            reason="netlink only for NETLINK_ROUTE: audit, uevent, diag and generic netlink talk to host-wide services",
            conditions=(_cond(0, Op.EQ, AF_NETLINK), _cond(2, Op.NE, NETLINK_ROUTE)),
        )
    )
    rules.append(
        Rule(
            syscall="socketpair",
            number=53,
            errno=EAFNOSUPPORT,
            reason="socketpair for AF_UNIX only: another family would load its protocol module as socket would",
            conditions=(_cond(0, Op.NE, AF_UNIX),),
        )
    )
    return tuple(rules)


TIOCSTI = 0x5412
TIOCLINUX = 0x541C

RULES: tuple[Rule, ...] = (
    *_each(
        ("add_key", 248),
        ("request_key", 249),
        ("keyctl", 250),
        errno=EPERM,
        reason="kernel keyrings are not namespaced: a key stored or found here crosses the sandbox boundary",
    ),
    *_each(
        ("unshare", 272),
        ("setns", 308),
        errno=EPERM,
        reason="new namespaces (user namespaces above all) open kernel surface and could undo the sandbox's own",
    ),
    *(
        Rule(
            syscall="clone",
            number=56,
            errno=EPERM,
            reason=f"clone with {name}: a new namespace, as unshare",
            conditions=(_masked(0, flag, flag),),
        )
        for name, flag in CLONE_NEW_FLAGS
    ),
    *_each(
        ("clone3", 435),
        errno=ENOSYS,
        reason="its flags sit behind a pointer no filter can read; ENOSYS makes libc fall back to clone",
    ),
    *_each(
        ("mount", 165),
        ("umount2", 166),
        ("pivot_root", 155),
        ("chroot", 161),
        errno=EPERM,
        reason="the mount table and the root are set up by the sandbox, never changed by the command",
    ),
    *_each(
        ("open_tree", 428),
        ("move_mount", 429),
        ("fsopen", 430),
        ("fsconfig", 431),
        ("fsmount", 432),
        ("fspick", 433),
        ("mount_setattr", 442),
        ("open_tree_attr", 467),
        errno=ENOSYS,
        reason="the new mount API; ENOSYS so tools fall back to mount(2), which is refused",
    ),
    *_each(
        ("ptrace", 101),
        ("process_vm_readv", 310),
        ("process_vm_writev", 311),
        errno=EPERM,
        reason="reading and steering another process's memory; security.allow_ptrace lifts it for debuggers",
        ptrace=True,
    ),
    *_each(
        ("kcmp", 312),
        ("pidfd_getfd", 438),
        ("process_madvise", 440),
        errno=EPERM,
        reason="compares or takes another process's kernel objects; Docker's default refuses them too",
    ),
    *_each(
        ("perf_event_open", 298),
        errno=EPERM,
        reason="performance counters leak addresses and timing across processes and have a long CVE record",
    ),
    *_personality_rules(),
    *_each(
        ("userfaultfd", 323),
        errno=EPERM,
        reason="lets a program stall kernel page faults at will, widening the race windows of kernel exploits",
    ),
    *_each(
        ("io_uring_setup", 425),
        ("io_uring_enter", 426),
        ("io_uring_register", 427),
        errno=EPERM,
        reason="io_uring runs operations outside the syscall path this filter sees; a rich source of kernel bugs",
    ),
    *_each(
        ("init_module", 175),
        ("finit_module", 313),
        ("delete_module", 176),
        ("create_module", 174),
        ("get_kernel_syms", 177),
        ("query_module", 178),
        errno=EPERM,
        reason="loading or removing kernel modules changes the host kernel",
    ),
    *_each(
        ("kexec_load", 246),
        ("kexec_file_load", 320),
        errno=EPERM,
        reason="replaces the running kernel",
    ),
    *_each(
        ("bpf", 321),
        errno=EPERM,
        reason="eBPF programs run inside the kernel; the verifier is a large attack surface",
    ),
    *_each(
        ("syslog", 103),
        errno=EPERM,
        reason="the kernel log is host-wide: other tenants' messages and kernel addresses (KASLR)",
    ),
    *_each(
        ("acct", 163),
        ("reboot", 169),
        ("swapon", 167),
        ("swapoff", 168),
        ("settimeofday", 164),
        ("clock_settime", 227),
        errno=EPERM,
        reason="host-wide state: process accounting, power, swap and the wall clock",
    ),
    *_each(
        ("sethostname", 170),
        ("setdomainname", 171),
        errno=EPERM,
        reason="the sandbox's names are set when it is created",
    ),
    *_each(
        ("iopl", 172),
        ("ioperm", 173),
        errno=EPERM,
        reason="direct access to I/O ports bypasses every driver",
    ),
    *_each(
        ("quotactl", 179),
        ("quotactl_fd", 443),
        errno=EPERM,
        reason="disk quotas are host administration",
    ),
    *_each(
        ("open_by_handle_at", 304),
        ("name_to_handle_at", 303),
        errno=EPERM,
        reason="file handles name inodes past path confinement (the 'shocker' container escape used them)",
    ),
    *_each(
        ("fanotify_init", 300),
        errno=EPERM,
        reason="filesystem-wide monitoring, and permission events that stall other processes",
    ),
    *_each(
        ("vhangup", 153),
        errno=EPERM,
        reason="hangs up the controlling terminal",
    ),
    *_each(
        ("mbind", 237),
        ("set_mempolicy", 238),
        ("get_mempolicy", 239),
        ("migrate_pages", 256),
        ("move_pages", 279),
        ("set_mempolicy_home_node", 450),
        errno=EPERM,
        reason="NUMA placement, of other processes' pages too; Docker's default refuses it without CAP_SYS_NICE",
    ),
    *_each(
        ("lookup_dcookie", 212),
        ("uselib", 134),
        ("ustat", 136),
        ("sysfs", 139),
        ("_sysctl", 156),
        errno=EPERM,
        reason="obsolete interfaces with a record of kernel bugs; nothing current calls them",
    ),
    *_each(
        ("nfsservctl", 180),
        ("getpmsg", 181),
        ("putpmsg", 182),
        ("afs_syscall", 183),
        ("tuxcall", 184),
        ("security", 185),
        ("vserver", 236),
        errno=ENOSYS,
        reason="never implemented on x86_64: kept at ENOSYS should a kernel fill the slot",
    ),
    *_each(
        ("lsm_get_self_attr", 459),
        ("lsm_set_self_attr", 460),
        ("lsm_list_modules", 461),
        errno=ENOSYS,
        reason="LSM self-attributes: refused as by Docker's default; libraries fall back to /proc/self/attr",
    ),
    *_each(
        ("file_getattr", 468),
        ("file_setattr", 469),
        errno=ENOSYS,
        reason="newer than Docker's default profile, which refuses them; callers fall back to FS_IOC_FSGETXATTR",
    ),
    Rule(
        syscall="ioctl",
        number=16,
        errno=EPERM,
        reason="TIOCSTI pushes keystrokes into a terminal's input (the kernel reads the low 32 bits of the request)",
        conditions=(_masked(1, _LOW32, TIOCSTI),),
    ),
    Rule(
        syscall="ioctl",
        number=16,
        errno=EPERM,
        reason="TIOCLINUX can read and paste the virtual console's screen (low 32 bits, as TIOCSTI)",
        conditions=(_masked(1, _LOW32, TIOCLINUX),),
    ),
    *_socket_rules(),
)

REVIEWED_THROUGH = 469  # the highest x86_64 syscall number (Linux 6.18) this list was checked against
