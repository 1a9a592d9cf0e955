"""LoRA adapters through the real server and real MLX: random-weight adapters (mlx-lm's and PEFT's layouts) on a
tiny random-weight Llama. Greedy output with an adapter equals mlx-lm loaded with that adapter; rows with different
adapters, stacked adapters and no adapter share the batch and each gets the tokens it gets alone; the prefix cache
never crosses adapters (nor a re-mounted adapter's old weights); mounting is all or nothing; an adapter in use is
unmounted after the requests that use it; a model pool's reload mounts them again. A client's path expands no
environment variable, must be an adapter under the adapter roots (the hub cache and flow's data directory unless the
graph widens them), and every refusal of a path is the same answer."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import mlx.core as mx
import openai
import pytest

from flow.builtins import compile_tables
from flow.catalog.capabilities import data_dir
from runtime.tiny.adapters import build_tiny_adapter
from tests.harness import RunningServer, running_server, tables_with_prefix_cache

MESSAGES = [{"role": "user", "content": "Write a haiku about adapters."}]
TWIN_KEYS = ("self_attn.q_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a1": build_tiny_adapter(tiny_llama, root / "a1", seed=1),
        # a PEFT adapter and its mlx-lm twin (the same factors): mlx-lm is the reference for both
        "peft": build_tiny_adapter(tiny_llama, root / "peft", seed=2, rank=8, keys=TWIN_KEYS, layout="peft"),
        "twin": build_tiny_adapter(tiny_llama, root / "twin", seed=2, rank=8, keys=TWIN_KEYS),
    }


@pytest.fixture(scope="module")
def server(tiny_llama: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[RunningServer]:
    tables = tables_with_prefix_cache(tiny_llama, tmp_path_factory.mktemp("kv"), block_tokens=16)
    tables["resources"]["model"].update(name="tiny-llama", adapters={"a1": str(adapters["a1"])},
                                        adapter_aliases={"tiny-tuned": "a1"})
    tables["stages"]["adapters"]["roots"] = [str(tmp_path_factory.getbasetemp())]  # the tests' adapters are there
    with running_server(compile_tables(tables, "adapters (test)")) as running:
        yield running


def chat(server: RunningServer, model: str = "tiny-llama", max_tokens: int = 16, messages: Any = None,
         **extra: Any) -> dict[str, Any]:
    answer = httpx.post(server.base_url + "/v1/chat/completions", timeout=120, json={
        "model": model, "messages": messages or MESSAGES, "max_tokens": max_tokens, "temperature": 0, **extra})
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def text(body: dict[str, Any]) -> str:
    return str(body["choices"][0]["message"]["content"])


def reference(server: RunningServer, model_dir: Path, adapter: Path | None, max_tokens: int = 16) -> str:
    """mlx_lm.generate, greedy, with mlx-lm's own loader applying the adapter (on the device thread)."""
    from mlx_lm import generate, load

    def run() -> str:
        model, tokenizer = load(str(model_dir), adapter_path=str(adapter) if adapter else None)
        ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
        return str(generate(model, tokenizer, prompt=ids, max_tokens=max_tokens))
    return server.server.device.call(run)


def mount(server: RunningServer, adapter_id: str, path: Path | str, **extra: Any) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/adapters", timeout=60, json={"id": adapter_id, "path": str(path), **extra})


def listed(server: RunningServer) -> dict[str, dict[str, Any]]:
    body = httpx.get(server.base_url + "/v1/adapters", timeout=30).json()
    assert body["adapters"] == body["data"]  # the reference API's key, and flow's own list shape
    return {entry["id"]: entry for entry in body["adapters"]}


def test_greedy_output_equals_mlx_lm_with_the_adapter(server: RunningServer, tiny_llama: Path,
                                                      adapters: dict[str, Path]) -> None:
    base, tuned = reference(server, tiny_llama, None), reference(server, tiny_llama, adapters["a1"])
    assert base != tuned  # the adapter changes the output: the test can tell
    assert text(chat(server)) == base
    assert text(chat(server, adapter="a1")) == tuned
    assert text(chat(server, model="tiny-tuned")) == tuned  # the alias means base + a1
    assert text(chat(server, model="tiny-tuned", adapter="none")) == base  # the request's field wins
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in openai.OpenAI(
        base_url=server.url, api_key="x").chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=16, temperature=0, stream=True,  # type: ignore[arg-type]
        extra_body={"adapter": "a1"}) if chunk.choices)
    assert streamed == tuned


def test_a_peft_adapter_mounts_and_matches_its_mlx_lm_twin(server: RunningServer, tiny_llama: Path,
                                                           adapters: dict[str, Path]) -> None:
    answer = mount(server, "peft", adapters["peft"])
    assert answer.status_code == 200, answer.text
    entry = answer.json()
    layers = json.loads((tiny_llama / "config.json").read_text())["num_hidden_layers"]
    assert (entry["format"], entry["rank"], entry["scale"]) == ("peft", 8, 2.0)
    assert entry["mounted_layers"] == layers * len(TWIN_KEYS)
    assert entry["size_bytes"] == (adapters["peft"] / "adapter_model.safetensors").stat().st_size
    assert text(chat(server, adapter="peft")) == reference(server, tiny_llama, adapters["twin"])
    shown = listed(server)
    assert {"a1", "peft"} <= set(shown)
    assert shown["a1"]["source"] == "graph" and shown["peft"]["source"] == "api"
    assert {"id", "path", "rank", "scale", "size_bytes", "mounted_layers"} <= set(shown["peft"])
    assert httpx.delete(server.base_url + "/v1/adapters/peft", timeout=30).status_code == 200


def test_a_batch_mixing_adapters_gives_each_row_its_own_tokens(server: RunningServer,
                                                               adapters: dict[str, Path]) -> None:
    assert mount(server, "peft2", adapters["peft"]).status_code == 200
    try:
        cases: list[dict[str, Any]] = [{}, {"adapter": "a1"}, {"adapter": "peft2"}, {"adapter": "a1+peft2"},
                                       {"adapter": "peft2+a1"}, {"model": "tiny-tuned"}, {}, {"adapter": "a1"}]
        alone = [text(chat(server, max_tokens=24, **case)) for case in cases]
        assert len(set(alone[:4])) == 4  # every adapter, and their stack, changes the output
        with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
            together = list(pool.map(lambda case: text(chat(server, max_tokens=24, **case)), cases))
        assert together == alone
        assert server.health()["models"][0]["engine"]["peak_batch"] > 1
    finally:
        httpx.delete(server.base_url + "/v1/adapters/peft2", timeout=30)


def cached(body: dict[str, Any]) -> int:
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_the_prefix_cache_never_crosses_adapters_nor_old_weights(server: RunningServer, tiny_llama: Path,
                                                                 tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "A long shared prompt about caches and adapters, " * 6}]
    # Earlier requests cached the chat template's preamble (before the message) with and without a1.
    preamble = cached(chat(server, messages=messages, adapter="a1"))
    again = cached(chat(server, messages=messages, adapter="a1"))
    assert again > preamble  # the same adapter: the whole prompt from its own KV
    assert cached(chat(server, messages=messages)) < again  # the base model: never the adapter's KV
    path = tmp_path / "re"
    build_tiny_adapter(tiny_llama, path, seed=4)
    assert mount(server, "re", path).status_code == 200
    old = chat(server, messages=messages, adapter="re")
    assert cached(old) == 0 and cached(chat(server, messages=messages, adapter="re")) > 0
    assert httpx.delete(server.base_url + "/v1/adapters/re", timeout=30).status_code == 200
    shutil.rmtree(path)
    build_tiny_adapter(tiny_llama, path, seed=5)  # the same id and path, new weights
    assert mount(server, "re", path).status_code == 200
    try:
        new = chat(server, messages=messages, adapter="re")
        assert cached(new) == 0  # the old weights' KV is never reused
        assert text(new) != text(old)
    finally:
        httpx.delete(server.base_url + "/v1/adapters/re", timeout=30)


def test_mounting_is_all_or_nothing(server: RunningServer, adapters: dict[str, Path], tmp_path: Path) -> None:
    before = listed(server)
    # Trained on a bigger model: more layers, wider projections (rewritten from a1's files).
    bigger = tmp_path / "bigger"
    shutil.copytree(adapters["a1"], bigger)
    factors = mx.load(str(bigger / "adapters.safetensors"))
    assert isinstance(factors, dict)
    grown = {name.replace("layers.1.", "layers.7."): mx.zeros((value.shape[0] * 2, value.shape[1]))
             if name.endswith("lora_a") else value for name, value in factors.items()}
    mx.save_safetensors(str(bigger / "adapters.safetensors"), grown)
    wrong_model = mount(server, "big", bigger)
    message = wrong_model.json()["error"]["message"]
    assert wrong_model.status_code == 400 and "does not fit this model" in message
    assert "no such layer" in message and "do not fit a 64 → 64 layer" in message
    assert mount(server, "x", tmp_path / "missing").status_code == 400
    (tmp_path / "empty").mkdir()
    assert "adapter_config.json" in mount(server, "x", tmp_path / "empty").json()["error"]["message"]
    renamed = tmp_path / "other-base"
    shutil.copytree(adapters["a1"], renamed)
    config = json.loads((renamed / "adapter_config.json").read_text())
    (renamed / "adapter_config.json").write_text(json.dumps({**config, "model": "someone/Other-Model-7B"}))
    refused = mount(server, "other", renamed)
    assert refused.status_code == 400 and "Other-Model-7B" in refused.json()["error"]["message"]
    truncated = tmp_path / "truncated"
    shutil.copytree(adapters["a1"], truncated)
    weights = truncated / "adapters.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    assert mount(server, "t", truncated).status_code == 400
    dora = tmp_path / "dora"
    shutil.copytree(adapters["a1"], dora)
    (dora / "adapter_config.json").write_text(json.dumps({**config, "fine_tune_type": "dora"}))
    assert "'lora'" in mount(server, "d", dora).json()["error"]["message"]
    assert mount(server, "a1", adapters["a1"]).status_code == 409  # the id is taken
    assert mount(server, "bad id!", adapters["a1"]).status_code == 400
    assert mount(server, "tail\n", adapters["a1"]).json()["error"]["param"] == "id"  # the whole id is checked
    assert listed(server) == before  # nothing of the refused ones is mounted
    forced = mount(server, "other", renamed, check_base_model=False)  # the client says it knows better
    assert forced.status_code == 200
    assert httpx.delete(server.base_url + "/v1/adapters/other", timeout=30).status_code == 200


def test_requests_naming_adapters_that_are_not_mounted(server: RunningServer) -> None:
    answer = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny-llama", "messages": MESSAGES, "max_tokens": 4, "adapter": "nope"})
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "adapter_not_found"
    assert "a1" in answer.json()["error"]["message"]  # names the mounted ones
    malformed = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny-llama", "messages": MESSAGES, "max_tokens": 4, "adapter": "a1++a1"})
    assert malformed.status_code == 400 and malformed.json()["error"]["param"] == "adapter"
    with pytest.raises(anthropic.NotFoundError) as raised:
        anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0).messages.create(
            model="tiny-llama", max_tokens=4, messages=MESSAGES, extra_body={"adapter": "nope"})  # type: ignore[arg-type]
    assert "nope" in str(raised.value)
    responses = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0).responses.create(
        model="tiny-llama", input="Hello", max_output_tokens=8, temperature=0, extra_body={"adapter": "a1"})
    assert responses.status == "incomplete" or responses.output_text  # served with the adapter
    assert httpx.delete(server.base_url + "/v1/adapters/nope", timeout=30).status_code == 404
    models = {m["id"]: m for m in httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"]}
    assert models["tiny-tuned"]["alias_of"] == "tiny-llama" and models["tiny-tuned"]["adapter"] == "a1"


def test_an_adapter_in_use_is_unmounted_after_its_requests(server: RunningServer, adapters: dict[str, Path]) -> None:
    assert mount(server, "busy", adapters["twin"]).status_code == 200
    expected = text(chat(server, max_tokens=48, adapter="busy"))
    result: dict[str, str] = {}
    streaming = threading.Event()

    def stream() -> None:
        parts = []
        with httpx.stream("POST", server.base_url + "/v1/chat/completions", timeout=120, json={
                "model": "tiny-llama", "messages": MESSAGES, "max_tokens": 48, "temperature": 0, "stream": True,
                "adapter": "busy"}) as answer:
            for line in answer.iter_lines():
                if line.startswith("data: {"):
                    streaming.set()
                    chunk = json.loads(line[6:])
                    parts.extend(c["delta"].get("content") or "" for c in chunk["choices"])
        result["text"] = "".join(parts)

    worker = threading.Thread(target=stream)
    worker.start()
    assert streaming.wait(60)
    deleted = httpx.delete(server.base_url + "/v1/adapters/busy", timeout=30).json()
    assert deleted["deleted"] is True
    later = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny-llama", "messages": MESSAGES, "max_tokens": 4, "adapter": "busy"})
    assert later.status_code == 404  # new requests cannot use it
    worker.join(120)
    assert result["text"] == expected  # the running one finished with it, unchanged
    assert "busy" not in listed(server)


def test_a_pool_reload_mounts_the_adapters_again(tiny_llama: Path, tiny_qwen3: Path, adapters: dict[str, Path],
                                                 tmp_path: Path) -> None:
    tables = tables_with_prefix_cache(tiny_llama, tmp_path, block_tokens=16)
    tables["resources"]["model"].update(name="tiny-llama", adapters={"a1": str(adapters["a1"])})
    tables["resources"]["other"] = {"type": "model", "path": str(tiny_qwen3), "name": "tiny-qwen3"}
    tables["resources"]["pool"] = {"type": "model_pool", "max_loaded": 1}
    tables["stages"]["adapters"]["roots"] = [str(adapters["twin"].parent)]
    with running_server(compile_tables(tables, "adapters in a pool (test)")) as running:
        assert mount(running, "twin", adapters["twin"]).status_code == 400  # two text models: which one?
        assert mount(running, "twin", adapters["twin"], model="tiny-llama").status_code == 200
        first = {spec: text(chat(running, adapter=spec)) for spec in ("a1", "twin")}
        chat(running, model="tiny-qwen3", max_tokens=2)  # evicts the Llama: its adapters leave with it
        assert listed(running)["twin"]["state"] == "not loaded"
        assert {spec: text(chat(running, adapter=spec)) for spec in ("a1", "twin")} == first
        assert listed(running)["twin"]["state"] == "mounted"


def test_a_request_path_expands_no_environment_variable(server: RunningServer, adapters: dict[str, Path],
                                                        tiny_llama: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "s3cret-" + os.urandom(8).hex()
    monkeypatch.setenv("FLOW_TEST_SECRET", secret)  # the server runs in this process: its environment
    monkeypatch.setenv("FLOW_TEST_ADAPTER", str(adapters["twin"]))
    for path in ("/x/${FLOW_TEST_SECRET}", "$FLOW_TEST_SECRET", f"{tmp_path}/$FLOW_TEST_SECRET/x",
                 "%FLOW_TEST_SECRET%", "${FLOW_TEST_SECRET:-x}", "~FLOW_TEST_SECRET"):
        answer = mount(server, "env", path)
        assert answer.status_code == 400, answer.text
        assert secret not in answer.text and answer.json()["error"]["param"] == "path"
        assert repr(path) in answer.json()["error"]["message"]  # the path as the client sent it
    # Not expanded, rather than expanded and hidden: the variable names a real adapter, which is not mounted.
    assert mount(server, "env", "$FLOW_TEST_ADAPTER").status_code == 400
    assert mount(server, "env", "${FLOW_TEST_ADAPTER}").status_code == 400
    assert "env" not in listed(server)
    # A leading ~ is the server's own user's home.
    build_tiny_adapter(tiny_llama, tmp_path / "home" / "tune", seed=6)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    answer = mount(server, "home", "~/tune")
    assert answer.status_code == 200, answer.text
    assert answer.json()["path"] == os.path.realpath(tmp_path / "home" / "tune")
    assert httpx.delete(server.base_url + "/v1/adapters/home", timeout=30).status_code == 200


def test_every_refused_path_gets_the_same_answer(server: RunningServer, adapters: dict[str, Path],
                                                 tmp_path: Path) -> None:
    """Missing, a file, a directory that is no adapter, one outside the roots, a real adapter outside them
    (directly, through a symlink inside, through ``..``): one answer, byte for byte but for the path echoed."""
    outside = Path(tempfile.mkdtemp(prefix="flow-outside-"))  # not under the roots (the tests' temp dir)
    try:
        shutil.copytree(adapters["a1"], outside / "tune")
        (tmp_path / "empty").mkdir()
        (tmp_path / "file").write_text("x")
        (tmp_path / "link").symlink_to(outside / "tune")
        half = tmp_path / "half"  # an adapter whose weights are a symlink out of the roots
        half.mkdir()
        shutil.copy(adapters["a1"] / "adapter_config.json", half)
        (half / "adapters.safetensors").symlink_to(outside / "tune" / "adapters.safetensors")
        paths = [str(tmp_path / "missing"), str(tmp_path / "file"), str(tmp_path / "empty"), "/nonexistent/x",
                 "/root/.ssh", "/etc", "/", str(outside / "tune"), str(tmp_path / "link"), str(half),
                 str(tmp_path) + "/.." * len(tmp_path.parts) + str(outside / "tune"), "relative/dir", "~root"]
        bodies = set()
        for path in paths:
            answer = mount(server, "probe", path)
            assert answer.status_code == 400, (path, answer.text)
            assert answer.json()["error"]["code"] == "adapter_path_refused"
            echoed = json.dumps(repr(path))[1:-1].encode()
            assert answer.content.count(echoed) == 1, answer.text
            bodies.add(answer.content.replace(echoed, b"PATH"))
        assert len(bodies) == 1, bodies
        assert "probe" not in listed(server)
        # The same adapter inside the roots mounts: the refusals above were for where it was, not what it is.
        shutil.copytree(outside / "tune", tmp_path / "tune")
        assert mount(server, "probe", tmp_path / "tune").status_code == 200
        assert httpx.delete(server.base_url + "/v1/adapters/probe", timeout=30).status_code == 200
    finally:
        shutil.rmtree(outside)


def _hub_snapshot(adapter: Path, cache: Path, repo: str, blobs_at: Path | None = None) -> Path:
    """``adapter``'s files laid out as huggingface_hub caches a repository: snapshot files are symlinks to blobs
    (in ``blobs_at`` instead of the repository's own blobs folder, if given)."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    blobs = blobs_at or folder / "blobs"
    snapshot = folder / "snapshots" / ("c0ffee" * 6 + "0000")
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(adapter.iterdir())):
        blob = blobs / f"{repo.replace('/', '-')}-{i:02d}"
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def test_default_roots_are_the_hub_cache_and_flows_own_adapter_directory(
        tiny_llama: Path, adapters: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # as the server resolves it, read at each mount
    monkeypatch.setenv("FLOW_DATA_DIR", str(tmp_path / "data"))
    hub = _hub_snapshot(adapters["a1"], tmp_path / "hub", "acme/tiny-lora")
    escaping = _hub_snapshot(adapters["a1"], tmp_path / "hub", "acme/escaping", blobs_at=tmp_path / "elsewhere")
    own = shutil.copytree(adapters["twin"], data_dir() / "adapters" / "twin")
    assert own == tmp_path / "data" / "adapters" / "twin"
    stray = shutil.copytree(adapters["a1"], tmp_path / "stray")
    tables = tables_with_prefix_cache(tiny_llama, tmp_path / "kv", block_tokens=16)
    tables["resources"]["model"]["name"] = "tiny-llama"
    assert "roots" not in tables["stages"]["adapters"]  # the graph names none
    with running_server(compile_tables(tables, "default adapter roots (test)")) as running:
        for adapter_id, path in (("hub", hub), ("own", own)):
            answer = mount(running, adapter_id, path)
            assert answer.status_code == 200, answer.text
        assert set(listed(running)) == {"hub", "own"}
        assert text(chat(running, adapter="hub")) != text(chat(running))
        refused = {mount(running, "x", path).json()["error"]["code"]
                   for path in (stray, escaping, tmp_path, f"{tmp_path}/hub/../stray", "/tmp")}
        assert refused == {"adapter_path_refused"}
        # The graph widens them, with the operator's own ~ and $VARS.
        monkeypatch.setenv("FLOW_TEST_ROOT", str(tmp_path))
        tables["stages"]["adapters"]["roots"] = ["$FLOW_TEST_ROOT/stray"]
    with running_server(compile_tables(tables, "wider adapter roots (test)")) as running:
        assert mount(running, "stray", stray).status_code == 200
        assert mount(running, "hub", hub).status_code == 200
        tables["stages"]["adapters"]["default_roots"] = False
    with running_server(compile_tables(tables, "narrower adapter roots (test)")) as running:
        assert mount(running, "stray", stray).status_code == 200
        assert mount(running, "hub", hub).json()["error"]["code"] == "adapter_path_refused"
