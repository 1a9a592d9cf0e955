"""The wheel carries the bundled graphs and model families: an ordinary install can serve.

Builds the wheel from a copy of the source tree (so nothing is written into the checkout),
installs it with ``--no-deps`` into a fresh virtual environment, and makes this environment's
dependencies visible to it through a plain path line in a ``.pth`` file. A plain path line does
not run the ``.pth`` files of the directory it names, so the checkout's editable-install finder
stays off and ``flow`` can only come from the wheel. Every command then runs from a temporary
directory outside the repository, as a user's would.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.harness import serve_process

ROOT = Path(__file__).resolve().parents[3]
# Top-level entries that are not part of the distribution (or are remade by the build).
NOT_SOURCE = {".git", ".venv", "build", "dist", "tests", "scripts", ".pytest_cache", ".mypy_cache", ".flow-cache"}


def _not_source(directory: str, names: list[str]) -> set[str]:
    """``copytree``'s ignore: the entries above at the top, build leftovers everywhere."""
    top = NOT_SOURCE if Path(directory) == ROOT else set()
    return {n for n in names if n in top or n == "__pycache__" or n.endswith(".egg-info")}


@dataclass(frozen=True)
class Installed:
    venv: Path
    cwd: Path  # outside the repository
    env: dict[str, str]

    def flow(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.venv / "bin" / "flow"), *args], cwd=self.cwd, env=self.env,
                              capture_output=True, text=True, timeout=timeout)


def _can_build_without_isolation() -> bool:
    """Whether this environment's setuptools can make a wheel itself (bdist_wheel: setuptools>=70.1 or wheel)."""
    if importlib.util.find_spec("wheel") is not None:
        return True
    import setuptools

    major, minor = (int(part) for part in setuptools.__version__.split(".")[:2])
    return (major, minor) >= (70, 1)


def _build_wheel(src: Path, out: Path) -> Path:
    isolated = not _can_build_without_isolation()
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)]
    if not isolated:
        cmd.insert(5, "--no-build-isolation")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0 and isolated and "satisfies the requirement" in done.stderr:
        pytest.skip("building the wheel needs `wheel` installed here, or an index to fetch setuptools from:\n"
                    + done.stderr[-1500:])
    assert done.returncode == 0, f"pip wheel failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    (wheel,) = out.glob("flow_server-*.whl")
    return wheel


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    base = tmp_path_factory.mktemp("packaging")
    src = base / "src"
    shutil.copytree(ROOT, src, ignore=_not_source)
    wheel = _build_wheel(src, base / "wheels")

    venv = base / "venv"
    python = getattr(sys, "_base_executable", None) or sys.executable
    subprocess.run([python, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                           "--no-deps", "-q", str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"pip install failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c",
                              "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # The dependencies (trio, mlx, …) from this environment; its own .pth files are not run.
    (Path(purelib) / "flow_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    cwd = base / "elsewhere"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "FLOW_FAMILY_PATH")}
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return Installed(venv, cwd, env)


def test_flow_and_its_graphs_come_from_the_wheel(installed: Installed) -> None:
    where = subprocess.run(
        [str(installed.venv / "bin" / "python"), "-c",
         "import json, flow, flow.catalog.bundled as b; "
         "print(json.dumps([flow.__file__, str(b.graphs_dir()), sorted(b.bundled_graphs())]))"],
        cwd=installed.cwd, env=installed.env, capture_output=True, text=True, timeout=60)
    assert where.returncode == 0, where.stderr
    flow_file, graphs, names = json.loads(where.stdout)
    venv = installed.venv.resolve()
    assert Path(flow_file).resolve().is_relative_to(venv), flow_file
    assert Path(graphs).resolve().is_relative_to(venv), graphs
    assert not Path(graphs).resolve().is_relative_to(ROOT)
    assert {"default", "demo"} <= set(names)


def test_families_lists_the_bundled_families(installed: Installed) -> None:
    done = installed.flow("families", "--json")
    assert done.returncode == 0, done.stderr
    families = {f["name"]: f for f in json.loads(done.stdout)}
    shipped = {p.stem for p in (ROOT / "graphs" / "families").glob("*.toml")}
    assert {"qwen3", "llama3", "gemma3"} <= shipped
    assert shipped <= set(families)
    assert "qwen3" in families["qwen3"]["detect"]["model_types"]
    assert families["qwen3"]["tools"]["parser"] == "hermes_json"
    assert families["qwen3"]["reasoning"]["parser"] == "think_tag"
    text = installed.flow("families")
    assert text.returncode == 0 and "qwen3:" in text.stdout and "model_type:" in text.stdout, text.stderr


def test_check_finds_bundled_graphs_by_name(installed: Installed) -> None:
    done = installed.flow("check", "demo", "default.toml")
    assert done.returncode == 0, done.stderr
    assert "demo: ok" in done.stdout and "default.toml: ok" in done.stdout
    missing = installed.flow("check", "no-such-graph")
    assert missing.returncode == 1 and "file not found" in missing.stderr


@pytest.fixture
def demo_server(installed: Installed, tiny_qwen3: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``flow serve demo`` from the installed wheel (its tiny model is built already: ``tiny_qwen3``)."""
    with serve_process([str(installed.venv / "bin" / "flow"), "serve", "demo"], log=installed.cwd / "serve.log",
                       cwd=installed.cwd, env=installed.env) as served:
        yield served


def test_serve_demo_from_the_wheel(demo_server: tuple[subprocess.Popen[bytes], str]) -> None:
    proc, base = demo_server
    models = httpx.get(base + "/v1/models", timeout=30)
    assert models.status_code == 200
    model = models.json()["data"][0]["id"]
    answer = httpx.post(base + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert answer.status_code == 200, answer.text
    assert isinstance(answer.json()["choices"], list) and answer.json()["choices"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
