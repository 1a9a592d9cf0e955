"""``python -m flow.cli.tethered PARENT_PID ARGS…``: the ``flow ARGS…`` command, ended when process PARENT_PID
(the one that started it) ends, however it ends (SIGKILL included).

``flow launch`` starts its ``flow serve`` this way. The server runs in a session of its own (the terminal's Ctrl-C
is the client's), so nothing else would end it when launch is killed: a ``kill -9``, a test's timeout or an
out-of-memory kill would leave it running, holding its port, its memory and the model. Tethered, it gets SIGTERM
when launch goes, which is ``flow serve``'s graceful drain.

* **Linux:** the kernel's parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGTERM)``), set by the process itself.
  It is kept across ``execve`` (``flow serve`` re-executes itself once to preload OpenBLAS), costs nothing while
  the parent lives, and fires when it dies. It is set here rather than in a ``preexec_fn`` of launch's
  ``Popen``: nothing runs between fork and exec, and the same module serves the other platforms.
* **Elsewhere (macOS):** no such signal; a daemon thread looks at ``getppid()`` once a second. A process whose
  parent ended is re-parented (to launchd, init or a subreaper), so a parent id other than PARENT_PID means the
  parent is gone. No re-exec happens there (the OpenBLAS preload is Linux's), so the thread lives as long as the
  server.
* **The race:** a parent that died before the signal was set up is seen by the same ``getppid()`` test, made once
  after it is set; the process then ends at once, before flow starts.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
POLL_S = 1.0


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)


def tether(parent: int) -> None:
    """SIGTERM to this process when ``parent`` (its parent now) ends; ended at once if it has ended already."""
    linux = False
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        linux = libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0
    if os.getppid() != parent:
        sys.exit(f"flow: the process that started this one ({parent}) has ended; not starting")
    if not linux:
        threading.Thread(target=_watch, args=(parent,), name="flow-tether", daemon=True).start()


def main() -> None:
    if len(sys.argv) < 3 or not sys.argv[1].isdigit():
        sys.exit("usage: python -m flow.cli.tethered PARENT_PID FLOW_ARGS…")
    tether(int(sys.argv[1]))
    sys.argv = ["flow", *sys.argv[2:]]
    from flow.cli.main import run

    run()


if __name__ == "__main__":
    main()
