"""Every result type's one JSON shape: for any instance, `from_json` of what `to_json` rendered
(through JSON text) is the same result, and the document is valid against `json_schema()`.

The types are found in sandboxer.api.results, so a new one is covered as soon as it is written; a
field of a kind this test cannot make fails it (add the kind to `_strategy`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, Literal, Union

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from sandboxer.api import results
from sandboxer.api.results import JsonObject, JsonResult
from sandboxer.service.openapi import schema_ref
from tests.openapi_schemas import validator

RESULTS = sorted(
    (
        value
        for value in vars(results).values()
        if isinstance(value, type)
        and issubclass(value, JsonResult)
        and value is not JsonResult
        and value.__module__ == results.__name__
    ),
    key=lambda cls: cls.__name__,
)


def _frozen(value: Any) -> Any:
    """A JSON value as a result holds it: objects read-only, arrays tuples."""
    if isinstance(value, dict):
        return MappingProxyType({key: _frozen(item) for key, item in value.items()})
    if isinstance(value, list):
        return tuple(_frozen(item) for item in value)
    return value


_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)  # what JSON has
    | st.text()
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)


def _objects(keys: st.SearchStrategy[str] | None = None) -> st.SearchStrategy[Any]:
    """Read-only JSON objects (keys from `keys`, any text when None)."""
    return st.dictionaries(st.text() if keys is None else keys, _VALUES, max_size=4).map(_frozen)


def _strategy(hint: Any) -> st.SearchStrategy[Any]:
    """Values of a result's field of type `hint`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint == JsonObject:
        return _objects()
    if origin is Annotated:
        raise TypeError(f"no strategy for {hint}")
    if isinstance(hint, type) and issubclass(hint, JsonResult):
        return _instances(hint)
    if origin in (Union, types.UnionType):
        return st.one_of(*(_strategy(arg) for arg in args))
    if origin is Literal:
        return st.sampled_from(args)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return st.lists(_strategy(args[0]), max_size=3).map(tuple)
    scalars: dict[Any, st.SearchStrategy[Any]] = {
        type(None): st.none(),
        str: st.text(),
        int: st.integers(),
        bool: st.booleans(),
        float: st.floats(allow_nan=False, allow_infinity=False),
    }
    if hint in scalars:
        return scalars[hint]
    raise TypeError(f"no strategy for {hint}")


def _instances(cls: type[JsonResult]) -> st.SearchStrategy[Any]:
    """Results of type `cls`, each of its fields (those with defaults too) made."""
    hints = typing.get_type_hints(cls, include_extras=True)
    names = {field.name for field in dataclasses.fields(cls)}  # type: ignore[arg-type]
    made: dict[str, st.SearchStrategy[Any]] = {}
    for name in names:
        if name == cls._sections_field:  # its keys are the document's: none may be a field's
            made[name] = _objects(st.text().filter(lambda key: key not in names))
        else:
            made[name] = _strategy(hints[name])
    return st.builds(cls, **made)


def test_the_result_types_are_found() -> None:
    assert {results.Created, results.Evidence, results.Receipt, results.GcReport} <= set(RESULTS)
    assert all(dataclasses.is_dataclass(cls) for cls in RESULTS)


@pytest.mark.parametrize("cls", RESULTS, ids=lambda cls: cls.__name__)
@settings(deadline=None, max_examples=60)
@given(data=st.data())
def test_a_result_round_trips_through_json_and_matches_its_schema(cls: type[JsonResult], data: st.DataObject) -> None:
    result = data.draw(_instances(cls))
    document = json.loads(json.dumps(result.to_json()))
    assert type(result).from_json(document) == result
    assert [error.message for error in _validator(cls).iter_errors(document)] == []


@functools.cache
def _validator(cls: type[JsonResult]) -> Draft202012Validator:
    """A validator of `cls.json_schema()`, its `$defs` lifted as the service's document has them."""
    schemas: dict[str, Any] = {}
    reference = schema_ref(cls, schemas)
    return validator({"components": {"schemas": schemas}}, reference)


def test_json_objects_are_read_only_once_parsed() -> None:
    parsed = results.Evidence.from_json(
        {
            **results.Evidence(
                id="a",
                profile="p",
                backend="bwrap",
                status="running",
                matches_plan=True,
                differences=(),
                runtime=MappingProxyType({"nested": MappingProxyType({"list": (1, 2)})}),
                mounts=(),
                user=MappingProxyType({}),
                capabilities=MappingProxyType({}),
                seccomp=MappingProxyType({}),
                env_names=(),
                limits=MappingProxyType({}),
                sections=MappingProxyType({"docker": MappingProxyType({"image": "x"})}),
            ).to_json()
        }
    )
    assert isinstance(parsed.runtime, MappingProxyType)
    assert isinstance(parsed.runtime["nested"], Mapping)
    assert parsed.runtime["nested"]["list"] == (1, 2)
    assert parsed.sections == {"docker": {"image": "x"}}
    with pytest.raises(TypeError):
        parsed.runtime["new"] = 1  # type: ignore[index]
