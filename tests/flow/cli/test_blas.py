"""OpenBLAS set-up: the kernel named where the library would fall back to a weak one, and only then."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import pytest

from flow.cli import blas

AVX512 = frozenset("fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma avx512f avx512cd avx512bw avx512dq avx512vl".split())
AVX2 = frozenset("fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma".split())
SSE = frozenset("fpu sse sse2 ssse3".split())


@pytest.mark.parametrize(("library_core", "flags", "expected"), [
    ("Prescott", AVX512, "SkylakeX"),  # Debian 12's 0.3.21 on a 5th-generation Xeon
    ("Prescott", AVX2, "Haswell"),
    ("Sandybridge", AVX2, "Haswell"),
    ("Haswell", AVX512, "SkylakeX"),
    ("SkylakeX", AVX512, None),
    ("Cooperlake", AVX512, None),  # the same kernels with bfloat16 ones added: as good
    ("SapphireRapids", AVX512, None),
    ("Zen", AVX2, None),
    ("Haswell", AVX2, None),
    ("Prescott", SSE, None),  # nothing better to run
    ("Prescott", AVX2 - {"fma"}, "Sandybridge"),
])
def test_the_kernel_is_named_only_where_openblas_picked_a_weaker_one(
        library_core: str, flags: frozenset[str], expected: str | None) -> None:
    assert blas.kernel_override(library_core, flags) == expected


def test_cpu_flags_are_read_from_the_first_processor(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 fma\n\n"
                       "processor\t: 1\nflags\t\t: fpu\n")
    assert blas.cpu_flags(str(cpuinfo)) == {"fpu", "avx2", "fma"}
    assert blas.cpu_flags(str(tmp_path / "missing")) == frozenset()


needs_openblas = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64" or blas.find_openblas() is None,
    reason="needs OpenBLAS on x86-64 Linux (apt-get install libopenblas0-pthread)")


@needs_openblas
def test_the_named_kernel_is_the_one_openblas_runs() -> None:
    clean = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "LD_PRELOAD")}
    env = blas.preload_env(clean)
    assert env is not None and env["LD_PRELOAD"].startswith(blas.find_openblas() or "")
    chosen = env.get("OPENBLAS_CORETYPE")
    if chosen is None:  # OpenBLAS knows this processor: its own pick is at least as good as the flags allow
        own = blas.library_core(blas.find_openblas() or "", clean)
        assert own is not None and blas.kernel_override(own, blas.cpu_flags()) is None
    else:
        assert blas.library_core(blas.find_openblas() or "", env) == chosen
        assert blas.kernel_override(chosen, blas.cpu_flags()) is None


@needs_openblas
def test_a_kernel_the_user_named_is_kept() -> None:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} | {"OPENBLAS_CORETYPE": "Prescott"}
    prepared = blas.preload_env(env)
    assert prepared is not None and prepared["OPENBLAS_CORETYPE"] == "Prescott"
    assert blas.preload_env(prepared) is None  # already set up: nothing to change, no second re-exec
