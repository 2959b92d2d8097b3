"""The vocabulary of the syscall policy: a `Rule` refuses one x86_64 syscall, with an errno and a
reason, when all of its argument `Condition`s hold; `Op` is how a condition compares.

A rule takes at most one condition per argument: libseccomp refuses two comparisons of one
argument, and runc would split them into separate rules, turning an AND into an OR. The rules
themselves are in `seccomp_rules`; `seccomp` compiles and renders them.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

_U64 = (1 << 64) - 1


class Op(enum.IntEnum):
    """How a condition compares a 64-bit argument; the values are libseccomp's `scmp_compare`."""

    NE = 1
    LT = 2
    LE = 3
    EQ = 4
    GE = 5
    GT = 6
    MASKED_EQ = 7  # (argument & mask) == value


@dataclass(frozen=True, slots=True, kw_only=True)
class Condition:
    """One comparison of one syscall argument, unsigned over all 64 bits as the kernel passes it."""

    index: int
    op: Op
    value: int
    mask: int = _U64  # MASKED_EQ only

    def __post_init__(self) -> None:
        if not 0 <= self.index <= 5:
            raise ValueError(f"argument index {self.index}: a syscall has arguments 0 to 5")
        if not (0 <= self.value <= _U64 and 0 <= self.mask <= _U64):
            raise ValueError("condition values are unsigned 64-bit")
        if self.op is not Op.MASKED_EQ and self.mask != _U64:
            raise ValueError(f"{self.op.name}: only MASKED_EQ takes a mask")

    def holds(self, argument: int) -> bool:
        """Whether `argument` (as the filter reads it: unsigned 64-bit) satisfies the condition."""
        arg = argument & _U64
        match self.op:
            case Op.NE:
                return arg != self.value
            case Op.LT:
                return arg < self.value
            case Op.LE:
                return arg <= self.value
            case Op.EQ:
                return arg == self.value
            case Op.GE:
                return arg >= self.value
            case Op.GT:
                return arg > self.value
            case Op.MASKED_EQ:
                return arg & self.mask == self.value


@dataclass(frozen=True, slots=True, kw_only=True)
class Rule:
    """Refuse `syscall` (x86_64 number `number`) with `errno` when every condition holds."""

    syscall: str
    number: int
    errno: int
    reason: str
    conditions: tuple[Condition, ...] = ()
    ptrace: bool = False  # lifted by the profile key security.allow_ptrace

    def __post_init__(self) -> None:
        indexes = [condition.index for condition in self.conditions]
        if len(set(indexes)) != len(indexes):
            raise ValueError(f"{self.syscall}: one condition per argument (see the module docstring)")
        if "\n" in self.reason or not self.reason:
            raise ValueError(f"{self.syscall}: the reason is one line")

    def matches(self, args: Sequence[int]) -> bool:
        """Whether a call with these six arguments is refused by this rule."""
        return all(condition.holds(args[condition.index]) for condition in self.conditions)
