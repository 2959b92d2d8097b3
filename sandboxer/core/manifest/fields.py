"""Reading a manifest document one field at a time, and the rules of single values.

`Reader` walks the strict-JSON document and fails at the first rule broken with a ManifestError
naming the file, the field path and the rule. The value rules here are the ones several parts of
the manifest share: absolute and clean paths, labels, environment names, expiry times.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta, timezone
from typing import Any, NoReturn

from sandboxer.core.manifest.schema import AMBIENT_MARKERS, ENV_NAME, EXPIRY, ManifestError, denied_name
from sandboxer.core.strictjson import JsonObject


class Reader:
    """Walks the document, failing at the first rule broken, with its field path."""

    def __init__(self, file: str) -> None:
        self.file = file

    def fail(self, field: str, rule: str) -> NoReturn:
        raise ManifestError(self.file, field, rule)

    def obj(self, value: Any, path: str, *, required: Sequence[str], optional: Sequence[str] = ()) -> JsonObject:
        if not isinstance(value, JsonObject):
            self.fail(path, "must be a JSON object")
        if value.duplicates:
            self.fail(_join(path, value.duplicates[0]), "duplicate key")
        known = set(required) | set(optional)
        for key in value:
            if key not in known:
                self.fail(_join(path, key), "unknown field")
        for key in required:
            if key not in value:
                self.fail(_join(path, key), "missing required field")
        return value

    def string(self, value: Any, path: str, pattern: re.Pattern[str] | None = None, rule: str = "") -> str:
        if not isinstance(value, str):
            self.fail(path, "must be a string")
        if "\0" in value:
            self.fail(path, "must not contain NUL")
        if pattern is not None and not pattern.fullmatch(value):
            self.fail(path, rule)
        return value

    def integer(self, value: Any, path: str, low: int, high: int) -> int:
        if type(value) is not int:
            self.fail(path, "must be an integer")
        if not low <= value <= high:
            self.fail(path, f"must be between {low} and {high}")
        return value

    def array(self, value: Any, path: str, most: int | None = None) -> list[Any]:
        if not isinstance(value, list):
            self.fail(path, "must be an array")
        if most is not None and len(value) > most:
            self.fail(path, f"at most {most} entries")
        return value


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def absolute(r: Reader, value: Any, path: str) -> str:
    text = r.string(value, path)
    if not text.startswith("/") or len(text) > 4096:
        r.fail(path, "must be an absolute path")
    return text


def clean_absolute(r: Reader, value: Any, path: str) -> str:
    text = absolute(r, value, path)
    parts = text.split("/")[1:]
    if text == "/" or text.endswith("/") or "//" in text or any(p in (".", "..") for p in parts):
        r.fail(path, "must be a clean absolute path (no ., .., // or trailing /)")
    lowered = text.lower()
    if any(marker in lowered for marker in AMBIENT_MARKERS):
        r.fail(path, "names an ambient-authority or secret path")
    return text


def label(r: Reader, value: Any, path: str) -> str:
    text = r.string(value, path)
    if not 1 <= len(text) <= 128 or any(c.isspace() for c in text) or "=" in text or "//" in text:
        r.fail(path, "must be 1-128 characters without whitespace, '=' or '//'")
    return text


def env_name(r: Reader, value: Any, path: str, *, project: bool) -> str:
    name = r.string(value, path, ENV_NAME, "must be [A-Z_][A-Z0-9_]*, at most 128 characters")
    if denied_name(name, project=project):
        r.fail(path, "this environment name is refused (shell, loader, Git, supervisor or broker control)")
    return name


def expiry(value: str) -> datetime | None:
    """An RFC 3339 time with offset, or None if `value` is not one."""
    match = EXPIRY.fullmatch(value)
    if match is None:
        return None
    year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
    fraction, offset = match.group(7), match.group(8)
    micro = int((fraction[1:] + "000000")[:6]) if fraction else 0
    if offset in ("Z", "z"):
        zone = UTC
    else:
        hours, minutes = int(offset[1:3]), int(offset[4:6])
        if hours > 23 or minutes > 59:
            return None
        delta = timedelta(hours=hours, minutes=minutes)
        zone = timezone(delta if offset[0] == "+" else -delta)
    try:
        return datetime(year, month, day, hour, minute, second, micro, tzinfo=zone)
    except ValueError:
        return None


def nested(a: str, b: str) -> bool:
    """Whether two paths are equal or one is below the other."""
    return a == b or a.startswith(b + "/") or b.startswith(a + "/")
