"""Tiny random-weight models of real architectures, built offline: the smoke-test models of tests, demos and
benchmarks.

Rules of this package
---------------------
* It builds models; it serves none. The engine, the device thread and the caches never import it (nor anything
  that imports it); a ``tiny:PRESET`` model reference reaches it only through :mod:`runtime.models`, which turns
  the reference into a directory and imports this package when it sees one.
* What the rest of the repository uses is exported here (:data:`__all__`); the modules below are imported by
  their own paths only for what is particular to them (``runtime.tiny.adapters``, ``runtime.tiny.vlm``, …).
* Builds are byte-for-byte deterministic: a spec's files depend on its fields and :data:`BUILDER_VERSION` only,
  and builds are cached under a hash of both. Change what a spec builds and bump the version.

Theory of operation
-------------------
Tests, demos and benchmarks need models without a network or a model hub, so this package writes a complete
Hugging Face style checkpoint directory that ``mlx_lm.load(path)`` (or mlx-vlm, mlx-embeddings, mlx-audio for
the other kinds) reads like any downloaded model:

* **weights**: the real model class (``qwen3``, ``llama``, ``gemma3_text``, the families' mlx-lm
  architectures, …) is instantiated from the same config dict that goes into ``config.json``; every matrix is
  then re-drawn from N(0, 0.02) (the HF ``initializer_range``) with keys derived from ``spec.seed`` only.
  qwen3 and llama keep a separate ``lm_head``: with tied embeddings a random model mostly repeats its last
  input token.
* **tokenizer**: a byte-level BPE (Llama-3 style split regex + ByteLevel pre-tokenizer and decoder, so any
  UTF-8 round-trips) trained with the ``tokenizers`` library on an embedded corpus, padded with deterministic
  pseudo-words so it can reach the requested vocabulary size. Each architecture gets its real special tokens
  and its real chat template; any shortfall in the vocabulary is filled with reserved special tokens (Llama 3
  and Gemma do the same).
* **marker**: ``config.json`` carries ``"flow_smoke_test": true`` and a README says the output is gibberish,
  so nobody mistakes it for a real model.

A build is staged in a temporary directory next to its destination and renamed into place, so a crash never
leaves half a model. :func:`ensure_tiny_model` caches builds under ``$FLOW_CACHE_DIR`` (or ``~/.cache/flow``)
keyed by a hash of the spec; when two processes race, the first rename wins and the loser discards its copy.

Modules, each importing only those before it:

* :mod:`runtime.tiny.templates`: the real checkpoints' chat templates;
* :mod:`runtime.tiny.archs`: what differs per text architecture (special tokens, template, mlx-lm module);
* :mod:`runtime.tiny.spec`: :class:`TinySpec`, :class:`~runtime.tiny.spec.VisionSpec`, the presets;
* :mod:`runtime.tiny.tokenizer`: the corpus and the BPE and WordPiece tokenizers trained on it;
* :mod:`runtime.tiny.qwen_vl`: what the Qwen vision-language models (3-D positions) have of their own;
* :mod:`runtime.tiny.vlm`, :mod:`runtime.tiny.audio`: the vision-language and audio models' files;
* :mod:`runtime.tiny.build`: configs, weights and files of the text models and encoders, the cache of builds;
* :mod:`runtime.tiny.adapters` (on its own): random LoRA adapters for a built model.
"""

from __future__ import annotations

from runtime.tiny.build import build_tiny_model, ensure_tiny_model, is_smoke_test_model, tiny_models_dir
from runtime.tiny.spec import PRESETS, SMOKE_TEST_LABEL, TinySpec, arch_info

__all__ = [
    "PRESETS",
    "SMOKE_TEST_LABEL",
    "TinySpec",
    "arch_info",
    "build_tiny_model",
    "ensure_tiny_model",
    "is_smoke_test_model",
    "tiny_models_dir",
]
