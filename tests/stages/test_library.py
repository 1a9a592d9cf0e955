"""``/library``, ``/fit``, ``/downloads``, ``flow fit`` and ``flow pull``: shapes, offline answers, and a real
download through ``huggingface_hub`` from a local stand-in hub (tests/fake_hub.py)."""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from flow.builtins import compile_tables
from flow.catalog.fit import Machine, assess, record_measured_decode_tps
from flow.cli import main as cli
from flow.resources.downloads import Download, Progress, progress_line, pull
from tests.fake_hub import COMMIT, Outage, hub_switched_on
from tests.harness import RunningServer, running_server, tables_with_model

REPO = "acme/tiny-chat"


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path) -> Iterator[RunningServer]:
    tables = tables_with_model(tiny_qwen3)
    tables["stages"]["library"]["cache_seconds"] = 0  # each test sees the cache as it is now
    with running_server(compile_tables(tables, "library")) as running:
        yield running


@pytest.fixture
def hub(tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A stand-in hub serving the tiny model as REPO, an empty hub cache, and the hub switched on."""
    with hub_switched_on(monkeypatch, REPO, tiny_qwen3, tmp_path / "hub-cache") as cache:
        yield cache


def get(server: RunningServer, path: str) -> Any:
    r = httpx.get(server.base_url + path, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_download_runs_with_progress_and_the_library_then_lists_it(server: RunningServer, hub: Path) -> None:
    r = httpx.post(server.base_url + "/downloads", json={"repo": REPO}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["repo"] == REPO and r.json()["state"] in ("queued", "running", "done")
    deadline = time.monotonic() + 60
    while (entry := get(server, "/downloads")["data"][0])["state"] in ("queued", "running"):
        assert time.monotonic() < deadline, entry
        time.sleep(0.1)
    assert entry["state"] == "done" and entry["error"] is None, entry["error"]
    assert entry["files_done"] == entry["files_total"] >= 3
    assert entry["received_bytes"] == entry["total_bytes"] > 100_000
    assert entry["current_file"] is None and entry["bytes_per_sec"] >= 0
    assert Path(entry["path"]).name == COMMIT and (Path(entry["path"]) / "config.json").is_file()

    library = get(server, "/library")
    assert library["offline"] is False
    pulled = next((m for m in library["data"] if m["repo_id"] == REPO), None)
    assert pulled is not None, [m["repo_id"] for m in library["data"]]
    assert pulled["kind"] == "text" and pulled["family"] == "qwen3" and pulled["supported"] is True
    assert pulled["serving"] is False and pulled["vision"] is False and pulled["audio"] is False
    assert pulled["size_bytes"] >= entry["total_bytes"] and pulled["quant_bits"] is None
    assessment = pulled["assessment"]
    assert assessment["fits"] is True and 0 < assessment["max_safe_context"] <= 4096
    assert assessment["predicted_decode_tps"] > 0
    # The model this server loaded is in the library too (a smoke-test build), marked as serving.
    assert any(m["serving"] for m in library["data"])

    fit = get(server, f"/fit?model={REPO}")["data"][0]
    assert fit["model"] == REPO and fit["weight_bytes"] > 0 and fit["moe"] is False


def test_offline_everything_answers_from_the_cache_and_says_so(server: RunningServer) -> None:
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # the tests' default (tests/conftest.py)
    assert get(server, "/library")["offline"] is True
    assert get(server, "/downloads")["offline"] is True
    assert get(server, "/fit")["offline"] is True
    r = httpx.post(server.base_url + "/downloads", json={"repo": REPO}, timeout=30)
    assert r.status_code == 503 and "offline" in r.json()["error"]["message"]


@pytest.mark.parametrize("body", [{"repo": "no-slash"}, {"repo": "../etc/x"}, {"repo": 3}, {},
                                  {"repo": "a/b", "revision": ""}, {"repo": "owner/name\n"},
                                  {"repo": "owner/name\nx"}, {"repo": "owner/na..me"}, {"repo": "owner/name/x"}])
def test_a_bad_download_request_is_a_400_that_says_what_to_send(server: RunningServer, body: Any) -> None:
    r = httpx.post(server.base_url + "/downloads", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_fit_of_the_served_model_uses_the_code_admission_uses(server: RunningServer) -> None:
    fit = get(server, "/fit")["data"]
    assert [f["model"] for f in fit] == ["tiny"]
    stats = get(server, "/stats")["models"]["tiny"]
    assert fit[0]["kv_bytes_per_token"] == stats["engine"]["kv_bytes_per_token"]
    assert fit[0]["kv_budget_bytes"] == stats["kv_budget_bytes"]
    assert fit[0]["context_length"] == stats["context_length"]
    assert fit[0]["fits"] is True and fit[0]["usable_bytes"] > 0
    missing = httpx.get(server.base_url + "/fit?model=nope/nothing", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_a_pull_again_fetches_only_the_files_it_lacks(tiny_qwen3: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    with hub_switched_on(monkeypatch, REPO, tiny_qwen3, tmp_path / "hub-cache", log):
        first = Download(REPO)
        snapshot = pull(first, Progress(first))
        assert len(log) == first.files_total == 7
        blob = (snapshot / "tokenizer.json").resolve()
        (snapshot / "tokenizer.json").unlink()  # as if the first pull had stopped before this file
        blob.unlink()
        log.clear()
        again = Download(REPO)
        pull(again, Progress(again))
    assert log == ["GET tokenizer.json from 0"]  # the files already complete did not travel again
    assert again.state == "done" and again.received_bytes == again.total_bytes == first.total_bytes
    assert again.files_done == 7 and (snapshot / "tokenizer.json").is_file()


def test_a_file_cut_off_mid_way_goes_on_from_the_bytes_on_disk(tiny_qwen3: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    # huggingface_hub writes what arrives in chunks of 10 MB (a cut loses the chunk under way); 100 kB here,
    # so that a file of 0.8 MB has some on disk when the hub goes away 300 kB into it.
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 100_000)
    log: list[str] = []
    outage = Outage(cut={"model.safetensors": 300_000})
    with hub_switched_on(monkeypatch, REPO, tiny_qwen3, tmp_path / "hub-cache", log, outage) as cache:
        first = Download(REPO)
        with pytest.raises(Exception, match="503"):
            pull(first, Progress(first))
        assert first.state == "failed" and first.files_done == 3  # README.md, config.json, generation_config.json
        (part,) = cache.glob("models--acme--tiny-chat/blobs/*.incomplete")
        assert part.stat().st_size == 300_000 and first.received_bytes == 300_000 + sum(
            (tiny_qwen3 / name).stat().st_size for name in ("README.md", "config.json", "generation_config.json"))
        outage.end()
        log.clear()
        again = Download(REPO)
        snapshot = pull(again, Progress(again))
    # The weights went on from byte 300,000 (a Range request); the files complete before were not fetched again.
    assert log == ["GET model.safetensors from 300000", "GET special_tokens_map.json from 0",
                   "GET tokenizer.json from 0", "GET tokenizer_config.json from 0"]
    assert (snapshot / "model.safetensors").read_bytes() == (tiny_qwen3 / "model.safetensors").read_bytes()
    assert not part.exists() and again.state == "done" and again.files_done == 7
    assert again.received_bytes == again.total_bytes  # the part on disk counted once, the rest as it came


def _moe_model(path: Path) -> Path:
    """A config and one safetensors file whose header names 8 experts' tensors (the data is zeros)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "model_type": "mixtral", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "hidden_size": 64, "vocab_size": 100, "num_local_experts": 8, "num_experts_per_tok": 2,
        "max_position_embeddings": 1 << 20, "torch_dtype": "float16"}))
    tensors = {"model.embed_tokens.weight": 200_000, "model.layers.0.block_sparse_moe.experts.0.w1.weight": 800_000}
    header: dict[str, Any] = {}
    offset = 0
    for name, size in tensors.items():
        header[name] = {"dtype": "F16", "shape": [size // 2], "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return path


def test_fit_counts_a_mixture_of_experts_by_its_active_weights(tmp_path: Path) -> None:
    host = Machine(usable_bytes=1 << 30, usable_source="test", bandwidth_bytes_per_sec=1e9,
                   bandwidth_source="test", kv_budget_bytes=64 << 20)
    fit = assess("moe", _moe_model(tmp_path / "moe"), host=host)
    assert fit.moe and fit.weight_bytes > 1_000_000
    # Non-expert bytes (embedding, header) plus a quarter (2 of 8) of the experts' 800 kB.
    assert fit.active_weight_bytes == fit.weight_bytes - 800_000 + 200_000
    assert fit.predicted_decode_tps == round(1e9 / fit.active_weight_bytes, 1)
    assert fit.kv_bytes_per_token == 2 * 2 * 16 * 2 * 2  # layers × KV heads × head dim × K and V × fp16
    assert fit.max_safe_context == (64 << 20) // fit.kv_bytes_per_token  # the KV budget binds first
    tight = assess("moe", tmp_path / "moe", host=Machine(1 << 20, "test", 1e9, "test", 64 << 20))
    assert not tight.fits and tight.max_safe_context == 0  # the weights alone exceed the memory
    assert fit.measured_decode_tps is None
    record_measured_decode_tps("moe", 123.45)  # what flow bench does after its rounds
    assert assess("moe", tmp_path / "moe", host=host).measured_decode_tps == 123.5


def test_progress_counts_bytes_files_rate_and_eta() -> None:
    now = [100.0]
    download = Download("a/b")
    progress = Progress(download, clock=lambda: now[0])
    progress.planned([("config.json", 1000), ("model.safetensors", 9000)])
    assert download.state == "running" and download.files_total == 2 and download.total_bytes == 10_000
    progress.file_started("config.json")
    progress.file_done(1000, 0)  # found complete in the cache: counted at once
    progress.file_started("model.safetensors")
    now[0] += 1.0
    progress.received(3000)
    assert download.current_file == "model.safetensors" and download.received_bytes == 4000
    assert download.bytes_per_sec == pytest.approx(3000.0)
    assert download.eta_seconds == pytest.approx(2.0)
    line = progress_line(download)
    assert "40%" in line and "files 1/2" in line and "model.safetensors" in line and "ETA 0:02" in line
    now[0] += 2.0
    progress.received(6000)
    progress.file_done(9000, 9000)
    progress.finished(Path("/cache/snap"), None)
    assert download.json()["state"] == "done" and download.received_bytes == 10_000 and download.files_done == 2
    failed = Download("a/c")
    Progress(failed).finished(None, "HTTPError: 404")
    assert failed.json()["state"] == "failed" and failed.json()["error"] == "HTTPError: 404"


def test_flow_fit_and_flow_pull_on_the_command_line(hub: Path, tiny_qwen3: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli.main(["fit", str(tiny_qwen3), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is True
    assert cli.main(["fit", str(tiny_qwen3)]) == 0
    text = capsys.readouterr().out
    assert "max safe context" in text and "predicted decode" in text and "measured decode" in text
    assert cli.main(["fit", "nobody/nothing"]) == 1  # never downloads: only what is here
    assert "nobody/nothing" in capsys.readouterr().err
    assert cli.main(["pull", REPO]) == 0
    assert capsys.readouterr().out.startswith(f"{REPO}: 7 files, ")
    assert (hub / "models--acme--tiny-chat" / "snapshots" / COMMIT / "config.json").is_file()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli.main(["pull", REPO]) == 1
    assert "offline" in capsys.readouterr().err
