"""What removing (part of) a sandbox did: what went, and what is left behind (residue).

Every step of a teardown or gc — a backend's stop, release and remove_spool, the host's unmounts,
the directory — returns one `Removal`; the steps are added up (`+`, `Removal.merge`) into the
receipt the caller gets (sandboxer.commands.teardown.receipt_of). Residue is never an error by
itself: the receipt carries it and the command decides (teardown: exit status 6).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Removal:
    """What went (`removed`) and what is left (`residue`), each a line a person reads."""

    removed: tuple[str, ...] = ()
    residue: tuple[str, ...] = ()

    @classmethod
    def of(cls, removed: Iterable[str] = (), residue: Iterable[str] = ()) -> Removal:
        """A Removal from any sequences of lines."""
        return cls(removed=tuple(removed), residue=tuple(residue))

    @classmethod
    def merge(cls, parts: Iterable[Removal]) -> Removal:
        """The parts added up, in order."""
        removed: list[str] = []
        residue: list[str] = []
        for part in parts:
            removed += part.removed
            residue += part.residue
        return cls(removed=tuple(removed), residue=tuple(residue))

    def __add__(self, other: Removal) -> Removal:
        return Removal(removed=self.removed + other.removed, residue=self.residue + other.residue)

    @property
    def clean(self) -> bool:
        """Whether nothing is left behind."""
        return not self.residue
