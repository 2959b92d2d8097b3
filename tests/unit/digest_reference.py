"""Tree digest v1 re-implemented from its published format only, and random runtime trees to feed it.

Nothing here imports `sandboxer`: the reference must stay independent of the code it checks.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import strategies as st

from tests.conftest import make_runtime


def reference_records(root: str | os.PathLike[str]) -> list[bytes]:
    """The tree digest v1 records of `root`, in digest order."""
    records: dict[bytes, bytes] = {}

    def visit(full: bytes, rel: bytes) -> None:
        st_ = os.lstat(full)
        mode = b"%04o" % (st_.st_mode & 0o7777)
        if stat.S_ISDIR(st_.st_mode):
            records[rel] = b"D\0" + rel + b"\0" + mode + b"\n"
            for name in os.listdir(full):
                visit(os.path.join(full, name), name if rel == b"." else rel + b"/" + name)
        elif stat.S_ISREG(st_.st_mode):
            with open(full, "rb") as stream:
                content = hashlib.sha256(stream.read()).hexdigest().encode()
            records[rel] = b"F\0" + rel + b"\0" + mode + b"\0" + content + b"\n"
        elif stat.S_ISLNK(st_.st_mode):
            records[rel] = b"L\0" + rel + b"\0" + os.readlink(full) + b"\n"
        else:
            raise ValueError(f"not a file, directory or symlink: {full!r}")

    visit(os.fsencode(root), b".")
    return [records[rel] for rel in sorted(records)]


def reference_digest(root: str | os.PathLike[str]) -> str:
    """Tree digest v1 of `root`: sha256 of its records sorted by relative path bytes."""
    return hashlib.sha256(b"".join(reference_records(root))).hexdigest()


# Random trees. Modes stay clear of world-writable and setuid/setgid files (the artifact rules
# refuse them) and keep the owner's rwx on directories so the tree can always be removed.
FILE_MODES = (0o600, 0o644, 0o755, 0o700, 0o640, 0o444, 0o750, 0o1644)
DIR_MODES = (0o755, 0o700, 0o750, 0o711, 0o1755, 0o2755)
# '-', ' ', '!' sort before '.', so names made of them put records ahead of the root's own.
_NAME_PARTS = (b"a", b"b", b"Z", b"0", b"-", b".", b"_", b" ", b"!", b"~", b"\xff", b"\xfe", b"\xc3\xa9", b"\n")


@dataclass
class FileNode:
    """A regular file."""

    content: bytes
    mode: int


@dataclass
class LinkNode:
    """A relative symlink to some other entry of the tree (`pick` chooses it), or dangling inside it."""

    pick: int | None


@dataclass
class DirNode:
    """A directory and its children."""

    mode: int
    children: dict[bytes, Node] = field(default_factory=dict)


Node = FileNode | LinkNode | DirNode

names = (
    st.lists(st.sampled_from(_NAME_PARTS), min_size=1, max_size=5)
    .map(b"".join)
    .filter(lambda name: name not in (b".", b".."))
)


def _dirs(children: st.SearchStrategy[Node]) -> st.SearchStrategy[DirNode]:
    return st.builds(DirNode, mode=st.sampled_from(DIR_MODES), children=st.dictionaries(names, children, max_size=4))


_files = st.builds(FileNode, content=st.one_of(st.just(b""), st.binary(max_size=200)), mode=st.sampled_from(FILE_MODES))
_links = st.builds(LinkNode, pick=st.one_of(st.none(), st.integers(min_value=0, max_value=10_000)))
nodes: st.SearchStrategy[Node] = st.recursive(st.one_of(_files, _links, _dirs(st.nothing())), _dirs, max_leaves=12)
trees = st.dictionaries(names, nodes, max_size=6)


@dataclass
class BuiltTree:
    """What `build_tree` made, for checking the digest's counters."""

    root: Path
    files: int
    entries: int
    bytes: int


def build_tree(root: Path, tree: dict[bytes, Node]) -> BuiltTree:
    """Make `tree` at `root` on top of the minimal runtime (pyvenv.cfg, bin/python3)."""
    make_runtime(root)
    broot = os.fsencode(root)
    targets = [broot]
    links: list[tuple[bytes, LinkNode]] = []
    counts = {"files": 2, "entries": 4, "bytes": (root / "pyvenv.cfg").stat().st_size}
    counts["bytes"] += (root / "bin" / "python3").stat().st_size

    def create(parent: bytes, children: dict[bytes, Node]) -> None:
        for name, node in children.items():
            path = os.path.join(parent, name)
            if parent == broot and name in (b"bin", b"pyvenv.cfg"):
                continue
            counts["entries"] += 1
            if isinstance(node, FileNode):
                with open(path, "wb") as stream:
                    stream.write(node.content)
                os.chmod(path, node.mode)
                counts["files"] += 1
                counts["bytes"] += len(node.content)
                targets.append(path)
            elif isinstance(node, DirNode):
                os.mkdir(path)
                create(path, node.children)
                os.chmod(path, node.mode)
                targets.append(path)
            else:
                links.append((path, node))

    create(broot, tree)
    for path, link in links:
        if link.pick is None:
            target = b"dangling-target"
        else:
            target = os.path.relpath(targets[link.pick % len(targets)], os.path.dirname(path))
        os.symlink(target, path)
    return BuiltTree(root=root, files=counts["files"], entries=counts["entries"], bytes=counts["bytes"])
