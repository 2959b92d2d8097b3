"""The session keyring every process entering a sandbox joins: one per sandbox, never the
caller's (real keyctl calls in forked children)."""

from __future__ import annotations

import ctypes
import os

from sandboxer.backends.bwrap import privileges

_libc = ctypes.CDLL(None, use_errno=True)
KEYCTL_GET_KEYRING_ID = 0
KEY_SPEC_SESSION_KEYRING = -3


def _session_keyring_in_child(name: str | None) -> int:
    """The session keyring serial a forked child has after joining `name` (or without joining)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            if name is not None:
                privileges.new_session_keyring(name)
            serial = _libc.syscall(250, KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING, 0)
            os.write(write_end, str(serial).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as stream:
        data = stream.read()
    os.waitpid(pid, 0)
    return int(data)


def test_every_process_of_a_sandbox_shares_one_keyring_that_is_not_the_callers() -> None:
    name = privileges.keyring_name(os.urandom(12).hex())
    caller = _session_keyring_in_child(None)
    # A holder keeps the sandbox's keyring alive, as bwrap and the holder do for a sandbox.
    ready_r, ready_w = os.pipe()
    stop_r, stop_w = os.pipe()
    holder = os.fork()
    if holder == 0:
        try:
            os.close(stop_w)
            privileges.new_session_keyring(name)
            os.write(ready_w, str(_libc.syscall(250, KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING, 0)).encode())
            os.close(ready_w)
            os.read(stop_r, 1)
        finally:
            os._exit(0)
    os.close(ready_w)
    try:
        with os.fdopen(ready_r, "rb") as stream:
            held = int(stream.read())
        joined = [_session_keyring_in_child(name) for _ in range(3)]
        other = _session_keyring_in_child(privileges.keyring_name(os.urandom(12).hex()))
    finally:
        os.close(stop_w)
        os.waitpid(holder, 0)
        os.close(stop_r)
    assert held > 0, held
    assert joined == [held] * 3, "each process made a keyring of its own (the owner's key quota pays)"
    assert held != caller
    assert other not in (held, caller)
