"""The workspace: a fresh Git clone of the profile's repository, made on the host side safely.

Host-side git runs as sandboxer/host/hostgit.py runs it: no system or global configuration,
hooks disabled, no templates, in a process group of its own, killed with its broker. `--no-local`
makes git copy objects through its transport instead of hard-linking into the owner's
repository. Its HOME is a directory inside the sandbox's own (`git-home`, 0700), so what a killed
clone leaves goes with the sandbox. The finished clone has no remote and no reflog: nothing in it
names the owner's repository. Host-side git never runs inside a clone after a sandbox used it.
An unprivileged broker's sandbox keeps its workspace in a sized tmpfs of its own: the clone is
made on the host as above and then copied in (`seed`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

from sandboxer.core.plan import WORKSPACE_TARGET
from sandboxer.errors import BackendError, SandboxerError, UsageError
from sandboxer.host import procs
from sandboxer.host.fstree import copy_tree, remove_tree
from sandboxer.host.hostgit import run_git

__all__ = [
    "GIT_HOME",
    "Checkout",
    "check_repository",
    "clone",
    "is_commit_id",
    "refs_digest",
    "remove_tree",
    "seed",
]

GIT_HOME = "git-home"  # in the sandbox's directory: HOME of host-side git while it clones


@dataclass(frozen=True, slots=True)
class Checkout:
    """What a clone checks out: `ref`, on a new `branch` when one is given; the fields that name
    them in messages, and what a ref the repository lacks is (a manifest's revision: a refusal of
    the manifest, PolicyError; the profile's or a caller's --ref: UsageError)."""

    ref: str
    branch: str | None = None
    ref_field: str = "workspace.ref"
    branch_field: str = "task_branch"
    missing: type[SandboxerError] = UsageError
    fresh_branch: bool = False  # a caller's --branch: refused when the repository has one of that name


def clone(
    *,
    repository: str,
    checkout: Checkout,
    destination: str,
    git_home: str,
    profile_file: str,
    owner: tuple[int, int] | None,
    identity: tuple[str, str],
) -> str:
    """Clone `repository` at `ref` into `destination`, owned by `owner` if given, with the commit
    `identity` (name, email) in its own config: `git commit` works inside from the start. The
    commit it checked out is returned: what an export counts the sandbox's new commits from.

    `destination` is new, or an empty directory that must stay the same directory (a warm
    container already has it bound at /workspace). `git_home` is git's HOME meanwhile, a new
    directory inside the sandbox's own, removed again before this returns. With a branch (a
    manifest's task branch, a caller's --branch), that branch is created at the ref and checked
    out.
    """
    bound = os.path.isdir(destination)
    with _home(git_home, repository) as home:
        _fetch(
            repository=repository,
            checkout=checkout,
            destination=destination,
            home=home,
            bound=bound,
            profile_file=profile_file,
            identity=identity,
        )
        # Before any sandbox code runs in it: no remote, no "clone: from <path>" reflog entry.
        if run_git(["remote", "remove", "origin"], home=home, cwd=destination).returncode != 0:
            raise BackendError(f"{profile_file}: workspace.repository: the clone's remote cannot be removed")
        # The reflogs are files of their own (git's "files" ref store): a fresh clone's hold only
        # that entry, and the sandbox's git starts new ones.
        logs = os.path.join(destination, ".git", "logs")
        if os.path.lexists(logs):
            remove_tree(logs)
        head = run_git(["rev-parse", "--verify", "HEAD^{commit}"], home=home, cwd=destination)
        base = head.stdout.decode(errors="replace").strip()
        if head.returncode != 0 or not is_commit_id(base):
            raise BackendError(f"{profile_file}: {checkout.ref_field}: the clone has no commit checked out")
    _finish(destination, owner)
    return base


def check_repository(repository: str, refs: tuple[str, ...], profile_file: str) -> None:
    """What a clone would trip on, checked when a profile is approved: `repository` is a Git
    repository (a work tree's top or a bare one) that has each of `refs` (the first is
    workspace.ref; patterns with * are not checked). UsageError (2) naming the key otherwise.
    Host-side git as for a clone: no config, no hooks, a HOME of its own."""

    parent = tempfile.mkdtemp(prefix="sandboxer-check-")  # 0700, this account's
    try:
        with _home(os.path.join(parent, "home"), repository) as home:
            if not _is_repository_root(repository, home):
                raise UsageError(f"{profile_file}: workspace.repository: not a Git repository")
            for index, ref in enumerate(refs):
                if "*" in ref:
                    continue
                found = run_git(["rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"], home=home, cwd=repository)
                if found.returncode != 0:
                    field = "workspace.ref" if index == 0 else f"workspace.refs[{index - 1}]"
                    raise UsageError(f"{profile_file}: {field}: not in the repository")
    finally:
        remove_tree(parent)


def refs_digest(repository: str, git_home: str) -> str:
    """The sha256 of every ref of `repository` (name and object id): what a clone of it copies
    and checks out follows from them alone, so while they are the same a clone made earlier is
    the clone a create would make now (a warm sandbox's). Host-side git as for a clone."""

    with _home(git_home, repository) as home:
        listed = run_git(["for-each-ref", "--format=%(objectname) %(refname)"], home=home, cwd=repository)
    if listed.returncode != 0:
        raise BackendError(f"{repository}: its refs cannot be listed (git for-each-ref failed)")
    return hashlib.sha256(listed.stdout).hexdigest()


def is_commit_id(text: str) -> bool:
    """A full commit id as git prints it (SHA-1 or SHA-256, lowercase hex)."""
    return len(text) in (40, 64) and all(c in "0123456789abcdef" for c in text)


def seed(source: str, *, holder_pid: int, holder_start: int | None, profile_file: str, size_mib: int) -> None:
    """Copy the clone at `source` into the /workspace tmpfs of the sandbox whose holder is
    `holder_pid`, then remove `source`: an unprivileged broker's workspace lives in the sandbox's
    own sized tmpfs, and the host keeps no copy.

    Host-side git cannot write there itself (it resolves /proc/PID/root away), so the finished
    clone is copied by descriptors, through the holder's root, before any sandbox code has run.
    """

    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        target = os.open(f"/proc/{holder_pid}/root{WORKSPACE_TARGET}", flags)
    except OSError as exc:
        raise BackendError(f"the sandbox's workspace cannot be opened ({exc.strerror})") from None
    try:
        if holder_start is None or procs.start_time(holder_pid) != holder_start:
            raise BackendError("the sandbox's holder ended before its workspace was filled")
        copy_tree(source, target)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise BackendError(
                f"{profile_file}: limits.workspace_mib: the clone does not fit in {size_mib} MiB"
            ) from None
        raise BackendError(f"the clone cannot be copied into the sandbox's workspace ({exc.strerror})") from None
    finally:
        os.close(target)
    remove_tree(source)


@contextlib.contextmanager
def _home(path: str, repository: str) -> Iterator[str]:
    """git's HOME at `path` (0700, made here, removed after) with our own "global" config."""
    if os.path.lexists(path):  # what a killed clone in this sandbox directory left
        remove_tree(path)
    os.mkdir(path, 0o700)
    try:
        # Read by every git process of the clone (upload-pack too): the owner's repository may
        # belong to another user, and hooks never run.
        with open(os.path.join(path, "gitconfig"), "x") as config:
            quoted = repository.replace("\\", "\\\\").replace('"', '\\"')
            config.write(f'[safe]\n\tdirectory = "{quoted}"\n\tdirectory = "{quoted}/.git"\n')
            config.write("[core]\n\thooksPath = /dev/null\n")
        yield path
    finally:
        remove_tree(path)


def _fetch(
    *,
    repository: str,
    checkout: Checkout,
    destination: str,
    home: str,
    bound: bool,
    profile_file: str,
    identity: tuple[str, str],
) -> None:
    """The clone itself, checked out at the ref (on the branch if given), with the commit
    `identity` (name, email) in its config."""
    ref, branch, ref_field = checkout.ref, checkout.branch, checkout.ref_field
    # The common case, a branch or tag, is one git process; a commit id takes a second step.
    name, email = identity
    clone_args = ["clone", "--quiet", "--no-local", "--template="]
    clone_args += ["--config", f"user.name={name}", "--config", f"user.email={email}"]  # the new clone's own
    if branch is None:
        fast = run_git([*clone_args, "--branch", ref, "--", repository, destination], home=home)
        if fast.returncode == 0:
            return
        _discard(destination, keep_directory=bound)
    if not _is_repository_root(repository, home):
        raise UsageError(f"{profile_file}: workspace.repository: not a Git repository")
    if run_git([*clone_args, "--no-checkout", "--", repository, destination], home=home).returncode != 0:
        raise BackendError(f"{profile_file}: workspace.repository: git clone failed")
    # A commit id or a tag as it is; a branch of the repository is a remote-tracking one here.
    commit = None
    for name in (ref, f"refs/remotes/origin/{ref}"):
        found = run_git(["rev-parse", "--verify", "--quiet", f"{name}^{{commit}}"], home=home, cwd=destination)
        if found.returncode == 0:
            commit = found.stdout.decode().strip()
            break
    if commit is None:
        raise checkout.missing(f"{profile_file}: {ref_field}: not found in the repository")
    if branch is not None and checkout.fresh_branch:
        for taken in (f"refs/heads/{branch}", f"refs/remotes/origin/{branch}"):
            if run_git(["rev-parse", "--verify", "--quiet", taken], home=home, cwd=destination).returncode == 0:
                raise checkout.missing(
                    f"{profile_file}: {checkout.branch_field}: {branch} is a branch of the repository already"
                )
    switch = ["checkout", "--quiet", "-b", branch, commit] if branch else ["checkout", "--quiet", "--detach", commit]
    if run_git(switch, home=home, cwd=destination).returncode != 0:
        what = f"{checkout.branch_field}: cannot be created" if branch else f"{ref_field}: checkout failed"
        raise BackendError(f"{profile_file}: {what}")
    # git checkout exits 0 when it could not write files (a full workspace filesystem leaves
    # them empty or cut short): the work tree must match what was checked out.
    if run_git(["diff", "--quiet"], home=home, cwd=destination).returncode != 0:
        raise BackendError(f"{profile_file}: {ref_field}: checkout failed{_full(destination)}")


def _full(destination: str) -> str:
    """Why a checkout may have failed, when the workspace filesystem has no room left."""
    try:
        room = os.statvfs(destination)
    except OSError:
        return ""
    if room.f_bavail * room.f_frsize < 1024 * 1024:
        return " (the workspace filesystem is full: limits.workspace_mib is smaller than the clone)"
    return ""


def _discard(destination: str, *, keep_directory: bool) -> None:
    """Remove what a failed clone left; a bound directory itself stays (emptied)."""
    if not keep_directory:
        remove_tree(destination)
        return
    with os.scandir(destination) as entries:
        for entry in entries:
            remove_tree(entry.path)


def _is_repository_root(repository: str, home: str) -> bool:
    """Whether `repository` is a bare repository or the top of a work tree (not a subdirectory)."""
    if not os.path.isdir(repository):
        return False
    bare = run_git(["-C", repository, "rev-parse", "--is-bare-repository"], home=home)
    if bare.returncode != 0:
        return False
    if bare.stdout.strip() == b"true":
        return True
    top = run_git(["-C", repository, "rev-parse", "--show-toplevel"], home=home)
    return top.returncode == 0 and os.path.realpath(top.stdout.decode().strip()) == os.path.realpath(repository)


def _finish(destination: str, owner: tuple[int, int] | None) -> None:
    os.chmod(destination, 0o700)
    if owner is not None:
        uid, gid = owner
        # The top directory changes hands last: until then it is root's and 0700, so nobody can
        # swap anything below it for a symlink while root walks the tree by name. A stack, not
        # os.walk, which recurses once per level in Python 3.11.
        below = [destination]
        while below:
            with os.scandir(below.pop()) as entries:
                for entry in entries:
                    os.lchown(entry.path, uid, gid)
                    if entry.is_dir(follow_symlinks=False):
                        below.append(entry.path)
        os.lchown(destination, uid, gid)
