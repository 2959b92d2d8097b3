"""Tree digest v1: the published format, sensitivity to every change, and the artifact rules."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import socket
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from sandboxer.core.digest import RuntimeArtifactError, tree_digest
from sandboxer.errors import UsageError
from tests.conftest import make_runtime
from tests.unit.digest_reference import BuiltTree, Node, build_tree, reference_digest, trees


@pytest.fixture
def runtime(tmp_path: Path) -> Path:
    """A minimal runtime at a canonical path."""
    return make_runtime(Path(os.path.realpath(tmp_path)) / "rt")


def _refused(root: Path | str, relpath: str) -> pytest.ExceptionInfo[RuntimeArtifactError]:
    with pytest.raises(RuntimeArtifactError) as info:
        tree_digest(str(root))
    assert info.value.message.startswith(f"runtime {relpath}: "), info.value.message
    return info


# --- the format -------------------------------------------------------------------------------


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    # The small name alphabet (collisions, ordering) makes hypothesis discard many dictionaries.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(tree=trees)
def test_tree_digest_equals_reference_implementation_for_random_trees(
    tmp_path_factory: pytest.TempPathFactory, tree: dict[bytes, Node]
) -> None:
    with tempfile.TemporaryDirectory(dir=tmp_path_factory.getbasetemp()) as scratch:
        built: BuiltTree = build_tree(Path(os.path.realpath(scratch)) / "rt", tree)
        result = tree_digest(str(built.root))
        assert result.sha256 == reference_digest(built.root)
        assert (result.files, result.entries, result.bytes) == (built.files, built.entries, built.bytes)
        assert result.bytes_read == result.bytes
        assert result.reused == 0


def test_records_are_sorted_globally_by_relative_path_bytes(runtime: Path) -> None:
    # '-' < '.' < '/': "a-b" and "a.b" come between the directory "a" and its child "a/b", and
    # "-top" even comes before the root's own record ".".
    (runtime / "a").mkdir()
    (runtime / "a" / "b").write_bytes(b"child")
    (runtime / "a.b").write_bytes(b"dot")
    (runtime / "a-b").write_bytes(b"dash")
    (runtime / "-top").write_bytes(b"")
    os.symlink("a/b", runtime / "z")
    for path, mode in [
        (runtime, 0o755),
        (runtime / "a", 0o750),
        (runtime / "a" / "b", 0o600),
        (runtime / "a.b", 0o644),
        (runtime / "a-b", 0o640),
        (runtime / "-top", 0o444),
        (runtime / "bin", 0o755),
        (runtime / "pyvenv.cfg", 0o644),
    ]:
        path.chmod(mode)

    def sha(data: bytes) -> bytes:
        return hashlib.sha256(data).hexdigest().encode()

    python = (runtime / "bin" / "python3").read_bytes()
    pyvenv = (runtime / "pyvenv.cfg").read_bytes()
    records = [
        b"F\0-top\x000444\0" + sha(b"") + b"\n",
        b"D\0.\x000755\n",
        b"D\0a\x000750\n",
        b"F\0a-b\x000640\0" + sha(b"dash") + b"\n",
        b"F\0a.b\x000644\0" + sha(b"dot") + b"\n",
        b"F\0a/b\x000600\0" + sha(b"child") + b"\n",
        b"D\0bin\x000755\n",
        b"F\0bin/python3\x000755\0" + sha(python) + b"\n",
        b"F\0pyvenv.cfg\x000644\0" + sha(pyvenv) + b"\n",
        b"L\0z\0a/b\n",
    ]
    expected = hashlib.sha256(b"".join(records)).hexdigest()
    result = tree_digest(str(runtime))
    assert result.sha256 == expected
    assert result.sha256 == reference_digest(runtime)
    assert (result.entries, result.files) == (10, 6)


def test_non_utf8_names_are_digested_as_raw_bytes(runtime: Path) -> None:
    broot = os.fsencode(runtime)
    os.mkdir(os.path.join(broot, b"\xff\xfe"))
    with open(os.path.join(broot, b"\xff\xfe", b"caf\xe9"), "wb") as stream:
        stream.write(b"latin-1 name")
    os.symlink(b"\xff\xfe/caf\xe9", os.path.join(broot, b"link\x80"))
    assert tree_digest(str(runtime)).sha256 == reference_digest(runtime)


def test_digest_ignores_location_and_timestamps(tmp_path: Path) -> None:
    base = Path(os.path.realpath(tmp_path))
    first = make_runtime(base / "one")
    second = make_runtime(base / "elsewhere" / "two")
    for root in (first, second):
        (root / "lib").mkdir()
        (root / "lib" / "mod.py").write_text("x = 1\n")
        os.symlink("../lib/mod.py", root / "bin" / "mod")
    os.utime(second / "lib" / "mod.py", ns=(1, 1))
    os.utime(second / "lib", ns=(2, 2))
    assert tree_digest(str(first)).sha256 == tree_digest(str(second)).sha256


def test_file_larger_than_one_mebibyte_is_hashed_whole(runtime: Path) -> None:
    big = runtime / "big.bin"
    big.write_bytes(os.urandom(1 << 20) + b"tail")
    before = tree_digest(str(runtime))
    assert before.sha256 == reference_digest(runtime)
    with open(big, "r+b") as stream:
        stream.seek(-1, os.SEEK_END)
        stream.write(b"T")
    after = tree_digest(str(runtime))
    assert after.sha256 != before.sha256
    assert after.sha256 == reference_digest(runtime)


# --- every single change changes the digest ---------------------------------------------------


def _populate(root: Path) -> None:
    (root / "lib").mkdir()
    (root / "lib" / "mod.py").write_bytes(b"value = 1\n")
    (root / "lib" / "mod.py").chmod(0o644)
    (root / "lib").chmod(0o755)
    (root / "share").mkdir()
    os.symlink("python3", root / "bin" / "python")


def _flip_content_byte(root: Path) -> None:
    (root / "lib" / "mod.py").write_bytes(b"value = 2\n")


def _set_owner_execute(root: Path) -> None:
    (root / "lib" / "mod.py").chmod(0o744)


def _set_sticky_bit(root: Path) -> None:
    (root / "lib" / "mod.py").chmod(0o1644)


def _clear_group_read(root: Path) -> None:
    (root / "lib" / "mod.py").chmod(0o604)


def _clear_dir_other_execute(root: Path) -> None:
    (root / "lib").chmod(0o754)


def _set_dir_setgid(root: Path) -> None:
    (root / "lib").chmod(0o2755)


def _change_root_mode(root: Path) -> None:
    root.chmod((root.stat().st_mode & 0o7777) ^ 0o010)


def _add_empty_dir(root: Path) -> None:
    (root / "share" / "empty").mkdir()


def _add_empty_file(root: Path) -> None:
    (root / "share" / "empty.txt").write_bytes(b"")


def _retarget_symlink_to_same_file(root: Path) -> None:
    (root / "bin" / "python").unlink()
    os.symlink("./python3", root / "bin" / "python")


def _rename_file(root: Path) -> None:
    (root / "lib" / "mod.py").rename(root / "lib" / "mod2.py")


def _move_file_to_other_dir(root: Path) -> None:
    (root / "lib" / "mod.py").rename(root / "share" / "mod.py")


def _remove_empty_dir(root: Path) -> None:
    (root / "share").rmdir()


def _replace_file_with_symlink(root: Path) -> None:
    (root / "lib" / "mod.py").rename(root / "lib" / "real.py")
    os.symlink("real.py", root / "lib" / "mod.py")


CHANGES: list[Callable[[Path], None]] = [
    _flip_content_byte,
    _set_owner_execute,
    _set_sticky_bit,
    _clear_group_read,
    _clear_dir_other_execute,
    _set_dir_setgid,
    _change_root_mode,
    _add_empty_dir,
    _add_empty_file,
    _retarget_symlink_to_same_file,
    _rename_file,
    _move_file_to_other_dir,
    _remove_empty_dir,
    _replace_file_with_symlink,
]


@pytest.mark.parametrize("change", CHANGES, ids=[change.__name__.strip("_") for change in CHANGES])
def test_digest_changes_after_any_single_change(runtime: Path, change: Callable[[Path], None]) -> None:
    _populate(runtime)
    before = tree_digest(str(runtime)).sha256
    assert tree_digest(str(runtime)).sha256 == before
    change(runtime)
    after = tree_digest(str(runtime)).sha256
    assert after != before
    assert after == reference_digest(runtime)


# --- refusals ---------------------------------------------------------------------------------


def test_refusal_is_a_usage_error() -> None:
    assert issubclass(RuntimeArtifactError, UsageError)
    assert RuntimeArtifactError.exit_status == 2


def test_absolute_symlink_is_refused(runtime: Path) -> None:
    (runtime / "lib").mkdir()
    os.symlink(runtime / "pyvenv.cfg", runtime / "lib" / "abs")
    info = _refused(runtime, "lib/abs")
    assert "absolute symlink" in info.value.message


def test_absolute_bin_python3_symlink_is_refused(runtime: Path) -> None:
    (runtime / "bin" / "python3").unlink()
    os.symlink("/usr/bin/python3", runtime / "bin" / "python3")
    _refused(runtime, "bin/python3")


@pytest.mark.parametrize(
    ("relpath", "target"),
    [
        ("up", "../.."),
        ("lib/up", "../../outside"),
        ("parent", ".."),
    ],
)
def test_symlink_escaping_the_root_is_refused(runtime: Path, relpath: str, target: str) -> None:
    (runtime / "lib").mkdir()
    os.symlink(target, runtime / relpath)
    info = _refused(runtime, relpath)
    assert "escapes" in info.value.message


def test_symlink_escaping_through_another_internal_symlink_is_refused(runtime: Path) -> None:
    os.symlink(".", runtime / "up")
    assert tree_digest(str(runtime)).sha256 == reference_digest(runtime)
    os.symlink("up/..", runtime / "x")
    info = _refused(runtime, "x")
    assert "escapes" in info.value.message


def test_symlink_leaving_the_root_and_coming_back_by_its_name_is_refused(runtime: Path) -> None:
    # At /opt/sandboxer/runtime this link would point at /opt/sandboxer/rt/pyvenv.cfg, outside the
    # runtime; and the same tree (same digest) would be refused if its directory had another name.
    os.symlink(f"../{runtime.name}/pyvenv.cfg", runtime / "sneaky")
    _refused(runtime, "sneaky")


def test_symlink_climbing_out_through_an_internal_link_and_back_by_name_is_refused(runtime: Path) -> None:
    # lib/a -> .. is the root, so lib/a/.. is the root's parent: x reaches pyvenv.cfg only while
    # the runtime's directory is called "rt"; renamed or mounted elsewhere, the same tree escapes.
    (runtime / "lib").mkdir()
    os.symlink("..", runtime / "lib" / "a")
    os.symlink(f"lib/a/../{runtime.name}/pyvenv.cfg", runtime / "x")
    _refused(runtime, "x")


def test_internal_symlinks_are_accepted(runtime: Path) -> None:
    (runtime / "lib").mkdir()
    os.symlink(".", runtime / "up")
    os.symlink("up/lib", runtime / "via-up")
    os.symlink("..", runtime / "lib" / "root")
    os.symlink("../bin/python3", runtime / "lib" / "python")
    os.symlink("missing", runtime / "lib" / "dangling")
    assert tree_digest(str(runtime)).sha256 == reference_digest(runtime)


def test_fifo_is_refused(runtime: Path) -> None:
    (runtime / "lib").mkdir()
    os.mkfifo(runtime / "lib" / "pipe")
    info = _refused(runtime, "lib/pipe")
    assert "special file" in info.value.message


@contextlib.contextmanager
def _short_runtime() -> Iterator[Path]:
    # A unix socket path must fit in sun_path (108 bytes); pytest's tmp_path may not.
    with tempfile.TemporaryDirectory(prefix="sbx-", dir="/tmp") as scratch:
        yield make_runtime(Path(os.path.realpath(scratch)) / "rt")


def test_unix_socket_is_refused() -> None:
    with _short_runtime() as root, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(root / "bin" / "sock"))
        info = _refused(root, "bin/sock")
        assert "special file" in info.value.message


def test_character_device_is_refused(runtime: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to mknod")
    try:
        os.mknod(runtime / "null", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("needs CAP_MKNOD to mknod (root in a restricted container)")
    info = _refused(runtime, "null")
    assert "special file" in info.value.message


def _deny(monkeypatch: pytest.MonkeyPatch, name: str, denied: bytes) -> None:
    """Make os.<name> fail with EACCES on `denied`, as it does for a non-root broker on a 0700 entry."""
    real = getattr(os, name)

    def fake(path: Any, *args: Any, **kwargs: Any) -> Any:
        if os.fsencode(path) == denied:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, name, fake)


def test_unreadable_file_is_refused_naming_its_path(runtime: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (runtime / "lib").mkdir()
    (runtime / "lib" / "secret").write_bytes(b"x")
    _deny(monkeypatch, "open", os.fsencode(runtime / "lib" / "secret"))
    _refused(runtime, "lib/secret")


def test_unreadable_directory_is_refused_naming_its_path(runtime: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (runtime / "closed").mkdir()
    _deny(monkeypatch, "scandir", os.fsencode(runtime / "closed"))
    with pytest.raises(RuntimeArtifactError, match=r"^runtime closed/?: cannot be read"):
        tree_digest(str(runtime))


def test_refusal_names_a_non_utf8_path_with_backslash_escapes(runtime: Path) -> None:
    os.mkfifo(os.path.join(os.fsencode(runtime), b"\xff"))
    _refused(runtime, "\\xff")


@pytest.mark.parametrize("replacement", ["missing", "directory", "symlink"])
def test_pyvenv_cfg_must_be_a_regular_file(runtime: Path, replacement: str) -> None:
    cfg = runtime / "pyvenv.cfg"
    cfg.rename(runtime / "real.cfg")
    if replacement == "directory":
        cfg.mkdir()
    elif replacement == "symlink":
        os.symlink("real.cfg", cfg)
    _refused(runtime, "pyvenv.cfg")


@pytest.mark.parametrize("replacement", ["missing", "not-executable", "directory", "dangling-symlink"])
def test_bin_python3_must_be_an_executable_file(runtime: Path, replacement: str) -> None:
    python = runtime / "bin" / "python3"
    if replacement == "not-executable":
        python.chmod(0o644)
    else:
        python.unlink()
    if replacement == "directory":
        python.mkdir()
    elif replacement == "dangling-symlink":
        os.symlink("python3.11", python)
    _refused(runtime, "bin/python3")


def test_bin_python3_may_be_a_relative_symlink_to_an_executable(runtime: Path) -> None:
    python = runtime / "bin" / "python3"
    python.rename(runtime / "bin" / "python3.11")
    os.symlink("python3.11", python)
    assert tree_digest(str(runtime)).sha256 == reference_digest(runtime)


@pytest.mark.parametrize(
    ("relpath", "mode"), [("lib/ww", 0o646), ("lib", 0o757), (".", 0o757)], ids=["file", "dir", "root"]
)
def test_world_writable_entry_is_refused(runtime: Path, relpath: str, mode: int) -> None:
    (runtime / "lib").mkdir()
    (runtime / "lib" / "ww").write_bytes(b"x")
    (runtime / relpath).chmod(mode)
    info = _refused(runtime, relpath)
    assert "world-writable" in info.value.message


@pytest.mark.parametrize("bit", [stat.S_ISUID, stat.S_ISGID], ids=["setuid", "setgid"])
def test_setuid_or_setgid_file_is_refused(runtime: Path, bit: int) -> None:
    (runtime / "lib").mkdir()
    tool = runtime / "lib" / "tool"
    tool.write_bytes(b"#!/bin/sh\n")
    tool.chmod(0o755 | bit)
    if not tool.stat().st_mode & bit:
        pytest.skip("the kernel cleared the bit (not a member of the file's group)")
    info = _refused(runtime, "lib/tool")
    assert "setuid or setgid" in info.value.message


@pytest.mark.parametrize(
    "spell",
    [
        pytest.param(os.path.relpath, id="relative"),
        pytest.param(lambda root: str(root) + "/", id="trailing-slash"),
        pytest.param(lambda root: f"{root.parent}/./{root.name}", id="dot-component"),
        pytest.param(lambda root: f"{root}/bin/..", id="dotdot-component"),
        pytest.param(lambda root: "/" + str(root), id="double-leading-slash"),
        pytest.param(lambda root: str(root.parent / "alias"), id="through-symlink"),
    ],
)
def test_non_canonical_path_is_refused(runtime: Path, spell: Callable[[Path], str]) -> None:
    os.symlink(runtime.name, runtime.parent / "alias")
    path = spell(runtime)
    with pytest.raises(RuntimeArtifactError) as info:
        tree_digest(path)
    assert info.value.message.startswith(f"runtime {path}: must be ")


def test_path_below_a_symlinked_directory_is_refused(runtime: Path) -> None:
    os.symlink(".", runtime.parent / "same")
    path = str(runtime.parent / "same" / runtime.name)
    with pytest.raises(RuntimeArtifactError, match=re.escape(f"runtime {path}: must be canonical")):
        tree_digest(path)


def test_path_that_is_a_file_is_refused(runtime: Path) -> None:
    path = str(runtime / "pyvenv.cfg")
    with pytest.raises(RuntimeArtifactError, match=re.escape(f"runtime {path}: must be a directory")):
        tree_digest(path)


def test_nonexistent_path_is_refused(runtime: Path) -> None:
    path = str(runtime / "nowhere")
    with pytest.raises(RuntimeArtifactError, match=re.escape(f"runtime {path}: does not exist")):
        tree_digest(path)
