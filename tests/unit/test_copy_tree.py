"""copy_tree: how an unprivileged broker's clone reaches the sandbox's sized tmpfs workspace.

Real files, a real git clone and (as root) a real tmpfs mounted below the test's directory.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxer.host.fstree import copy_tree, remove_tree


@pytest.fixture
def target(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    where = tmp_path / "target"
    where.mkdir()
    fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield where, fd
    finally:
        os.close(fd)


def _tree(top: Path) -> dict[str, tuple[str, int, bytes | str | None, int | None]]:
    """Every entry below `top`: kind, permission bits, content or link text, mtime of files."""
    seen: dict[str, tuple[str, int, bytes | str | None, int | None]] = {}
    for path in sorted(top.rglob("*")):
        info = path.lstat()
        name = str(path.relative_to(top))
        bits = stat.S_IMODE(info.st_mode)
        if path.is_symlink():
            seen[name] = ("link", 0, os.readlink(path), None)
        elif path.is_dir():
            seen[name] = ("dir", bits, None, None)
        else:
            seen[name] = ("file", bits, path.read_bytes(), info.st_mtime_ns)
    return seen


def test_a_git_clone_arrives_whole_and_git_sees_it_clean(tmp_path: Path, target: tuple[Path, int]) -> None:
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost", "-c", "init.defaultBranch=main"]
    repo = tmp_path / "repo"
    subprocess.run([*git, "init", "-q", str(repo)], check=True)
    (repo / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (repo / "run.sh").chmod(0o755)
    (repo / "sub" / "deeper").mkdir(parents=True)
    (repo / "sub" / "deeper" / "data").write_bytes(os.urandom(3 * 1024 * 1024))  # more than one chunk
    (repo / "link").symlink_to("sub/deeper/data")
    (repo / "dangling").symlink_to("/etc/shadow")  # copied as a link, never followed
    subprocess.run([*git, "-C", str(repo), "add", "-A"], check=True)
    subprocess.run([*git, "-C", str(repo), "commit", "-qm", "c"], check=True)
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--no-local", str(repo), str(clone)], check=True)

    where, fd = target
    copy_tree(str(clone), fd)

    assert _tree(where) == _tree(clone)
    assert os.readlink(where / "dangling") == "/etc/shadow"
    status = subprocess.run(
        ["git", "-C", str(where), "status", "--porcelain"], capture_output=True, text=True, check=True
    )
    assert status.stdout == "", status
    assert subprocess.run([str(where / "run.sh")], capture_output=True, text=True, check=True).stdout == "ran\n"


def test_directory_bits_are_kept_with_the_owners_rwx(tmp_path: Path, target: tuple[Path, int]) -> None:
    source = tmp_path / "source"
    (source / "locked").mkdir(parents=True)
    (source / "locked" / "f").write_text("x")
    (source / "locked").chmod(0o500)
    (source / "shared").mkdir(mode=0o755)
    (source / "shared").chmod(0o755)
    try:
        where, fd = target
        copy_tree(str(source), fd)
    finally:
        (source / "locked").chmod(0o700)
    assert stat.S_IMODE((where / "locked").stat().st_mode) == 0o700
    assert stat.S_IMODE((where / "shared").stat().st_mode) == 0o755
    assert (where / "locked" / "f").read_text() == "x"


def test_a_deep_tree_needs_no_recursion(tmp_path: Path, target: tuple[Path, int]) -> None:
    source = tmp_path / "source"
    source.mkdir()
    where, target_fd = target
    try:
        fd = os.open(source, os.O_RDONLY | os.O_DIRECTORY)
        for _ in range(3000):  # deeper than Python's recursion limit and than PATH_MAX by name
            os.mkdir("d", dir_fd=fd)
            inner = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = inner
        os.close(os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
        os.close(fd)
        copy_tree(str(source), target_fd)
        fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY)
        for _ in range(3000):
            inner = os.open("d", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = inner
        try:
            assert os.listdir(fd) == ["leaf"]
        finally:
            os.close(fd)
    finally:  # pytest's own clean-up recurses once per level
        remove_tree(str(source))
        remove_tree(str(where))


def test_a_link_already_in_the_target_is_never_followed(tmp_path: Path, target: tuple[Path, int]) -> None:
    """Were something to plant a link where the copy writes, the copy fails on it instead of
    writing through it."""
    source = tmp_path / "source"
    (source / "dir").mkdir(parents=True)
    (source / "file").write_text("mine")
    outside = tmp_path / "outside"
    outside.mkdir()
    where, fd = target
    (where / "file").symlink_to(outside / "written")
    with pytest.raises(FileExistsError):
        copy_tree(str(source), fd)
    assert list(outside.iterdir()) == []


def test_a_fifo_is_refused(tmp_path: Path, target: tuple[Path, int]) -> None:
    source = tmp_path / "source"
    source.mkdir()
    os.mkfifo(source / "pipe")
    with pytest.raises(OSError, match="neither a directory") as raised:
        copy_tree(str(source), target[1])
    assert raised.value.errno == errno.EINVAL


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a sized tmpfs needs root")
def test_a_full_target_fails_with_enospc(tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    (source / "big").write_bytes(b"\0" * (2 * 1024 * 1024))
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    try:
        fd = os.open(small, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with pytest.raises(OSError, match="No space left") as raised:
                copy_tree(str(source), fd)
        finally:
            os.close(fd)
        assert raised.value.errno == errno.ENOSPC
    finally:
        subprocess.run(["umount", str(small)], check=True)
