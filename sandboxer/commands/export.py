"""`export`: a sandbox's work (sandboxer.commands.work) out to its caller — its new commits as
a Git bundle or a patch series, or its working tree as a tar.

The sandbox's git writes the export; it lands in a quarantine directory of the broker's
(`<state>/exports/`, owner-only), at most twice the workspace's size and within its caller's
export budget (sandboxer.commands.export_space: one budget per caller across every export under
way and what is kept for it; room is reserved before it is written), where the host verifies it
with git that runs on nothing of the sandbox's but that output: a bundle is fetched, with every
object checked (transfer.fsckObjects), into a fresh repository (no config, no hooks, no
templates) that borrows the profile repository's objects for the bundle's prerequisites, and its
heads must be the head the sandbox reported; a patch series is split, as it is read, where each
of the commits the sandbox listed begins; a tree's tar is read member by member (files,
directories, and links that stay inside, by relative names, never below another link). Only
then is it delivered to the caller (sandboxer.commands.export_delivery), and the record notes
what was taken out.
"""

from __future__ import annotations

import contextlib
import os
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from sandboxer.api.results import Exported
from sandboxer.backends import Backends
from sandboxer.commands.export_space import RESERVE_STEP, Budget, Quarantine
from sandboxer.commands.making import before
from sandboxer.commands.work import GIT, GIT_SECONDS, WorkState, git_inside, ready_work, work_state
from sandboxer.core.tarcheck import TreeModel, TreeRefused, check_keywords, shown
from sandboxer.errors import BackendError, SandboxerError, UsageError
from sandboxer.host.hostgit import run_git
from sandboxer.host.registry import Registry
from sandboxer.host.workspace import is_commit_id

if TYPE_CHECKING:
    from sandboxer.core.record import SandboxRecord, WorkRecord
    from sandboxer.dirs import Dirs

Format = Literal["bundle", "patch", "tar"]
FORMATS: tuple[Format, ...] = ("bundle", "patch", "tar")
MAX_MEMBERS = 1_000_000  # entries of a tree's tar
_FROM_LINE = b"From %s Mon Sep 17 00:00:00 2001\n"  # what git format-patch starts each patch with


@dataclass(frozen=True, slots=True)
class Export:
    """A verified export in its quarantine directory, ready to deliver: `files` (name, path) in
    order — one for a bundle or a tar, one per commit for a patch series."""

    sandbox_id: str
    format: Format
    state: WorkState
    work: WorkRecord
    quarantine: Quarantine
    files: tuple[tuple[str, str], ...]

    @property
    def directory(self) -> str:
        """The quarantine directory it is in."""
        return self.quarantine.path

    @property
    def taken(self) -> tuple[str, str]:
        """What it takes out, as the record notes it: the commits up to its head, or its tree."""
        return ("tree", self.state.tree) if self.format == "tar" else ("commits", self.state.head)

    def summary(self, destination: str | None = None) -> Exported:
        """What it took out (export --json), delivered to `destination`."""
        return Exported(
            id=self.sandbox_id,
            format=self.format,
            destination=destination,
            files=tuple(name for name, _ in self.files),
            head=self.state.head,
            branch=self.state.branch,
            base=self.work.base,
            ref=self.work.ref,
            ahead=self.state.ahead,
            dirty=self.state.dirty,
        )


def check_format(name: str) -> Format:
    for known in FORMATS:
        if name == known:
            return known
    raise UsageError(f"export: the format must be one of {', '.join(FORMATS)}")


def prepare(
    dirs: Dirs,
    sandbox_id: str,
    fmt: Format,
    *,
    backends: Backends,
    budget: Budget,
    state: WorkState | None = None,
    seconds: float = GIT_SECONDS,
) -> Export:
    """Take the work out of the sandbox into a new quarantine directory and verify it, within
    the caller's `budget` (PolicyError, 3, past it: nothing is left behind; `state`: the work as
    the caller asked the sandbox's git a moment ago; `seconds`: each git command's time). The
    caller delivers it and then calls `finished` (or `discard_quarantine`)."""
    record, work = ready_work(dirs, sandbox_id)
    if state is None:
        state, work = work_state(dirs, sandbox_id, backends=backends, seconds=seconds)
    if fmt != "tar" and state.ahead == 0:
        dirty = " (its tree has changes not committed: commit them, or export --tar)" if state.dirty else ""
        raise UsageError(f"export: sandbox {sandbox_id} has no commits since {work.ref}{dirty}")
    if fmt != "tar" and state.ahead is None:
        raise UsageError(
            f"export: sandbox {sandbox_id}: the commit its workspace started from is gone from its history"
        )
    before("the export's quarantine")  # a service's caller: still granted
    quarantine = Quarantine(dirs.state, budget)
    try:
        inside = _Inside(dirs, record, quarantine, seconds, backends)
        if fmt == "bundle":
            files = _bundle(inside, state, work)
        elif fmt == "patch":
            files = _patches(inside, state, work)
        else:
            files = _tar(inside, state)
    except BaseException:
        quarantine.remove()
        raise
    return Export(sandbox_id, fmt, state, work, quarantine, files)


def finished(dirs: Dirs, export: Export) -> bool:
    """The export reached its caller: note what it took out (teardown then loses nothing of it)
    and remove the quarantine. False when it could not be noted (the sandbox went meanwhile, say):
    the caller has its export all the same, and teardown would only ask for --discard."""
    try:
        return note_exported(dirs, export.sandbox_id, export.taken)
    finally:
        export.quarantine.remove()


def note_exported(dirs: Dirs, sandbox_id: str, taken: tuple[str, str]) -> bool:
    """Note in the sandbox's record that an export took `taken` out; False when it cannot be."""
    registry = Registry(dirs.state)
    try:
        lock = registry.lock(sandbox_id)
    except (OSError, SandboxerError):
        return False
    if lock is None:
        return False
    try:
        record = registry.read_or_none(sandbox_id)
        if record is None or record.work is None or record.state != "ready":
            return False
        if taken not in record.work.exported:
            work = replace(record.work, exported=(*record.work.exported, taken))
            registry.write(replace(record, work=work))
        return True
    except (OSError, SandboxerError):
        return False
    finally:
        os.close(lock)


def discard_quarantine(export: Export) -> None:
    """Remove the export's quarantine (and its reservation) without noting anything."""
    export.quarantine.remove()


@dataclass(frozen=True, slots=True)
class _Inside:
    """Where an export's git runs (the sandbox) and where its output goes (the quarantine)."""

    dirs: Dirs
    record: SandboxRecord
    quarantine: Quarantine
    seconds: float
    backends: Backends

    @property
    def directory(self) -> str:
        return self.quarantine.path

    def git(self, name: str, *args: str) -> str:
        """Run the broker's `git ARGS` in the sandbox into the quarantine file `name` (room for
        each chunk reserved before it is written); its path."""
        path = os.path.join(self.directory, name)
        with _new_file(path) as fd:
            git_inside(
                self.dirs,
                self.record,
                [*GIT, *args],
                backends=self.backends,
                into=fd,
                room=self.quarantine.need,
                seconds=self.seconds,
            )
        return path


def _bundle(inside: _Inside, state: WorkState, work: WorkRecord) -> tuple[tuple[str, str], ...]:
    """The new commits as a bundle of HEAD (and its branch), with the base as prerequisite."""
    refs = ["HEAD", *([f"refs/heads/{state.branch}"] if state.branch else [])]
    path = inside.git("bundle", "bundle", "create", "--quiet", "-", *refs, f"^{work.base}")
    # The verifying fetch copies the bundle's objects once more (and the bases of a thin pack):
    # room for twice the bundle first, then what it really wrote is measured.
    inside.quarantine.need(2 * os.stat(path).st_size + RESERVE_STEP)
    _verify_bundle(path, state, work, inside.directory)
    inside.quarantine.settle()
    return (("bundle", path),)


def _verify_bundle(path: str, state: WorkState, work: WorkRecord, directory: str) -> None:
    """Fetch the bundle into a fresh repository of the broker's that borrows the profile
    repository's objects (the prerequisites), every object checked; its heads must all be the
    head the sandbox reported."""
    home = os.path.join(directory, "home")
    os.mkdir(home, 0o700)
    repository = os.path.join(directory, "verify.git")
    if run_git(["init", "--quiet", "--bare", "--template=", repository], home=home).returncode != 0:
        raise BackendError("export: the quarantine repository cannot be made")
    objects = _objects_of(work.repository)
    if objects is not None:
        with open(os.path.join(repository, "objects", "info", "alternates"), "w") as alternates:
            alternates.write(objects + "\n")
    heads = run_git(["bundle", "list-heads", path], home=home, cwd=repository)
    listed = {line.split(" ", 1)[0] for line in heads.stdout.decode(errors="replace").splitlines() if line}
    if heads.returncode != 0 or listed != {state.head}:
        raise BackendError("export: the sandbox's bundle holds other heads than it reported")
    checked = ["-c", "transfer.fsckObjects=true", "fetch", "--quiet", "--no-tags", path, "HEAD:refs/heads/exported"]
    if run_git(checked, home=home, cwd=repository).returncode != 0:
        raise BackendError("export: the sandbox's bundle does not verify against the profile's repository")
    fetched = run_git(["rev-parse", "--verify", "refs/heads/exported"], home=home, cwd=repository)
    if fetched.returncode != 0 or fetched.stdout.decode(errors="replace").strip() != state.head:
        raise BackendError("export: the sandbox's bundle holds another head than it reported")


def _objects_of(repository: str) -> str | None:
    """The object directory of the profile's repository (a work tree's or a bare one's)."""
    for candidate in (os.path.join(repository, ".git", "objects"), os.path.join(repository, "objects")):
        if os.path.isdir(candidate):
            return candidate
    return None


def _patches(inside: _Inside, state: WorkState, work: WorkRecord) -> tuple[tuple[str, str], ...]:
    """One patch per new commit (git format-patch), split as it is read where each of the
    commits the sandbox listed begins. An empty commit is a patch of its own (--always); a merge
    is refused: a patch series cannot carry one (a bundle can)."""
    listing = inside.git("commits", "rev-list", "--reverse", "--parents", f"{work.base}..{state.head}")
    mbox = inside.git("series.mbox", "format-patch", "--always", "--stdout", "--no-color", f"{work.base}..{state.head}")
    # Its split copy, and later (through HTTP) the tar of the patch files: once more each.
    inside.quarantine.need(os.stat(mbox).st_size + RESERVE_STEP)
    files: list[tuple[str, str]] = []
    with open(listing, "rb") as commits, open(mbox, "rb") as series:
        expected = _next_commit(commits)
        out = None
        try:
            for line in series:
                if expected is not None and line == _FROM_LINE % expected:
                    if out is not None:
                        out.close()
                        files[-1] = _named(files[-1], len(files))
                    part = os.path.join(inside.directory, f"part-{len(files) + 1}")
                    out = open(part, "xb")  # noqa: SIM115 - closed when the next one begins, or below
                    files.append((part, part))
                    expected = _next_commit(commits)
                elif out is None:
                    raise BackendError("export: the sandbox's patch series does not begin with its first commit")
                out.write(line)
        finally:
            if out is not None:
                out.close()
        if expected is not None or not files:
            raise BackendError("export: the sandbox's patch series does not hold the commits it listed")
    files[-1] = _named(files[-1], len(files))
    os.unlink(mbox)
    os.unlink(listing)
    return tuple(files)


def _next_commit(commits: Any) -> bytes | None:
    """The next commit of a `rev-list --parents` listing (each line: the commit, its parents)."""
    ids = commits.readline().split()
    if not ids:
        return None
    if not all(is_commit_id(part.decode(errors="replace")) for part in ids):
        raise BackendError("export: the sandbox's git listed its commits out of shape")
    if len(ids) > 2:
        merge = ids[0].decode()[:12]
        raise UsageError(f"export: --patch cannot carry the merge commit {merge}: export a bundle, which can")
    return bytes(ids[0])


def _named(part: tuple[str, str], number: int) -> tuple[str, str]:
    """A finished patch file under its name, NNNN-subject.patch."""
    _, path = part
    with open(path, "rb") as stream:
        subject = next((line[9:] for line in stream if line.startswith(b"Subject: ")), b"")
    name = f"{number:04d}-{_slug(subject.decode('utf-8', errors='replace'))}.patch"
    renamed = os.path.join(os.path.dirname(path), name)
    os.rename(path, renamed)
    return name, renamed


def _slug(subject: str) -> str:
    """A file name part from a patch's subject, as git format-patch makes one."""
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", subject.strip())
    slug = re.sub(r"\.{2,}", ".", re.sub(r"[^A-Za-z0-9._]+", "-", subject)).strip("-.")[:52].rstrip("-.")
    return slug or "patch"


def _tar(inside: _Inside, state: WorkState) -> tuple[tuple[str, str], ...]:
    """The working tree (as the state's tree object) as a tar, read through before delivery."""
    path = inside.git("tree.tar", "archive", "--format=tar", state.tree)
    _verify_tar(path)
    return (("tree.tar", path),)


def _verify_tar(path: str) -> None:
    """Files, directories and symbolic links, each path once, none below a link, and every link
    leading inside the tree through the links it passes (sandboxer.core.tarcheck); nothing else
    (read as a stream: no member is kept, only each path's kind and each link's target)."""
    tree = TreeModel()
    count = 0
    try:
        with tarfile.open(path, "r|") as archive:
            for member in archive:
                if member.type in (tarfile.XGLTYPE, tarfile.XHDTYPE):
                    continue
                count += 1
                if count > MAX_MEMBERS:
                    raise BackendError(f"export: the sandbox's tar holds more than {MAX_MEMBERS} entries")
                check_keywords(member.name, member.pax_headers)
                if member.isdir():
                    tree.add(member.name.rstrip("/"), "directory")
                elif member.isfile():
                    tree.add(member.name, "file")
                elif member.issym():
                    tree.add(member.name, "link", member.linkname)
                else:
                    raise TreeRefused(f"{shown(member.name)}, which is not a plain part of a tree")
        tree.finish()
    except TreeRefused as exc:
        raise BackendError(f"export: the sandbox's tar holds {exc}") from None
    except (tarfile.TarError, OSError) as exc:
        raise BackendError(f"export: the sandbox's tar cannot be read ({type(exc).__name__})") from None


@contextlib.contextmanager
def _new_file(path: str) -> Iterator[int]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        yield fd
    finally:
        os.close(fd)
