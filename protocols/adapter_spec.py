"""The ``adapter`` a request names (a flow extension field in every protocol): ``"id"``, stacked ``"a+b"``, or
``"none"``; and what an adapter id may be."""

from __future__ import annotations

import re

from protocols.errors import ApiError

ADAPTER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # the whole id (fullmatch: no trailing newline)


def check_adapter_id(adapter_id: str) -> str:
    """``adapter_id`` if it is a valid id, else a ``ValueError`` saying what is accepted."""
    if not ADAPTER_ID.fullmatch(adapter_id) or adapter_id == "none":
        raise ValueError(f"adapter id {adapter_id!r} is not valid: use 1 to 64 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit ('none' is reserved)")
    return adapter_id


def parse_adapter_spec(spec: str) -> tuple[str, ...]:
    """The ids in ``spec`` in stacking order (``"none"`` or ``""``: no adapter, ``()``); a ``ValueError``
    names what is wrong."""
    spec = spec.strip()
    if spec in ("none", ""):
        return ()
    ids = tuple(part.strip() for part in spec.split("+"))
    for adapter_id in ids:
        check_adapter_id(adapter_id)
    if len(set(ids)) != len(ids):
        raise ValueError(f"adapter {spec!r} names an adapter twice")
    return ids


def decode_adapter(value: str | None) -> tuple[str, ...] | None:
    """A request body's ``adapter`` field: None when it names none (the model id's default applies)."""
    if value is None:
        return None
    try:
        return parse_adapter_spec(value)
    except ValueError as exc:
        raise ApiError("invalid_request", f"'adapter': {exc}; send an adapter id, ids joined by '+' to stack "
                       "them, or 'none'.", param="adapter") from None
