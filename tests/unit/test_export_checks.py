"""What the host checks of a sandbox's work and of what an export brings out: the state its git
reports (untrusted: refused out of shape), what teardown would lose, the tree's tar, and the
patch files written on the caller's side."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from sandboxer.commands.export import _slug, _verify_tar
from sandboxer.commands.export_delivery import _unpacked, check_mine, write_file_at, write_series_at
from sandboxer.commands.work import WorkState, _parse_state
from sandboxer.core.record import WorkRecord
from sandboxer.errors import BackendError, UsageError

HEAD, TREE, HEAD_TREE, C1 = "a" * 40, "b" * 40, "c" * 40, "d" * 40
WORK = WorkRecord(base="e" * 40, ref="main", repository="/srv/repo")


def _report(**fields: str) -> str:
    lines = {"head": HEAD, "tree": TREE, "head_tree": HEAD_TREE, "branch": "main", "ahead": "1"} | fields
    return "".join(f"{key} {value}\n" for key, value in lines.items() if value != "-")


def test_a_report_is_read_into_the_work_it_describes() -> None:
    state = _parse_state(_report())
    assert state == WorkState(head=HEAD, branch="main", tree=TREE, head_tree=HEAD_TREE, ahead=1)
    assert state.dirty
    assert state.ahead == 1
    detached = _parse_state(_report(branch="", ahead="0", tree=HEAD_TREE))
    assert detached.branch is None
    assert not detached.dirty
    assert detached.ahead == 0
    assert _parse_state(_report(ahead="unknown")).ahead is None
    assert _parse_state(_report(ahead="2500")).ahead == 2500  # however many: a count, not a list


@pytest.mark.parametrize(
    "report",
    [
        _report(head="not-hex"),
        _report(tree="A" * 40),  # git prints lowercase
        _report(branch="two words"),
        _report(ahead="two"),
        _report(ahead="-"),
        _report(ahead="\u0662"),  # a digit, but not an ASCII one
        _report() + "head " + HEAD + "\n",  # said twice
        _report() + "origin /etc/passwd\n",  # a key it never prints
        _report() + f"commit {C1}\n",
    ],
)
def test_a_report_out_of_shape_is_refused(report: str) -> None:
    with pytest.raises(BackendError, match="out of shape"):
        _parse_state(report)


def test_what_teardown_would_lose_and_what_an_export_covers() -> None:
    state = _parse_state(_report())  # one new commit and changes not committed
    assert state.unexported(WORK) == ["1 new commit on main (made from main)", "changes not committed"]
    bundled = WorkRecord(base=WORK.base, ref="main", repository="/srv/repo", exported=(("commits", HEAD),))
    assert state.unexported(bundled) == ["changes not committed"]
    both = WorkRecord(base=WORK.base, ref="main", repository="/srv/repo", exported=(("commits", HEAD), ("tree", TREE)))
    assert state.unexported(both) == []
    # A tar of an older tree, a bundle of an older head: they cover nothing of today's work.
    stale = WorkRecord(base=WORK.base, ref="main", repository="/srv/repo", exported=(("commits", C1), ("tree", C1)))
    assert len(state.unexported(stale)) == 2
    clean = _parse_state(_report(ahead="0", tree=HEAD_TREE))
    assert clean.unexported(WORK) == []
    gone = _parse_state(_report(ahead="unknown", tree=HEAD_TREE))
    assert gone.unexported(WORK) == ["new commits on main (made from main)"]


def _tar(path: Path, *members: tuple[str, bytes, int, str]) -> None:
    with tarfile.open(path, "w") as archive:
        for name, data, kind, link in members:
            info = tarfile.TarInfo(name)
            info.type = bytes([kind]) if isinstance(kind, int) else kind
            info.linkname = link
            info.size = len(data) if info.type == tarfile.REGTYPE else 0
            archive.addfile(info, io.BytesIO(data) if info.size else None)


def test_a_trees_tar_holds_files_directories_and_links_inside_it(tmp_path: Path) -> None:
    path = tmp_path / "tree.tar"
    _tar(
        path,
        ("src/", b"", tarfile.DIRTYPE[0], ""),
        ("src/a.py", b"x", tarfile.REGTYPE[0], ""),
        ("src/link", b"", tarfile.SYMTYPE[0], "../README"),
    )
    _verify_tar(str(path))


@pytest.mark.parametrize(
    "member",
    [
        ("/etc/passwd", b"x", tarfile.REGTYPE[0], ""),
        ("a/../../b", b"x", tarfile.REGTYPE[0], ""),
        ("hard", b"", tarfile.LNKTYPE[0], "a"),
        ("dev", b"", tarfile.CHRTYPE[0], ""),
        ("fifo", b"", tarfile.FIFOTYPE[0], ""),
        ("up", b"", tarfile.SYMTYPE[0], "../../etc"),
        ("abs", b"", tarfile.SYMTYPE[0], "/etc/shadow"),
    ],
)
def test_a_trees_tar_with_anything_else_is_refused(tmp_path: Path, member: tuple[str, bytes, int, str]) -> None:
    path = tmp_path / "tree.tar"
    _tar(path, member)
    with pytest.raises(BackendError):
        _verify_tar(str(path))


def test_patch_names_follow_their_subjects() -> None:
    assert _slug("[PATCH 2/3] Fix: the parser's ../ edge!\n") == "Fix-the-parser-s-.-edge"
    assert _slug("///\n") == "patch"
    assert len(_slug("word " * 40)) <= 52


def test_a_patch_series_goes_into_a_new_or_empty_directory_only(tmp_path: Path) -> None:
    target = tmp_path / "patches"
    write_series_at(str(target), [("0001-a.patch", b"one"), ("0002-b.patch", b"two")])
    assert sorted(os.listdir(target)) == ["0001-a.patch", "0002-b.patch"]
    with pytest.raises(UsageError, match="must be a new or empty directory"):
        write_series_at(str(target), [("0001-c.patch", b"three")])
    assert (target / "0001-a.patch").read_bytes() == b"one"


def test_a_series_that_breaks_off_leaves_nothing(tmp_path: Path) -> None:
    target = tmp_path / "patches"

    def series() -> list[tuple[str, bytes]]:
        return [("0001-a.patch", b"one"), ("../escape.patch", b"two")]

    with pytest.raises(BackendError, match="not a patch file's name"):
        write_series_at(str(target), series())
    assert not target.exists()
    assert not (tmp_path / "escape.patch").exists()


def test_a_file_export_never_replaces_a_file(tmp_path: Path) -> None:
    existing = tmp_path / "out.bundle"
    existing.write_bytes(b"mine")
    with pytest.raises(UsageError, match="cannot be created"):
        write_file_at(str(existing), [b"theirs"])
    assert existing.read_bytes() == b"mine"
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UsageError):
        write_file_at(str(link), [b"x"])
    assert not (tmp_path / "elsewhere").exists()


def test_a_sent_series_holds_patch_files_only() -> None:
    good = io.BytesIO()
    with tarfile.open(fileobj=good, mode="w") as archive:
        info = tarfile.TarInfo("0001-a.patch")
        info.size = 3
        archive.addfile(info, io.BytesIO(b"one"))
    good.seek(0)
    assert list(_unpacked(good)) == [("0001-a.patch", b"one")]
    bad = io.BytesIO()
    with tarfile.open(fileobj=bad, mode="w") as archive:
        info = tarfile.TarInfo("0001-a.patch")
        info.type = tarfile.SYMTYPE
        info.linkname = "/etc/passwd"
        archive.addfile(info)
    bad.seek(0)
    with pytest.raises(BackendError, match="not a patch file"):
        list(_unpacked(bad))


def test_a_trees_tar_with_a_member_below_a_link_is_refused(tmp_path: Path) -> None:
    """Each link stays inside on its own, but one below another goes out: refused."""
    path = tmp_path / "tree.tar"
    _tar(path, ("a/l", b"", tarfile.SYMTYPE[0], ".."), ("a/l/m", b"", tarfile.SYMTYPE[0], ".."))
    with pytest.raises(BackendError, match="'a/l/m', which is below a link of the tree"):
        _verify_tar(str(path))


def _links(tmp_path: Path, *members: tuple[str, bytes, int, str]) -> Path:
    path = tmp_path / "tree.tar"
    _tar(path, *members)
    return path


DIR, FILE, LINK = tarfile.DIRTYPE[0], tarfile.REGTYPE[0], tarfile.SYMTYPE[0]


def test_links_that_lead_outside_together_are_refused(tmp_path: Path) -> None:
    """a/b -> .. stays inside, and c -> a/b/.. does as a name, but through a/b it is the parent of
    the tree: refused, naming c (issue 31)."""
    path = _links(tmp_path, ("a/", b"", DIR, ""), ("a/b", b"", LINK, ".."), ("c", b"", LINK, "a/b/.."))
    with pytest.raises(BackendError) as raised:
        _verify_tar(str(path))
    assert raised.value.message == (
        "export: the sandbox's tar holds 'c', a link that leads outside the tree through the links it names"
    )


@pytest.mark.parametrize(
    "members",
    [
        [("a", b"", LINK, "."), ("b", b"", LINK, "a/..")],  # .. of where a leads
        [("b", b"", LINK, "a/.."), ("a", b"", LINK, ".")],  # a link that comes later counts too
        [("x", b"", LINK, "y/.."), ("y", b"", LINK, "d/..")],  # y leads to the top: x to its parent
        [("a", b"", LINK, "b"), ("b", b"", LINK, "c"), ("c", b"", LINK, "..")],  # to the end of a chain
        [("a", b"", LINK, "b"), ("b", b"", LINK, "a")],  # a loop
        [("a", b"", FILE, ""), ("a", b"", LINK, ".")],  # a later member replacing an earlier one
        [("d/", b"", DIR, ""), ("d", b"", LINK, ".")],
        [("f", b"", FILE, ""), ("f/g", b"", FILE, "")],  # below a file
    ],
)
def test_links_are_judged_through_the_links_they_pass(
    tmp_path: Path, members: list[tuple[str, bytes, int, str]]
) -> None:
    with pytest.raises(BackendError, match=r"^export: the sandbox's tar holds '"):
        _verify_tar(str(_links(tmp_path, *members)))


def test_links_that_stay_inside_through_other_links_are_kept(tmp_path: Path) -> None:
    path = _links(
        tmp_path,
        ("a/", b"", DIR, ""),
        ("a/b/", b"", DIR, ""),
        ("a/b/c", b"", LINK, "../.."),  # the top
        ("up", b"", LINK, "a/b/c/a"),  # a, through the top
        ("d", b"", LINK, "up/b/.."),  # a again
        ("e", b"", LINK, "missing/.."),  # nothing there: taken as named, as realpath does
        ("a/", b"", DIR, ""),  # a directory given twice is still a directory
    )
    _verify_tar(str(path))


def test_a_pax_keyword_two_tars_may_read_differently_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tree.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as archive:
        info = tarfile.TarInfo("f")
        info.pax_headers = {"GNU.sparse.name": "../../etc/passwd"}
        archive.addfile(info)
    with pytest.raises(BackendError, match=r"pax keyword 'GNU\.sparse\.name'"):
        _verify_tar(str(path))


def test_an_export_is_written_only_into_a_callers_own_file_on_a_filesystem_for_files(tmp_path: Path) -> None:
    """What a caller opened is checked on its descriptor: a regular file (or directory) of the
    caller's, not a file of the kernel's, whose writes may be judged by the writer's rights."""
    mine = tmp_path / "mine"
    mine.write_bytes(b"")
    uid = os.geteuid()
    fd = os.open(mine, os.O_RDONLY)
    try:
        check_mine(fd, "mine", uid)
        with pytest.raises(UsageError, match=r"^export: mine: must be a regular file of the caller's own$"):
            check_mine(fd, "mine", uid + 1)
        with pytest.raises(UsageError, match=r"^export: mine: must be a directory of the caller's own$"):
            check_mine(fd, "mine", uid, directory=True)
    finally:
        os.close(fd)
    for path, directory, name in (("/proc/self/sched", False, "procfs"), ("/sys", True, "sysfs")):
        fd = os.open(path, os.O_RDONLY)
        try:
            with pytest.raises(UsageError, match=f"must be a .* on a filesystem for files, not on {name}$"):
                check_mine(fd, path, os.fstat(fd).st_uid, directory=directory)
        finally:
            os.close(fd)
