"""The tree `tar -x` makes of an untrusted archive, modelled member by member, to judge it before
anyone unpacks it: nothing is created, and no link resolves, outside the directory it is
unpacked in (GNU tar with its default options, Python's tarfile with filter='data').

What a tree's tar needs is small — git archive writes each path once, directories before what
they hold, and no hard links — so the model refuses everything else outright rather than
predicting what each tar would do with it: a name that is not plain (absolute, empty, `.` or
`..` parts), a member other than a file, directory or symbolic link, one below a link or a file,
a name given twice (a later member replacing an earlier one), and a link with an absolute target.
Every creation then happens in a real directory of the tree.

What is left is where the links point, and a link alone says too little: `a/b -> ..` stays
inside, and so does `c -> a/b/..` read as a name, but through a/b it is the parent of the top.
So each link is resolved as the kernel (and os.path.realpath) would resolve it in the finished
tree: every link on the way is followed, `..` goes up from where a link led, a component that
no member makes is taken as it is. A link that leads above the top, or through more than
MAX_FOLLOWED links (a loop), is refused. The tree judged is the finished one: a link can only
change where another leads by being in the tree, and once there it never changes again.

Pure: names and targets in, a refusal (TreeRefused) out; the caller reads the archive.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

MAX_FOLLOWED = 40  # links followed in resolving one target: the kernel's limit for one lookup
# The pax keywords git archive writes (a global comment: the commit; a name, a target or a size
# too long for the old header), and the times and owners any tar may. Others (GNU.sparse.*,
# SCHILY.*, hdrcharset, vendor keywords) are where two tars could read one member differently.
PAX_KEYWORDS = frozenset(
    {"comment", "path", "linkpath", "size", "mtime", "atime", "ctime", "uid", "gid", "uname", "gname"}
)
Kind = Literal["directory", "file", "link"]


class TreeRefused(ValueError):
    """Why the archive is refused: one line naming the member and the rule."""


def shown(name: str) -> str:
    """A member's name as a message may print it: ASCII, at most 100 characters, quoted."""
    return repr(name[:100].encode("ascii", errors="backslashreplace").decode())


def check_keywords(name: str, keywords: Iterable[str]) -> None:
    """Refuse a member whose pax headers (its own and the global ones) hold a keyword other than
    PAX_KEYWORDS."""
    unknown = sorted(set(keywords) - PAX_KEYWORDS)
    if unknown:
        raise TreeRefused(f"{shown(name)} with the pax keyword {shown(unknown[0])}, which a tree's tar never has")


class TreeModel:
    """The tree an archive unpacks to: each path's kind, and each link's target in archive order."""

    def __init__(self) -> None:
        self._kinds: dict[str, Kind] = {}
        self._links: dict[str, str] = {}

    def add(self, name: str, kind: Kind, target: str = "") -> None:
        """One member, in archive order (a directory's name without its trailing slash)."""
        parts = name.split("/")
        if any(part in ("", ".", "..") for part in parts):
            raise TreeRefused(f"{shown(name)}, which is not a plain part of a tree")
        # Every path in the model has directories all the way up: walk up to the first one there.
        missing = []
        end = name.rfind("/")
        while end > 0:
            above = name[:end]
            made = self._kinds.get(above)
            if made == "directory":
                break
            if made is not None:
                raise TreeRefused(f"{shown(name)}, which is below a {made} of the tree, not a directory")
            missing.append(above)
            end = name.rfind("/", 0, end)
        for above in missing:
            self._kinds[above] = "directory"  # tar makes a missing one
        seen = self._kinds.get(name)
        if seen is not None and (seen != "directory" or kind != "directory"):
            raise TreeRefused(f"{shown(name)} twice, which a tree never has")
        if kind == "link":
            if target.startswith("/"):
                raise TreeRefused(f"{shown(name)}, a link to an absolute path, which leads outside the tree")
            self._links[name] = target
        self._kinds[name] = kind

    def finish(self) -> None:
        """Judge every link in the finished tree (TreeRefused for the first that leads outside)."""
        for name, target in self._links.items():
            followed = [0]
            parent = name.split("/")[:-1]
            try:
                inside = self._resolve(parent, target, followed)
            except _Loop:
                raise TreeRefused(
                    f"{shown(name)}, a link through more than {MAX_FOLLOWED} links (a loop), which no tar resolves"
                ) from None
            if inside is None:
                raise TreeRefused(f"{shown(name)}, a link that leads outside the tree through the links it names")

    def _resolve(self, start: list[str], target: str, followed: list[int]) -> list[str] | None:
        """The path (its parts below the top) that `target` leads to from the directory `start`,
        every link on the way followed; None when it leads above the top."""
        path = list(start)
        for part in target.split("/"):
            if part in ("", "."):
                continue
            if part == "..":
                if not path:
                    return None
                path.pop()
                continue
            link = self._links.get("/".join([*path, part]))
            if link is None:
                path.append(part)  # a directory, a file, or nothing (taken as named, as realpath does)
                continue
            followed[0] += 1
            if followed[0] > MAX_FOLLOWED:
                raise _Loop
            resolved = self._resolve(path, link, followed)
            if resolved is None:
                return None
            path = resolved
        return path


class _Loop(Exception):
    pass
