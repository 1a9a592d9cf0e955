"""The OpenBLAS fast path for MLX on Linux CPUs.

The Linux ``mlx[cpu]`` wheel links a reference BLAS; preloading OpenBLAS makes
its matrix products 30–60× faster. ``flow`` re-executes itself once with
``LD_PRELOAD`` set when OpenBLAS is installed, and otherwise says how to get it.
Set ``FLOW_OPENBLAS=0`` to opt out.

An OpenBLAS older than the processor does not know its model number and falls
back to its slowest x86-64 kernels (``Prescott``, SSE3): Debian 12's 0.3.21 does
so on 5th-generation Xeons, and its float32 matrix products run 7–10× slower
than its AVX-512 kernels do on the same core. Where that happens, flow names
the kernel the processor's instructions allow (``OPENBLAS_CORETYPE``), as a
newer OpenBLAS would pick itself. A ``OPENBLAS_CORETYPE`` already set is kept.
"""

from __future__ import annotations

import glob
import logging
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger("flow.cli.blas")

CANDIDATES = (
    "/usr/lib/{arch}-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/{arch}-linux-gnu/openblas-openmp/libblas.so.3",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/{arch}-linux-gnu/libopenblas.so.0",
)
INSTALL_HINT = "sudo apt-get install libopenblas0-pthread   (Fedora: sudo dnf install openblas)"

# OpenBLAS's x86-64 kernel families, best first, with the CPU flags (as Linux lists them in /proc/cpuinfo,
# only where the kernel enabled their register state) that each needs, and the core names OpenBLAS reports
# for a kernel of that family or an equivalent one.
X86_KERNELS: tuple[tuple[str, frozenset[str], frozenset[str]], ...] = (
    ("SkylakeX", frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}),
     frozenset({"skylakex", "cooperlake", "sapphirerapids"})),
    ("Haswell", frozenset({"avx2", "fma"}), frozenset({"haswell", "zen"})),
    ("Sandybridge", frozenset({"avx"}), frozenset({"sandybridge", "bulldozer", "piledriver", "steamroller",
                                                    "excavator"})),
)


def find_openblas() -> str | None:
    arch = platform.machine()
    for pattern in CANDIDATES:
        for path in glob.glob(pattern.format(arch=arch)):
            if os.path.exists(path):
                return path
    return None


def preloaded_path(env: Mapping[str, str]) -> str | None:
    """The BLAS library ``env`` preloads, if any."""
    return next((p for p in env.get("LD_PRELOAD", "").split(":") if "blas" in p), None)


def openblas_active() -> bool:
    return preloaded_path(os.environ) is not None


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first processor's flags, or none where the file is missing or has no flags line."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def kernel_override(library_core: str, flags: frozenset[str]) -> str | None:
    """The ``OPENBLAS_CORETYPE`` to set: the best x86-64 kernel family ``flags`` allow, where OpenBLAS chose a
    weaker one (``library_core``); None where its own choice is as good. (Families are ranked by their place in
    :data:`X86_KERNELS`; a core name it does not list ranks below them all.)"""
    allowed = next((rank for rank, (_, needs, _) in enumerate(X86_KERNELS) if needs <= flags), None)
    chosen = next((rank for rank, (_, _, names) in enumerate(X86_KERNELS) if library_core.lower() in names),
                  len(X86_KERNELS))
    return None if allowed is None or allowed >= chosen else X86_KERNELS[allowed][0]


# Asked in a fresh interpreter: OpenBLAS picks its kernels once, when it is loaded, so a process that has it
# loaded already (under another OPENBLAS_CORETYPE) would answer for itself, not for the process to be started.
_ASK_CORE = """
import ctypes, os, sys
from pathlib import Path
for candidate in (sys.argv[1], str(Path(sys.argv[1]).with_name("libopenblas.so.0"))):
    try:
        corename = ctypes.CDLL(candidate, mode=os.RTLD_LOCAL).openblas_get_corename
    except (OSError, AttributeError):
        continue
    corename.restype = ctypes.c_char_p
    print((corename() or b"").decode())
    break
"""


def library_core(path: str, env: dict[str, str] | None = None) -> str | None:
    """The kernel family the OpenBLAS at ``path`` (or the libopenblas beside it) picks on this machine under
    ``env`` (default: this process's), as ``openblas_get_corename`` reports it; None where it cannot be asked."""
    try:
        answer = subprocess.run([sys.executable, "-I", "-S", "-c", _ASK_CORE, path], env=env, capture_output=True,
                                text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return answer.stdout.strip() or None


def coretype_env(path: str, env: dict[str, str]) -> str | None:
    """The kernel to name for the OpenBLAS at ``path``, or None (not x86-64, already named, or well chosen)."""
    if platform.machine() not in ("x86_64", "AMD64") or env.get("OPENBLAS_CORETYPE"):
        return None
    ask = {k: v for k, v in env.items() if k != "LD_PRELOAD"}
    core = library_core(path, ask)
    return None if core is None else kernel_override(core, cpu_flags())


def preload_env(env: dict[str, str] | None = None) -> dict[str, str] | None:
    """An environment with OpenBLAS preloaded and its kernel named where it would pick a weak one, or None when
    there is nothing to change (not Linux, opted out, OpenBLAS missing, or already set up)."""
    env = dict(os.environ if env is None else env)
    if sys.platform != "linux" or env.get("FLOW_OPENBLAS") == "0":
        return None
    changed = False
    path = preloaded_path(env)
    if path is None:
        path = find_openblas()
        if path is None:
            return None
        env["LD_PRELOAD"] = ":".join(p for p in (path, env.get("LD_PRELOAD", "")) if p)
        changed = True
    coretype = coretype_env(path, env)
    if coretype is not None:
        env["OPENBLAS_CORETYPE"] = coretype
        changed = True
    return env if changed else None


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
        coretype = os.environ.get("OPENBLAS_CORETYPE")
        log.info("MLX CPU matrix products use OpenBLAS (LD_PRELOAD)%s",
                 f", its {coretype} kernels (OPENBLAS_CORETYPE)" if coretype else "")
    else:
        log.warning("MLX on Linux CPU is using its slow reference BLAS. Install OpenBLAS for a 30-60x "
                    "faster CPU path: %s", INSTALL_HINT)


if __name__ == "__main__":
    # `eval "$(python -m flow.cli.blas)"` in a shell: export LD_PRELOAD (and OPENBLAS_CORETYPE where OpenBLAS would
    # pick a weak kernel) when OpenBLAS is available.
    import shlex

    found = preload_env()
    if found is not None:
        for name in ("LD_PRELOAD", "OPENBLAS_CORETYPE"):
            if name in found and found.get(name) != os.environ.get(name):
                print(f"export {name}={shlex.quote(found[name])}")
