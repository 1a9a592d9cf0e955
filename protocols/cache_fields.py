"""Request fields that steer the prefix cache, shared by the protocols; and the ``adapter`` field.

OpenAI-style bodies may carry four extension fields, which official clients
never send and other servers ignore: ``session_id`` (a conversation's name, for
its cache state in ``/stats``; ``prompt_cache_key``, which Codex sends, counts
as one), ``cache_mode`` (``full``: keep prompt and answer for the next turn;
``prefix``: keep the prompt only) and ``ttl`` (seconds the cached blocks live
after their last use; 0: memory only) and ``cache_audit`` (``true``: this
request's prefix-cache hit is recomputed cold and its first logits compared;
``flow cache verify`` sends it). Anthropic bodies say the ttl with
``cache_control`` marks: the longest ``ttl`` among them (``"5m"``, ``"1h"``) is
the request's; ``cache_audit`` is the same extension there.

Every protocol's body may also name LoRA adapters in an ``adapter`` field (see :mod:`protocols.adapter_spec`).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from protocols.ir import CachePolicy

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
ANTHROPIC_DEFAULT_TTL = 300.0  # cache_control without a ttl: Anthropic's five minutes


class SessionFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    session_id: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    cache_mode: Literal["full", "prefix"] = "full"
    ttl: float | None = Field(default=None, ge=0)
    cache_audit: bool = False
    adapter: str | None = Field(default=None, max_length=512)

    def cache_policy(self) -> CachePolicy:
        return CachePolicy(mode=self.cache_mode, ttl_seconds=self.ttl,
                           session_id=self.session_id or self.prompt_cache_key, audit=self.cache_audit)


def duration_seconds(value: Any) -> float | None:
    """``"5m"``, ``"1h"``, ``"90s"``, ``300`` → seconds; None when it is none of those."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and (m := _DURATION.match(value)):
        return float(m.group(1)) * _SECONDS[m.group(2)]
    return None


def cache_control_ttl(body: Any) -> float | None:
    """The longest TTL among the ``cache_control`` marks anywhere in an Anthropic body (None: no marks)."""
    found: list[float] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            mark = node.get("cache_control")
            if isinstance(mark, dict):
                found.append(duration_seconds(mark.get("ttl")) or ANTHROPIC_DEFAULT_TTL)
            for value in node.values():
                if isinstance(value, (dict, list)):
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(body)
    return max(found) if found else None
