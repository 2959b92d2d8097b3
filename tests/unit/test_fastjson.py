"""fastjson (the exec path's JSON) reads and writes exactly what the json module does."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxer.core import fastjson

scalars = st.none() | st.booleans() | st.integers() | st.text()
documents = st.recursive(
    scalars | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=30,
)
writable = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5), max_leaves=30
)


@given(documents, st.sampled_from([None, 1]))
@settings(max_examples=300, deadline=None)
def test_loads_reads_what_json_writes(document: Any, indent: int | None) -> None:
    text = json.dumps(document, indent=indent)
    assert fastjson.loads(text) == json.loads(text)
    assert fastjson.loads(f" \n{text}\t\r\n".encode()) == document


@given(writable)
@settings(max_examples=300, deadline=None)
def test_dumps_writes_what_json_writes(document: Any) -> None:
    assert fastjson.dumps(document) == json.dumps(document, separators=(",", ":"))


def _refuses(load: Any, data: str | bytes) -> bool:
    try:
        load(data)
    except ValueError:
        return True
    return False


@pytest.mark.parametrize(
    "text",
    ["", " ", "{", "[1,]", '{"a":1} x', "[1] [2]", "NaN", "[Infinity]", '"\x01"', "{'a': 1}", "01", "\xff", b'"\xff"'],
)
def test_what_is_not_exactly_one_document_is_refused(text: str | bytes) -> None:
    assert _refuses(fastjson.loads, text)
    # json refuses the same, but for the constants it accepts (no document we read has them)
    assert _refuses(json.loads, text) or text in ("NaN", "[Infinity]")


@pytest.mark.parametrize("value", [1.5, {1: "a"}, {"a": object()}, b"bytes"])
def test_what_it_does_not_write_is_a_type_error(value: object) -> None:
    with pytest.raises(TypeError):
        fastjson.dumps(value)
