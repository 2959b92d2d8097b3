"""Strict JSON for documents from outside the broker (manifests, bootstrap files, tool
requests): one reader for all three. Duplicate keys are remembered rather than silently
collapsed, the non-standard numbers NaN and Infinity are refused, and a document that is too
large, not UTF-8 or nested too deeply is refused before or while it is parsed. Each caller words
the refusal in its own format (file, field, rule); none repeats any of the document's text."""

from __future__ import annotations

import json
from typing import Any, Literal, NoReturn


class JsonObject(dict[str, Any]):
    """A decoded JSON object that remembers the keys written more than once."""

    duplicates: list[str]


def _object(pairs: list[tuple[str, Any]]) -> JsonObject:
    obj = JsonObject()
    obj.duplicates = []
    for key, value in pairs:
        if key in obj:
            obj.duplicates.append(key)
        obj[key] = value
    return obj


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"non-standard number {name}")


def loads(text: str) -> Any:
    """Decode `text`: every object a JsonObject; ValueError (JSONDecodeError for syntax, with
    "non-standard" in the message for NaN/Infinity); RecursionError for absurd nesting."""
    return json.loads(text, object_pairs_hook=_object, parse_constant=_refuse_constant)


class Malformed(ValueError):
    """Why bytes are not a strict JSON document: `kind` is "size" (over the limit), "utf8",
    "depth" (nested too deeply), "constant" (NaN or Infinity) or "syntax", which has the
    position of the first error (`line`, `column`)."""

    def __init__(self, kind: Literal["size", "utf8", "depth", "constant", "syntax"], line: int = 0, column: int = 0):
        super().__init__(kind)
        self.kind = kind
        self.line = line
        self.column = column


def document(data: bytes, *, max_bytes: int | None = None) -> Any:
    """Decode a whole document (`loads` of its UTF-8 text), at most `max_bytes` long (checked
    before parsing); Malformed says why not."""
    if max_bytes is not None and len(data) > max_bytes:
        raise Malformed("size")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise Malformed("utf8") from None
    try:
        return loads(text)
    except RecursionError:
        raise Malformed("depth") from None
    except json.JSONDecodeError as exc:
        raise Malformed("syntax", exc.lineno, exc.colno) from None
    except ValueError:  # _refuse_constant
        raise Malformed("constant") from None
