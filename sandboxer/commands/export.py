"""`export`: a sandbox's work (sandboxer.commands.work) out to its caller — its new commits as
a Git bundle or a patch series, or its working tree as a tar.

The sandbox's git writes the export; it lands in a quarantine directory of the broker's
(`<state>/exports/`, owner-only) where the host verifies it with git that runs on nothing of the
sandbox's but that output: a bundle by `git bundle verify` in a fresh repository (no config, no
hooks, no templates) that borrows the profile repository's objects for the bundle's
prerequisites, its heads the head the sandbox reported; a patch series is split where each of
the commits the sandbox named begins; a tree's tar is read member by member (files, directories,
and links that stay inside, by relative names). Only then is it delivered to the caller
(sandboxer.commands.export_delivery), and the record notes what was taken out.
"""

from __future__ import annotations

import contextlib
import os
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from sandboxer.commands.work import WorkState, git_inside, work_state
from sandboxer.errors import BackendError, UsageError
from sandboxer.host.fstree import remove_tree
from sandboxer.host.registry import Registry
from sandboxer.host.workspace import run_git

if TYPE_CHECKING:
    from sandboxer.core.record import WorkRecord
    from sandboxer.dirs import Dirs

Format = Literal["bundle", "patch", "tar"]
FORMATS: tuple[Format, ...] = ("bundle", "patch", "tar")
EXPORTS = "exports"  # in the state dir: quarantine while an export runs, and what the reaper kept
_FROM_LINE = "From {} Mon Sep 17 00:00:00 2001\n"  # what git format-patch starts each patch with


@dataclass(frozen=True, slots=True)
class Export:
    """A verified export in its quarantine directory, ready to deliver: `files` (name, path) in
    order — one for a bundle or a tar, one per commit for a patch series."""

    sandbox_id: str
    format: Format
    state: WorkState
    work: WorkRecord
    directory: str
    files: tuple[tuple[str, str], ...]

    def summary(self, destination: str | None = None) -> dict[str, Any]:
        """export --json."""
        return {
            "id": self.sandbox_id,
            "format": self.format,
            "destination": destination,
            "files": [name for name, _ in self.files],
            "head": self.state.head,
            "branch": self.state.branch,
            "base": self.work.base,
            "ref": self.work.ref,
            "ahead": self.state.ahead,
            "dirty": self.state.dirty,
        }


def check_format(name: str) -> Format:
    for known in FORMATS:
        if name == known:
            return known
    raise UsageError(f"export: the format must be one of {', '.join(FORMATS)}")


def prepare(dirs: Dirs, sandbox_id: str, fmt: Format) -> Export:
    """Take the work out of the sandbox into a new quarantine directory and verify it. The
    caller delivers it and then calls `finished` (or `discard_quarantine` when it could not)."""
    state, work = work_state(dirs, sandbox_id)
    if fmt != "tar" and state.ahead == 0:
        dirty = " (its tree has changes not committed: commit them, or export --tar)" if state.dirty else ""
        raise UsageError(f"export: sandbox {sandbox_id} has no commits since {work.ref}{dirty}")
    if fmt != "tar" and state.commits is None:
        raise UsageError(
            f"export: sandbox {sandbox_id}: the commit its workspace started from is gone from its history"
        )
    directory = _quarantine(dirs)
    try:
        if fmt == "bundle":
            files = _bundle(dirs, sandbox_id, state, work, directory)
        elif fmt == "patch":
            files = _patches(dirs, sandbox_id, state, work, directory)
        else:
            files = _tar(dirs, sandbox_id, state, directory)
    except BaseException:
        remove_tree(directory)
        raise
    return Export(sandbox_id, fmt, state, work, directory, files)


def finished(dirs: Dirs, export: Export) -> None:
    """The export reached its caller: note what it took out (teardown then loses nothing of
    it) and remove the quarantine."""
    try:
        taken = ("tree", export.state.tree) if export.format == "tar" else ("commits", export.state.head)
        registry = Registry(dirs.state)
        lock = registry.lock(export.sandbox_id)
        if lock is None:
            raise BackendError(f"sandbox {export.sandbox_id}: its lock could not be taken")
        try:
            record = registry.read_or_none(export.sandbox_id)
            if record is not None and record.work is not None and taken not in record.work.exported:
                work = replace(record.work, exported=(*record.work.exported, taken))
                registry.write(replace(record, work=work))
        finally:
            os.close(lock)
    finally:
        remove_tree(export.directory)


def discard_quarantine(export: Export) -> None:
    remove_tree(export.directory)


def _quarantine(dirs: Dirs) -> str:
    import tempfile

    root = os.path.join(dirs.state, EXPORTS)
    os.makedirs(root, mode=0o700, exist_ok=True)
    return tempfile.mkdtemp(prefix=".export-", dir=root)


def _bundle(
    dirs: Dirs, sandbox_id: str, state: WorkState, work: WorkRecord, directory: str
) -> tuple[tuple[str, str], ...]:
    """The new commits as a bundle of HEAD (and its branch), with the base as prerequisite."""
    path = os.path.join(directory, "bundle")
    refs = ["HEAD", *([f"refs/heads/{state.branch}"] if state.branch else [])]
    with _new_file(path) as fd:
        git_inside(dirs, sandbox_id, ["git", "bundle", "create", "--quiet", "-", *refs, f"^{work.base}"], into=fd)
    _verify_bundle(path, state, work, directory)
    return (("bundle", path),)


def _verify_bundle(path: str, state: WorkState, work: WorkRecord, directory: str) -> None:
    """`git bundle verify` in a fresh repository of the broker's that borrows the profile
    repository's objects (the prerequisites); its heads must be the head the sandbox reported."""
    home = os.path.join(directory, "home")
    os.mkdir(home, 0o700)
    repository = os.path.join(directory, "verify.git")
    if run_git(["init", "--quiet", "--bare", "--template=", repository], home=home).returncode != 0:
        raise BackendError("export: the quarantine repository cannot be made")
    objects = _objects_of(work.repository)
    if objects is not None:
        with open(os.path.join(repository, "objects", "info", "alternates"), "w") as alternates:
            alternates.write(objects + "\n")
    checked = run_git(["bundle", "verify", "--quiet", path], home=home, cwd=repository)
    if checked.returncode != 0:
        raise BackendError("export: the sandbox's bundle does not verify against the profile's repository")
    heads = run_git(["bundle", "list-heads", path], home=home, cwd=repository)
    listed = {line.split(" ", 1)[0] for line in heads.stdout.decode(errors="replace").splitlines() if line}
    if heads.returncode != 0 or listed != {state.head}:
        raise BackendError("export: the sandbox's bundle holds other heads than it reported")


def _objects_of(repository: str) -> str | None:
    """The object directory of the profile's repository (a work tree's or a bare one's)."""
    for candidate in (os.path.join(repository, ".git", "objects"), os.path.join(repository, "objects")):
        if os.path.isdir(candidate):
            return candidate
    return None


def _patches(
    dirs: Dirs, sandbox_id: str, state: WorkState, work: WorkRecord, directory: str
) -> tuple[tuple[str, str], ...]:
    """One patch per new commit (git format-patch), split where each of them begins."""
    mbox = os.path.join(directory, "series.mbox")
    with _new_file(mbox) as fd:
        argv = ["git", "format-patch", "--stdout", "--no-color", f"{work.base}..{state.head}"]
        git_inside(dirs, sandbox_id, argv, into=fd)
    with open(mbox, "rb") as stream:
        text = stream.read().decode("utf-8", errors="surrogateescape")
    commits = state.commits or ()
    starts: list[int] = []
    position = 0
    for commit in commits:
        found = text.find(_FROM_LINE.format(commit), position)
        if found < 0 or (not starts and found != 0):
            raise BackendError("export: the sandbox's patch series does not hold the commits it reported")
        starts.append(found)
        position = found + 1
    files = []
    for index, start in enumerate(starts):
        end = starts[index + 1] if index + 1 < len(starts) else len(text)
        body = text[start:end]
        name = f"{index + 1:04d}-{_slug(body)}.patch"
        path = os.path.join(directory, name)
        with open(path, "xb") as out:
            out.write(body.encode("utf-8", errors="surrogateescape"))
        files.append((name, path))
    os.unlink(mbox)
    return tuple(files)


def _slug(patch: str) -> str:
    """A file name part from a patch's subject, as git format-patch makes one."""
    subject = next((line[9:] for line in patch.splitlines() if line.startswith("Subject: ")), "")
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", subject)
    slug = re.sub(r"\.{2,}", ".", re.sub(r"[^A-Za-z0-9._]+", "-", subject)).strip("-.")[:52].rstrip("-.")
    return slug or "patch"


def _tar(dirs: Dirs, sandbox_id: str, state: WorkState, directory: str) -> tuple[tuple[str, str], ...]:
    """The working tree (as the state's tree object) as a tar, read through before delivery."""
    path = os.path.join(directory, "tree.tar")
    with _new_file(path) as fd:
        git_inside(dirs, sandbox_id, ["git", "archive", "--format=tar", state.tree], into=fd)
    _verify_tar(path)
    return (("tree.tar", path),)


def _verify_tar(path: str) -> None:
    """Files, directories and links that stay inside the tree, by relative names; nothing else."""
    try:
        with tarfile.open(path, "r:") as archive:
            for member in archive:
                name = member.name.rstrip("/")
                parts = name.split("/")
                if (
                    not name
                    or name.startswith("/")
                    or ".." in parts
                    or not (member.isfile() or member.isdir() or member.issym())
                ):
                    if member.type == tarfile.XGLTYPE:
                        continue
                    raise BackendError(
                        f"export: the sandbox's tar holds {name[:100]!r}, which is not a plain part of a tree"
                    )
                if member.issym():
                    target = os.path.normpath(os.path.join(os.path.dirname(name), member.linkname))
                    if member.linkname.startswith("/") or target == ".." or target.startswith("../"):
                        raise BackendError(f"export: {name[:100]!r} in the tree links outside it")
    except (tarfile.TarError, OSError) as exc:
        raise BackendError(f"export: the sandbox's tar cannot be read ({exc})") from None


@contextlib.contextmanager
def _new_file(path: str) -> Iterator[int]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        yield fd
    finally:
        os.close(fd)
