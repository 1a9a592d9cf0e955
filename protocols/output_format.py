"""Structured output requests, as each protocol writes them, to one :class:`~protocols.ir.ResponseFormat`.

* OpenAI Chat ``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}``, or
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``;
* OpenAI Responses ``text.format``: the same types, with ``name``/``schema``/``strict`` beside ``type``;
* Anthropic ``output_config.format``: ``{"type": "json_schema", "schema": {...}}``.

One decoder reads all three shapes (nested under ``json_schema`` or flat). A schema must be a JSON object.
"""

from __future__ import annotations

from typing import Any

from protocols.errors import ApiError
from protocols.ir import ResponseFormat

TYPES = ("text", "json_object", "json_schema")


def decode_response_format(value: Any, param: str) -> ResponseFormat | None:
    """``value`` (a protocol's format object, or None) as the IR; None for free text. 400s name ``param``."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApiError("invalid_request", f"'{param}' must be an object with a 'type' ({', '.join(TYPES)}).",
                       param=param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind != "json_schema":
        raise ApiError("invalid_request", f"'{param}.type' is {kind!r}; accepted: {', '.join(TYPES)}.",
                       param=f"{param}.type")
    nested = value.get("json_schema")
    spec = nested if isinstance(nested, dict) else value
    where = f"{param}.json_schema" if isinstance(nested, dict) else param
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise ApiError("invalid_request", f"'{where}.schema' must be a JSON Schema object.",
                       param=f"{where}.schema")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ApiError("invalid_request", f"'{where}.strict' must be true or false.", param=f"{where}.strict")
    name = spec.get("name")
    return ResponseFormat("json_schema", schema, name if isinstance(name, str) else "", bool(strict))


def encode_text_format(fmt: ResponseFormat | None) -> dict[str, Any]:
    """The Responses API's echo of ``text.format``."""
    if fmt is None:
        return {"type": "text"}
    if fmt.type == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "name": fmt.name, "schema": fmt.schema, "strict": fmt.strict}
