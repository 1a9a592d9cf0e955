"""Summarize a py-spy speedscope profile of flow's event loop: where its samples are, as text.

    .venv/bin/python scripts/profile_summary.py profile.speedscope.json > profile.txt

Only the event loop's thread is read (py-spy names it ``MainThread``; else the thread with the most samples).
Printed: the share of samples whose innermost frame is in each package (trio, hypercorn, quart, h11, flow's
own code, …: who spends the loop's time), then the functions with the most samples of their own (self) and
the most samples under them (total).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# Path fragments → the package a frame belongs to; the first that matches names it.
PACKAGES = (("/trio/", "trio"), ("/hypercorn/", "hypercorn"), ("/quart_trio/", "quart-trio"), ("/quart/", "quart"),
            ("/werkzeug/", "werkzeug"), ("/h11/", "h11"), ("/h2/", "h2"), ("/pydantic", "pydantic"),
            ("/orjson", "orjson"), ("/tokenizers", "tokenizers"), ("/transformers/", "transformers"),
            ("/mlx_lm/", "mlx-lm"), ("/flow/", "flow"), ("/stages/", "flow"), ("/protocols/", "flow"),
            ("/runtime/", "flow"), ("/viz/", "flow"), ("/sortedcontainers/", "sortedcontainers"),
            ("/outcome/", "outcome"), ("/asyncio/", "asyncio"), ("/python3", "python stdlib"))


def package(file: str) -> str:
    for fragment, name in PACKAGES:
        if fragment in file:
            return name
    return "native" if not file.endswith(".py") else "other"


def loop_profile(data: dict[str, Any]) -> dict[str, Any]:
    profiles: list[dict[str, Any]] = data["profiles"]
    named = [p for p in profiles if "MainThread" in p.get("name", "")]
    return max(named or profiles, key=lambda p: len(p["samples"]))


def most(counts: dict[str, float]) -> list[tuple[str, float]]:
    return sorted(counts.items(), key=lambda item: -item[1])


def summarize(data: dict[str, Any], top: int = 30) -> str:
    frames = data["shared"]["frames"]
    profile = loop_profile(data)
    samples: list[list[int]] = profile["samples"]
    weights: list[float] = profile.get("weights") or [1.0] * len(samples)
    total = sum(weights) or 1.0
    own: dict[str, float] = {}
    under: dict[str, float] = {}
    packages: dict[str, float] = {}

    def label(index: int) -> str:
        frame = frames[index]
        file = frame.get("file", "")
        short = "/".join(file.split("/")[-2:])
        return f"{frame['name']} ({short})" if file else frame["name"]  # a function, all its lines together

    for stack, weight in zip(samples, weights):
        if not stack:
            continue
        innermost = label(stack[-1])
        own[innermost] = own.get(innermost, 0.0) + weight
        where = package(frames[stack[-1]].get("file", ""))
        packages[where] = packages.get(where, 0.0) + weight
        for name in {label(i) for i in stack}:
            under[name] = under.get(name, 0.0) + weight
    lines = [f"thread: {profile.get('name', '?')}; {len(samples)} samples", "",
             "innermost frame's package (share of samples):"]
    lines += [f"  {share / total:6.1%}  {name}" for name, share in most(packages)]
    lines += ["", f"top {top} functions by own samples:"]
    lines += [f"  {share / total:6.1%}  {name}" for name, share in most(own)[:top]]
    lines += ["", f"top {top} functions by samples under them:"]
    lines += [f"  {share / total:6.1%}  {name}" for name, share in most(under)[:top]]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print(summarize(json.loads(Path(argv[0]).read_text())), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
