"""Starting and supervising the ranks of a distributed model (``[resources.*] distributed = {...}``).

Theory of operation
-------------------
``flow serve`` is rank 0 of the group: the model resource, when it loads,
starts the other ranks itself (:meth:`Cluster.start`) as child processes
running ``python -m runtime.rank`` with ``mlx.launch``'s environment
conventions — ``MLX_RANK``, and ``MLX_HOSTFILE`` naming a file with, per rank,
the ``ip:port`` addresses the ring backend listens on — and sets the same
variables in its own environment before rank 0 joins on the device thread
(:func:`runtime.distributed.load_leader`). Ranks a hostfile puts on other hosts
are started as ``mlx.launch`` starts them: ``ssh -tt HOST SCRIPT``, the script
writing the addresses to a file of its own and becoming the rank (``exec``);
ending the ssh ends the remote session, and the rank with it.

Supervision is one trio task per group (:meth:`Cluster.supervise`), every
``POLL_SECONDS``:

* a rank that exited (killed, crashed, refused the group) → a clear log line,
  the other ranks stopped by PID;
* a step or heartbeat in flight longer than ``watchdog_seconds`` (a rank stopped,
  not gone) → the same, by killing the ranks;
* rank 0's engine saw a collective fail → the same;
* rank 0 idle for ``heartbeat_seconds`` → a heartbeat on the device thread, so a
  lost rank is noticed before the next request, and followers know rank 0 lives.

Once the group is down, nothing waits for rank 0's device thread: a collective
over the lost peer may hold it for good (see :mod:`runtime.distributed`). The
supervisor ends every in-flight stream of the model from trio, with an error
event in its protocol; new requests get 503 and ``/health`` shows the model not
ready. The device thread then has ``SETTLE_SECONDS`` to free the engine; past
that it is reported stuck (``/health``: ``distributed.device_thread``), the
model is dropped without freeing its memory, and only a new process — the
re-execution ``restart = true`` asks for, or a restart by hand — frees it.

Stopping the server stops every rank (:meth:`Cluster.stop`): a ``stop`` message
first, then SIGTERM and SIGKILL by PID for any that did not end. Followers also
end by themselves when their parent process is gone (no orphans, whatever
killed ``flow serve``).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from runtime.replication import GroupLost

if TYPE_CHECKING:
    from runtime.device import DeviceThread
    from runtime.distributed import Broadcast, RankSpec
    from runtime.engine import Engine

log = logging.getLogger("flow.resources.cluster")

POLL_SECONDS = 0.25
SETTLE_SECONDS = 5.0  # a lost group's device thread has this long to come back from its last collective
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


class ClusterError(Exception):
    """The group cannot be started as configured; the message says what to change."""


@dataclass(frozen=True)
class Placement:
    """Where each rank runs: its listen addresses (``ip:port``) for the ring backend, and for ranks on other
    machines the host to reach over ssh."""

    addresses: list[list[str]]
    ssh_hosts: list[str | None] = field(default_factory=list)  # per rank: ssh destination (None: this machine)

    @classmethod
    def local(cls, ranks: int) -> Placement:
        """``ranks`` ranks on this machine, each on a free loopback port."""
        return cls([[f"127.0.0.1:{_free_port()}"] for _ in range(ranks)])

    @classmethod
    def from_hostfile(cls, path: Path, starting_port: int = 32323) -> Placement:
        """An ``mlx.launch`` hostfile (a list of hosts, or ``{"hosts": [...]}``, each with ``ips``): the ring
        addresses as ``mlx.launch`` gives them (one port per rank, counting up from ``starting_port``)."""
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ClusterError(f"cannot read the hostfile {path}: {exc}") from None
        hosts = data.get("hosts") if isinstance(data, dict) else data
        if not isinstance(hosts, list) or len(hosts) < 2:
            raise ClusterError(f"the hostfile {path} must list at least two hosts "
                               '(mlx.launch\'s format: [{"ssh": "host", "ips": ["10.0.0.1"]}, ...])')
        addresses: list[list[str]] = []
        ssh_hosts: list[str | None] = []
        port = starting_port
        for i, host in enumerate(hosts):
            ips = host.get("ips") if isinstance(host, dict) else None
            if not ips or not isinstance(ips, list):
                raise ClusterError(f"hosts[{i}] of {path} has no \"ips\": the ring backend needs an IP per host")
            addresses.append([f"{ips[0]}:{port}"])
            ssh_hosts.append(None if ips[0] in LOCAL_HOSTS else str(host.get("ssh") or ips[0]))
            port += 1
        if ssh_hosts[0] is not None:
            raise ClusterError(f"hosts[0] of {path} is {ssh_hosts[0]}: rank 0 is the server itself, so the first "
                               "host must be this machine (127.0.0.1, or start flow serve there)")
        return cls(addresses, ssh_hosts)

    @property
    def ranks(self) -> int:
        return len(self.addresses)

    def remote(self) -> list[int]:
        """The ranks not on this machine."""
        return [r for r, h in enumerate(self.ssh_hosts) if h is not None]


@dataclass
class Cluster:
    """The follower processes of one distributed model, and their supervision."""

    name: str  # the model's
    placement: Placement
    heartbeat_seconds: float = 1.0
    ssh: str = "ssh"  # the command that reaches the other hosts (as mlx.launch does)
    python: str | None = None  # the interpreter on the other hosts (default: this one's path)
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)  # rank → its process
    down: str | None = None  # why the group is down (None: up, or not started)
    stuck: str | None = None  # once down: why rank 0's device thread is taken as blocked for good (None: it is free)
    _hostfile: Path | None = None

    def start(self, spec: RankSpec) -> None:
        """Start ranks 1.. (here, or on their hosts over ssh) and put rank 0's variables in this process's
        environment."""
        if shutil.which(self.ssh.split()[0]) is None and self.placement.remote():
            raise ClusterError(f"ranks {self.placement.remote()} are on other hosts and {self.ssh!r} is not a "
                               "command here; set distributed.ssh")
        fd, name = tempfile.mkstemp(prefix="flow-ranks-", suffix=".json")  # private: 0600
        with os.fdopen(fd, "w") as f:
            json.dump(self.placement.addresses, f)
        self._hostfile = Path(name)
        root = str(Path(__file__).resolve().parents[2])
        pythonpath = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        command = [sys.executable, "-m", "runtime.rank", spec.json()]
        for rank in range(1, self.placement.ranks):
            host = self.placement.ssh_hosts[rank] if self.placement.ssh_hosts else None
            if host is None:
                env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": name, "PYTHONPATH": pythonpath}
                self.procs[rank] = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL)
            else:
                # mlx.launch's way: a shell on the host writes the ring addresses to a file of its own and
                # becomes the rank. -tt: when this ssh ends, the host's session (and the rank) gets SIGHUP.
                script = (f"cd {shlex.quote(os.getcwd())} 2>/dev/null; export MLX_RANK={rank} "
                          f"PYTHONPATH={shlex.quote(pythonpath)}; MLX_HOSTFILE=$(mktemp); export MLX_HOSTFILE; "
                          f"printf %s {shlex.quote(json.dumps(self.placement.addresses))} > $MLX_HOSTFILE; "
                          f"exec {shlex.join([self.python or sys.executable, *command[1:]])}")
                self.procs[rank] = subprocess.Popen([*shlex.split(self.ssh), "-tt", host, script],
                                                    stdin=subprocess.DEVNULL)
            log.info("model %s: rank %d started (pid %d%s)", self.name, rank, self.procs[rank].pid,
                     f", over {self.ssh} on {host}" if host else "")
        os.environ["MLX_RANK"] = "0"
        os.environ["MLX_HOSTFILE"] = name

    def exited(self) -> str | None:
        """A rank that is gone, said as the log says it (None: all run)."""
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
                return f"rank {rank} (pid {proc.pid}) {how}"
        return None

    async def supervise(self, engine: Engine, broadcast: Broadcast, device: DeviceThread) -> None:
        """Watch the group until it is down (see the module's doc); then the ranks are stopped."""
        from runtime.distributed import heartbeat

        beat: trio.Event | None = None
        while self.down is None and engine.lost is None:
            await trio.sleep(POLL_SECONDS)
            gone = self.exited()
            busy = broadcast.busy_since
            if gone is not None:
                self._lose(f"{gone}; the model's group is down")
            elif busy is not None and time.monotonic() - busy > broadcast.watchdog_seconds:
                self._lose(f"a collective has waited {time.monotonic() - busy:.0f} s (watchdog_seconds "
                           f"{broadcast.watchdog_seconds:g}); stopping the model's group")
            elif (busy is None and not engine.has_work() and (beat is None or beat.is_set())
                  and time.monotonic() - broadcast.last > self.heartbeat_seconds):
                beat = trio.Event()
                future = device.submit(lambda: heartbeat(engine, broadcast))
                token = trio.lowlevel.current_trio_token()
                done = beat
                future.add_done_callback(lambda _: _set_soon(token, done))
        if self.down is None and engine.lost is not None:
            await trio.sleep(POLL_SECONDS)  # a rank's death is the better reason, when its exit is in by now
            gone = self.exited()
            self._lose(f"{gone}; the model's group is down" if gone is not None else str(engine.lost))
        await self.wind_down(engine, device)

    async def wind_down(self, engine: Engine, device: DeviceThread) -> None:
        """The group is down: end the model's streams now, from trio, then let the device thread free what the
        engine holds, for at most ``SETTLE_SECONDS``. Never waits longer for the device thread: it may be blocked
        for good in a collective over the lost peer (see runtime.distributed); past that time it is taken as
        stuck (:attr:`stuck` says so, and only a new process frees it)."""
        from runtime.device import wait_future
        from runtime.distributed import settle

        assert self.down is not None
        engine.end_streams(GroupLost(self.down))
        future = device.submit(lambda: settle(engine))
        with trio.move_on_after(SETTLE_SECONDS):
            try:
                await wait_future(future)
            except Exception as exc:  # noqa: BLE001 - the group is down either way
                log.warning("model %s: freeing the engine after the group was lost failed: %s", self.name, exc)
            return
        self.stuck = (f"rank 0's device thread has not come back from a collective of the model's group in "
                      f"{SETTLE_SECONDS:g} s (a collective over a lost peer may never end); the model's memory and the "
                      "device thread are freed when the server process restarts")
        log.error("model %s: %s", self.name, self.stuck)
        device.abandon(f"model {self.name!r}: {self.stuck}")  # the thread's other models are stuck too: none waits

    def _lose(self, reason: str) -> None:
        self.down = reason
        log.error("model %s: %s", self.name, reason)
        self.kill()

    def stop(self, engine: Engine | None, broadcast: Broadcast | None, device: DeviceThread | None) -> None:
        """The server stops: tell the followers, then make sure every one has ended (by PID)."""
        if engine is not None and broadcast is not None and device is not None and self.down is None:
            from runtime.distributed import stop_group

            try:
                device.submit(lambda: stop_group(engine, broadcast)).result(timeout=5)
            except Exception as exc:  # a stuck device thread: the ranks are stopped by signal below
                log.warning("model %s: could not tell the ranks to stop (%s)", self.name, exc)
        self.down = self.down or "stopped"
        deadline = time.monotonic() + 3
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """SIGTERM, then SIGKILL, every rank still running; wait for each (no zombies)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 3
        for rank, proc in self.procs.items():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                log.warning("model %s: rank %d (pid %d) killed", self.name, rank, proc.pid)
        if self._hostfile is not None:
            self._hostfile.unlink(missing_ok=True)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ranks": self.placement.ranks, "state": "up" if self.down is None else "down",
                               "down_reason": self.down, "pids": {str(r): p.pid for r, p in self.procs.items()}}
        if self.stuck is not None:
            out["device_thread"] = self.stuck
        return out


def _set_soon(token: trio.lowlevel.TrioToken, event: trio.Event) -> None:
    try:
        token.run_sync_soon(event.set)
    except trio.RunFinishedError:
        pass


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
