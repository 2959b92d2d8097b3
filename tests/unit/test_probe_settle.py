"""The probe's environment is read only once the kernel has finished laying it out."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from sandboxer.backends.bwrap import live as bwrap


def test_an_empty_environment_is_read_again_until_the_exec_has_finished(tmp_path: Path) -> None:
    environ = tmp_path / "environ"
    environ.write_bytes(b"")  # what /proc/PID/environ shows between close-on-exec and the new stack
    timer = threading.Timer(0.05, environ.write_bytes, args=(b"PATH=/usr/bin\0HOME=/home/sandbox\0",))
    timer.start()
    try:
        assert bwrap._settled_environ(str(tmp_path)) == b"PATH=/usr/bin\0HOME=/home/sandbox\0"
    finally:
        timer.cancel()


def test_an_environment_that_stays_empty_is_reported_as_empty_after_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "environ").write_bytes(b"")
    monkeypatch.setattr(bwrap, "_PROBE_SETTLE_SECONDS", 0.02)
    assert bwrap._settled_environ(str(tmp_path)) == b""


def test_a_vanished_probe_is_an_os_error_not_a_wait(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        bwrap._settled_environ(str(tmp_path / "gone"))
