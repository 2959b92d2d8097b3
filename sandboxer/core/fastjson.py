"""JSON for the exec hot path, without the start-up cost of the `json` package.

`import json` compiles regular expressions at import, and so imports `re` and `enum`: about
3.5 ms here, a twentieth of a Docker exec. The C scanner and string encoder that `json` itself
uses live in `_json`; this module drives them directly for the few documents the exec path
reads (a sandbox's record, the Engine's answers) and writes (the Engine's request bodies).
Without `_json` (another Python implementation) it uses `json`.

`loads` accepts exactly what `json.loads` does, except NaN and Infinity (no document we read
carries them). `dumps` writes dicts with string keys, lists, tuples, strings, ints, booleans and
None, as `json.dumps` would with `ensure_ascii` and compact separators.
"""

from __future__ import annotations

TYPE_CHECKING = False  # `typing` costs ~1.5 ms to import on this path; mypy knows the name
if TYPE_CHECKING:
    from typing import Any

try:
    import _json
except ImportError:  # pragma: no cover - CPython always has it
    _json = None  # type: ignore[assignment]

_WHITESPACE = " \t\n\r"


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not allowed here")


class _Options:
    """What the C scanner reads from its context (the attributes json.JSONDecoder has)."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = staticmethod(_no_constant)


# typeshed types the context as a scanner; the C code reads only the attributes above.
_scan: Any = _json.make_scanner(_Options()) if _json is not None else None  # type: ignore[arg-type]


def loads(data: bytes | str) -> Any:
    """Parse one JSON document; ValueError when it is not exactly one."""
    text = data.decode("utf-8") if isinstance(data, bytes) else data
    if _scan is None:  # pragma: no cover
        import json

        return json.loads(text)
    start = len(text) - len(text.lstrip(_WHITESPACE))
    try:
        value, end = _scan(text, start)
    except StopIteration as stop:
        raise ValueError(f"not JSON at character {stop.value}") from None
    if text[end:].strip(_WHITESPACE):
        raise ValueError(f"extra data after the document at character {end}")
    return value


def dumps(value: object) -> str:
    """Serialize dicts (string keys), lists, tuples, strings, ints, booleans and None."""
    if isinstance(value, str):
        return _json.encode_basestring_ascii(value) if _json is not None else _fallback(value)
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(dumps(item) for item in value) + "]"
    if isinstance(value, dict):
        parts = []
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError("JSON object keys must be strings")
            parts.append(dumps(key) + ":" + dumps(item))
        return "{" + ",".join(parts) + "}"
    raise TypeError(f"{type(value).__name__} is not serialized here")


def _fallback(text: str) -> str:  # pragma: no cover - without _json
    import json

    return json.dumps(text)
