"""How an exec's output travels over the service's socket: a stream of frames, each a one-byte
kind, a four-byte big-endian length and that many bytes. Kinds: 1 stdout, 2 stderr, 3 the end
(a JSON object: {"status": N} or {"error": {...}}). Standard library only: the client uses it.

Long outputs are never held whole: each chunk the command writes is one frame as it arrives.
"""

from __future__ import annotations

import json
import struct

STDOUT, STDERR, END = 1, 2, 3
HEADER = struct.Struct(">BI")
MAX_FRAME = 1 << 20  # no chunk of output is larger than this (a pipe read is 64 KiB)
CONTENT_TYPE = "application/vnd.sandboxer.exec-frames"
EXEC_HEADER = "Sandboxer-Exec"  # the answer's header naming the exec, for its signals


def frame(kind: int, payload: bytes) -> bytes:
    """One frame."""
    return HEADER.pack(kind, len(payload)) + payload


def end(document: dict[str, object]) -> bytes:
    """The last frame: the exec's status, or the error that ended it."""
    return frame(END, json.dumps(document).encode())


class FrameReader:
    """Frames out of bytes as they arrive (`feed`), whole frames only."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self._buffer += data
        found = []
        while len(self._buffer) >= HEADER.size:
            kind, size = HEADER.unpack_from(self._buffer)
            if kind not in (STDOUT, STDERR, END) or size > MAX_FRAME:
                raise ValueError("the service sent a malformed exec frame")
            if len(self._buffer) < HEADER.size + size:
                break
            found.append((kind, self._buffer[HEADER.size : HEADER.size + size]))
            self._buffer = self._buffer[HEADER.size + size :]
        return found

    @property
    def pending(self) -> bool:
        """Whether part of a frame is still expected."""
        return bool(self._buffer)
