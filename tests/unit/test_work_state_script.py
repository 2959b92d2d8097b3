"""The script that reports a sandbox's work (sandboxer.commands.work.STATE_SCRIPT), run by sh with
real git on repositories made here: the tree it reports is the one `git add --all` would commit
from a copy of the index, whether the working tree is clean (it then reports HEAD's tree without
writing one) or not — also where the repository's own config would hide a change from
`git status`; and a git that fails ends the report, never reads as clean."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from sandboxer.commands.work import STATE_SCRIPT, WorkState, _parse_state

GIT_ENV = {
    "PATH": "/usr/bin:/bin",
    "HOME": "/nonexistent",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@localhost",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@localhost",
}


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=GIT_ENV, check=True)
    return done.stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository with one commit: a file, an ignored pattern, a script."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    (repo / "a.txt").write_text("a\n")
    (repo / ".gitignore").write_text("*.log\n")
    (repo / "run.sh").write_text("echo\n")
    _git(repo, "add", "--all")
    _git(repo, "commit", "-qm", "base")
    return repo


def _run_script(repo: Path, *, check: bool) -> subprocess.CompletedProcess[str]:
    """The work-state script in the repository, given HEAD's commit as the base."""
    return subprocess.run(
        ["sh", "-c", STATE_SCRIPT, "sh", _git(repo, "rev-parse", "HEAD")],
        cwd=repo,
        capture_output=True,
        text=True,
        env=GIT_ENV,
        check=check,
    )


def _report(repo: Path) -> WorkState:
    return _parse_state(_run_script(repo, check=True).stdout)


def _tree_git_add_all_commits(repo: Path, tmp_path: Path) -> str:
    """The reference: `git add --all` into a copy of the index, then write-tree."""
    index = tmp_path / "reference-index"
    shutil.copy2(repo / ".git" / "index", index)
    env = GIT_ENV | {"GIT_INDEX_FILE": str(index)}
    subprocess.run(["git", "-C", str(repo), "add", "--all"], env=env, check=True)
    done = subprocess.run(["git", "-C", str(repo), "write-tree"], env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_a_clean_tree_is_heads_tree_and_the_index_is_left_alone(repo: Path) -> None:
    (repo / "debug.log").write_text("ignored: not work\n")
    index = (repo / ".git" / "index").read_bytes()
    state = _report(repo)
    assert state.tree == state.head_tree == _git(repo, "rev-parse", "HEAD^{tree}")
    assert not state.dirty
    assert (state.branch, state.ahead) == ("main", 0)
    assert (repo / ".git" / "index").read_bytes() == index


# What an agent did to the working tree since the commit (sh in the repository).
CHANGES = {
    "a changed file": "echo b > a.txt",
    "a removed file": "rm a.txt",
    "a new file": "echo new > new.txt",
    "a new file in a new directory": "mkdir -p d/e && : > d/e/f",
    "a file made executable": "chmod +x run.sh",
    "a change staged, then undone in the tree": "echo staged > a.txt && git add a.txt && echo a > a.txt",
    "a new file the config hides from status": "git config status.showUntrackedFiles no && echo x > hidden.txt",
    "a change with status's own config against it": (
        "git config diff.ignoreSubmodules all && git config status.relativePaths false && echo c > a.txt"
    ),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_changed_tree_is_the_one_git_add_all_commits(repo: Path, tmp_path: Path, change: str) -> None:
    subprocess.run(["sh", "-c", CHANGES[change]], cwd=repo, env=GIT_ENV, check=True)
    index = (repo / ".git" / "index").read_bytes()
    state = _report(repo)
    assert state.tree == _tree_git_add_all_commits(repo, tmp_path)
    assert (repo / ".git" / "index").read_bytes() == index  # its own index: untouched
    if change == "a change staged, then undone in the tree":
        assert not state.dirty  # the tree as `git add --all` commits it is HEAD's again
    else:
        assert state.dirty


def test_a_git_that_fails_ends_the_report(repo: Path) -> None:
    (repo / "a.txt").write_text("changed\n")
    (repo / ".git" / "index").write_bytes(b"DIRC not an index")
    done = _run_script(repo, check=False)
    assert done.returncode != 0
    assert "tree " not in done.stdout


def test_a_same_size_change_in_the_index_s_own_second_is_work(repo: Path) -> None:
    """git trusts an entry's stat data only where it is older than the index file itself: a
    change of the same size, in the same second as the index was written, is seen by content. A
    copy of the index made later must keep its time (cp -p), or `git add --all` into it trusts
    the stale entry and the change reads as no work at all (teardown would lose it)."""
    before = (repo / "a.txt").stat()
    (repo / "a.txt").write_text("b\n")  # the same size as "a\n"
    for path in (repo / "a.txt", repo / ".git" / "index"):  # both in the entry's own second
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    second = int(time.time())
    while int(time.time()) == second:  # a copy made now is younger than the entry
        time.sleep(0.05)
    state = _report(repo)
    assert state.dirty
    assert state.tree != state.head_tree
