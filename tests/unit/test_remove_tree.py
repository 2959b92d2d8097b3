"""remove_tree against trees a sandbox shaped to hurt: deep, wide, unreadable, full of symlinks to
the host, with a mount below.

The mount tests mount on the host (as root, below the test's own directory) and unmount again;
the unprivileged variants fork a child that becomes uid 65534 and builds the tree itself, as a
sandbox of an ordinary broker would.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sandboxer.host import workspace
from sandboxer.host.fstree import remove_tree
from sandboxer.host.fsutil import mount_points

NOBODY = 65534


def _nest(top: Path, depth: int, *, mode: Callable[[int], int | None] = lambda _: None) -> None:
    """`depth` directories named "d", one inside the other, below `top`, and a file in the last
    (by descriptor: the path soon exceeds PATH_MAX); `mode(level)` may take a level's bits away,
    which happens once its own child exists, as a sandbox would do it."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for level in range(depth):
            os.mkdir("d", dir_fd=fd)
            inner = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            _chmod(fd, mode(level - 1) if level else None)
            os.close(fd)
            fd = inner
        os.close(os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
        _chmod(fd, mode(depth - 1))
    finally:
        os.close(fd)


def _chmod(fd: int, mode: int | None) -> None:
    if mode is not None:
        os.fchmod(fd, mode)


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def few_descriptors() -> Iterator[None]:
    """RLIMIT_NOFILE just above what is open now: one descriptor per level would run out."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (_open_descriptors() + 16, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_missing_path_is_gone(tmp_path: Path) -> None:
    assert remove_tree(str(tmp_path / "absent"))


def test_a_file_or_a_symlink_alone_is_unlinked(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path)
    assert remove_tree(str(tmp_path / "file"))
    assert remove_tree(str(tmp_path / "link"))
    assert sorted(os.listdir(tmp_path)) == []
    assert tmp_path.is_dir()


@pytest.mark.usefixtures("few_descriptors")
def test_removes_5000_levels_holding_a_few_descriptors(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    _nest(tree, 5000)
    assert remove_tree(str(tree))
    assert not tree.exists()
    assert os.listdir(tmp_path) == []


def test_workspace_teardown_removes_1500_levels(tmp_path: Path) -> None:
    """The attacker's probe: shutil.rmtree recursed once per level and died of RecursionError."""
    clone = tmp_path / "workspace"
    clone.mkdir()
    _nest(clone, 1500)
    assert workspace.remove_tree(str(clone))
    assert not clone.exists()


def test_removes_a_directory_of_100k_entries(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY)
    try:
        # Hard links: entries as many as files, without 100k inodes to allocate (ext4 allows
        # 65,000 links to one inode, so two of them).
        for name in ("a", "b"):
            os.close(os.open(name, os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
            for i in range(50_000):
                os.link(name, f"{name}{i}", src_dir_fd=fd, dst_dir_fd=fd)
        for i in range(1_000):
            os.mkdir(f"d{i}", dir_fd=fd)
            os.symlink("/", f"l{i}", dir_fd=fd)
    finally:
        os.close(fd)
    assert len(os.listdir(tree)) == 102_002
    assert remove_tree(str(tree))
    assert not tree.exists()


def _hostile(tree: Path) -> None:
    """Directories without read, write or search bits, at the top and below, around files."""
    tree.mkdir()
    for name, mode in (("none", 0o000), ("read-only", 0o500), ("search-only", 0o100), ("list-only", 0o400)):
        below = tree / name / "a" / "b"
        below.mkdir(parents=True)
        (below / "file").write_text("x")
        (tree / name / "file").write_text("x")
        (tree / name / "a").chmod(0o000)
        (tree / name).chmod(mode)
    deep = tree / "deep"
    deep.mkdir()
    _nest(deep, 300, mode=lambda level: 0o000 if level % 3 == 0 else 0o500)
    tree.chmod(0o000)


def test_removes_unreadable_unwritable_unsearchable_directories(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    _hostile(tree)
    assert remove_tree(str(tree))
    assert not tree.exists()


def _run_as(uid: int, body: Callable[[], bool]) -> int:
    """Run `body` in a child with only `uid`'s credentials; its exit status (0 when it held)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        status = 3
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            status = 0 if body() else 1
        except BaseException:
            traceback.print_exc()
            status = 2
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory uid 65534 may reach and owns (pytest's tmp_path is root's and 0700)."""
    if os.geteuid() != 0:
        pytest.skip("the unprivileged variant forks a child that drops root; run as root (CI does)")
    base = Path(tempfile.mkdtemp(prefix="sbx-rm-", dir="/tmp"))
    base.chmod(0o755)
    os.chown(base, NOBODY, NOBODY)
    try:
        yield base
    finally:
        remove_tree(str(base))


def test_an_unprivileged_owner_removes_its_unreadable_directories(shared_dir: Path) -> None:
    tree = shared_dir / "tree"

    def build_and_remove() -> bool:
        _hostile(tree)
        return remove_tree(str(tree)) and not os.path.lexists(tree)

    assert _run_as(NOBODY, build_and_remove) == 0
    assert os.listdir(shared_dir) == []


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A host directory a sandbox might point a symlink at, with content that must survive."""
    host = tmp_path / "host"
    (host / "sub").mkdir(parents=True)
    (host / "secret").write_text("keep")
    (host / "sub" / "file").write_text("keep")
    host.chmod(0o700)
    return host


def _host_content(host: Path) -> list[str]:
    return sorted(str(p.relative_to(host)) for p in host.rglob("*"))


def test_symlinks_to_the_host_are_unlinked_never_followed(tmp_path: Path, outside: Path) -> None:
    before = _host_content(outside)
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "to-dir").symlink_to(outside)
    (tree / "to-file").symlink_to(outside / "secret")
    (tree / "a" / "b" / "to-sub").symlink_to(outside / "sub")
    (tree / "a" / "relative").symlink_to("../../host")
    (tree / "a" / "loop").symlink_to("loop")
    (tree / "a").chmod(0o000)
    assert remove_tree(str(tree))
    assert not tree.exists()
    assert _host_content(outside) == before
    assert (outside / "secret").read_text() == "keep"


def test_a_symlinked_tree_is_the_link_alone(tmp_path: Path, outside: Path) -> None:
    before = _host_content(outside)
    link = tmp_path / "workspace"
    link.symlink_to(outside)
    assert remove_tree(str(link))
    assert not os.path.lexists(link)
    assert _host_content(outside) == before


def test_an_unprivileged_owner_never_follows_a_symlink(shared_dir: Path) -> None:
    host = shared_dir / "host"
    tree = shared_dir / "tree"

    def build_and_remove() -> bool:
        (host / "sub").mkdir(parents=True)
        (host / "sub" / "file").write_text("keep")
        (tree / "a").mkdir(parents=True)
        (tree / "a" / "to-host").symlink_to(host)
        (tree / "to-sub").symlink_to(host / "sub")
        (tree / "a").chmod(0o000)
        tree.chmod(0o100)
        return remove_tree(str(tree)) and (host / "sub" / "file").read_text() == "keep"

    assert _run_as(NOBODY, build_and_remove) == 0
    assert os.listdir(shared_dir) == ["host"]


# --- mounts ---------------------------------------------------------------------------------------


@pytest.fixture
def mounter() -> Iterator[Callable[..., None]]:
    """mount(8) for the test (root only); everything mounted is unmounted at the end."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting needs root and mount(8) (CI runs as root)")
    mounted: list[Path] = []

    def mount(*argv: str) -> None:
        subprocess.run(["mount", *argv], check=True)
        mounted.append(Path(argv[-1]))

    try:
        yield mount
    finally:
        for point in reversed(mounted):
            subprocess.run(["umount", "-l", str(point)], check=False)


def test_a_mount_below_is_not_crossed(tmp_path: Path, mounter: Callable[..., None]) -> None:
    tree = tmp_path / "tree"
    point = tree / "a" / "b" / "mnt"
    point.mkdir(parents=True)
    (tree / "a" / "file").write_text("x")
    (tree / "other" / "c").mkdir(parents=True)
    mounter("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(point))
    (point / "inside").mkdir()
    (point / "inside" / "file").write_text("keep")
    point.chmod(0o000)
    os.chmod(point / "inside", 0o000)

    assert not remove_tree(str(tree))
    assert str(point) in mount_points()
    assert (point / "inside" / "file").read_text() == "keep"
    # Everything beside the mount went; only the way down to it stays.
    assert sorted(str(p.relative_to(tree)) for p in tree.rglob("*") if point not in p.parents) == [
        "a",
        "a/b",
        "a/b/mnt",
    ]


def test_a_bind_mount_of_the_same_filesystem_is_not_entered(
    tmp_path: Path, outside: Path, mounter: Callable[..., None]
) -> None:
    """st_dev cannot tell a bind mount of the tree's own filesystem; the mount id can."""
    before = _host_content(outside)
    tree = tmp_path / "tree"
    point = tree / "a" / "bound"
    point.mkdir(parents=True)
    mounter("--bind", str(outside), str(point))
    assert os.stat(point).st_dev == os.stat(tree).st_dev

    assert not remove_tree(str(tree))
    assert _host_content(outside) == before
    assert str(point) in mount_points()


def test_a_tree_that_is_itself_a_mount_point_is_left_whole(tmp_path: Path, mounter: Callable[..., None]) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    mounter("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(tree))
    (tree / "file").write_text("keep")

    assert not remove_tree(str(tree))
    assert (tree / "file").read_text() == "keep"
