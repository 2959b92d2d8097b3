"""wait_ready answers as select(2) would, for descriptor numbers select itself refuses (a busy
service holds thousands)."""

from __future__ import annotations

import contextlib
import os
import resource
import select
from collections.abc import Iterator

import pytest

from sandboxer.host.ready import wait_ready

HIGH = 4000  # past select's FD_SETSIZE (1024)


@pytest.fixture
def high_pipe() -> Iterator[tuple[int, int]]:
    """A pipe whose ends are numbered past 1023."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= HIGH + 1:
        pytest.skip(f"the hard descriptor limit ({hard}) is below {HIGH + 2}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, HIGH + 2), hard))
    read_end, write_end = os.pipe()
    os.dup2(read_end, HIGH)
    os.dup2(write_end, HIGH + 1)
    os.close(read_end)
    os.close(write_end)
    try:
        yield HIGH, HIGH + 1
    finally:
        for fd in (HIGH, HIGH + 1):
            with contextlib.suppress(OSError):
                os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_select_itself_refuses_such_a_descriptor(high_pipe: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="filedescriptor out of range"):
        select.select([high_pipe[0]], [], [], 0)


def test_a_high_descriptor_is_waited_for(high_pipe: tuple[int, int]) -> None:
    read_end, write_end = high_pipe
    assert wait_ready([read_end], [write_end], timeout=0) == ([], [write_end])
    os.write(write_end, b"x")
    assert wait_ready([read_end], timeout=0) == ([read_end], [])
    assert os.read(read_end, 1) == b"x"
    os.close(write_end)
    assert wait_ready([read_end], timeout=5) == ([read_end], [])  # its end is ready too
    assert os.read(read_end, 1) == b""


def test_nothing_ready_waits_out_the_timeout() -> None:
    read_end, write_end = os.pipe()
    try:
        assert wait_ready([read_end], timeout=0.01) == ([], [])
    finally:
        os.close(read_end)
        os.close(write_end)
