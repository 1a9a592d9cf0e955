"""Typing argument values that a format writes as bare text, by the tool's JSON schema.

XML-ish formats (Qwen3-Coder's ``<parameter=k>``, GLM's ``<arg_value>``) write
every value as text; the request's schema says what it was meant to be. A value
is converted to the first declared type it fits (null, boolean, integer,
number, object, array, in that order); if it fits none — or the schema says
string — the text is kept as it was written, so nothing is ever lost.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

from protocols.parsers.base import JSON

# Names that hand-written schemas use for the JSON types.
_ALIASES = {
    "int": "integer", "long": "integer", "float": "number", "double": "number",
    "bool": "boolean", "dict": "object", "list": "array", "str": "string", "text": "string",
}
_PYTHON_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null"}


def declared_types(schema: Mapping[str, Any] | None) -> set[str]:
    """The JSON types a schema allows (``type`` as a name or a list, ``anyOf``/``oneOf``,
    ``enum``/``const`` values, or ``properties``/``items`` implying object/array)."""
    if not schema:
        return set()
    types: set[str] = set()
    kind = schema.get("type")
    if isinstance(kind, str):
        types.add(kind.lower())
    elif isinstance(kind, list):
        types.update(k.lower() for k in kind if isinstance(k, str))
    for key in ("anyOf", "oneOf", "allOf"):
        options = schema.get(key)
        if isinstance(options, list):
            for option in options:
                if isinstance(option, Mapping):
                    types |= declared_types(option)
    if not types:
        values = schema.get("enum")
        if not isinstance(values, list):
            values = [schema["const"]] if "const" in schema else []
        types.update(_PYTHON_TYPES.get(type(v), "string") for v in values)
    types = {_ALIASES.get(t, t) for t in types}
    if not types and "properties" in schema:
        types.add("object")
    if not types and "items" in schema:
        types.add("array")
    return types


def convert(
    raw: str, schema: Mapping[str, Any] | None, *, untyped: Literal["string", "json"] = "string"
) -> Any:
    """``raw`` as the type its ``schema`` declares. Without a schema (an unknown tool or
    parameter), ``untyped`` decides: keep the text, or take it as JSON if it is JSON."""
    types = declared_types(schema)
    if not types:
        if untyped == "json":
            ok, value = _json(raw.strip())
            return value if ok else raw
        return raw
    text = raw.strip()
    for kind, converter in _CONVERTERS:
        if kind in types:
            ok, value = converter(text)
            if ok:
                return value
    return raw


def _null(text: str) -> tuple[bool, Any]:
    return text.lower() in ("null", "none"), None


def _boolean(text: str) -> tuple[bool, Any]:
    lowered = text.lower()
    return lowered in ("true", "false"), lowered == "true"


def _integer(text: str) -> tuple[bool, Any]:
    try:
        return True, int(text)
    except ValueError:
        pass
    try:
        number = float(text)
    except ValueError:
        return False, None
    if math.isfinite(number) and number.is_integer():
        return True, int(number)
    return False, None


def _number(text: str) -> tuple[bool, Any]:
    ok, value = _integer(text)
    if ok and "." not in text and "e" not in text.lower():
        return True, value
    try:
        number = float(text)
    except ValueError:
        return False, None
    return math.isfinite(number), number


class _JsonNames(ast.NodeTransformer):
    """``true``/``false``/``null`` in Python-literal text (templates mix the two)."""

    NAMES = {"true": True, "false": False, "null": None}

    def visit_Name(self, node: ast.Name) -> ast.expr:
        if node.id in self.NAMES:
            return ast.copy_location(ast.Constant(self.NAMES[node.id]), node)
        return node


def literal(node: ast.expr) -> tuple[bool, Any]:
    """A Python literal expression (with JSON's names allowed) as a value."""
    try:
        return True, ast.literal_eval(_JsonNames().visit(node))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _json(text: str) -> tuple[bool, Any]:
    try:
        return True, JSON.decode(text)
    except ValueError:
        return False, None


def _container(kind: type) -> Callable[[str], tuple[bool, Any]]:
    def convert(text: str) -> tuple[bool, Any]:
        ok, value = _json(text)
        if not ok:
            try:
                ok, value = literal(ast.parse(text, mode="eval").body)
            except (SyntaxError, ValueError, MemoryError, RecursionError):
                ok = False
        if ok and isinstance(value, tuple) and kind is list:
            value = list(value)
        return (True, value) if ok and isinstance(value, kind) else (False, None)

    return convert


_CONVERTERS: tuple[tuple[str, Callable[[str], tuple[bool, Any]]], ...] = (
    ("null", _null),
    ("boolean", _boolean),
    ("integer", _integer),
    ("number", _number),
    ("object", _container(dict)),
    ("array", _container(list)),
)

__all__ = ["convert", "declared_types", "literal"]
