"""Strict JSON for documents from outside the broker (manifests, bootstrap files, tool
requests): duplicate keys are remembered rather than silently collapsed, and the non-standard
numbers NaN and Infinity are refused."""

from __future__ import annotations

import json
from typing import Any, NoReturn


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
