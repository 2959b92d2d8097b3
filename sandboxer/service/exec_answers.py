"""The three shapes of an exec's answer (docs/service.md, "exec"), chosen per request:

- `frames` (application/vnd.sandboxer.exec-frames, frames.py): what sandboxer's own clients read,
  and the default;
- `ndjson` (application/x-ndjson): one JSON object a line, `{"stream", "data"}` for output (`data`
  its text, or base64 with `"encoding": "base64"` when it is not UTF-8), then last
  `{"exit_status": N}` (with `"error"` when the broker could not run it);
- `text` (text/plain): the command's stdout and stderr bytes as they come, then one last line
  `sandboxer: exit status N` (`: MESSAGE` after it when the broker could not run it), on a line
  of its own: a newline is put before it when the output did not end with one.

`?format=frames|ndjson|text` chooses, else the request's Accept header (the type it prefers
among these three); anything else is the frames, as before. An Answer turns output chunks and the
exec's end (`{"status": N}` or `{"error": {...}}`) into the bytes of its shape; it is used by one
thread (the event loop's), in order.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Protocol

from sandboxer.errors import UsageError
from sandboxer.service import frames

FRAMES, NDJSON, TEXT = "frames", "ndjson", "text"
MEDIA_TYPES = {FRAMES: frames.CONTENT_TYPE, NDJSON: "application/x-ndjson", TEXT: "text/plain"}
_BY_MEDIA_TYPE = {media: name for name, media in MEDIA_TYPES.items()}


class Answer(Protocol):
    """An exec's answer in one shape."""

    media_type: str

    def output(self, stream: str, chunk: bytes) -> bytes: ...

    def end(self, document: dict[str, Any]) -> bytes: ...


def chosen(query: str | None, accept: str | None) -> str:
    """The shape a request asks for: `query` (`?format=`) when given (UsageError when it names no
    shape), else the one of the three its Accept header prefers (highest q, then first), else frames."""
    if query is not None:
        if query not in MEDIA_TYPES:
            names = ", ".join(MEDIA_TYPES)
            raise UsageError(f"format: must be one of {names} (or left out: what Accept names, else frames)")
        return query
    offered = []  # (-q, position, shape) of each of the three the header names
    for position, item in enumerate((accept or "").split(",")):
        media, *parameters = (part.strip() for part in item.split(";"))
        name, quality = _BY_MEDIA_TYPE.get(media.lower()), _quality(parameters)
        if name is not None and quality > 0:
            offered.append((-quality, position, name))
    return min(offered)[2] if offered else FRAMES


def _quality(parameters: list[str]) -> float:
    """An Accept item's q (1 when it has none; 0, not acceptable, when it is no number from 0 to 1)."""
    for parameter in parameters:
        key, _, value = parameter.partition("=")
        if key.strip().lower() == "q":
            try:
                quality = float(value.strip())
            except ValueError:
                return 0.0
            return quality if 0 <= quality <= 1 else 0.0
    return 1.0


def answer(name: str) -> Answer:
    """A new answer of the shape `name` (one of MEDIA_TYPES), for one exec."""
    if name == NDJSON:
        return NdjsonAnswer()
    if name == TEXT:
        return TextAnswer()
    return FramesAnswer()


class FramesAnswer:
    """frames.py's: what sandboxer.Client and the CLI read."""

    media_type = frames.CONTENT_TYPE

    def output(self, stream: str, chunk: bytes) -> bytes:
        return frames.frame(frames.STDOUT if stream == "stdout" else frames.STDERR, chunk)

    def end(self, document: dict[str, Any]) -> bytes:
        return frames.end(document)


class NdjsonAnswer:
    """One JSON object a line. Output is text when it is UTF-8: a character a chunk cut in two
    waits for its end in the next chunk of its stream (at most 3 bytes held); a chunk that is not
    UTF-8 is sent whole as base64."""

    media_type = MEDIA_TYPES[NDJSON]

    def __init__(self) -> None:
        self._held = {"stdout": b"", "stderr": b""}  # the start of a character cut at a chunk's end

    def output(self, stream: str, chunk: bytes) -> bytes:
        data = self._held[stream] + chunk
        self._held[stream] = b""
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            if not (exc.end == len(data) and exc.reason == "unexpected end of data"):
                return _line({"stream": stream, "data": base64.b64encode(data).decode(), "encoding": "base64"})
            text, self._held[stream] = data[: exc.start].decode("utf-8"), data[exc.start :]
        return _line({"stream": stream, "data": text}) if text else b""

    def end(self, document: dict[str, Any]) -> bytes:
        held = b"".join(  # a character the output never finished is not UTF-8
            _line({"stream": stream, "data": base64.b64encode(data).decode(), "encoding": "base64"})
            for stream, data in self._held.items()
            if data
        )
        error = document.get("error")
        if error is None:
            return held + _line({"exit_status": document["status"]})
        return held + _line({"exit_status": error["status"], "error": error})


def _line(document: dict[str, Any]) -> bytes:
    return json.dumps(document, ensure_ascii=False).encode() + b"\n"


class TextAnswer:
    """The output's bytes as they come, stdout and stderr together; the exit status last, on a
    line of its own."""

    media_type = MEDIA_TYPES[TEXT]

    def __init__(self) -> None:
        self._last = b"\n"  # the last byte of output sent (none yet: no newline needed)

    def output(self, stream: str, chunk: bytes) -> bytes:
        if chunk:
            self._last = chunk[-1:]
        return chunk

    def end(self, document: dict[str, Any]) -> bytes:
        error = document.get("error")
        if error is None:
            line = f"sandboxer: exit status {document['status']}"
        else:
            hint = f" (hint: {error['hint']})" if error.get("hint") else ""
            line = f"sandboxer: exit status {error['status']}: {error['message']}{hint}"
        return (b"" if self._last == b"\n" else b"\n") + line.encode() + b"\n"
