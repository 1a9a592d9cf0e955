"""Fuzzing the real server: a ``flow serve`` process, cases sent to it, every answer judged.

``strategies.py`` says what to send; this module runs the server and judges the
answers; ``test_fuzz.py`` is the short fixed-seed run for CI and ``scripts/fuzz.py``
the long one.

Theory of operation
-------------------
:class:`FlowProcess` starts ``python -m flow.cli serve GRAPH --port P`` as a child
process, with a graph that extends ``graphs/default.toml`` and serves tiny local
models (a chat model, an embedding model, a text-to-speech model), and a private
``FLOW_DATA_DIR``. A separate process is the point: a segfault or an abort in MLX
kills it, and the next liveness check sees that, where an embedded server would take
the test run down with it.

:func:`run_case` sends a case's prelude and then its request, reads the whole answer
(streams to their end), and returns a :class:`Verdict` listing every
:class:`Failure`:

* ``crash``: the server process is gone, or ``/health`` no longer answers 200;
  ``wedged``: the process is up but a one-token completion after the case fails
  (either way the process is then restarted, so that the next case has a server);
* ``connection``: the connection broke mid-answer while the server stayed up;
* ``hang``: no complete answer within the timeout;
* ``5xx``: a server error, as the status or as an error event in a stream;
* ``status``: 2xx for a request that must be refused, or 4xx for a valid one;
* ``shape``: a 4xx whose body is not the route's protocol error shape (OpenAI routes
  ``{"error": {"message", "type", "param", "code"}}``, Anthropic routes
  ``{"type": "error", "error": {"type", "message"}}``);
* ``stream``: a 200 event stream that does not end properly (``[DONE]``,
  ``response.completed``/``response.incomplete``, ``message_stop``) or carries an error;
* ``body``: a 2xx JSON answer that is not JSON.

What counts as "must be refused" is the case's own expectation tightened by the
route's request model: bytes that are not a JSON object, or that the pydantic model
rejects (parsed by ``json.loads`` and validated exactly as the server does), must get a
4xx. Each failure has a signature (kind, route, normalized detail) that groups the
cases one bug produces.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.fuzz.strategies import Case, Expect, Request
from tests.harness import free_port

REPO = Path(__file__).resolve().parents[2]
MAX_BODY_BYTES = 2 * 1024 * 1024  # the fuzz graph's server.max_body_bytes (large-size cases cross it)
ANTHROPIC_ERROR_TYPES = {"invalid_request_error", "authentication_error", "permission_error", "not_found_error",
                         "request_too_large", "rate_limit_error", "api_error", "overloaded_error", "timeout_error",
                         "billing_error"}
READ_LIMIT = 64 * 1024 * 1024
TEXT_ANSWERS = ("text/plain", "text/vtt", "application/x-subrip")  # transcripts: response_format text, vtt, srt


# --------------------------------------------------------------------------- the server


def fuzz_graph(model_path: Path | str, default_max_tokens: int = 8) -> str:
    return f"""# Written by tests/fuzz: the default graph on tiny models, small answers, a small body cap.
extends = {json.dumps(str(REPO / "graphs" / "default.toml"))}

[server]
max_body_bytes = {MAX_BODY_BYTES}

[resources.model]
path = {json.dumps(str(model_path))}
name = "tiny"
aliases = ["default"]
default_max_tokens = {default_max_tokens}
max_batch = 8

# the other kinds: embeddings and rerank, speech (small answers: 16 audio tokens a sentence), transcription
[resources.embedder]
type = "model"
path = "tiny:tiny-bert"
name = "embedder"

[resources.speaker]
type = "model"
path = "tiny:tiny-soprano"
name = "speaker"
speech_max_tokens = 16

# speech to text (multipart uploads)
[resources.listener]
type = "model"
path = "tiny:tiny-whisper"
name = "listener"
aliases = ["whisper-1"]

[resources.prefix_cache]
hot_bytes = 67108864
disk_max_bytes = 268435456
"""


class Server:
    """A server to fuzz: its URL, and whether it is still the same one, alive and serving."""

    url: str
    pid: int | None = None

    def check(self) -> str | None:
        """None when the server is up and the same one as before; else what happened to it."""
        raise NotImplementedError

    def probe(self) -> str | None:
        """None when a one-token completion still works: a process can be up, /health 200, and serve nothing."""
        from tests.fuzz.strategies import TARGET

        body = json.dumps({"model": TARGET.models[0], "prompt": "ok", "max_tokens": 1}).encode()
        try:
            r = _client().post(self.url + "/v1/completions", content=body,
                               headers={"content-type": "application/json"}, timeout=30)
        except httpx.HTTPError as exc:
            return f"a one-token completion after it failed: {type(exc).__name__}"
        if r.status_code >= 500:
            return f"up, but a one-token completion after it answers {r.status_code}"
        return None

    def cause(self, answer: bytes) -> str | None:
        """What the server log says caused a 5xx answer (its exception), when this server's log can be read."""
        return None

    def recover(self) -> None:
        """Make the server usable again after ``check`` found it gone."""

    def log_tail(self, lines: int = 25) -> str:
        return ""

    def close(self) -> None:
        pass


_CLIENT: httpx.Client | None = None


def _client() -> httpx.Client:
    """The client for health checks and probes (one: making one costs ~0.2 s, its TLS context)."""
    global _CLIENT
    if _CLIENT is None:
        _CLIENT = httpx.Client()
    return _CLIENT


def _health(url: str, timeout: float = 10.0) -> tuple[int | None, dict[str, Any]]:
    try:
        r = _client().get(url.rstrip("/") + "/health", timeout=timeout)
    except httpx.HTTPError as exc:
        return None, {"error": f"{type(exc).__name__}: {exc}"}
    try:
        body = r.json()
    except ValueError:
        body = {}
    return r.status_code, body if isinstance(body, dict) else {}


_NOISE = re.compile(r"(trio\.EndOfChannel|trio\.Cancelled|(Base)?ExceptionGroup|RuntimeError: Nursery is closed)")
_NOT_EXCEPTIONS = ("File ", "During handling", "The above", "Traceback", "raise ", "return ", "await ")


class FlowProcess(Server):
    """``flow serve`` in a child process on a tiny model, restarted by :meth:`recover` when it died."""

    def __init__(self, workdir: Path | None = None, model: Path | str | None = None,
                 default_max_tokens: int = 8) -> None:
        if model is None:
            from runtime.tiny import ensure_tiny_model

            model = ensure_tiny_model("tiny-qwen3")
        self._own_workdir = workdir is None  # removed by close()
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="flow-fuzz-"))
        self.graph = self.workdir / "fuzz.toml"
        self.graph.write_text(fuzz_graph(model, default_max_tokens))
        self.log_path = self.workdir / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._log_offset = 0
        atexit.register(self.close)  # no server outlives the run that started it
        self.start()

    def start(self, timeout: float = 240.0) -> None:
        for _attempt in range(3):
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            env = {**os.environ, "FLOW_DATA_DIR": str(self.workdir / "data"), "HF_HUB_OFFLINE": "1",
                   "PYTHONUNBUFFERED": "1"}
            with open(self.log_path, "ab") as log:
                self._log_offset = log.tell()
                log.write(f"---- flow serve on port {port} (start {self.starts + 1})\n".encode())
                log.flush()
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "flow.cli", "serve", str(self.graph), "--port", str(port)],
                    cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                status, _ = _health(self.url, timeout=2)
                if status == 200:
                    self.pid = self.proc.pid
                    self.starts += 1
                    return
                time.sleep(0.2)
            if self.proc.poll() is None:
                self.stop()
                raise RuntimeError(f"flow serve did not become healthy in {timeout:.0f} s:\n{self.log_tail()}")
            if "address" not in self.log_tail().lower():  # a port race is worth another try; nothing else is
                break
        raise RuntimeError(f"flow serve exited with {self.proc.returncode if self.proc else '?'}:\n{self.log_tail()}")

    def check(self) -> str | None:
        assert self.proc is not None
        code = self.proc.poll()
        if code is None:
            status, body = _health(self.url)
            if status == 200:
                return self.probe()
            time.sleep(0.5)  # it may be dying: say how, if it did
            code = self.proc.poll()
            if code is None:
                return f"/health answered {status} {json.dumps(body)[:200]}"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"server process {self.pid} killed by {name}"
        return f"server process {self.pid} exited with status {code}"

    def recover(self) -> None:
        self.stop()
        self.start()

    def cause(self, answer: bytes, retried: bool = False) -> str | None:
        found = re.search(rb"request id ([0-9a-f]{8,})", answer)
        if not found:
            return None
        text = self.log_tail(100_000)
        start = text.find(found.group(1).decode())
        if start < 0:
            return None
        # The exception lines of the request's log record; when they only say that the request's channel
        # ended (its task died of something logged next), of the next few records as well.
        exceptions: list[str] = []
        records = 0
        for line in text[start:].splitlines()[1:400]:
            if re.match(r"\d{4}-\d\d-\d\d ", line):  # the next log record
                records += 1
                if records > 3 or (exceptions and not _NOISE.match(exceptions[-1])):
                    break
                continue
            line = line.strip(" |+-")
            if re.match(r"[A-Za-z_][\w.]*(: |$)", line) and not line.startswith(_NOT_EXCEPTIONS):
                exceptions.append(line)
        real = [e for e in exceptions if not _NOISE.match(e)]
        if not real and not retried:  # what killed the request's task may not be in the log yet
            time.sleep(0.3)
            return self.cause(answer, retried=True)
        return (real or exceptions)[-1] if exceptions else None

    def log_tail(self, lines: int = 25) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_offset)
                text = log.read().decode("utf-8", "replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(15)

    def close(self) -> None:
        self.stop()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


class RemoteServer(Server):
    """A server someone else started: alive means /health 200 and an uptime that never went back."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self._uptime = -1.0
        why = self.check()
        if why:
            raise RuntimeError(f"{self.url}: {why}")

    def check(self) -> str | None:
        status, body = _health(self.url)
        if status != 200:
            return f"/health answered {status} {json.dumps(body)[:200]}"
        uptime = float(body.get("uptime_seconds", 0) or 0)
        restarted = uptime + 1.0 < self._uptime
        self._uptime = uptime
        return "the server restarted (its uptime went back)" if restarted else self.probe()

    def recover(self) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if _health(self.url, timeout=2)[0] == 200:
                self._uptime = -1.0
                return
            time.sleep(1)
        raise RuntimeError(f"{self.url} did not come back")


# --------------------------------------------------------------------------- judging


@dataclass(frozen=True)
class Failure:
    kind: str  # crash, wedged, hang, connection, 5xx, status, shape, stream, body, prelude, generator
    route: str
    detail: str  # normalized: the same for every case of one bug
    message: str = ""  # what happened, in full

    @property
    def signature(self) -> tuple[str, str, str]:
        return (self.kind, self.route, self.detail)

    def title(self) -> str:
        return f"{self.kind} on {self.route}: {self.detail}"


@dataclass
class Verdict:
    case: Case
    expect: Expect
    status: int | None = None
    answer: bytes = b""
    seconds: float = 0.0
    failures: list[Failure] = field(default_factory=list)

    def report(self, url: str, only: tuple[str, str, str] | None = None) -> str:
        """A failing case for people: what failed, the answer, and the curl lines that reproduce it."""
        shown = [f for f in self.failures if only is None or f.signature == only] or self.failures
        lines = [f.title() + (f"\n    {f.message}" if f.message and f.message != f.detail else "") for f in shown]
        others = [f.title() for f in self.failures if f not in shown]
        if others:
            lines.append("the same case also: " + "; ".join(others))
        lines.append(f"case: {self.case.route}, {'; '.join(self.case.labels) or 'valid body'} "
                     f"(expected {self.expect}, got {self.status}, {self.seconds:.2f} s)")
        if self.answer:
            lines.append("answer: " + self.answer[:600].decode("utf-8", "replace")
                         + (f"… ({len(self.answer)} bytes)" if len(self.answer) > 600 else ""))
        lines.append("reproduce:\n" + "\n".join("  " + line for line in self.case.curl(url).splitlines()))
        return "\n".join(lines)


def normalize(text: str, limit: int = 100) -> str:
    """A message with its particulars (numbers, quoted values, addresses) blanked, for grouping."""
    text = re.sub(r"\\[uU][0-9a-fA-F]{4,8}|\\x[0-9a-fA-F]{2}|[\ud800-\udfff]", "…", text)  # escapes, surrogates
    text = re.sub(r"(\w)'(\w)", r"\1\2", text)  # apostrophes (can't) are no quotes
    text = re.sub(r"0x[0-9a-fA-F]+", "0x…", text)
    text = re.sub(r"\b(?=[0-9a-f]*\d)[0-9a-f]{8,}\b", "…", text)  # request ids
    text = re.sub(r"'[^']{0,200}'|\"[^\"]{0,200}\"|\(got [^)]*\)", "…", text)
    text = re.sub(r"\d+", "N", text)
    text = re.sub(r"\s+", " ", text).strip()
    return text[:limit]


def _label_kind(label: str) -> str:
    return normalize(label.split(" = ")[0].split(" {")[0], 60)


_MODELS: dict[str, Any] = {}


def _model(path: str) -> Any:
    if path not in _MODELS:
        module, name = path.split(":")
        _MODELS[path] = getattr(importlib.import_module(module), name)
    return _MODELS[path]


def expectation(case: Case) -> tuple[Expect, str | None]:
    """The case's expectation, tightened to ``reject`` when the server's own parsing must refuse the body."""
    if case.model is None or case.request.body is None or case.expect == "reject":
        return case.expect, None
    from pydantic import ValidationError

    try:
        data = json.loads(case.request.content() or b"")
    except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError, too many digits
        return "reject", "not JSON"
    if not isinstance(data, dict):
        return "reject", "not a JSON object"
    try:
        _model(case.model).model_validate(data)
    except ValidationError as exc:
        return "reject", f"fails {case.model.split(':')[1]}: {exc.errors()[0]['type']} at {exc.errors()[0]['loc']}"
    except Exception:  # noqa: BLE001 - a model that cannot even say why: the server decides
        return "any", None
    return case.expect, None


def _error_message(answer: bytes) -> str:
    try:
        data = json.loads(answer)
    except ValueError:
        return answer[:200].decode("utf-8", "replace")
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return f"{error.get('type')}: {error['message']}"
    return answer[:200].decode("utf-8", "replace")


def shape_problem(shape: str, status: int, headers: httpx.Headers, answer: bytes) -> str | None:
    """What is wrong with a 4xx body for the route's protocol, or None."""
    if "json" not in headers.get("content-type", ""):
        return f"content-type {headers.get('content-type')!r}, not JSON"
    try:
        data = json.loads(answer)
    except ValueError:
        return "body is not JSON"
    if not isinstance(data, dict):
        return "body is not an object"
    error = data.get("error")
    if shape == "anthropic":
        if data.get("type") != "error" or not isinstance(error, dict):
            return "not {type: error, error: {...}}" + (" (it is the OpenAI shape)" if isinstance(error, dict) else "")
        if not isinstance(error.get("message"), str) or error.get("type") not in ANTHROPIC_ERROR_TYPES:
            return f"error.type {error.get('type')!r} / error.message not as Anthropic has them"
        return None
    if not isinstance(error, dict):
        return "no error object"
    missing = [k for k in ("message", "type", "param", "code") if k not in error]
    if missing:
        return f"error lacks {', '.join(missing)}"
    if not isinstance(error["message"], str) or not isinstance(error["type"], str):
        return "error.message / error.type not strings"
    if error["param"] is not None and not isinstance(error["param"], str):
        return "error.param neither a string nor null"
    return None


def sse_events(answer: bytes) -> list[tuple[str | None, str]]:
    """(event name, data) for each event of an SSE body; comments skipped."""
    events: list[tuple[str | None, str]] = []
    name: str | None = None
    data: list[str] = []
    for line in re.split(r"\r\n|\r|\n", answer.decode("utf-8")):  # SSE's line ends only (not U+2028, \x85…)
        if not line:
            if data:
                events.append((name, "\n".join(data)))
            name, data = None, []
        elif line.startswith(":"):
            continue
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        events.append((name, "\n".join(data)))
    return events


def stream_problem(grammar: str | None, answer: bytes) -> tuple[str, str] | None:
    """(kind, detail) of what is wrong with a 200 event stream, or None."""
    try:
        events = sse_events(answer)
    except UnicodeDecodeError:
        return "stream", "not UTF-8"
    if not events:
        return "stream", "no events"
    payloads: list[Any] = []
    for name, data in events:
        if data == "[DONE]":
            payloads.append("[DONE]")
            continue
        try:
            payloads.append(json.loads(data))
        except ValueError:
            return "stream", f"an event's data is not JSON: {normalize(data, 60)}"
        obj = payloads[-1]
        error = obj.get("error") if isinstance(obj, dict) else None
        if name == "error" or (isinstance(obj, dict) and (obj.get("type") in ("error", "response.failed") or error)):
            if isinstance(obj, dict) and obj.get("type") == "response.failed":
                error = (obj.get("response") or {}).get("error")
            message = error.get("message", "") if isinstance(error, dict) else str(error)
            etype = error.get("type", error.get("code")) if isinstance(error, dict) else None
            kind = "5xx" if etype in (None, "server_error", "api_error", "internal_error") else "stream"
            return kind, f"error event in a 200 stream: {etype}: {normalize(str(message))}"
    last = payloads[-1]
    if grammar in ("chat", "completions"):
        if last != "[DONE]":
            return "stream", "does not end with data: [DONE]"
    elif grammar == "responses":
        ending = last.get("type") if isinstance(last, dict) else last
        if ending not in ("response.completed", "response.incomplete"):
            return "stream", f"ends with {ending!r}, not response.completed/incomplete"
    elif grammar == "anthropic":
        if events[-1][0] != "message_stop":
            return "stream", f"ends with event {events[-1][0]!r}, not message_stop"
    elif grammar == "transcription":
        ending = last.get("type") if isinstance(last, dict) else last
        if ending != "transcript.text.done":
            return "stream", f"ends with {ending!r}, not transcript.text.done"
    return None


def _send(client: httpx.Client, url: str, request: Request, timeout: float) -> tuple[int, httpx.Headers, bytes]:
    headers = dict(request.headers)
    with client.stream(request.method, url.rstrip("/") + request.path, content=request.content(), headers=headers,
                       timeout=httpx.Timeout(timeout, connect=10.0)) as response:
        chunks: list[bytes] = []
        size = 0
        for chunk in response.iter_raw():
            chunks.append(chunk)
            size += len(chunk)
            if size > READ_LIMIT:
                break
        return response.status_code, response.headers, b"".join(chunks)


def run_case(server: Server, case: Case, *, client: httpx.Client | None = None, timeout: float = 60.0) -> Verdict:
    """Send one case (after its prelude) and judge the answer; restarts the server if it died."""
    own = client is None
    client = client or httpx.Client()
    expect, why = expectation(case)
    verdict = Verdict(case, expect)
    failures = verdict.failures
    route = case.route
    try:
        if case.expect == "accept" and expect == "reject" and not case.labels:
            failures.append(Failure("generator", route, f"a valid body the model refuses: {why}"))
        for request in case.prelude:
            try:
                status, _, answer = _send(client, server.url, request, timeout)
            except httpx.HTTPError as exc:
                failures.append(Failure("prelude", route, f"{request.method} {request.path}: {type(exc).__name__}"))
                break
            if status >= 500 or (request.method == "POST" and status >= 300):
                failures.append(Failure("prelude", route, f"{request.method} {request.path}: {status}",
                                        _error_message(answer)))
        started = time.perf_counter()
        try:
            status, headers, answer = _send(client, server.url, case.request, timeout)
        except httpx.TimeoutException:
            failures.append(Failure("hang", route, f"no complete answer in {timeout:.0f} s"))
        except httpx.HTTPError as exc:
            # The connection broke: the server died (the check below says how) or it broke the protocol.
            failures.append(Failure("connection", route, f"{type(exc).__name__}", str(exc)[:300]))
        else:
            verdict.status, verdict.answer = status, answer
            _judge(verdict, headers, server)
        verdict.seconds = time.perf_counter() - started
    finally:
        if own:
            client.close()
        why_dead = server.check()
        if why_dead:
            cause = "; ".join(sorted({_label_kind(label) for label in case.labels})) or "valid body"
            failures[:] = [f for f in failures if f.kind != "connection"]
            kind = "wedged" if "completion" in why_dead else "crash"
            failures.append(Failure(kind, route, normalize(why_dead, 60),
                                    f"{why_dead}, after: {cause}\n    server log, last lines:\n      "
                                    + server.log_tail(12).replace("\n", "\n      ")))
            server.recover()
    return verdict


def _judge(verdict: Verdict, headers: httpx.Headers, server: Server) -> None:
    case, status, answer, expect = verdict.case, verdict.status or 0, verdict.answer, verdict.expect
    route, failures = case.route, verdict.failures
    kinds = "; ".join(sorted({_label_kind(label) for label in case.labels})) or "valid body"
    if status >= 500:
        cause = server.cause(answer)
        message = _error_message(answer) + (f"\n    server log: {cause}" if cause else "")
        if cause:  # the exception's type and the head of its message say which bug it is
            kind, _, said = cause.partition(": ")
            detail = f"{kind}: {' '.join(normalize(said).split()[:4])}"
        else:
            detail = normalize(_error_message(answer))
        failures.append(Failure("5xx", route, f"{status} {detail}", message))
        return
    if 400 <= status < 500:
        problem = shape_problem(case.shape, status, headers, answer)
        if problem:
            failures.append(Failure("shape", route, f"{status} error body: {problem}"))
        if expect == "accept":
            failures.append(Failure("status", route, f"{status} for a request that must succeed ({kinds}): "
                                    f"{normalize(_error_message(answer), 80)}", _error_message(answer)))
        return
    if not 200 <= status < 300:
        failures.append(Failure("status", route, f"status {status}"))
        return
    if expect == "reject":
        failures.append(Failure("status", route, f"{status} for a request that must be refused: {kinds}"))
    if "text/event-stream" in headers.get("content-type", ""):
        stream = stream_problem(case.grammar, answer)
        if stream:
            failures.append(Failure(stream[0], route, stream[1]))
    elif headers.get("content-type", "").startswith("audio/"):
        if not answer:
            failures.append(Failure("body", route, f"{status} audio answer is empty"))
    elif headers.get("content-type", "").split(";")[0] in TEXT_ANSWERS:  # transcripts as text or subtitles
        kind = headers["content-type"].split(";")[0]
        try:
            text = answer.decode("utf-8")
        except UnicodeDecodeError:
            failures.append(Failure("body", route, f"{status} {kind} answer is not UTF-8"))
        else:
            if kind == "text/vtt" and not text.startswith("WEBVTT"):
                failures.append(Failure("body", route, f"{status} text/vtt answer does not start with WEBVTT"))
    elif case.request.method not in ("HEAD", "OPTIONS"):
        try:
            json.loads(answer)
        except ValueError:
            failures.append(Failure("body", route, f"{status} answer is not JSON ({len(answer)} bytes)"))


# --------------------------------------------------------------------------- minimizing


ESSENTIALS = ("model", "messages", "prompt", "input", "max_tokens", "max_output_tokens")


def _smaller_bodies(body: Any, keep: tuple[tuple[Any, ...], ...] = ()) -> list[Any]:
    """Bodies one step simpler than ``body``: one key or element fewer, a shorter repeat, a plainer value.

    Paths in ``keep`` (what the case's mutations changed), their parents and their insides stay as they are."""
    from tests.fuzz.strategies import Many, Rep, del_at, get_at, paths, set_at

    def kept(path: tuple[Any, ...]) -> bool:
        return any(k[:len(path)] == path or path[:len(k)] == k for k in keep)

    out: list[Any] = []
    if isinstance(body, dict):  # big steps first: the essentials and what the mutations touched; then less
        for essentials in (ESSENTIALS, ()):
            smaller = {k: v for k, v in body.items() if k in essentials or kept((k,))}
            if len(smaller) < len(body):
                out.append(smaller)
    for path in sorted(paths(body), key=len):
        if kept(path):
            continue
        value = get_at(body, path)
        out.append(del_at(body, path))
        if isinstance(value, Many) and value.count > 1:
            out.append(set_at(body, path, Many(value.item, max(1, value.count // 10))))
        elif isinstance(value, Rep) and value.count > 1:
            out.append(set_at(body, path, Rep(value.unit, max(1, value.count // 10))))
        elif isinstance(value, str) and len(value) > 1 and path != ("model",):  # a model id stays one
            out.append(set_at(body, path, value[:1]))
        elif isinstance(value, (dict, list)) and len(json.dumps(value, default=str)) > 20:
            out.append(set_at(body, path, {} if isinstance(value, dict) else []))
    return out


def minimize(server: Server, case: Case, signature: tuple[str, str, str], *, budget: int = 60,
             crash_budget: int = 4, client: httpx.Client | None = None, timeout: float = 60.0,
             deadline: float | None = None) -> tuple[Case, Verdict | None]:
    """A simpler case with the same failure signature, and its verdict (None: found nothing simpler).

    Greedy: remove one part of the body at a time while the failure stays, within ``budget`` sends and, when
    each success costs a server restart (crash, wedged), ``crash_budget`` successes."""
    from dataclasses import replace

    if isinstance(case.request.body, (bytes, type(None))):
        return case, None
    left = budget
    restarts = crash_budget if signature[0] in ("crash", "wedged") else budget
    current, found = case, None
    improved = True
    while improved and left > 0:
        improved = False
        candidates = [replace(current, request=replace(current.request, body=b)) for b in
                      _smaller_bodies(current.request.body, current.touched)]
        if not current.request.ascii:
            candidates.insert(0, replace(current, request=replace(current.request, ascii=True)))
        for candidate in candidates:
            if left <= 0 or (deadline is not None and time.monotonic() > deadline):
                return current, found
            left -= 1
            verdict = run_case(server, candidate, client=client, timeout=timeout)
            if any(f.signature == signature for f in verdict.failures):
                current, found, improved = candidate, verdict, True
                restarts -= 1
                if restarts <= 0:
                    return current, found
                break
    return current, found


PRIORITY = ["generator", "crash", "wedged", "hang", "5xx", "connection", "stream", "shape", "status", "body", "prelude"]


class Collector:
    """Failures grouped by signature: how many cases hit each, and the smallest such case."""

    def __init__(self) -> None:
        self.hits: dict[tuple[str, str, str], int] = {}
        self.smallest: dict[tuple[str, str, str], Verdict] = {}

    def add(self, verdict: Verdict) -> list[Failure]:
        """Record a verdict's failures; returns those of a signature not seen before."""
        new = []
        for failure in verdict.failures:
            sig = failure.signature
            if sig not in self.hits:
                new.append(failure)
            self.hits[sig] = self.hits.get(sig, 0) + 1
            known = self.smallest.get(sig)
            case = verdict.case
            if known is None or (case.size(), len(case.labels)) < (known.case.size(), len(known.case.labels)):
                self.smallest[sig] = verdict
        return new

    def signatures(self) -> list[tuple[str, str, str]]:
        return sorted(self.hits, key=lambda s: (s[1], PRIORITY.index(s[0]) if s[0] in PRIORITY else 99, s[2]))

    def minimize(self, server: Server, *, client: httpx.Client | None = None, timeout: float = 60.0,
                 seconds: float = 300.0, budget: int = 60, crash_budget: int = 4) -> None:
        """Make each signature's case smaller, all within ``seconds``; a case shared by several signatures once."""
        deadline = time.monotonic() + seconds
        done: dict[int, Verdict] = {}
        for sig in self.signatures():
            verdict = self.smallest[sig]
            if id(verdict) in done:
                self.smallest[sig] = done[id(verdict)]
                continue
            if time.monotonic() > deadline:
                break
            _, smaller = minimize(server, verdict.case, sig, budget=budget, crash_budget=crash_budget, client=client,
                                  timeout=timeout, deadline=deadline)
            if smaller is not None:
                self.smallest[sig] = done[id(verdict)] = smaller

    def report(self, url: str) -> str:
        lines = [f"{len(self.hits)} distinct failures:"]
        for n, sig in enumerate(self.signatures(), 1):
            lines.append(f"\n[{n}] {sig[0]} on {sig[1]}: {sig[2]}  ({self.hits[sig]} cases)")
            lines.append("    " + self.smallest[sig].report(url, only=sig).replace("\n", "\n    "))
        return "\n".join(lines)
