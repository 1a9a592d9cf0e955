"""Wheels for ``scripts/bench_device.sh`` on a lent NVIDIA machine that cannot reach any package index.

Such a machine (docs/benchmarks.md, "On a lent GPU") runs Python 3.12 with CUDA 13 and PyTorch's image — numpy,
transformers, tokenizers, safetensors, jinja2 and the like — but no MLX and none of flow's serving packages, and
each call to it carries at most 64 MiB with the checkout. Run here, with the environment flow's tests pass in::

    .venv/bin/python scripts/device_wheels.py            # writes .device-wheels/part1, part2, ...

It downloads, for CPython 3.12 on manylinux x86-64, MLX's CUDA 13 build of this environment's MLX version and the
exact version installed here of every other package this environment has that the machine lacks (test and
development tools left out), packs them into one tar archive and splits it into parts of at most ``--part-mib``
MiB, one folder each: every call to the machine carries one part (``carry: [".device-wheels/partN"]``; a warm
machine keeps the parts carried before, as the ignored files they are). The last call joins and installs them
and runs the benchmark: ``bash scripts/device_run.sh --out $OUT/bench-device.md``. The folder is ignored by git.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / ".device-wheels"
PYTHON_VERSION = "3.12"
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (35, 34, 31, 28, 27, 24, 17)] + ["manylinux2014_x86_64"]

# On the machine's image already (its package list, 2026-11): the imports resolve to these.
PRESENT = {
    "aiofiles", "annotated-doc", "anyio", "attrs", "certifi", "charset-normalizer", "click", "filelock", "fsspec",
    "h11", "hf-xet", "httpcore", "httpx", "huggingface-hub", "idna", "jinja2", "markdown-it-py", "markupsafe",
    "mdurl", "networkx", "numpy", "packaging", "pandas", "pillow", "protobuf", "pyarrow", "pygments",
    "python-dateutil", "pyyaml", "regex", "requests", "rich", "safetensors", "scipy", "sentencepiece",
    "shellingham", "sortedcontainers", "tokenizers", "tqdm", "transformers", "typer", "typing-extensions",
    "urllib3", "werkzeug", "cffi", "pycparser", "tzdata", "xxhash", "cryptography", "pluggy", "iniconfig",
}
# Tools of this environment that serving and benchmarking never import, and MLX's CPU build (CUDA's replaces it).
LEFT_OUT = {
    "flow-server", "pip", "setuptools", "wheel", "pytest", "pytest-trio", "pytest-xdist", "execnet", "hypothesis",
    "mypy", "mypy-extensions", "librt", "ast-serialize", "pathspec", "import-linter", "grimp", "playwright",
    "openai", "anthropic", "ollama", "jiter", "docstring-parser", "distro", "websockets", "jsonschema",
    "jsonschema-specifications", "referencing", "rpds-py", "py-spy", "mlx-cpu", "opencv-python", "datasets",
    "multiprocess", "dill", "fastapi", "starlette", "uvicorn", "python-multipart", "sounddevice",
    "opentelemetry-api", "truststore", "gguf",
    "av",  # PyAV (35 MB): audio containers, for the audio kinds; no benchmark of bench_device.sh serves audio
}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wanted() -> list[str]:
    """``name==version`` of what the machine lacks, from this environment, MLX's CUDA 13 build first."""
    versions = {normalized(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
    if "mlx" not in versions:
        raise SystemExit("device_wheels: MLX is not installed in this environment")
    pins = [f"mlx-cuda-13=={versions['mlx']}"]
    pins += [f"{name}=={version}" for name, version in sorted(versions.items())
             if name not in PRESENT and name not in LEFT_OUT]
    return pins


def download(pins: list[str], into: Path) -> None:
    base = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
            "--python-version", PYTHON_VERSION, "--implementation", "cp", "-d", str(into)]
    for platform in PLATFORMS:
        base += ["--platform", platform]
    missing: list[str] = []
    for pin in pins:
        if subprocess.run([*base, pin], capture_output=True).returncode != 0:
            missing.append(pin)
    if missing:
        raise SystemExit(f"device_wheels: no CPython {PYTHON_VERSION} manylinux wheel for {', '.join(missing)}")


def split(archive: Path, part_bytes: int) -> list[Path]:
    """``archive`` cut into ``OUT/partN/wheels.tar.NNN`` of at most ``part_bytes`` each."""
    parts: list[Path] = []
    with archive.open("rb") as source:
        while chunk := source.read(part_bytes):
            folder = OUT / f"part{len(parts) + 1}"
            folder.mkdir(parents=True)
            piece = folder / f"wheels.tar.{len(parts):03d}"
            piece.write_bytes(chunk)
            parts.append(piece)
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part-mib", type=int, default=52,
                        help="largest part (a call carries 64 MiB with the checkout, ~6 MiB); default %(default)s")
    args = parser.parse_args()
    shutil.rmtree(OUT, ignore_errors=True)
    wheels = OUT / "wheels"
    wheels.mkdir(parents=True)
    pins = wanted()
    download(pins, wheels)
    archive = OUT / "wheels.tar"
    with tarfile.open(archive, "w") as tar:
        for wheel in sorted(wheels.glob("*.whl")):
            tar.add(wheel, arcname=wheel.name)
    parts = split(archive, args.part_mib << 20)
    shutil.rmtree(wheels)
    archive.unlink()
    total = sum(p.stat().st_size for p in parts)
    print(f"device_wheels: {len(pins)} packages, {total / 2**20:.1f} MiB in {len(parts)} parts under {OUT}")
    for i, part in enumerate(parts, 1):
        last = i == len(parts)
        command = ("bash scripts/device_run.sh --out $OUT/bench-device.md" if last
                   else "true  # the part stays on the warm machine for the next call")
        print(f'  call {i}: carry [".device-wheels/{part.parent.name}"], command: {command}')


if __name__ == "__main__":
    main()
