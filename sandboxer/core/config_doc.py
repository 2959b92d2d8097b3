"""Typed, path-aware reading of a parsed owner YAML document (sandboxer.core.yamlstrict): every
fault is a ConfigError naming the file, the line and column, the key path and the rule — never a
value read from the file. The parsers of extension configs, profiles and grants read through it
(sandboxer.core.config).
"""

from __future__ import annotations

import difflib
import posixpath
import re
from collections.abc import Callable
from typing import TypeVar

from sandboxer.core.config_types import EXTENSIONS, ExtensionName
from sandboxer.core.yamlstrict import Mark, YMap, YNode, YScalar, YSeq
from sandboxer.errors import ConfigError, ForbiddenSettingError

T = TypeVar("T")


def unknown_key(key: str, allowed: set[str]) -> str:
    """The rule for a key the schema does not know, with the known key it is closest to, if any."""

    close = difflib.get_close_matches(key, sorted(allowed), n=1, cutoff=0.75)
    return f"unknown key (did you mean {close[0]}?)" if close else "unknown key"


class Doc:
    """Typed, path-aware access to a parsed document; every fault names file, line and key."""

    def __init__(self, file: str, expected_name: str | None) -> None:
        self.file = file
        self.expected_name = expected_name
        self.forbidden: list[ForbiddenSettingError] = []

    def fail(self, mark: Mark, path: str, rule: str) -> ConfigError:
        return ConfigError(self.file, mark.line, mark.column, path, rule)

    def forbid(self, mark: Mark, path: str, rule: str) -> None:
        self.forbidden.append(ForbiddenSettingError(self.file, mark.line, mark.column, path, rule))

    def mapping(
        self,
        node: YNode,
        path: str,
        required: tuple[str, ...],
        optional: tuple[str, ...] = (),
    ) -> dict[str, YNode]:
        if not isinstance(node, YMap):
            raise self.fail(node.mark, path or "(document)", "must be a mapping")
        allowed = set(required) | set(optional)
        found: dict[str, YNode] = {}
        for key, key_mark, value in node.items:
            if key not in allowed:
                raise self.fail(key_mark, join(path, key), unknown_key(key, allowed))
            found[key] = value
        for key in required:
            if key not in found:
                raise self.fail(node.mark, join(path, key), "missing required key")
        return found

    def string(
        self,
        node: YNode,
        path: str,
        pattern: re.Pattern[str] | None = None,
        rule: str = "",
    ) -> str:
        if not isinstance(node, YScalar) or not isinstance(node.value, str):
            raise self.fail(node.mark, path, "must be a string")
        if pattern is not None and not pattern.fullmatch(node.value):
            raise self.fail(node.mark, path, rule)
        return node.value

    def integer(self, node: YNode, path: str, bounds: tuple[int, int]) -> int:
        if not isinstance(node, YScalar) or isinstance(node.value, bool) or not isinstance(node.value, int):
            raise self.fail(node.mark, path, "must be an integer")
        low, high = bounds
        if not low <= node.value <= high:
            raise self.fail(node.mark, path, f"must be between {low} and {high}")
        return node.value

    def decimal(self, node: YNode, path: str, bounds: tuple[float, float]) -> float:
        """A number, integer or decimal (never a boolean), within `bounds`."""
        value = node.value if isinstance(node, YScalar) else None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(node.mark, path, "must be a number")
        low, high = bounds
        if not low <= value <= high:
            raise self.fail(node.mark, path, f"must be between {low:g} and {high:g}")  # NaN too
        return float(value)

    def boolean(self, node: YNode, path: str) -> bool:
        if not isinstance(node, YScalar) or not isinstance(node.value, bool):
            raise self.fail(node.mark, path, "must be true or false")
        return node.value

    def sequence(self, node: YNode, path: str, item: Callable[[YNode, str], T]) -> tuple[T, ...]:
        if not isinstance(node, YSeq):
            raise self.fail(node.mark, path, "must be a list")
        return tuple(item(entry, f"{path}[{i}]") for i, entry in enumerate(node.items))

    def absolute_path(self, node: YNode, path: str) -> str:
        value = self.string(node, path)
        if (
            not value.startswith("/")
            or value == "/"
            or posixpath.normpath(value) != value
            or any(ord(c) < 0x20 or c == "\x7f" for c in value)
        ):
            raise self.fail(
                node.mark, path, "must be a normalized absolute path other than /, without control characters"
            )
        return value

    def own_name(self, node: YNode, path: str, value: str) -> None:
        if self.expected_name is not None and value != self.expected_name:
            raise self.fail(node.mark, path, f"must equal the file's name ({self.expected_name})")

    def extension_name(self, node: YNode, path: str) -> ExtensionName:
        value = self.string(node, path)
        for name in EXTENSIONS:
            if value == name:
                return name
        raise self.fail(node.mark, path, f"must be one of {', '.join(EXTENSIONS)}")


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
