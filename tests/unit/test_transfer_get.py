"""get's unpacking (sandboxer/api/transfer.py) against archives made here: what it makes, what it
refuses, and that a failed get removes what it made and nothing else. The sandbox's side is a
stream of the archive's bytes (the real exec is tested in tests/integration/test_service.py)."""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sandboxer.api.transfer import get
from sandboxer.errors import UsageError


class _Stream:
    """An exec_stream's answer: the archive as stdout chunks, then a status."""

    def __init__(self, data: bytes, status: int = 0, stderr: bytes = b"") -> None:
        self.data, self.final, self.stderr = data, status, stderr
        self.status: int | None = None

    def __iter__(self) -> Iterator[tuple[str, bytes]]:
        for start in range(0, len(self.data), 7000):
            yield "stdout", self.data[start : start + 7000]
        if self.stderr:
            yield "stderr", self.stderr
        self.status = self.final


def _archive(*members: tuple[str, bytes | None]) -> bytes:
    """A tar of (name, content) members; content None: a directory."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name, content in members:
            info = tarfile.TarInfo(name)
            if content is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                archive.addfile(info)
            else:
                info.size, info.mode = len(content), 0o644
                archive.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


def _run(stream: _Stream, before: Callable[[], None] = lambda: None) -> Callable[..., _Stream]:
    def run(argv: list[str]) -> _Stream:
        assert argv[:4] == ["tar", "-c", "-f", "-"]
        before()
        return stream

    return run


def test_a_directory_comes_out_whole(tmp_path: Path) -> None:
    data = _archive(("out", None), ("out/a.txt", b"alpha"), ("out/deep", None), ("out/deep/b", b"x" * 100_000))
    get(_run(_Stream(data)), "/workspace/out", str(tmp_path / "copy"))
    assert (tmp_path / "copy" / "a.txt").read_bytes() == b"alpha"
    assert (tmp_path / "copy" / "deep" / "b").read_bytes() == b"x" * 100_000


def test_a_refused_member_removes_what_was_unpacked(tmp_path: Path) -> None:
    buffer = io.BytesIO(_archive(("out", None), ("out/a.txt", b"alpha")))
    with tarfile.open(fileobj=buffer, mode="a") as archive:
        link = tarfile.TarInfo("out/link")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/shadow"
        archive.addfile(link)
    with pytest.raises(UsageError, match="is not a regular file or directory"):
        get(_run(_Stream(buffer.getvalue())), "/workspace/out", str(tmp_path / "copy"))
    assert not (tmp_path / "copy").exists()


def test_a_destination_that_appears_meanwhile_is_never_removed(tmp_path: Path) -> None:
    theirs = tmp_path / "copy"

    def someone_else() -> None:
        theirs.mkdir()
        (theirs / "keep").write_text("theirs")

    data = _archive(("out", None), ("out/a.txt", b"alpha"))
    with pytest.raises(UsageError, match="cannot be written"):
        get(_run(_Stream(data), someone_else), "/workspace/out", str(theirs))
    assert (theirs / "keep").read_text() == "theirs"
    assert sorted(os.listdir(theirs)) == ["keep"]


def test_a_member_outside_the_name_is_refused(tmp_path: Path) -> None:
    data = _archive(("out", None), ("other/x", b"x"))
    with pytest.raises(UsageError, match="outside out"):
        get(_run(_Stream(data)), "/workspace/out", str(tmp_path / "copy"))
    assert not (tmp_path / "copy").exists()


def test_the_sandboxs_tar_failing_is_said_and_nothing_is_made(tmp_path: Path) -> None:
    stream = _Stream(b"", status=2, stderr=b"tar: out: Cannot stat: No such file or directory\n")
    with pytest.raises(UsageError) as failed:
        get(_run(stream), "/workspace/out", str(tmp_path / "copy"))
    assert failed.value.message == (
        "get: /workspace/out: tar in the sandbox failed (tar: out: Cannot stat: No such file or directory)"
    )
    assert not (tmp_path / "copy").exists()


def test_an_archive_cut_inside_a_file_is_said_damaged(tmp_path: Path) -> None:
    whole = _archive(("out", None), ("out/a.txt", b"alpha" * 1000))
    with tarfile.open(fileobj=io.BytesIO(whole)) as archive:
        start = archive.getmember("out/a.txt").offset_data
    data = whole[: start + 100]
    with pytest.raises(UsageError, match="damaged archive"):
        get(_run(_Stream(data)), "/workspace/out", str(tmp_path / "copy"))
    assert not (tmp_path / "copy").exists()


@pytest.mark.parametrize("members", [(("f", b"hello"),), (("f", None), ("f/a.txt", b"hello"))], ids=["file", "dir"])
def test_a_bare_name_is_made_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, members: tuple[tuple[str, bytes | None], ...]
) -> None:
    """`get /workspace/f f`: a destination with no directory part (its dirname is "")."""
    monkeypatch.chdir(tmp_path)
    get(_run(_Stream(_archive(*members))), "/workspace/f", "f")
    made = tmp_path / "f"
    assert (made / "a.txt" if made.is_dir() else made).read_bytes() == b"hello"
