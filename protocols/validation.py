"""Turn request bodies into validated pydantic models, or one clear :class:`ApiError`.

Every protocol parses its JSON body through :func:`parse_json_body`, so that a
malformed body, a missing field and a wrongly typed field all produce the same
kind of message: which field, what was wrong, what is accepted.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from protocols.errors import ApiError

M = TypeVar("M", bound=BaseModel)


def field_path(loc: tuple[int | str, ...]) -> str:
    """``("messages", 0, "role")`` → ``"messages[0].role"``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _describe(error: Any) -> str:
    path = field_path(tuple(p for p in error["loc"] if not _is_union_tag(p)))
    kind = error["type"]
    if kind == "missing":
        return f"'{path}' is required"
    got = error.get("input")
    shown = json.dumps(got)[:80] if _jsonable(got) else type(got).__name__
    return f"'{path}': {error['msg']} (got {shown})"


def _is_union_tag(part: int | str) -> bool:
    # pydantic inserts the union member's name ("str", "list[...]", "function-after[...]")
    # into the location; it means nothing to a client.
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "list", "dict"))


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _most_specific(errors: list[Any]) -> list[Any]:
    """Drop a union's shallow complaints when a branch got further.

    For ``content: str | list[Block]`` given a list with one bad block, pydantic
    reports both "not a string" at ``content`` and the real problem at
    ``content[0].id``; only the latter helps the client."""
    paths = [field_path(tuple(p for p in e["loc"] if not _is_union_tag(p))) for e in errors]
    kept = [e for e, path in zip(errors, paths)
            if not any(other != path and other.startswith((path + ".", path + "[")) for other in paths)]
    return kept or errors


def parse_json_body(model: type[M], body: bytes) -> M:
    """Parse and validate ``body`` as ``model``; raise one ApiError naming the first bad field."""
    if not body.strip():
        raise ApiError("invalid_request", "The request body is empty; send a JSON object.")
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError("invalid_request", f"The request body is not valid JSON: {exc}.") from None
    if not isinstance(data, dict):
        raise ApiError(
            "invalid_request", f"The request body must be a JSON object, not {type(data).__name__}."
        )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = _most_specific(exc.errors())
        first = errors[0]
        param = field_path(tuple(p for p in first["loc"] if not _is_union_tag(p))) or None
        message = "; ".join(_describe(e) for e in errors[:3])
        if len(errors) > 3:
            message += f" (and {len(errors) - 3} more)"
        raise ApiError("invalid_request", message, param=param) from None
