"""The leak tests' scanner (tests/integration/scan.py) finds a needle wherever it is in a file:
after a hole, across two of its read chunks, in a later data extent; and nothing in holes."""

from __future__ import annotations

import os
from pathlib import Path

from tests.integration.scan import CHUNK, files_holding

NEEDLE = b"sbx-secret-5f1c"


def _sparse(path: Path, pieces: dict[int, bytes], size: int) -> None:
    with path.open("wb") as stream:
        stream.truncate(size)
        for offset, data in pieces.items():
            stream.seek(offset)
            stream.write(data)


def test_needles_are_found_past_holes_and_across_chunks(tmp_path: Path) -> None:
    gib = 1 << 30
    _sparse(tmp_path / "after-a-hole", {gib - 4096: NEEDLE}, gib)
    _sparse(tmp_path / "across-chunks", {0: b"x" * (CHUNK - 5) + NEEDLE}, 2 * CHUNK)
    _sparse(tmp_path / "second-extent", {0: b"y" * 4096, 64 * CHUNK: b"z" + NEEDLE}, 128 * CHUNK)
    _sparse(tmp_path / "holes-only", {}, gib)
    (tmp_path / "plain").write_bytes(b"nothing here")
    os.symlink(tmp_path / "after-a-hole", tmp_path / "link")  # not followed
    found = files_holding(tmp_path, [b"absent", NEEDLE])
    assert sorted(os.path.basename(path) for path in found) == ["across-chunks", "after-a-hole", "second-extent"]
    assert files_holding(tmp_path, [b"absent"]) == []
