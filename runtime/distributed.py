"""One model served by a group of processes with ``mlx.distributed`` (ring over TCP, and the other backends).

Theory of operation
-------------------
The ranks of a group are started with ``mlx.launch``'s conventions: each gets
``MLX_RANK`` and ``MLX_HOSTFILE`` (for the ring backend a JSON list, per rank,
of the ``ip:port`` addresses it listens on) in its environment, and joins with
``mx.distributed.init``. Rank 0 is the server's own process (HTTP, tokenizer,
templates, parsers, scheduling); ranks above 0 are followers
(``python -m runtime.rank``, see :func:`follow`).

Joining (:func:`join`): every rank reports its versions (flow, mlx, mlx-lm, a
digest of its runtime code) and its model's digest (config, weight file sizes
and safetensors headers); the reports are gathered and compared **before any
weight is read**, and a mismatch is refused on every rank with one message that
names what differs. Then each rank loads its shard: ``model.shard(group)`` for
tensor parallelism, the model's pipeline mixin for pipeline parallelism (lazy
loading reads only the layers a rank keeps).

Running: every rank runs the same :class:`runtime.engine.Engine` step by step.
Rank 0 sends each step's decisions (:mod:`runtime.replication`) with
:class:`Broadcast`, which carries them over the group's own collectives — MLX
has no broadcast, so it is an ``all_sum`` of a byte buffer that only rank 0
fills (a second one when a message is longer than the first's room). The same
all-sum carries, in slots of their own, every rank's running figures (steps,
step seconds, collective seconds, bytes), so rank 0 shows all ranks' numbers
without another collective.

Supervision: a collective over a lost peer raises (the ring backend: "connection
to a peer was lost"); rank 0's engine then fails every sequence and stops. But
not for long: MLX's ring backend (0.32) fails a socket's pending transfers once
and ends that socket's thread, so a collective issued on it afterwards — often
the next all-sum of the same forward pass — waits for good, and rank 0's device
thread with it (two ranks on loopback, a peer killed by SIGKILL: the third
single all-sum after the kill never returns; with 8 in one evaluation, the first
evaluation never does). So the supervisor (``flow.resources.cluster``) never
relies on the device thread once a rank is gone: it ends the streams from trio
(:meth:`runtime.engine.Engine.end_streams`) and gives the device thread a
bounded time to come back (:func:`settle`). A collective that hangs (a peer
stopped, not gone) is the watchdog's: the supervisor kills the followers when a
step or a heartbeat has been in flight longer than ``watchdog_seconds``; a
follower ends itself when it has heard nothing for that long, or when its
parent process is gone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from runtime.replication import HEARTBEAT, STOP, GroupLost, StepMessage, decode, encode

if TYPE_CHECKING:
    import mlx.core as mx

    from runtime.device import DeviceThread
    from runtime.engine import Engine
    from runtime.models import LoadedModel
    from runtime.prefix_cache import PrefixCache

log = logging.getLogger("flow.distributed")

Parallel = Literal["tensor", "pipeline"]
Backend = Literal["ring", "jaccl", "mpi", "nccl", "any"]

HEAD = 1024  # bytes of a message the first all-sum carries (a step with a short new prompt fits)
SLOT = 40  # bytes of each rank's figures in it: steps, step/collective seconds, bytes, sequences (5 float64)
REPORT_BYTES = 2048  # a rank's versions-and-digest report, zero-padded


@dataclass(frozen=True)
class RankSpec:
    """What every rank must agree on to run the same engine: given to the followers as JSON."""

    path: str  # the model directory (the same files on every host)
    parallel: Parallel = "tensor"
    backend: Backend = "ring"
    max_batch: int = 32
    prefill_chunk: int = 512
    strategy: str = "decode_first"
    max_queue: int = 256
    prefill_burst: int = 4
    prefix_block_tokens: int | None = None  # rank 0 has a prefix cache with blocks of this many tokens
    prefix_hot_bytes: int = 2 << 30
    watchdog_seconds: float = 60.0

    def json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def of_json(cls, text: str) -> RankSpec:
        return cls(**json.loads(text))


# ---------------------------------------------------------------------------------------------- joining
def report(path: Path) -> dict[str, str]:
    """This rank's versions and its model's digest, compared across ranks before anything loads."""
    from importlib.metadata import version

    return {"flow": _flow_version(), "runtime_code": _code_digest(), "mlx": version("mlx"),
            "mlx_lm": version("mlx-lm"), "model": model_digest(path)}


def _flow_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flow-server")
    except PackageNotFoundError:
        return "source"


def _code_digest() -> str:
    """The runtime and protocols code this rank runs: ranks on other versions would schedule differently."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for folder in ("runtime", "protocols"):
        for file in sorted((root / folder).rglob("*.py")):
            digest.update(str(file.relative_to(root)).encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()[:16]


def model_digest(path: Path) -> str:
    """The model's config and, per weight file, its size and safetensors header (names, dtypes, shapes,
    offsets): cheap for a model of any size, and different for any other checkpoint."""
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for file in sorted(path.glob("*.safetensors")):
        with file.open("rb") as f:
            head = f.read(8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            digest.update(file.name.encode() + struct.pack("<Q", file.stat().st_size) + f.read(min(size, 1 << 24)))
    return digest.hexdigest()[:16]


def compare_reports(reports: list[dict[str, str]]) -> str | None:
    """What differs between the ranks' reports (None: they agree), said so that one can act on it."""
    problems = []
    for key in reports[0]:
        values = [r.get(key, "?") for r in reports]
        if len(set(values)) > 1:
            what = "model files" if key == "model" else f"{key} version"
            problems.append(f"{what} differ: " + ", ".join(f"rank {i} {v}" for i, v in enumerate(values)))
    if not problems:
        return None
    return ("the ranks of the group do not match (" + "; ".join(problems) + "); install the same flow, mlx and "
            "mlx-lm and copy the same model files to every host, then start the group again")


_joined: list[str] = []  # the group this process joined (MLX forms one per process)


def init_group(backend: Backend) -> mx.distributed.Group:
    """Join the group the environment describes (MLX_RANK, MLX_HOSTFILE, …), once per process."""
    import mlx.core as mx

    if _joined:
        # mx.distributed.init does not form a second group in a process: it would reuse the first's connections.
        raise GroupLost(f"this process already joined a group ({_joined[0]}); a model's group is started again "
                        "by restarting the server")
    _joined.append(f"{backend}, rank {os.environ.get('MLX_RANK', '?')}")
    group = mx.distributed.init(strict=True, backend=backend)
    if group.size() < 2:
        raise GroupLost(f"mx.distributed.init({backend!r}) gave a group of one rank: check MLX_HOSTFILE")
    return group


def join(group: mx.distributed.Group, path: Path) -> None:
    """Compare every rank's report; raises :class:`GroupLost` (on every rank alike) when they differ."""
    import mlx.core as mx

    mine = json.dumps(report(path)).encode()[:REPORT_BYTES]
    buffer = np.zeros(REPORT_BYTES, dtype=np.uint8)
    buffer[: len(mine)] = np.frombuffer(mine, dtype=np.uint8)
    gathered = mx.distributed.all_gather(mx.array(buffer), group=group, stream=mx.cpu)
    rows = np.array(gathered, copy=False).reshape(group.size(), REPORT_BYTES)
    reports = [json.loads(bytes(row).rstrip(b"\0")) for row in rows]
    problem = compare_reports(reports)
    if problem is not None:
        raise GroupLost(problem)


def load_shard(path: Path, group: mx.distributed.Group, parallel: Parallel) -> Any:
    """This rank's part of the model: its share of every layer (tensor) or its layers (pipeline)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(path, lazy=True, strict=False)
    if parallel == "tensor":
        if not hasattr(model, "shard"):
            raise GroupLost(f"{path.name}: mlx-lm has no tensor parallelism for {type(model).__module__}; "
                            "try parallel = \"pipeline\"")
        model.shard(group)
    else:
        inner = _pipeline_module(model)
        if inner is None:
            raise GroupLost(f"{path.name}: mlx-lm has no pipeline parallelism for {type(model).__module__}; "
                            "try parallel = \"tensor\"")
        inner.pipeline(group)
    mx.eval(model.parameters())
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))  # every rank has loaded
    return model


def _pipeline_module(model: Any) -> Any:
    for inner in (getattr(model, "model", None), getattr(getattr(model, "language_model", None), "model", None)):
        if inner is not None and hasattr(inner, "pipeline"):
            return inner
    return None


def shard_namespace(path: Path, spec: RankSpec, rank: int, size: int) -> bytes:
    """Prefix-cache keys of a rank's shard: never those of the whole model (or of another split of it)."""
    from runtime.models import model_identity
    from runtime.prefix_cache import namespace_of

    return namespace_of(f"{model_identity(path)}|{spec.parallel}|rank {rank} of {size}")


# ---------------------------------------------------------------------------------------------- the step message
@dataclass
class RankFigures:
    """One rank's running figures, as the last exchange brought them to rank 0."""

    steps: int = 0
    step_seconds: float = 0.0
    collective_seconds: float = 0.0
    bytes: int = 0
    sequences: int = 0  # in its engine (batch, prefilling, waiting)


@dataclass
class Broadcast:
    """A :class:`runtime.replication.Replicator` over the group's collectives (one per rank)."""

    group: Any  # mx.distributed.Group
    watchdog_seconds: float = 60.0
    mine: RankFigures = field(default_factory=RankFigures)
    ranks: list[RankFigures] = field(default_factory=list)  # rank 0: every rank's, from the last exchange
    busy_since: float | None = None  # rank 0: a step or heartbeat in flight since (the watchdog reads it)
    heard: float = field(default_factory=time.monotonic)  # a follower: when a message last arrived
    last: float = field(default_factory=time.monotonic)  # when the last exchange ended (rank 0's heartbeats)
    held: Callable[[], int] | None = None  # this rank's engine's sequences, for the figures
    _step_started: float | None = None
    _seconds: float = 0.0  # the last exchange's

    def __post_init__(self) -> None:
        self.ranks = [RankFigures() for _ in range(self.group.size())]

    @property
    def leader(self) -> bool:
        return bool(self.group.rank() == 0)

    def exchange(self, message: StepMessage | None) -> StepMessage:
        if self.leader:
            assert message is not None
            self.busy_since = self._step_started = time.monotonic()
            self._send(encode(message))
            return message
        while True:
            waiting = time.monotonic()
            received = decode(self._send(b"", counted=False))
            self.heard = time.monotonic()
            if received.kind == "stop":
                raise GroupLost("rank 0 stopped the group")
            if received.kind == "step":
                # Its step began with this wait (a wait that ended in a heartbeat was this rank idling).
                self.mine.collective_seconds += self._seconds
                self._step_started = waiting
                return received

    def step_done(self) -> None:
        if self._step_started is not None:
            self.mine.steps += 1
            self.mine.step_seconds += time.monotonic() - self._step_started
            self._step_started = None
        self.busy_since = None

    def heartbeat(self) -> None:
        """Rank 0, idle: show the followers it is alive (and learn whether they are)."""
        self.busy_since = time.monotonic()
        try:
            self._send(encode(HEARTBEAT))
        finally:
            self.busy_since = None

    def stop(self) -> None:
        """Rank 0: end the followers' loops."""
        self._send(encode(STOP))

    def _send(self, payload: bytes, counted: bool = True) -> bytes:
        """All-sum a buffer that rank 0 fills with ``payload`` (its length first) and each rank with its
        figures in its own slot; returns the payload and keeps every rank's figures."""
        import mlx.core as mx

        size, rank = self.group.size(), self.group.rank()
        started = time.perf_counter()
        buffer = np.zeros(HEAD + SLOT * size, dtype=np.uint8)
        if rank == 0:
            buffer[:4] = np.frombuffer(struct.pack("<I", len(payload)), dtype=np.uint8)
            first = payload[: HEAD - 4]
            buffer[4 : 4 + len(first)] = np.frombuffer(first, dtype=np.uint8)
        m = self.mine
        m.sequences = self.held() if self.held is not None else 0
        buffer[HEAD + SLOT * rank : HEAD + SLOT * (rank + 1)] = np.frombuffer(
            struct.pack("<5d", m.steps, m.step_seconds, m.collective_seconds, m.bytes, m.sequences), dtype=np.uint8)
        summed = np.array(mx.distributed.all_sum(mx.array(buffer), group=self.group, stream=mx.cpu))
        length = struct.unpack("<I", summed[:4].tobytes())[0]
        data = summed[4 : 4 + min(length, HEAD - 4)].tobytes()
        sent = buffer.nbytes
        if length > HEAD - 4:  # the rest of a long message
            rest = np.zeros(length - (HEAD - 4), dtype=np.uint8)
            if rank == 0:
                rest[:] = np.frombuffer(payload[HEAD - 4 :], dtype=np.uint8)
            data += np.array(mx.distributed.all_sum(mx.array(rest), group=self.group, stream=mx.cpu)).tobytes()
            sent += rest.nbytes
        for r in range(size):
            steps, step_s, coll_s, nbytes, seqs = struct.unpack(
                "<5d", summed[HEAD + SLOT * r : HEAD + SLOT * (r + 1)].tobytes())
            self.ranks[r] = RankFigures(int(steps), step_s, coll_s, int(nbytes), int(seqs))
        self._seconds = time.perf_counter() - started
        if counted:
            m.collective_seconds += self._seconds
        self.last = time.monotonic()
        m.bytes += sent
        self.ranks[rank] = RankFigures(m.steps, m.step_seconds, m.collective_seconds, m.bytes, m.sequences)
        return data

    def stats_json(self) -> list[dict[str, Any]]:
        """Per rank: steps, seconds per step, collective seconds and share, bytes the step messages took (the
        model's own collectives run inside its forward passes, counted in step time)."""
        out = []
        for r, f in enumerate(self.ranks):
            out.append({"rank": r, "steps": f.steps, "step_seconds": round(f.step_seconds, 3),
                        "step_ms_mean": round(1000 * f.step_seconds / f.steps, 3) if f.steps else None,
                        "collective_seconds": round(f.collective_seconds, 3),
                        "collective_share": round(f.collective_seconds / f.step_seconds, 3) if f.step_seconds
                        else None, "bytes": f.bytes, "sequences": f.sequences})
        return out


# ---------------------------------------------------------------------------------------------- rank 0
def load_leader(name: str, spec: RankSpec, device: DeviceThread, prefix: PrefixCache | None,
                engine_config: Any) -> tuple[LoadedModel, Broadcast]:
    """Rank 0: join the group, check it, load this rank's shard and the tokenizer, and build the engine
    (blocking the caller; the followers must be starting)."""
    from runtime.engine import Engine
    from runtime.models import LoadedModel, _allow_context_length

    path = Path(spec.path)

    def _load() -> tuple[Any, Any, int, Broadcast]:
        from mlx.utils import tree_flatten
        from mlx_lm.tokenizer_utils import load as load_tokenizer

        from runtime.detokenizers import use_exact_detokenizer

        group = init_group(spec.backend)
        join(group, path)
        model = load_shard(path, group, spec.parallel)
        config = json.loads((path / "config.json").read_text())
        tokenizer = load_tokenizer(path, {"trust_remote_code": True}, eos_token_ids=config.get("eos_token_id"))
        use_exact_detokenizer(tokenizer)
        leaves: Any = tree_flatten(model.parameters())
        return model, tokenizer, sum(v.nbytes for _, v in leaves), Broadcast(group, spec.watchdog_seconds)

    log.info("loading model %s across ranks (%s parallel, %s backend) from %s …", name, spec.parallel,
             spec.backend, path)
    start = time.perf_counter()
    model, tokenizer, weight_bytes, broadcast = device.call(_load)
    config = json.loads((path / "config.json").read_text())
    engine: Engine = Engine(model, device, engine_config, prefix, shard_namespace(path, spec, 0, broadcast.group.size()),
                            broadcast)
    broadcast.held = lambda: engine.active + engine.waiting
    loaded = LoadedModel(name, path, model, tokenizer, engine, config, time.perf_counter() - start, weight_bytes)
    _allow_context_length(tokenizer, loaded.context_length)
    return loaded, broadcast


def heartbeat(engine: Engine, broadcast: Broadcast) -> None:
    """A device-thread job: rank 0's idle heartbeat; a lost group fails the engine's sequences."""
    if engine.lost is not None:
        return
    try:
        broadcast.heartbeat()
    except Exception as exc:
        engine.group_lost(exc)


def settle(engine: Engine) -> None:
    """A device-thread job once the group is lost: the engine fails what it still holds and frees it, starting
    no collective. That it runs at all tells the supervisor the device thread is free (not blocked for good in
    a collective over the lost peer)."""
    if engine.lost is not None:
        engine.group_lost(engine.lost)


def stop_group(engine: Engine, broadcast: Broadcast) -> None:
    """A device-thread job: tell the followers to end (when the group still stands)."""
    if engine.lost is None:
        try:
            broadcast.stop()
        except Exception as exc:  # they are gone already: nothing to tell
            log.info("distributed: followers already gone (%s)", exc)
        engine.group_lost(GroupLost("the server stopped the model's group"))


# ---------------------------------------------------------------------------------------------- followers
def follow(spec: RankSpec, device: DeviceThread) -> None:
    """A follower rank: join, check, load its shard, then replay rank 0's steps until told to stop.

    Runs as one device-thread job (the engine is not a stepper here: it steps when a message says so)."""
    from runtime.engine import Engine
    from runtime.engine_config import EngineConfig
    from runtime.prefix_cache import PrefixCache, PrefixConfig

    path = Path(spec.path)
    group = init_group(spec.backend)
    log.info("rank %d of %d: checking the group", group.rank(), group.size())
    join(group, path)
    model = load_shard(path, group, spec.parallel)
    log.info("rank %d: shard of %s loaded (%s parallel)", group.rank(), path.name, spec.parallel)
    # Memory only: rank 0's disk tier is off in distributed mode, so both hold what the same steps stored.
    prefix = (PrefixCache(PrefixConfig(block_tokens=spec.prefix_block_tokens, hot_bytes=spec.prefix_hot_bytes))
              if spec.prefix_block_tokens is not None else None)
    broadcast = Broadcast(group, spec.watchdog_seconds)
    config = EngineConfig(spec.max_batch, spec.prefill_chunk, spec.strategy,  # type: ignore[arg-type]
                          spec.max_queue, prefill_burst=spec.prefill_burst)
    engine = Engine(model, device, config, prefix, shard_namespace(path, spec, group.rank(), group.size()),
                    broadcast)
    device.remove_stepper(engine)  # it steps on rank 0's messages only
    broadcast.held = lambda: engine.active + engine.waiting
    _watch(broadcast)
    while True:
        try:
            engine.step()
        except GroupLost as exc:
            log.info("rank %d: %s", group.rank(), exc)
            return


def _watch(broadcast: Broadcast) -> None:
    """A follower's watchdog: end the process when rank 0 has been silent for ``watchdog_seconds`` (it sends
    heartbeats when idle) or the process that started this one is gone."""
    parent = os.getppid()

    def run() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                log.error("rank %d: the server that started it is gone; exiting", broadcast.group.rank())
                os._exit(3)
            silent = time.monotonic() - broadcast.heard
            if silent > broadcast.watchdog_seconds:
                log.error("rank %d: nothing from rank 0 for %.0f s; exiting", broadcast.group.rank(), silent)
                os._exit(3)

    threading.Thread(target=run, name="flow-rank-watchdog", daemon=True).start()
