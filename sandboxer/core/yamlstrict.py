"""A strict YAML reader for owner files: one document, string keys, no duplicates, no aliases.

ruamel.yaml composes the node graph (keeping every line and column); we walk it ourselves so
that duplicate keys, anchors, merge keys and exotic tags are refused with a position, and so
that no error message ever quotes a value from the file. ruamel.yaml is imported only when a
file is parsed, so the commands that never read YAML (exec, teardown) do not pay for it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ruamel.yaml import YAML
from ruamel.yaml.error import MarkedYAMLError, YAMLError
from ruamel.yaml.nodes import MappingNode, ScalarNode, SequenceNode

from sandboxer.errors import ConfigError

if TYPE_CHECKING:
    from ruamel.yaml.nodes import Node

MAX_FILE_BYTES = 256 * 1024

_TAG = "tag:yaml.org,2002:"
_DECIMAL = re.compile(r"[-+]?[0-9]{1,18}")
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")


@dataclass(frozen=True, slots=True)
class Mark:
    """A 1-based position in the file."""

    line: int
    column: int


@dataclass(frozen=True, slots=True)
class YScalar:
    """A scalar with its resolved Python value."""

    mark: Mark
    value: str | int | bool | float | None


@dataclass(frozen=True, slots=True)
class YSeq:
    """A sequence of nodes."""

    mark: Mark
    items: tuple[YNode, ...]


@dataclass(frozen=True, slots=True)
class YMap:
    """A mapping with string keys, in file order; each key keeps its own position."""

    mark: Mark
    items: tuple[tuple[str, Mark, YNode], ...]

    def keys(self) -> Iterator[str]:
        """The keys in file order."""
        return (key for key, _, _ in self.items)


YNode = YScalar | YSeq | YMap


def _mark(node: Node) -> Mark:
    return Mark(node.start_mark.line + 1, node.start_mark.column + 1)


def _scalar_value(node: ScalarNode, file: str, path: str) -> str | int | bool | float | None:
    tag = str(node.tag)
    mark = _mark(node)
    if tag == _TAG + "str":
        return str(node.value)
    if tag == _TAG + "null":
        return None
    if tag == _TAG + "bool":
        return str(node.value).lower() == "true"
    if tag == _TAG + "int":
        if not _DECIMAL.fullmatch(node.value):
            raise ConfigError(
                file,
                mark.line,
                mark.column,
                path,
                "integers must be decimal, at most 18 digits",
            )
        return int(node.value)
    if tag == _TAG + "float":
        try:
            return float(node.value)
        except ValueError:
            raise ConfigError(file, mark.line, mark.column, path, "not a plain number") from None
    if tag == _TAG + "timestamp":  # YAML reads an unquoted date as its own type: say what to do
        raise ConfigError(file, mark.line, mark.column, path, "unsupported YAML tag (quote dates and times)")
    raise ConfigError(file, mark.line, mark.column, path, "unsupported YAML tag")


def _convert(node: Node, file: str, path: str) -> YNode:

    mark = _mark(node)
    if getattr(node, "anchor", None):
        raise ConfigError(file, mark.line, mark.column, path, "anchors and aliases are not allowed")
    if isinstance(node, ScalarNode):
        return YScalar(mark, _scalar_value(node, file, path))
    if isinstance(node, SequenceNode):
        if str(node.tag) != _TAG + "seq":
            raise ConfigError(file, mark.line, mark.column, path, "unsupported YAML tag")
        items = tuple(_convert(item, file, f"{path}[{i}]") for i, item in enumerate(node.value))
        return YSeq(mark, items)
    if isinstance(node, MappingNode):
        if str(node.tag) != _TAG + "map":
            raise ConfigError(file, mark.line, mark.column, path, "unsupported YAML tag")
        seen: set[str] = set()
        entries: list[tuple[str, Mark, YNode]] = []
        for key_node, value_node in node.value:
            key_mark = _mark(key_node)
            if not isinstance(key_node, ScalarNode) or str(key_node.tag) != _TAG + "str":
                raise ConfigError(
                    file,
                    key_mark.line,
                    key_mark.column,
                    path,
                    "keys must be plain strings",
                )
            key = str(key_node.value)
            key_path = f"{path}.{key}" if path else key
            if key in seen:
                raise ConfigError(file, key_mark.line, key_mark.column, key_path, "duplicate key")
            seen.add(key)
            entries.append((key, key_mark, _convert(value_node, file, key_path)))
        return YMap(mark, tuple(entries))
    raise ConfigError(file, mark.line, mark.column, path, "unsupported YAML node")


def _tab_indented(text: str, last_line: int) -> tuple[int, int] | None:
    """(line, column) of the first tab in the indentation of a line up to `last_line`, if any."""
    for number, line in enumerate(text.splitlines()[:last_line], start=1):
        indent = line[: len(line) - len(line.lstrip(" \t"))]
        if "\t" in indent:
            return number, indent.index("\t") + 1
    return None


def parse_yaml(data: bytes, file: str) -> YNode:
    """Parse one YAML document from `data`; `file` is only used in error messages."""

    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(file, 1, 1, "", f"file is larger than {MAX_FILE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(file, 1, 1, "", "file is not valid UTF-8") from None
    try:
        node = YAML(typ="rt").compose(text)
    except MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, column = (mark.line + 1, mark.column + 1) if mark is not None else (1, 1)
        tab = _tab_indented(text, line)  # YAML indents with spaces: say so, not "cannot start any token"
        if tab is not None:
            raise ConfigError(file, *tab, "", "tab characters are not allowed for indentation") from None
        # The problem text names the syntax fault; the snippet that would quote the file is dropped.
        problem = _QUOTED.sub("'…'", (exc.problem or exc.context or "invalid YAML").strip())  # never quote the file
        raise ConfigError(file, line, column, "", f"invalid YAML: {problem}") from None
    except YAMLError:
        raise ConfigError(file, 1, 1, "", "invalid YAML") from None
    if node is None:
        raise ConfigError(file, 1, 1, "", "file is empty")
    return _convert(node, file, "")
