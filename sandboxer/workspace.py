"""The workspace: a fresh Git clone of the profile's repository, made on the host side safely.

Host-side git runs with no system or global configuration, an empty HOME, hooks disabled and
no templates; `--no-local` makes git copy objects through its transport instead of hard-linking
into the owner's repository. Host-side git never runs inside a clone after a sandbox used it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from typing import TYPE_CHECKING

from sandboxer.errors import BackendError, PolicyError, UsageError

if TYPE_CHECKING:
    import subprocess


def _git(
    args: list[str], *, home: str, cwd: str | None = None, repo: str | None = None
) -> subprocess.CompletedProcess[bytes]:
    import subprocess  # here, not at import: teardown uses this module without running git

    git = shutil.which("git", path="/usr/bin:/bin:/usr/local/bin")
    if git is None:
        raise BackendError("git is not installed", hint="apt-get install -y git")
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": home,
        "LANG": "C",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.path.join(home, "gitconfig"),
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_ASKPASS": "/bin/false",
    }
    config = ["-c", "core.hooksPath=/dev/null", "-c", "protocol.file.allow=always"]
    return subprocess.run([git, *config, *args], cwd=cwd, env=env, capture_output=True, check=False, timeout=300)


def clone(
    *,
    repository: str,
    ref: str,
    destination: str,
    profile_file: str,
    owner: tuple[int, int] | None,
    branch: str | None = None,
    ref_field: str = "workspace.ref",
) -> None:
    """Clone `repository` at `ref` into `destination`, owned by `owner` if given.

    `destination` is new, or an empty directory that must stay the same directory (a warm
    container already has it bound at /workspace). With `branch` (a manifest's task branch),
    that branch is created at `ref` and checked out; a `ref` the repository lacks is then a
    refusal of the manifest (PolicyError, exit 3).
    """
    bound = os.path.isdir(destination)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="sandboxer-git-home-") as home:
        # Our own "global" config, read by every git process of the clone (upload-pack too):
        # the owner's repository may belong to another user, and hooks never run.
        with open(os.path.join(home, "gitconfig"), "w") as config:
            quoted = repository.replace("\\", "\\\\").replace('"', '\\"')
            config.write(f'[safe]\n\tdirectory = "{quoted}"\n\tdirectory = "{quoted}/.git"\n')
            config.write("[core]\n\thooksPath = /dev/null\n")
        # The common case, a branch or tag, is one git process; a commit id takes a second step.
        clone_args = ["clone", "--quiet", "--no-local", "--template="]
        if branch is None:
            fast = _git([*clone_args, "--branch", ref, "--", repository, destination], home=home)
            if fast.returncode == 0:
                return _finish(destination, owner)
            _discard(destination, keep_directory=bound)
        if not _is_repository_root(repository, home):
            raise UsageError(f"{profile_file}: workspace.repository: not a Git repository")
        if _git([*clone_args, "--no-checkout", "--", repository, destination], home=home).returncode != 0:
            raise BackendError(f"{profile_file}: workspace.repository: git clone failed")
        found = _git(["rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"], home=home, cwd=destination)
        if found.returncode != 0:
            refusal = PolicyError if branch is not None else UsageError
            raise refusal(f"{profile_file}: {ref_field}: not found in the repository")
        checkout = ["checkout", "--quiet", "-b", branch, ref] if branch else ["checkout", "--quiet", "--detach", ref]
        if _git(checkout, home=home, cwd=destination).returncode != 0:
            what = "task_branch: cannot be created" if branch else f"{ref_field}: checkout failed"
            raise BackendError(f"{profile_file}: {what}")
    _finish(destination, owner)


def _discard(destination: str, *, keep_directory: bool) -> None:
    """Remove what a failed clone left; a bound directory itself stays (emptied)."""
    if not keep_directory:
        shutil.rmtree(destination, ignore_errors=True)
        return
    with os.scandir(destination) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)


def _is_repository_root(repository: str, home: str) -> bool:
    """Whether `repository` is a bare repository or the top of a work tree (not a subdirectory)."""
    if not os.path.isdir(repository):
        return False
    bare = _git(["-C", repository, "rev-parse", "--is-bare-repository"], home=home)
    if bare.returncode != 0:
        return False
    if bare.stdout.strip() == b"true":
        return True
    top = _git(["-C", repository, "rev-parse", "--show-toplevel"], home=home)
    return top.returncode == 0 and os.path.realpath(top.stdout.decode().strip()) == os.path.realpath(repository)


def _finish(destination: str, owner: tuple[int, int] | None) -> None:
    os.chmod(destination, 0o700)
    if owner is not None:
        uid, gid = owner
        # The top directory changes hands last: until then it is root's and 0700, so nobody can
        # swap anything below it for a symlink while root walks the tree by name.
        for directory, dirnames, filenames in os.walk(destination):
            for name in (*dirnames, *filenames):
                os.lchown(os.path.join(directory, name), uid, gid)
        os.lchown(destination, uid, gid)


def remove_tree(path: str) -> bool:
    """Remove a tree the sandbox may have made hostile (dirs without write or search bits).

    Called only after every sandbox process is gone, so nothing changes the tree meanwhile.
    Symlinks are never followed. Returns whether the tree is gone.
    """
    if not os.path.lexists(path):
        return True
    if os.path.isdir(path) and not os.path.islink(path) and os.geteuid() == 0:
        shutil.rmtree(path, ignore_errors=True)  # root needs no mode bits; rmtree never follows links
    elif os.path.isdir(path) and not os.path.islink(path):
        # An ordinary broker owns these files itself, so only its own uid could race this walk.
        with contextlib.suppress(OSError):
            os.chmod(path, stat.S_IRWXU)
        for directory, dirnames, _ in os.walk(path):
            for name in dirnames:
                full = os.path.join(directory, name)
                if not os.path.islink(full):
                    with contextlib.suppress(OSError):
                        os.chmod(full, stat.S_IRWXU)
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)
    return not os.path.lexists(path)
