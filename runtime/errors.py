"""Errors that several runtime modules raise and the layers above catch by type.

A leaf module (it imports nothing of flow's), so that the modules that find, import and load models can share
one error without importing each other: :mod:`runtime.models`, :mod:`runtime.gguf_file` (whose
``GGUFImportError`` is one), :mod:`runtime.gguf_import`, :mod:`runtime.vision`, :mod:`runtime.audio` and
:mod:`runtime.embeddings`.
"""

from __future__ import annotations


class ModelNotAvailable(Exception):
    """The model cannot be found, fetched or loaded; the message says what to do."""
