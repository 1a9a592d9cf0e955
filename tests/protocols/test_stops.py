"""Stop strings are matched on text and no part of one is ever released."""

from __future__ import annotations

import pytest

from protocols.stops import StopMatcher

TEXT = "The lighthouse keeper said: STOP here, and then kept going."


def run(chunks: list[str], stops: list[str]) -> tuple[list[str], str | None]:
    matcher = StopMatcher(stops)
    out = [matcher.feed(c) for c in chunks]
    if matcher.matched is None:
        out.append(matcher.flush())
    return out, matcher.matched


@pytest.mark.parametrize("size", range(1, 12))
def test_every_chunking_gives_the_same_text(size: int) -> None:
    chunks = [TEXT[i : i + size] for i in range(0, len(TEXT), size)]
    out, matched = run(chunks, ["STOP", "zzz"])
    assert "".join(out) == "The lighthouse keeper said: "
    assert matched == "STOP"
    assert not any("S" in piece for piece in out)  # not even the first letter leaks


def test_no_match_releases_everything() -> None:
    out, matched = run(["abc S", "TO", "x"], ["STOP"])
    assert "".join(out) == "abc STOx" and matched is None
    assert out[1] == ""  # "STO" was held back while it could still become "STOP"


def test_earliest_stop_wins() -> None:
    out, matched = run(["one two three"], ["three", "two"])
    assert out == ["one "] and matched == "two"


def test_no_stops_is_passthrough() -> None:
    assert run(["a", "b"], []) == (["a", "b", ""], None)
