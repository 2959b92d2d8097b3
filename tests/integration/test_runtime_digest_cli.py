"""`sandboxer runtime digest` through the real CLI: the published digest, refusals, the stat cache."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import Broker, make_runtime
from tests.unit.digest_reference import reference_digest


def _minimal(root: Path) -> None:
    del root


def _sorting(root: Path) -> None:
    (root / "a").mkdir(mode=0o750)
    (root / "a" / "b").write_bytes(b"child")
    (root / "a.b").write_bytes(b"dot")
    (root / "a-b").write_bytes(b"dash")
    (root / "-top").write_bytes(b"")


def _assorted(root: Path) -> None:
    broot = os.fsencode(root)
    os.makedirs(os.path.join(broot, b"lib", b"\xff\xfe", b"empty"))
    with open(os.path.join(broot, b"lib", b"\xff\xfe", b"caf\xe9.py"), "wb") as stream:
        stream.write(os.urandom(3000))
    (root / "lib" / os.fsdecode(b"\xff\xfe")).chmod(0o2750)
    (root / "lib" / "tool").write_bytes(b"#!/bin/sh\n")
    (root / "lib" / "tool").chmod(0o1755)
    (root / "lib" / "secret").write_bytes(b"")
    (root / "lib" / "secret").chmod(0o600)
    os.symlink("python3", root / "bin" / "python")
    os.symlink(b"../lib/\xff\xfe/caf\xe9.py", os.path.join(broot, b"bin", b"entry"))
    os.symlink("missing", root / "lib" / "dangling")


TREES: list[Callable[[Path], None]] = [_minimal, _sorting, _assorted]


def _runtime(tmp_path: Path) -> Path:
    return make_runtime(Path(os.path.realpath(tmp_path)) / "rt")


@pytest.mark.parametrize("populate", TREES, ids=[tree.__name__.strip("_") for tree in TREES])
def test_runtime_digest_prints_the_reference_digest(
    broker: Broker, tmp_path: Path, populate: Callable[[Path], None]
) -> None:
    root = _runtime(tmp_path)
    populate(root)
    expected = reference_digest(root)

    plain = broker.run("runtime", "digest", str(root))
    assert (plain.status, plain.stderr) == (0, "")
    assert plain.stdout == expected + "\n"

    as_json = broker.run("runtime", "digest", str(root), "--json")
    assert (as_json.status, as_json.stderr) == (0, "")
    document = as_json.json()
    assert document["sha256"] == expected
    assert document["path"] == str(root)
    assert document["format"] == "tree-digest-v1"
    assert document["full"] is False


def test_runtime_digest_refusal_is_one_stderr_line_with_status_2(broker: Broker, tmp_path: Path) -> None:
    root = _runtime(tmp_path)
    (root / "lib").mkdir()
    os.mkfifo(root / "lib" / "pipe")

    plain = broker.run("runtime", "digest", str(root))
    assert plain.status == 2
    assert plain.stdout == ""
    lines = plain.stderr.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("sandboxer: ")
    assert "lib/pipe" in lines[0]

    as_json = broker.run("runtime", "digest", str(root), "--json")
    assert as_json.status == 2
    error = as_json.json()["error"]
    assert set(error) == {"kind", "message"}
    assert error["kind"] == "runtime-artifact"
    assert "lib/pipe" in error["message"]
    assert as_json.stderr == f"sandboxer: {error['message']}\n"


def test_runtime_digest_escaping_symlink_exits_2_naming_it(broker: Broker, tmp_path: Path) -> None:
    root = _runtime(tmp_path)
    os.symlink("../../..", root / "bin" / "out")
    result = broker.run("runtime", "digest", str(root), "--json")
    assert result.status == 2
    assert result.json()["error"]["message"].startswith("runtime bin/out: ")


def test_runtime_digest_reuses_the_stat_cache_and_full_rereads(broker: Broker, tmp_path: Path) -> None:
    root = _runtime(tmp_path)
    _assorted(root)
    expected = reference_digest(root)
    time.sleep(2.1)  # past the default 2 s racy window, so the first run may store every file

    first = broker.run("runtime", "digest", str(root), "--json").json()
    second = broker.run("runtime", "digest", str(root), "--json").json()
    assert first["sha256"] == second["sha256"] == expected
    assert first["reused"] == 0
    assert first["bytes_read"] == first["bytes"] > 3000
    assert second["files"] == first["files"] == 5
    assert second["reused"] == second["files"]
    assert second["bytes_read"] == 0

    full = broker.run("runtime", "digest", str(root), "--full", "--json").json()
    assert full["full"] is True
    assert full["sha256"] == expected
    assert full["reused"] == 0
    assert full["bytes_read"] == full["bytes"] == first["bytes"]

    assert not any(path.name.endswith(".cache") for path in root.rglob("*"))
    (cache,) = (broker.state / "digest-cache").iterdir()
    assert cache.stat().st_mode & 0o777 == 0o600
