"""The runtime bootstrap: the one file a Sandbox Provider hands the Runtime it starts
(docs/bootstrap.md). The broker plays the Provider: it validates the document and delivers it,
byte for byte, into the sandbox user's home before anything runs there.

Errors name the file, the field and the rule, never a submitted value: the document carries a
credential.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn
from urllib.parse import urlsplit

from sandboxer.core import strictjson
from sandboxer.core.reading import CallerFile, UnfitFile, read_caller_file
from sandboxer.core.strictjson import JsonObject
from sandboxer.errors import DocumentError

VERSION = "1"
MAX_BYTES = 16 * 1024
TARGET = "/run/sandboxer/state/home/runtime-bootstrap.json"
SUSPEND_DIR = "/run/sandboxer/state/suspend"
PUBLIC_WORKSPACE = "/workspace"
FIELDS = (
    "version",
    "core_url",
    "device_id",
    "credential",
    "environment_id",
    "session_id",
    "workspace",
    "suspend_control",
)
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_ZERO_UUID = "00000000-0000-0000-0000-000000000000"


class BootstrapError(DocumentError):
    """A bootstrap document or file breaks a rule (exit 2): `file: field: rule`."""

    kind = "bootstrap"


@dataclass(frozen=True, slots=True, kw_only=True)
class Bootstrap:
    """A valid bootstrap document (the credential is kept out of repr)."""

    version: str
    core_url: str
    device_id: str
    environment_id: str
    session_id: str
    workspace: str
    suspend_control: bool

    def meaning(self) -> dict[str, Any]:
        """What `bootstrap check --json` prints: every field but the credential."""
        return {
            "version": self.version,
            "core_url": self.core_url,
            "device_id": self.device_id,
            "environment_id": self.environment_id,
            "session_id": self.session_id,
            "workspace": self.workspace,
            "suspend_control": self.suspend_control,
        }


def parse(data: bytes, *, file: str) -> Bootstrap:
    """The document `data` means, or BootstrapError naming the first rule it breaks."""

    def fail(field: str, rule: str) -> NoReturn:
        raise BootstrapError(file, field, rule)

    document = _decode(data, fail)
    if document["version"] != VERSION or not isinstance(document["version"], str):
        fail("version", f'must be the JSON string "{VERSION}"')
    core_url = _core_url(document["core_url"], fail)
    ids = {}
    for key in ("device_id", "environment_id", "session_id"):
        value = document[key]
        if not isinstance(value, str) or not _UUID.fullmatch(value) or value == _ZERO_UUID:
            fail(key, "must be a canonical lowercase hyphenated UUID, not all zero")
        ids[key] = value
    credential = document["credential"]
    if not isinstance(credential, str) or not credential:
        fail("credential", "must be a non-empty string")
    if "\0" in credential or any(c.isspace() for c in credential):
        fail("credential", "must contain no whitespace and no NUL")
    workspace = document["workspace"]
    if not isinstance(workspace, str) or not clean_absolute(workspace):
        fail("workspace", "must be a clean absolute path (no ., .., // or trailing /)")
    if not isinstance(document["suspend_control"], bool):
        fail("suspend_control", "must be a JSON boolean")
    return Bootstrap(
        version=VERSION,
        core_url=core_url,
        device_id=ids["device_id"],
        environment_id=ids["environment_id"],
        session_id=ids["session_id"],
        workspace=workspace,
        suspend_control=document["suspend_control"],
    )


def _decode(data: bytes, fail: Callable[[str, str], NoReturn]) -> JsonObject:
    """One JSON object of at most MAX_BYTES (checked before parsing) with exactly the fields."""
    try:
        document = strictjson.document(data, max_bytes=MAX_BYTES)
    except strictjson.Malformed as exc:
        rules = {
            "size": f"larger than {MAX_BYTES} bytes",
            "utf8": "not UTF-8",
            "depth": "nested too deeply",
            "constant": "NaN and Infinity are not JSON",
            "syntax": f"not one valid JSON object (line {exc.line} column {exc.column})",
        }
        fail("", rules[exc.kind])
    if not isinstance(document, JsonObject):
        fail("", "the bootstrap must be one JSON object")
    if document.duplicates:
        fail(document.duplicates[0], "duplicate field")
    for key in document:
        if key not in FIELDS:
            alias = any(key.lower() == name for name in FIELDS)
            fail(key, f"a case alias of {key.lower()}" if alias else "unknown field")
    for key in FIELDS:
        if key not in document:
            fail(key, "missing required field")
    return document


def _core_url(value: Any, fail: Callable[[str, str], NoReturn]) -> str:
    rule = "must be an http(s) URL whose path ends in /api/v1, without credentials, query or fragment"
    if not isinstance(value, str) or any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        fail("core_url", rule)
    try:
        parts = urlsplit(value)
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        fail("core_url", rule)
    if (
        parts.scheme not in ("http", "https")
        or not value.startswith(parts.scheme + "://")
        or not parts.hostname
        or "@" in parts.netloc
        or "?" in value
        or "#" in value
        or not parts.path.endswith("/api/v1")
        or not port_ok
    ):
        fail("core_url", rule)
    return str(value)


def clean_absolute(path: str) -> bool:
    """Absolute, with no `.` or `..` segment, no `//` and no trailing slash (`/` itself is clean)."""
    if path == "/":
        return True
    if not path.startswith("/") or path.endswith("/") or "//" in path or "\0" in path:
        return False
    return all(part not in (".", "..") for part in path.split("/")[1:])


def load(source: str | CallerFile) -> tuple[Bootstrap, bytes]:
    """Read the bootstrap file once (a regular, owner-only file, not a symlink; or what its
    caller read of it for a service) and parse it; returns the document and its exact bytes."""
    absolute = os.path.abspath(source if isinstance(source, str) else source.path)
    try:
        # One more byte than allowed is read, so that parse names the size rule.
        data = read_caller_file(absolute if isinstance(source, str) else source, MAX_BYTES + 1)
    except UnfitFile as exc:
        raise BootstrapError(absolute, "", f"the bootstrap file {exc.reason}") from None
    return parse(data, file=absolute), data
