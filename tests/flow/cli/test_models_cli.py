"""``flow models``: local models from the hub cache, configured directories and smoke-test builds."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from flow.catalog.capabilities import Capabilities, CapabilityStore
from flow.cli.main import main

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def make_hub_repo(cache: Path, repo_id: str, model: Path) -> Path:
    """Lay ``model`` out as the hub does: content-addressed blobs, a snapshot of symlinks, refs/main."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in model.iterdir():
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def empty_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No hub cache, no FLOW_MODEL_PATH, an empty flow cache."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("FLOW_CACHE_DIR", str(tmp_path / "flow-cache"))
    monkeypatch.delenv("FLOW_MODEL_PATH", raising=False)
    return tmp_path


@pytest.fixture
def populated(empty_env: Path, monkeypatch: pytest.MonkeyPatch, tiny_qwen3: Path, tiny_llama: Path) -> dict[str, Path]:
    """tiny-qwen3 in the hub cache (probed), tiny-llama in $FLOW_MODEL_PATH, tiny-qwen3 as a smoke-test build."""
    snapshot = make_hub_repo(empty_env / "hub", "flow-test/tiny-qwen3", tiny_qwen3)
    (empty_env / "hub" / "datasets--flow-test--corpus" / "snapshots").mkdir(parents=True)  # not a model: skipped
    models_dir = empty_env / "models"
    shutil.copytree(tiny_llama, models_dir / "my-llama")
    (models_dir / "notes").mkdir()  # no config.json: not a model
    monkeypatch.setenv("FLOW_MODEL_PATH", str(models_dir))
    smoke = empty_env / "flow-cache" / "tiny-models"
    shutil.copytree(tiny_qwen3, smoke / tiny_qwen3.name)
    (smoke / f".{tiny_qwen3.name}.tmp-x").mkdir()  # a build in progress: skipped
    CapabilityStore().put(Capabilities(
        model=str(snapshot), family="qwen3", tool_parser="hermes_json", reasoning_parser="think_tag",
        tool_delivery="injected", thinking=True, context_length=4096, tool_calls_verified=True))
    return {"hub": snapshot, "llama": models_dir / "my-llama", "smoke": smoke / tiny_qwen3.name}


def models_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, dict[str, Any]]:
    assert main(["models", "--json", *args]) == 0
    return {m["id"]: m for m in json.loads(capsys.readouterr().out)}


def test_json_lists_hub_configured_and_smoke_test_models(
        populated: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    models = models_json(capsys)
    assert list(models) == ["flow-test/tiny-qwen3", str(populated["llama"]), "tiny:tiny-qwen3"]

    hub = models["flow-test/tiny-qwen3"]
    assert (hub["source"], hub["path"], hub["model_type"], hub["architectures"]) == (
        "hub", str(populated["hub"].resolve()), "qwen3", ["Qwen3ForCausalLM"])
    # The stored record wins over detection (which would say template delivery).
    assert (hub["family"], hub["family_source"], hub["tool_delivery"], hub["tool_parser"]) == (
        "qwen3", "probed", "injected", "hermes_json")
    assert hub["capabilities"]["thinking"] is True and hub["capabilities"]["context_length"] == 4096
    weights = (populated["hub"] / "model.safetensors").stat().st_size
    assert hub["weight_bytes"] == weights and hub["size_bytes"] > weights
    assert hub["smoke_test"] is True and hub["quantization_bits"] is None

    llama = models[str(populated["llama"])]
    assert (llama["source"], llama["model_type"], llama["family"], llama["family_source"]) == (
        "directory", "llama", "llama3", "detected")
    assert (llama["tool_parser"], llama["capabilities"]) == ("llama3_json", None)

    smoke = models["tiny:tiny-qwen3"]
    assert (smoke["source"], smoke["path"], smoke["family"], smoke["family_source"]) == (
        "smoke-test", str(populated["smoke"]), "qwen3", "detected")
    assert (smoke["tool_delivery"], smoke["reasoning_parser"]) == ("template", "think_tag")


def test_table_shows_each_model_with_its_family_source(
        populated: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["MODEL", "KIND", "TYPE", "SIZE", "FAMILY", "TOOLS|VECTORS", "REASONING", "CONTEXT"]
    rows = {line.split()[0]: line for line in lines[1:4]}
    assert set(rows) == {"flow-test/tiny-qwen3", str(populated["llama"]), "tiny:tiny-qwen3"}
    assert "qwen3 (probed)" in rows["flow-test/tiny-qwen3"] and "injected/hermes_json (verified)" in rows[
        "flow-test/tiny-qwen3"] and rows["flow-test/tiny-qwen3"].rstrip().endswith("4096")
    assert "llama3 (detected)" in rows[str(populated["llama"])] and rows[str(populated["llama"])].endswith("-")
    assert "(smoke test)" in rows["tiny:tiny-qwen3"] and "qwen3 (detected)" in rows["tiny:tiny-qwen3"]
    assert all(" text " in row for row in rows.values())  # the KIND column
    # Columns line up: every row's FAMILY cell starts under the header.
    column = lines[0].index("FAMILY")
    assert all(line[column:].startswith(("qwen3 (", "llama3 (")) for line in lines[1:4])
    assert "flow probe MODEL" in lines[-1]


def test_directories_on_the_command_line(empty_env: Path, tiny_llama: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    model = empty_env / "elsewhere" / "llama-copy"
    shutil.copytree(tiny_llama, model)
    assert list(models_json(capsys, str(model))) == [str(model)]  # a model directory itself
    assert list(models_json(capsys, str(model.parent))) == [str(model)]  # a directory of them
    assert main(["models", str(empty_env / "nowhere")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_nothing_found_says_how_to_get_models(empty_env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "no local models found" in out and str(empty_env / "hub") in out
    assert "flow serve graphs/default.toml" in out and "FLOW_MODEL_PATH" in out
    assert main(["models", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == [] and "no local models found" in captured.err
