"""Flow's own cost per token: the default graph with ``generate.echo``, every chat protocol, 1 to 256 streams.

Run (OpenBLAS preloaded first, as the other benchmarks)::

    eval "$(.venv/bin/python -m flow.cli.blas)"
    .venv/bin/python scripts/bench_pipeline.py --json pipeline.json
    # before/after, side by side in one run: a worktree of the old commit beside this one
    git worktree add /tmp/flow-before <commit>
    .venv/bin/python scripts/bench_pipeline.py --server before=/tmp/flow-before --server after=. --rounds 3

With ``generate`` swapped for ``generate.echo`` (stages/echo.py) there is no model cost at all: the echo
device steps every row together, one token per row per step, the next step as soon as the event loop is idle,
and the tokens go through the real tokenizer, detokenizer, stop matcher, parsers and protocol encoders. What
the server process spends is flow's own Python per token, the ceiling a fast device would meet.

Each server (``--server LABEL=CHECKOUT``, default this checkout) runs as ``python -m flow.cli serve`` in a
subprocess with that checkout first on its path, all of them started at once and each cell of the table run
on each in turn (the order alternating), so drift on a noisy machine hits them alike; figures are medians
over ``--rounds``. A cell is one protocol (OpenAI chat, Responses, Anthropic messages, Ollama chat), streamed
or not, at one concurrency: that many keep-alive clients (scripts/pipeline_load.py, a lean client so the
load costs little) each sending requests one after another until the cell has ``--min-tokens`` tokens.

Figures per cell:

* server CPU per token and per request: utime + stime of the server process from ``/proc/PID/stat`` over the
  cell (every thread of the server, none of the client's), over the completion tokens the answers report;
* tok/s: completion tokens over the cell's wall time;
* event-loop lag p99: from the server's ``flow_event_loop_lag_seconds`` histogram on ``/metrics``, read
  before and after the cell (a timer every 20 ms; interpolated within a bucket).

``--profile DIR``: afterwards, each server is profiled with py-spy during one more cell (``--profile-cell``,
default 64 OpenAI streams): ``DIR/LABEL.speedscope.json`` (open it in https://www.speedscope.app) and
``DIR/LABEL-top.txt``, the loop thread's samples by package and by function (scripts/profile_summary.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline_load import PROTOCOLS, Load, echo_text, run_load
from profile_summary import summarize
from server_env import checkout_env

MODES = ("stream", "whole")


@dataclass
class Server:
    label: str
    checkout: Path
    port: int
    proc: subprocess.Popen[bytes]
    log: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(label: str, checkout: Path, model_dir: Path, tmp: Path, step_seconds: float) -> Server:
    """``flow serve`` from ``checkout``: its default graph, ``generate`` swapped for the echo."""
    home = tmp / label
    home.mkdir(parents=True)
    graph = home / "graph.toml"
    step = f"step_seconds = {step_seconds}\n" if step_seconds else ""
    graph.write_text(
        f'extends = "{checkout / "graphs" / "default.toml"}"\n\n'
        f'[resources.model]\npath = "{model_dir}"\nname = "bench"\naliases = []\n\n'
        f'[resources.prefix_cache]\ndirectory = "{home / "kv-cache"}"\n\n'
        f'[stages.generate]\ntype = "generate.echo"\n{step}')
    port = free_port()
    env = checkout_env(checkout, FLOW_DATA_DIR=str(home / "data"))
    log = home / "server.log"
    cmd = [sys.executable, "-m", "flow.cli", "--log-level", "WARNING", "serve", str(graph), "--port", str(port)]
    with open(log, "wb") as err:  # the child has its own copy of the descriptor
        proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=err)
    return Server(label, checkout, port, proc, log)


def wait_ready(server: Server, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server {server.label} exited with {server.proc.returncode}:\n"
                               f"{server.log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/v1/models", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"server {server.label} not ready in {timeout:g} s")


def stop(server: Server) -> None:
    server.proc.terminate()
    try:
        server.proc.wait(20)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()


def load(server: Server, protocol: str, mode: str, level: int, args: argparse.Namespace, text: str) -> Load:
    waves = max(1, math.ceil(args.min_tokens / (level * args.tokens)))
    return trio.run(run_load, "127.0.0.1", server.port, server.proc.pid, protocol, mode == "stream", level, waves,
                    text, args.tokens)


def figures(loads: list[Load]) -> dict[str, Any]:
    """The median of each figure over a cell's rounds (failures summed)."""
    def median(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None

    per_token = [ld.cpu_s / ld.tokens * 1e6 if ld.tokens else None for ld in loads]
    system_share = [ld.system_s / ld.cpu_s if ld.cpu_s else None for ld in loads]
    per_request = [ld.cpu_s / (ld.requests - ld.failed) * 1000 if ld.requests > ld.failed else None for ld in loads]
    rate = [ld.tokens / ld.wall_s if ld.wall_s else None for ld in loads]
    return {"cpu_us_per_token": median(per_token), "cpu_ms_per_request": median(per_request),
            "system_share": median(system_share),
            "tokens_per_s": median(rate), "lag_p99_ms": median([ld.lag_p99_ms for ld in loads]),
            "lag_p50_ms": median([ld.lag_p50_ms for ld in loads]),
            "failed": sum(ld.failed for ld in loads), "requests": sum(ld.requests for ld in loads),
            "tokens_per_request": median([ld.tokens / (ld.requests - ld.failed) if ld.requests > ld.failed else None
                                          for ld in loads]),
            "errors": sorted({e for ld in loads for e in ld.errors})[:3],
            "rounds": [asdict(ld) for ld in loads]}


def profile(server: Server, out: Path, cell: tuple[str, str, int], args: argparse.Namespace, text: str) -> str:
    """py-spy on ``server`` during one more run of ``cell``; the speedscope file and its summary."""
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        return "py-spy is not installed (pip install py-spy)"
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"{server.label}.speedscope.json"
    recorder = subprocess.Popen([spy, "record", "--pid", str(server.proc.pid), "--rate", str(args.profile_rate),
                                 "--nonblocking", "--format", "speedscope", "--output", str(target)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # py-spy attaches
    protocol, mode, level = cell
    done = load(server, protocol, mode, level, args, text)
    recorder.send_signal(signal.SIGINT)
    _, err = recorder.communicate(timeout=60)
    if not target.exists():
        return f"py-spy wrote no profile: {err.decode(errors='replace')[-400:]}"
    summary = (f"{server.label}: {level} {protocol} {mode} clients, {done.tokens} tokens, "
               f"{done.cpu_s / max(done.tokens, 1) * 1e6:.1f} µs of server CPU per token while profiled\n"
               + summarize(json.loads(target.read_text())))
    (out / f"{server.label}-top.txt").write_text(summary)
    return summary


def markdown(result: dict[str, Any]) -> str:
    labels = [s["label"] for s in result["servers"]]
    head = (f"model `{result['model']}` (its tokenizer; the echo stands in for the model), {result['tokens']} "
            f"tokens per request, at least {result['min_tokens']} tokens per cell, median of {result['rounds']} "
            f"round(s); OpenBLAS {'on' if result['openblas'] else 'off'}; {result['cpus']} CPUs; load average "
            f"before/after {result['load_before']:.2f}/{result['load_after']:.2f}")
    cols = [f"{label} {what}" for label in labels for what in ("µs/token", "ms/request", "tok/s", "lag p99 ms")]
    ratio = len(labels) > 1
    lines = [head, "", "| streams | protocol | mode | " + " | ".join(cols)
             + (f" | {labels[-1]}/{labels[0]} µs/token |" if ratio else " |"),
             "|---|---|---|" + "---|" * (len(cols) + ratio)]

    def show(value: float | None, digits: int) -> str:
        return "–" if value is None else f"{value:.{digits}f}"

    for cell in result["cells"]:
        row = [str(cell["level"]), cell["protocol"], cell["mode"]]
        for label in labels:
            f = cell["servers"][label]
            fail = f" ({f['failed']} failed)" if f["failed"] else ""
            row += [show(f["cpu_us_per_token"], 1) + fail, show(f["cpu_ms_per_request"], 2),
                    show(f["tokens_per_s"], 0), show(f["lag_p99_ms"], 1)]
        if ratio:
            first, last = (cell["servers"][labels[0]]["cpu_us_per_token"],
                           cell["servers"][labels[-1]]["cpu_us_per_token"])
            row.append(f"{last / first:.2f}" if first and last else "–")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model", default="tiny:tiny-qwen3", help="tiny:PRESET or a model directory (its tokenizer)")
    parser.add_argument("--server", action="append", default=[], metavar="LABEL=CHECKOUT",
                        help="a server to measure, from a checkout of flow (repeat to compare; default this one)")
    parser.add_argument("--levels", default="1,8,64,256", help="concurrent clients, comma-separated")
    parser.add_argument("--protocols", default=",".join(PROTOCOLS), help=f"any of {', '.join(PROTOCOLS)}")
    parser.add_argument("--modes", default=",".join(MODES), help="stream, whole or both")
    parser.add_argument("--tokens", type=int, default=300, help="completion tokens per request")
    parser.add_argument("--min-tokens", type=int, default=20000, help="at least this many tokens per cell")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--step-seconds", type=float, default=0.0, help="the echo device's least step time")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 and 8 clients, 2,000 tokens per cell")
    parser.add_argument("--profile", metavar="DIR", help="py-spy each server during one more cell; files here")
    parser.add_argument("--profile-rate", type=int, default=200, help="py-spy's samples per second")
    parser.add_argument("--profile-cell", default="openai,stream,64", help="PROTOCOL,MODE,CLIENTS to profile")
    parser.add_argument("--json", help="also write the full result here")
    parser.add_argument("--markdown", help="also write the table here")
    args = parser.parse_args(argv)
    if args.quick:
        args.levels, args.min_tokens = "1,8", 2000
    levels = [int(x) for x in args.levels.split(",") if x]
    protocols = [p for p in args.protocols.split(",") if p]
    modes = [m for m in args.modes.split(",") if m]
    for name, given, valid in (("protocol", protocols, PROTOCOLS), ("mode", modes, MODES)):
        for value in given:
            if value not in valid:
                parser.error(f"unknown {name} {value!r}: one of {', '.join(valid)}")
    specs = [s.split("=", 1) for s in args.server] or [["flow", str(ROOT)]]
    if any(len(s) != 2 for s in specs):
        parser.error("--server takes LABEL=CHECKOUT")

    from flow.cli import blas
    from runtime.models import resolve_model_path

    blas.advise()
    model_dir = resolve_model_path(args.model)
    text = echo_text(2 * args.tokens)  # more than enough words: every answer stops at --tokens ("length")
    result: dict[str, Any] = {
        "model": args.model, "tokens": args.tokens, "min_tokens": args.min_tokens, "rounds": args.rounds,
        "step_seconds": args.step_seconds, "openblas": blas.openblas_active(), "cpus": os.cpu_count(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "load_before": os.getloadavg()[0],
        "servers": [{"label": label, "checkout": str(Path(path).resolve())} for label, path in specs],
    }
    cells = [(level, protocol, mode) for level in levels for protocol in protocols for mode in modes]
    runs: dict[tuple[int, str, str], dict[str, list[Load]]] = {c: {label: [] for label, _ in specs} for c in cells}
    with tempfile.TemporaryDirectory(prefix="flow-pipeline-") as tmpdir:
        servers = [start_server(label, Path(path).resolve(), model_dir, Path(tmpdir), args.step_seconds)
                   for label, path in specs]
        try:
            for server in servers:
                wait_ready(server)
                for protocol in protocols:  # the model loads; every route's first request is behind it
                    for mode in modes:
                        load(server, protocol, mode, 2, argparse.Namespace(**{**vars(args), "min_tokens": 1}),
                             text)
            turn = 0
            for round_no in range(args.rounds):
                for cell in cells:
                    turn += 1
                    order = servers if turn % 2 else servers[::-1]
                    for server in order:
                        done = load(server, cell[1], cell[2], cell[0], args, text)
                        runs[cell][server.label].append(done)
                        print(f"round {round_no + 1} {server.label:>8} {cell[0]:>3} {cell[1]:>9} {cell[2]:>6}: "
                              f"{done.cpu_s / max(done.tokens, 1) * 1e6:7.1f} µs/token "
                              f"({done.system_s / max(done.cpu_s, 1e-9):.0%} system) "
                              f"{done.tokens / done.wall_s:8.0f} tok/s lag p99 {done.lag_p99_ms} ms"
                              + (f" failed {done.failed} {done.errors}" if done.failed else ""), file=sys.stderr)
            if args.profile:
                protocol, mode, clients = args.profile_cell.split(",")
                result["profiles"] = {s.label: profile(s, Path(args.profile), (protocol, mode, int(clients)), args,
                                                       text) for s in servers}
        finally:
            for server in servers:
                stop(server)
    result["load_after"] = os.getloadavg()[0]
    result["cells"] = [{"level": c[0], "protocol": c[1], "mode": c[2],
                        "servers": {label: figures(loads) for label, loads in runs[c].items()}} for c in cells]
    table = markdown(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
