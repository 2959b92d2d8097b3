"""The verified-stat cache: reuse only what stat proves unchanged, never trust a doubtful cache file."""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from sandboxer.core.digest import TreeDigest, tree_digest
from sandboxer.host.digest_cache import StatCache, digest_runtime
from tests.conftest import make_runtime
from tests.unit.digest_reference import Node, build_tree, reference_digest, trees


@pytest.fixture
def runtime(tmp_path: Path) -> Path:
    """A small runtime: a few files in nested directories, one with a non-UTF-8 name."""
    root = make_runtime(Path(os.path.realpath(tmp_path)) / "rt")
    (root / "lib" / "pkg").mkdir(parents=True)
    (root / "lib" / "pkg" / "mod.py").write_bytes(b"value = 1\n")
    (root / "lib" / "pkg" / "empty.py").write_bytes(b"")
    with open(os.path.join(os.fsencode(root), b"lib", b"caf\xe9.txt"), "wb") as stream:
        stream.write(b"latin-1 name\n")
    os.symlink("pkg/mod.py", root / "lib" / "mod.py")
    return root


@pytest.fixture
def state(tmp_path: Path) -> str:
    """A state directory that does not exist yet (the cache creates it owner-only)."""
    return str(Path(os.path.realpath(tmp_path)) / "state")


def _digest(root: Path, state: str, *, racy_seconds: float = 0, save: bool = True) -> TreeDigest:
    cache = StatCache.for_root(state, str(root), racy_seconds=racy_seconds)
    result = tree_digest(str(root), cache=cache)
    if save:
        cache.save()
    return result


def _warm(root: Path, state: str) -> TreeDigest:
    """Fill the cache (racy window off, so fresh files are stored) and check a reload reuses all."""
    first = _digest(root, state)
    assert (first.reused, first.bytes_read) == (0, first.bytes)
    second = _digest(root, state, save=False)
    assert (second.reused, second.bytes_read) == (second.files, 0)
    return first


def _cache_file(state: str) -> Path:
    (path,) = (Path(state) / "digest-cache").iterdir()
    return path


def test_reloaded_cache_reuses_every_unchanged_file_with_the_same_digest(runtime: Path, state: str) -> None:
    first = _digest(runtime, state)
    assert first.sha256 == reference_digest(runtime)
    assert first.files == 5
    second = _digest(runtime, state)
    assert second.reused == second.files == 5
    assert second.bytes_read == 0
    assert second.sha256 == first.sha256


def test_cache_file_and_state_dir_are_owner_only(runtime: Path, state: str) -> None:
    _digest(runtime, state)
    assert _cache_file(state).stat().st_mode & 0o777 == 0o600
    assert (Path(state) / "digest-cache").stat().st_mode & 0o077 == 0
    assert not any(path.name.endswith(".cache") for path in runtime.rglob("*"))


def test_same_size_edit_with_restored_mtime_is_seen(runtime: Path, state: str) -> None:
    first = _warm(runtime, state)
    mod = runtime / "lib" / "pkg" / "mod.py"
    old = mod.stat()
    time.sleep(0.02)  # let the (coarse) ctime clock tick past the creation time
    mod.write_bytes(b"value = 2\n")
    os.utime(mod, ns=(old.st_atime_ns, old.st_mtime_ns))
    new = mod.stat()
    assert (new.st_size, new.st_mtime_ns, new.st_ino) == (old.st_size, old.st_mtime_ns, old.st_ino)
    assert new.st_ctime_ns != old.st_ctime_ns

    after = _digest(runtime, state)
    assert after.sha256 != first.sha256
    assert after.sha256 == reference_digest(runtime)
    assert after.reused == after.files - 1
    assert after.bytes_read == new.st_size


def test_replaced_file_with_same_size_and_mtime_is_seen(runtime: Path, state: str) -> None:
    first = _warm(runtime, state)
    mod = runtime / "lib" / "pkg" / "mod.py"
    old = mod.stat()
    replacement = runtime / "lib" / "pkg" / "new.tmp"
    replacement.write_bytes(b"value = 3\n")
    os.utime(replacement, ns=(old.st_atime_ns, old.st_mtime_ns))
    replacement.replace(mod)
    after = _digest(runtime, state)
    assert after.sha256 != first.sha256
    assert after.sha256 == reference_digest(runtime)


def test_full_digest_rereads_every_byte_despite_a_warm_cache(runtime: Path, state: str) -> None:
    first = _warm(runtime, state)
    cached = digest_runtime(str(runtime), state_dir=state)
    assert (cached.reused, cached.bytes_read) == (cached.files, 0)
    full = digest_runtime(str(runtime), state_dir=state, full=True)
    assert full.reused == 0
    assert full.bytes_read == full.bytes == first.bytes
    assert full.sha256 == first.sha256 == reference_digest(runtime)


def test_digest_without_a_state_dir_reads_everything(runtime: Path) -> None:
    result = digest_runtime(str(runtime), state_dir=None)
    assert (result.reused, result.bytes_read) == (0, result.bytes)
    assert result.sha256 == reference_digest(runtime)


@pytest.mark.parametrize("where", ["header", "body"])
def test_tampered_cache_file_is_ignored(runtime: Path, state: str, where: str) -> None:
    first = _warm(runtime, state)
    path = _cache_file(state)
    data = bytearray(path.read_bytes())
    header_end = data.index(b"\n")
    if where == "header":
        index = header_end - 1  # the last hex digit of the checksum
    else:
        # the last digit of the stored content hash of pyvenv.cfg: trusted, it would change the digest
        content_hash = hashlib.sha256((runtime / "pyvenv.cfg").read_bytes()).hexdigest().encode()
        index = data.index(content_hash, header_end) + len(content_hash) - 1
    data[index] = ord("0") if data[index] != ord("0") else ord("1")
    path.write_bytes(bytes(data))
    after = _digest(runtime, state, save=False)
    assert after.reused == 0
    assert after.sha256 == first.sha256 == reference_digest(runtime)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620], ids=oct)
def test_cache_file_open_to_others_is_ignored(runtime: Path, state: str, mode: int) -> None:
    first = _warm(runtime, state)
    _cache_file(state).chmod(mode)
    after = _digest(runtime, state, save=False)
    assert after.reused == 0
    assert after.sha256 == first.sha256


def test_cache_file_that_is_a_symlink_is_ignored(runtime: Path, state: str) -> None:
    first = _warm(runtime, state)
    path = _cache_file(state)
    path.rename(path.with_name("elsewhere"))
    os.symlink("elsewhere", path)
    after = _digest(runtime, state, save=False)
    assert after.reused == 0
    assert after.sha256 == first.sha256


def test_cache_of_another_root_is_not_used(runtime: Path, state: str, tmp_path: Path) -> None:
    _warm(runtime, state)
    other = Path(os.path.realpath(tmp_path)) / "other"
    os.rename(runtime, other)
    # the same inodes under another root: a cache file renamed to the other root's name is refused
    own = _cache_file(state)
    theirs = StatCache.for_root(state, str(other)).path
    os.rename(own, theirs)
    after = _digest(other, state, save=False)
    assert after.reused == 0
    assert after.sha256 == reference_digest(other)


def test_files_changed_within_the_racy_window_are_not_stored(runtime: Path, state: str) -> None:
    cache = StatCache.for_root(state, str(runtime))  # default window: 2 s
    tree_digest(str(runtime), cache=cache)
    assert cache.fresh == {}
    cache.save()
    again = _digest(runtime, state, save=False)
    assert again.reused == 0


def test_digest_runtime_right_after_creation_reuses_nothing(runtime: Path, state: str) -> None:
    first = digest_runtime(str(runtime), state_dir=state)
    second = digest_runtime(str(runtime), state_dir=state)
    assert first.reused == second.reused == 0
    assert second.bytes_read == second.bytes
    assert second.sha256 == first.sha256


@settings(
    max_examples=30,
    deadline=None,
    database=None,
    # The small name alphabet (collisions, ordering) makes hypothesis discard many dictionaries.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(tree=trees)
def test_digest_through_a_warm_cache_equals_reference(
    tmp_path_factory: pytest.TempPathFactory, tree: dict[bytes, Node]
) -> None:
    with tempfile.TemporaryDirectory(dir=tmp_path_factory.getbasetemp()) as scratch:
        base = Path(os.path.realpath(scratch))
        built = build_tree(base / "rt", tree)
        state = str(base / "state")
        expected = reference_digest(built.root)
        assert _digest(built.root, state).sha256 == expected
        warm = _digest(built.root, state)
        assert warm.sha256 == expected
        assert (warm.reused, warm.bytes_read) == (built.files, 0)
