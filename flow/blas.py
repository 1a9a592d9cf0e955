"""The OpenBLAS fast path for MLX on Linux CPUs.

The Linux ``mlx[cpu]`` wheel links a reference BLAS; preloading OpenBLAS makes
its matrix products 30–60× faster. ``flow`` re-executes itself once with
``LD_PRELOAD`` set when OpenBLAS is installed, and otherwise says how to get it.
Set ``FLOW_OPENBLAS=0`` to opt out.
"""

from __future__ import annotations

import glob
import logging
import os
import platform
import sys

log = logging.getLogger("flow.blas")

CANDIDATES = (
    "/usr/lib/{arch}-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/{arch}-linux-gnu/openblas-openmp/libblas.so.3",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/{arch}-linux-gnu/libopenblas.so.0",
)
INSTALL_HINT = "sudo apt-get install libopenblas0-pthread   (Fedora: sudo dnf install openblas)"


def find_openblas() -> str | None:
    arch = platform.machine()
    for pattern in CANDIDATES:
        for path in glob.glob(pattern.format(arch=arch)):
            if os.path.exists(path):
                return path
    return None


def openblas_active() -> bool:
    return any("blas" in p for p in os.environ.get("LD_PRELOAD", "").split(":") if p)


def preload_env(env: dict[str, str] | None = None) -> dict[str, str] | None:
    """An environment with OpenBLAS preloaded, or None when not applicable or not found."""
    env = dict(os.environ if env is None else env)
    if sys.platform != "linux" or env.get("FLOW_OPENBLAS") == "0" or openblas_active():
        return None
    path = find_openblas()
    if path is None:
        return None
    env["LD_PRELOAD"] = ":".join(p for p in (path, env.get("LD_PRELOAD", "")) if p)
    return env


def reexec_with_openblas() -> None:
    """Replace this process with itself under OpenBLAS, once; no-op when not useful."""
    if os.environ.get("FLOW_BLAS_REEXEC") == "1":
        return
    env = preload_env()
    if env is None:
        return
    env["FLOW_BLAS_REEXEC"] = "1"
    os.execve(sys.executable, [sys.executable, "-m", "flow.cli", *sys.argv[1:]], env)


def advise() -> None:
    """Log how fast MLX matrix products will be on this machine."""
    if sys.platform != "linux" or os.environ.get("FLOW_OPENBLAS") == "0":
        return
    if openblas_active():
        log.info("MLX CPU matrix products use OpenBLAS (LD_PRELOAD)")
    else:
        log.warning("MLX on Linux CPU is using its slow reference BLAS. Install OpenBLAS for a 30-60x "
                    "faster CPU path: %s", INSTALL_HINT)


if __name__ == "__main__":
    # `eval "$(python -m flow.blas)"` in a shell: export LD_PRELOAD when OpenBLAS is available.
    import shlex

    found = preload_env()
    if found is not None:
        print(f"export LD_PRELOAD={shlex.quote(found['LD_PRELOAD'])}")
