"""The reference server's documented bodies (its API page, as the issue quotes it), answered by flow through the
real server: ``GET /library → {models}``, ``GET /downloads → {downloads}``, ``GET /fit → {machine, …, report,
sku_matrix}``, ``GET /v1/adapters → {adapters}``, ``GET /stats → {server, prompt_cache, response_store, kv_quant,
admission, batch}`` — every field there and filled from flow's own figures, flow's own keys still beside them. And
a request field over a limit is named as the protocol spells it (``stop_sequences``)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from flow.builtins import compile_tables
from flow.catalog.fit import record_measured_decode_tps
from runtime.tiny import TinySpec, ensure_tiny_model
from runtime.tiny.adapters import build_tiny_adapter
from tests.fake_hub import hub_switched_on
from tests.harness import RunningServer, running_server, tables_with_model, tables_with_prefix_cache

# The reference's field lists, as its API page gives them.
LIBRARY_MODEL = {"repo_id", "model_type", "size_bytes", "quant_bits", "vision", "supported", "serving", "assessment"}
ASSESSMENT = {"fits", "max_safe_context", "predicted_decode_tps"}
DOWNLOAD = {"repo_id", "state", "current_file", "received_bytes", "total_bytes", "files_done", "files_total",
            "bytes_per_sec", "started_at", "finished_at"}
FIT = {"machine", "context_tokens", "typical_context_tokens", "typical_decode_tps", "measured_decode_tps",
       "measured_at", "report", "sku_matrix_ctx", "sku_matrix"}
MACHINE = {"chip", "ram_bytes", "bandwidth_gbs"}
REPORT = {"fits", "weights_bytes", "kv_bytes", "transient_bytes", "total_bytes", "usable_bytes", "max_safe_context",
          "predicted_decode_tps"}
SKU = {"sku", "ram_gb", "fits", "max_context", "decode_tps"}
ADAPTER = {"id", "path", "rank", "scale", "size_bytes", "mounted_layers"}
STATS = {"server": {"owner", "model", "started_at"}, "prompt_cache": {"entries", "bytes", "max_bytes", "hits", "misses"},
         "response_store": {"entries", "bytes", "max_bytes", "ttl_ms"}, "kv_quant": {"mode", "layers", "attention"},
         "admission": {"max_safe_context", "memory_budget_bytes", "usable_bytes", "weights_bytes"},
         "batch": {"configured", "batched", "active_rows"}}
REPO = "acme/tiny-chat"


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    adapter = build_tiny_adapter(tiny_llama, tmp_path_factory.mktemp("adapters") / "a1", seed=1)
    tables = tables_with_prefix_cache(tiny_llama, tmp_path_factory.mktemp("kv"), block_tokens=16)
    tables["resources"]["model"].update(name="tiny-llama", max_batch=6, adapters={"a1": str(adapter)})
    tables["stages"]["library"]["cache_seconds"] = 0
    with running_server(compile_tables(tables, "reference shapes (test)")) as running:
        yield running


def get(server: RunningServer, path: str) -> Any:
    answer = httpx.get(server.base_url + path, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def chat(server: RunningServer, content: str, **extra: Any) -> None:
    answer = httpx.post(server.base_url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny-llama", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra})
    assert answer.status_code == 200, answer.text


def test_library_answers_models_with_the_reference_fields(server: RunningServer, tiny_llama: Path) -> None:
    body = get(server, "/library")
    assert body["models"] == body["data"] and body["object"] == "list"  # flow's own list beside the reference's
    assert body["models"], "the tiny models built for the tests are local models"
    for entry in body["models"]:
        assert LIBRARY_MODEL <= set(entry), entry
        assert entry["assessment"] is None or ASSESSMENT <= set(entry["assessment"])
    served = [m for m in body["models"] if m["serving"]]
    assert len(served) == 1 and served[0]["supported"] is True and served[0]["vision"] is False
    config = json.loads((tiny_llama / "config.json").read_text())
    assert served[0]["model_type"] == config["model_type"] == "llama"
    assert served[0]["assessment"]["fits"] is True


def test_downloads_answers_the_reference_records(server: RunningServer, tiny_qwen3: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    with hub_switched_on(monkeypatch, REPO, tiny_qwen3, tmp_path / "hub-cache"):
        for repo in (REPO, "acme/not-on-this-hub"):
            assert httpx.post(server.base_url + "/downloads", json={"repo": repo}, timeout=30).status_code == 200
        deadline = time.monotonic() + 60
        body = get(server, "/downloads")
        while any(d["state"] == "active" for d in body["downloads"]):
            assert time.monotonic() < deadline, body
            time.sleep(0.1)
            body = get(server, "/downloads")
    assert body["object"] == "list" and [d["repo"] for d in body["data"]] == [d["repo_id"] for d in body["downloads"]]
    failed, done = body["downloads"]  # the latest first
    for entry in (failed, done):
        assert DOWNLOAD <= set(entry), entry
        assert abs(entry["started_at"] - time.time()) < 120 and entry["finished_at"] >= entry["started_at"]
    assert done["repo_id"] == REPO and done["state"] == "done" and "error" not in done
    assert done["files_done"] == done["files_total"] >= 3 and done["received_bytes"] == done["total_bytes"] > 0
    assert done["current_file"] is None and done["bytes_per_sec"] >= 0
    assert failed["repo_id"] == "acme/not-on-this-hub" and failed["state"] == "error" and failed["error"]
    assert body["data"][0]["state"] == "failed"  # flow's own record keeps its own states


def test_fit_answers_the_reference_report_and_sku_matrix(server: RunningServer) -> None:
    record_measured_decode_tps("tiny-llama", 123.4)  # as `flow bench` does
    body = get(server, "/fit")
    assert FIT <= set(body) and MACHINE <= set(body["machine"]) and REPORT <= set(body["report"])
    own = body["data"][0]  # flow's own assessment, which the reference's fields are read from
    assert own["model"] == body["model"] == "tiny-llama"
    report = body["report"]
    assert report["max_safe_context"] == body["context_tokens"] == own["max_safe_context"] > 0
    assert body["typical_context_tokens"] == min(8192, body["context_tokens"])
    assert report["weights_bytes"] == own["weight_bytes"] and report["transient_bytes"] == own["transient_bytes"]
    assert report["kv_bytes"] == own["kv_bytes_per_token"] * body["context_tokens"]
    assert report["total_bytes"] == report["weights_bytes"] + report["kv_bytes"] + report["transient_bytes"]
    assert report["usable_bytes"] == own["usable_bytes"] and report["fits"] is own["fits"] is True
    assert report["predicted_decode_tps"] == own["predicted_decode_tps"] >= body["typical_decode_tps"] > 0
    machine = body["machine"]
    assert machine["chip"] and machine["ram_bytes"] > machine["usable_bytes"] / 2 > 0
    assert machine["bandwidth_gbs"] == own["bandwidth_gbps"] > 0
    assert body["measured_decode_tps"] == 123.4 and abs(body["measured_at"] / 1000 - time.time()) < 120
    assert body["sku_matrix_ctx"] == min(32768, own["context_length"])
    assert body["sku_matrix"] and all(SKU <= set(row) for row in body["sku_matrix"])
    row = next(r for r in body["sku_matrix"] if r["sku"] == "M4 Pro 24 GB")
    assert row["ram_gb"] == 24 and row["fits"] is True and row["max_context"] == body["sku_matrix_ctx"]
    faster = next(r for r in body["sku_matrix"] if r["sku"] == "M4 Max 128 GB")
    assert faster["decode_tps"] > row["decode_tps"] > 0  # more bandwidth, faster decode
    one = get(server, "/fit?model=tiny-llama")
    # The same report for the one model, but for the memory free now (read live, it moves between calls).
    steady = {key: value for key, value in body["report"].items() if key != "usable_bytes"}
    assert one["model"] == "tiny-llama" and {k: v for k, v in one["report"].items() if k != "usable_bytes"} == steady


def test_adapters_answers_the_reference_list(server: RunningServer) -> None:
    body = get(server, "/v1/adapters")
    assert body["adapters"] == body["data"] and body["object"] == "list"
    (entry,) = body["adapters"]
    assert ADAPTER <= set(entry)
    assert entry["id"] == "a1" and entry["rank"] == 4 and entry["scale"] == 2.0 and entry["mounted_layers"] > 0
    assert entry["size_bytes"] == (Path(entry["path"]) / "adapters.safetensors").stat().st_size


def test_stats_answers_the_reference_blocks_beside_flows_own(server: RunningServer, tiny_llama: Path) -> None:
    before = get(server, "/stats")
    for _ in range(2):  # the second reuses the first's prefix blocks
        chat(server, "A prompt long enough to fill a few prefix cache blocks of sixteen tokens. " * 4)
    client = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0)
    client.responses.create(model="tiny-llama", input="Hello", max_output_tokens=4)  # stored (store defaults on)
    stats = get(server, "/stats")
    for block, fields in STATS.items():
        assert fields <= set(stats[block]), (block, stats[block])
    assert {"graph", "models", "resources", "edges", "stages", "recent_requests"} <= set(stats)  # the console's
    assert stats["server"] == {"owner": "embedded", "model": "tiny-llama",
                               "started_at": int(server.server.started_at)}
    own_cache = stats["resources"]["prefix_cache"]
    cache = stats["prompt_cache"]
    assert cache["hits"] == own_cache["hits"] >= before["prompt_cache"]["hits"] + 1
    assert cache["misses"] == own_cache["lookups"] - own_cache["hits"] >= 1
    assert cache["entries"] == own_cache["blocks"]["hot"] + own_cache["blocks"]["warm"] > 0
    assert 0 < cache["bytes"] <= cache["max_bytes"]
    store, own_store = stats["response_store"], stats["resources"]["response_store"]
    assert store["entries"] == own_store["entries"] == before["response_store"]["entries"] + 1
    assert store["bytes"] == own_store["bytes"] > 0 and store["max_bytes"] == own_store["max_bytes"]
    assert store["ttl_ms"] == own_store["ttl_seconds"] * 1000
    layers = json.loads((tiny_llama / "config.json").read_text())["num_hidden_layers"]
    kv = stats["kv_quant"]
    assert kv["mode"] in ("bf16", "fp16", "fp32") and kv["layers"] == {kv["mode"]: layers}
    assert kv["attention"] == {"global": layers, "sliding_window": 0}
    model = stats["models"]["tiny-llama"]
    admission = stats["admission"]
    assert admission["max_safe_context"] == model["context_length"]  # half the machine's memory holds all of it
    assert admission["memory_budget_bytes"] is None  # the graph sets none: the machine's default
    assert admission["usable_bytes"] == model["kv_budget_bytes"]
    assert admission["weights_bytes"] == server.server.models[0].loaded.weight_bytes > 0  # type: ignore[union-attr]
    assert stats["batch"]["configured"] == 6 and stats["batch"]["batched"] is True


def test_stats_batch_counts_the_rows_decoding_now(server: RunningServer, tiny_llama: Path) -> None:
    assert get(server, "/stats")["batch"]["active_rows"] == 0
    streaming, done = threading.Event(), threading.Event()
    # The random model's end-of-sequence tokens are banned: a sampled EOS would end the row before /stats is read.
    eos = json.loads((tiny_llama / "config.json").read_text())["eos_token_id"]
    no_end = {str(token): -100 for token in (eos if isinstance(eos, list) else [eos])}

    def stream() -> None:
        with httpx.stream("POST", server.base_url + "/v1/chat/completions", timeout=120, json={
                "model": "tiny-llama", "messages": [{"role": "user", "content": "Tell a long story."}],
                "max_tokens": 3000, "logit_bias": no_end, "stream": True}) as answer:
            for line in answer.iter_lines():
                if line.startswith("data: {"):
                    streaming.set()
                    done.wait(60)  # stop reading: the sequence stays in the batch until the client leaves
                    return

    worker = threading.Thread(target=stream)
    worker.start()
    try:
        assert streaming.wait(60)
        assert get(server, "/stats")["batch"]["active_rows"] == 1
    finally:
        done.set()
        worker.join(60)


def test_kv_quant_and_admission_follow_the_models_settings(tmp_path: Path) -> None:
    """``kv_bits`` on the model: mode uniform-kv8 on every attention layer; a graph's ``kv_budget_bytes``: the
    admission ceiling is the longest context whose KV (quantized past its start) fits it, and past it is a 400."""
    wide = ensure_tiny_model(TinySpec(num_heads=2, num_kv_heads=1))  # a head dimension a quantization group fits
    layers = json.loads((wide / "config.json").read_text())["num_hidden_layers"]
    tables = tables_with_model(wide, kv_bits=8, quantized_kv_start=16)
    probe_budget = 300_000
    tables["resources"]["model"]["kv_budget_bytes"] = probe_budget
    with running_server(compile_tables(tables, "kv quantization and a budget (test)")) as running:
        stats = get(running, "/stats")
        kv = stats["kv_quant"]
        assert kv["mode"] == "uniform-kv8" and kv["layers"] == {"kv8": layers} and kv["bits"] == 8
        assert kv["attention"] == {"global": layers, "sliding_window": 0}
        admission = stats["admission"]
        assert admission["memory_budget_bytes"] == admission["usable_bytes"] == probe_budget
        engine = running.server.models[0].loaded.engine  # type: ignore[union-attr]
        ceiling = admission["max_safe_context"]
        assert 16 < ceiling < stats["models"]["tiny"]["context_length"]
        assert engine.kv_bytes_for(ceiling) <= probe_budget < engine.kv_bytes_for(ceiling + 1)
        refused = httpx.post(running.base_url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": ceiling})
        assert refused.status_code == 400 and "budget" in refused.json()["error"]["message"]


def test_kv_quant_counts_sliding_window_layers() -> None:
    gemma = ensure_tiny_model("tiny-gemma3")
    config = json.loads((gemma / "config.json").read_text())
    with running_server(compile_tables(tables_with_model(gemma), "sliding windows (test)")) as running:
        attention = get(running, "/stats")["kv_quant"]["attention"]
    assert attention["global"] >= 1 and attention["sliding_window"] >= 1
    assert attention["global"] + attention["sliding_window"] == config.get("num_hidden_layers",
                                                                           config.get("text_config", {}).get(
                                                                               "num_hidden_layers"))


def test_too_many_stops_name_the_protocols_own_field(server: RunningServer) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
    for stops in (["###"] * 65, ["x" * 4097]):
        with pytest.raises(anthropic.BadRequestError) as raised:
            client.messages.create(model="tiny-llama", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                                   stop_sequences=stops)
        message = raised.value.body["error"]["message"]  # type: ignore[index]
        assert "'stop_sequences'" in message and "'stop'" not in message, message
    chat_client = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0)
    for stop in (["###"] * 65, "x" * 4097):
        with pytest.raises(openai.BadRequestError) as failed:
            chat_client.chat.completions.create(model="tiny-llama", max_tokens=4, stop=stop,
                                                messages=[{"role": "user", "content": "hi"}])
        error = failed.value.body
        assert isinstance(error, dict) and error["param"] == "stop" and "'stop'" in error["message"], error
    chat(server, "hi", stop=["###"] * 64)  # at the limit: served
