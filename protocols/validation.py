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


def _describe(error: Any, tags: frozenset[str]) -> str:
    path = _client_path(error["loc"], tags)
    kind = error["type"]
    if kind == "missing":
        return f"'{path}' is required"
    got = error.get("input")
    shown = json.dumps(got)[:80] if _jsonable(got) else type(got).__name__
    return f"'{path}': {error['msg']} (got {shown})"


def _model_names() -> frozenset[str]:
    """The class names of the pydantic models defined so far (a union member's tag, see :func:`_client_path`)."""
    seen: set[type] = set()
    stack: list[type] = [BaseModel]
    while stack:
        subclasses: list[type] = stack.pop().__subclasses__()
        for sub in subclasses:
            if sub not in seen:
                seen.add(sub)
                stack.append(sub)
    return frozenset(cls.__name__ for cls in seen)


def _client_path(loc: tuple[int | str, ...], tags: frozenset[str]) -> str:
    """An error location as the client's field path. pydantic inserts the name of the union member it tried
    ("str", "list[...]", "function-after[...]", a model class such as "_Document") into the location; it means
    nothing to a client."""
    return field_path(tuple(p for p in loc if not (
        isinstance(p, str) and ("[" in p or p in ("str", "int", "float", "bool", "list", "dict") or p in tags))))


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _most_specific(errors: list[Any], tags: frozenset[str]) -> list[Any]:
    """Drop a union's shallow complaints when a branch got further.

    For ``content: str | list[Block]`` given a list with one bad block, pydantic
    reports both "not a string" at ``content`` and the real problem at
    ``content[0].id``; only the latter helps the client."""
    paths = [_client_path(e["loc"], tags) for e in errors]
    kept = [e for e, path in zip(errors, paths)
            if not any(other != path and other.startswith((path + ".", path + "[")) for other in paths)]
    return kept or errors


# JSON nesting deeper than this is refused: request schemas nest a handful of levels, tool schemas a
# few dozen; deeper input only exercises recursion (in the parser, validation, templates).
MAX_DEPTH = 64
# Objects and arrays in one body, at most. Parsing and validating a body costs per value, not per byte, and
# the parser and the validator each hold the GIL for their whole call (250,000 one-letter messages, 9 MB, held
# it for 3 s; validating 20,000 messages holds it 75 ms). An agent's longest conversation with its tools is some
# thousands; a token-id embeddings request of 2,048 inputs, 2,049.
MAX_JSON_CONTAINERS = 25_000
# Values of any kind (counted by an upper bound: separators), at most. OpenAI's embeddings API takes 300,000
# tokens a request; a million token ids parse in about 0.1 s.
MAX_JSON_VALUES = 1_000_000


def _check_size(body: bytes) -> None:
    """Refuse, before parsing, a body of more values than a request needs (a 413 naming the limit). Counting
    bytes is cheap, so the exact count (skipping strings, where brackets are text) runs only where the cheap
    one, an upper bound, is over the limit; it stops at the limit, and gives the loop its turn between
    matches (decoding a large body runs on a worker thread)."""
    if body.count(b",") > MAX_JSON_VALUES:
        raise ApiError("request_too_large", f"The request body holds more than {MAX_JSON_VALUES:,} JSON values; "
                       "that is more than any request to this server needs.")
    if body.count(b"{") + body.count(b"[") <= MAX_JSON_CONTAINERS:
        return
    if _containers(body, MAX_JSON_CONTAINERS) > MAX_JSON_CONTAINERS:
        raise ApiError("request_too_large", f"The request body holds more than {MAX_JSON_CONTAINERS:,} JSON "
                       "objects and arrays; send a shorter conversation (or fewer inputs).")


def _containers(body: bytes, limit: int) -> int:
    """The opening brackets of ``body`` outside its strings, counted up to just past ``limit``. Each step is
    a ``find`` or ``count`` over bytes (C speed, whatever a string holds); Python runs once per string."""
    count = position = 0
    while True:
        quote = body.find(b'"', position)
        end = len(body) if quote < 0 else quote
        count += body.count(b"{", position, end) + body.count(b"[", position, end)
        if quote < 0 or count > limit:
            return count
        close = quote
        while True:  # the string's closing quote: the next one not escaped by an odd run of backslashes
            close = body.find(b'"', close + 1)
            if close < 0:
                return count  # an unterminated string: the parser says so
            if _backslashes_before(body, close) % 2 == 0:
                break
        position = close + 1


def _backslashes_before(body: bytes, index: int) -> int:
    run = 0
    while index - run > 0:
        piece = body[max(0, index - run - 64):index - run]
        kept = len(piece.rstrip(b"\\"))
        run += len(piece) - kept
        if kept:
            break
    return run


def _not_json(value: str) -> Any:
    raise ValueError(f"{value} is not a JSON number")


def _finite(text: str) -> float:
    number = float(text)
    if number in (float("inf"), float("-inf")):
        raise ValueError(f"the number {text[:40]} is too large")
    return number


def _walk(data: Any, check_strings: bool) -> None:
    """Refuse nesting past :data:`MAX_DEPTH` and, when the body escaped any, lone UTF-16 surrogates
    (``"\\ud800"``): JSON allows them, UTF-8 cannot encode them, so the tokenizer would fail."""
    stack: list[tuple[Any, int, str]] = [(data, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, dict):
            items: Any = value.items()
        elif isinstance(value, list):
            items = enumerate(value)
        else:
            if check_strings and isinstance(value, str):
                _encodable(value, path)
            continue
        if depth > MAX_DEPTH:
            raise ApiError("invalid_request", f"The request body nests deeper than {MAX_DEPTH} levels "
                           f"(at '{path}').", param=path or None)
        for key, item in items:
            where = f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else str(key))
            if check_strings and isinstance(key, str):
                _encodable(key, where)
            stack.append((item, depth + 1, where))


def _encodable(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError("invalid_request", f"'{where}' holds a lone UTF-16 surrogate (an unpaired \\ud800-"
                       "\\udfff escape), which is not valid Unicode text.", param=where or None) from None


def load_json(body: bytes) -> Any:
    """``body`` as JSON, or an ApiError saying why not: malformed, NaN/Infinity, numbers too large,
    nesting too deep, unpaired surrogates."""
    if not body.strip():
        raise ApiError("invalid_request", "The request body is empty; send a JSON object.")
    _check_size(body)
    try:
        # Strict UTF-8 (RFC 8259): json.loads would decode bytes with 'surrogatepass', letting encoded
        # surrogates through as text that nothing downstream can encode.
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError("invalid_request", f"The request body is not valid UTF-8 (byte {exc.start}: {exc.reason}); "
                       "JSON bodies must be UTF-8.") from None
    try:
        data = json.loads(text, parse_constant=_not_json, parse_float=_finite)
    except json.JSONDecodeError as exc:
        raise ApiError("invalid_request", f"The request body is not valid JSON: {exc}.") from None
    except RecursionError:
        raise ApiError("invalid_request", f"The request body nests deeper than {MAX_DEPTH} levels.") from None
    except ValueError as exc:  # NaN/Infinity, 1e999, integers of thousands of digits
        raise ApiError("invalid_request", f"The request body is not acceptable JSON: {exc}.") from None
    _walk(data, check_strings=b"\\ud" in body or b"\\uD" in body)
    return data


def json_object_argument(arguments: str | dict[str, Any] | None, where: str) -> dict[str, Any]:
    """Tool-call arguments a client sends back (a JSON object, or a string encoding one) as a dict:
    chat templates index into them. Strings get the body's own checks (depth, numbers, surrogates)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = load_json((arguments or "{}").encode("utf-8", "surrogatepass"))
    except ApiError as exc:
        raise ApiError("invalid_request", f"'{where}' must be a JSON object string: "
                       f"{exc.message[0].lower()}{exc.message[1:]}", param=where) from None
    if not isinstance(parsed, dict):
        raise ApiError("invalid_request", f"'{where}' must encode a JSON object.", param=where)
    return parsed


def parse_json_body(model: type[M], body: bytes) -> M:
    """Parse and validate ``body`` as ``model``; raise one ApiError naming the first bad field."""
    data = load_json(body)
    if not isinstance(data, dict):
        raise ApiError(
            "invalid_request", f"The request body must be a JSON object, not {type(data).__name__}."
        )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        tags = _model_names()
        errors = _most_specific(exc.errors(), tags)
        param = _client_path(errors[0]["loc"], tags) or None
        message = "; ".join(_describe(e, tags) for e in errors[:3])
        if len(errors) > 3:
            message += f" (and {len(errors) - 3} more)"
        raise ApiError("invalid_request", message, param=param) from None
