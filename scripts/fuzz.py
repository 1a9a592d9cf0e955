#!/usr/bin/env python3
"""The long fuzz run: valid and mutated requests for every protocol, for N minutes, every answer judged.

    .venv/bin/python scripts/fuzz.py --minutes 10                  # starts its own server on a tiny model
    .venv/bin/python scripts/fuzz.py --minutes 60 --seed 7 --only chat,messages
    .venv/bin/python scripts/fuzz.py --url http://127.0.0.1:8080 --model qwen3-0.6b --vocab 151936
    .venv/bin/python scripts/fuzz.py --url http://127.0.0.1:8080 --model default --embedder minilm --speaker tts-1 \
        --listener whisper-1

Cases come from ``tests/fuzz/strategies.py`` (Hypothesis, generation only, seeded: the same seed
and the same code send the same cases), rounds of ``--batch`` cases per endpoint in turn until
the time is up. Each answer is judged by ``tests.fuzz.run_case``: no 5xx, 4xx in the route's error
shape, 200 streams that end properly, the server still the same live process (a server this
script started is restarted after a crash; with ``--url``, a restart shows as the uptime going
back). At the end: the cases sent per route and status, then each distinct failure (grouped by
signature) once, with the number of cases that hit it, the smallest such case made smaller still
by removing parts of its body while it fails the same way, and the curl lines that reproduce it.
Exit status 1 when anything failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from collections import Counter
from urllib.parse import urlsplit
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis.configuration import set_hypothesis_home_dir  # noqa: E402
from hypothesis.errors import NonInteractiveExampleWarning  # noqa: E402

from tests.fuzz import Collector, FlowProcess, RemoteServer, Server, run_case  # noqa: E402
from tests.fuzz.strategies import NAMES, Case, cases, configure  # noqa: E402


class Run:
    def __init__(self, server: Server, client: httpx.Client, deadline: float, timeout: float, verbose: bool) -> None:
        self.server, self.client, self.deadline, self.timeout, self.verbose = server, client, deadline, timeout, verbose
        self.counts: Counter[tuple[str, str]] = Counter()
        self.found = Collector()
        self.sent = 0

    def send(self, case: Case) -> None:
        if time.monotonic() >= self.deadline:
            return
        verdict = run_case(self.server, case, client=self.client, timeout=self.timeout)
        self.sent += 1
        self.counts[(case.route, str(verdict.status) if verdict.status is not None else "none")] += 1
        for failure in self.found.add(verdict):
            print(f"  new failure: {failure.title()}", file=sys.stderr)
        if self.verbose:
            print(f"  {verdict.status} {case.route} {'; '.join(case.labels)[:100]}", file=sys.stderr)

    def round(self, name: str, seed_value: int, batch: int) -> None:
        @settings(max_examples=batch, deadline=None, database=None, phases=[Phase.generate], print_blob=False,
                  suppress_health_check=list(HealthCheck))
        @seed(seed_value)
        @given(case=cases(name))
        def fuzz(case: Case) -> None:
            self.send(case)

        fuzz()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0, help="how long to send cases (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first round (default 0)")
    parser.add_argument("--url", help="fuzz this running server instead of starting one on a tiny model")
    parser.add_argument("--model", action="append", help="with --url: a model id it serves (repeatable; "
                                                          "default: default)")
    parser.add_argument("--embedder", help="with --url: an embedding model it serves (fuzzes embeddings and rerank)")
    parser.add_argument("--speaker", help="with --url: a text-to-speech model it serves (fuzzes speech)")
    parser.add_argument("--listener", help="with --url: a speech-to-text model it serves (fuzzes the multipart "
                                           "transcription and translation uploads)")
    parser.add_argument("--vocab", type=int, help="with --url: the model's vocabulary size (default 1024)")
    parser.add_argument("--only", help="comma-separated endpoints, of: " + ", ".join(NAMES))
    parser.add_argument("--batch", type=int, default=40, help="cases per endpoint per round (default 40)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds one answer may take (default 60)")
    parser.add_argument("--no-minimize", action="store_true", help="report failing cases as found")
    parser.add_argument("--minimize-minutes", type=float, default=5.0,
                        help="time for making failing cases smaller, after the run (default 5)")
    parser.add_argument("--verbose", "-v", action="store_true", help="print every case")
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else NAMES
    if args.url and not args.only:  # the other kinds' endpoints only where the server's models were named
        names = [n for n in names if not (n in ("embeddings", "rerank") and not args.embedder
                                          or n == "speech" and not args.speaker
                                          or n == "transcriptions" and not args.listener)]
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        parser.error(f"unknown endpoint(s) {', '.join(unknown)}; valid: {', '.join(NAMES)}")
    warnings.simplefilter("ignore", NonInteractiveExampleWarning)
    caches = tempfile.TemporaryDirectory(prefix="flow-fuzz-hypothesis-")
    set_hypothesis_home_dir(caches.name)  # Hypothesis writes nothing into the checkout

    if args.url:
        host = urlsplit(args.url).hostname or ""
        configure(models=tuple(args.model or ["default"]), vocab=args.vocab, embedder=args.embedder,
                  speaker=args.speaker, listeners=(args.listener,) if args.listener else None,
                  loopback=host in ("localhost", "::1") or host.startswith("127."))
        server: Server = RemoteServer(args.url)
    else:
        print("starting flow serve on a tiny model…", file=sys.stderr)
        process = FlowProcess()
        print(f"serving on {process.url} (pid {process.pid}; log {process.log_path})", file=sys.stderr)
        server = process
    started = time.monotonic()
    deadline = started + args.minutes * 60
    try:
        with httpx.Client() as client:
            run = Run(server, client, deadline, args.timeout, args.verbose)
            round_no = 0
            while time.monotonic() < deadline:
                for i, name in enumerate(names):
                    if time.monotonic() >= deadline:
                        break
                    run.round(name, args.seed * 1_000_003 + round_no * 101 + i, args.batch)
                round_no += 1
                print(f"round {round_no}: {run.sent} cases, {len(run.found.hits)} distinct failures, "
                      f"{time.monotonic() - started:.0f} s", file=sys.stderr)
            elapsed = time.monotonic() - started
            report(run, server, client, args, elapsed)
    finally:
        server.close()
        caches.cleanup()
    return 1 if run.found.hits else 0


def report(run: Run, server: Server, client: httpx.Client, args: argparse.Namespace, elapsed: float) -> None:
    print(f"\nflow fuzz: {run.sent} cases in {elapsed / 60:.1f} min, seed {args.seed}, "
          f"{'server ' + args.url if args.url else 'own server (tiny models)'}")
    print(f"\n{'route':<44} {'status':>6} {'cases':>7}")
    for (route, status), count in sorted(run.counts.items()):
        print(f"{route:<44} {status:>6} {count:>7}")
    if not run.found.hits:
        print("\nno failures")
        return
    if not args.no_minimize:
        print(f"making {len(run.found.hits)} failing cases smaller…", file=sys.stderr)
        run.found.minimize(server, client=client, timeout=args.timeout, seconds=args.minimize_minutes * 60)
    print("\n" + run.found.report(server.url))


if __name__ == "__main__":
    sys.exit(main())
