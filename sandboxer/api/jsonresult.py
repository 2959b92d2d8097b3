"""The JSON form every result type shares (sandboxer.api.results): one shape for rendering,
parsing and the schema, from the type's fields through pydantic's TypeAdapter. Parts that differ
by backend or are open-ended are read-only mappings (`frozen` makes one); `thawed` turns one
back into plain dicts and lists."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, ClassVar, Self

from pydantic import AfterValidator, PlainSerializer, TypeAdapter


def frozen(value: Any) -> Any:
    """A read-only view of a JSON value (a result's open-ended part, as parsing makes it):
    mappings become mappingproxies, lists tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({key: frozen(item) for key, item in value.items()})
    if isinstance(value, list | tuple):
        return tuple(frozen(item) for item in value)
    return value


def thawed(value: Any) -> Any:
    """A result's read-only part as plain JSON values again (dicts and lists), e.g. to dump it."""
    if isinstance(value, Mapping):
        return {key: thawed(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return [thawed(item) for item in value]
    return value


# An open-ended JSON object inside a result: read-only once parsed, plain JSON when rendered (its
# schema is then an object: `return_type` says so, where a bare serializer's would allow anything).
JsonObject = Annotated[Mapping[str, Any], AfterValidator(frozen), PlainSerializer(thawed, return_type=dict[str, Any])]


_ADAPTERS: dict[type[Any], TypeAdapter[Any]] = {}


def _adapter(cls: type[Any]) -> TypeAdapter[Any]:
    """The codec of one result type, built on first use (a few ms each) and kept (two threads
    building it at once each get a whole one)."""
    adapter = _ADAPTERS.get(cls)
    if adapter is None:
        adapter = _ADAPTERS[cls] = TypeAdapter(cls)
    return adapter


class JsonResult:
    """The JSON form of a result type: one shape for rendering, parsing and the schema."""

    __slots__ = ()
    # The keys of a document that are not fields but the open-ended `sections` of one (inspect).
    _sections_field: ClassVar[str | None] = None
    # Fields the document leaves out when they are None (create's manifest, bootstrap, expiry).
    _absent_when_none: ClassVar[tuple[str, ...]] = ()

    def to_json(self) -> dict[str, Any]:
        """The document the CLI prints with --json and the service answers with."""
        document: dict[str, Any] = _adapter(type(self)).dump_python(self, mode="json")
        if self._sections_field is not None:
            document.update(document.pop(self._sections_field))
        for name in self._absent_when_none:
            if document.get(name) is None:
                document.pop(name, None)
        return document

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> Self:
        """The result a document describes (keys it does not know are ignored: a newer service)."""
        if cls._sections_field is not None:
            known = set(cls.__dataclass_fields__)  # type: ignore[attr-defined]
            sections = {key: value for key, value in document.items() if key not in known}
            document = {**{k: v for k, v in document.items() if k in known}, cls._sections_field: sections}
        result: Self = _adapter(cls).validate_python(document)
        return result

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        """The JSON Schema of the document (pydantic's, in its serialization mode)."""
        schema: dict[str, Any] = _adapter(cls).json_schema(
            mode="serialization", ref_template="#/components/schemas/{model}"
        )
        if cls._sections_field is not None:
            schema["properties"].pop(cls._sections_field, None)
            schema["required"] = [name for name in schema.get("required", []) if name != cls._sections_field]
            schema["additionalProperties"] = True  # a backend's own sections
        return schema
