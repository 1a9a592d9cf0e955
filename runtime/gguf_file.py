"""Reading GGUF files: the parts of a split file, the header (metadata and tensor table), tensors as float32.

GGUF (llama.cpp's format) is a header — key/value metadata, then a table of tensors (name, dimensions,
ggml type, offset) — and the tensors' bytes, aligned. A split GGUF (``x-00001-of-00003.gguf``) repeats the
format per part: the first part carries the model's metadata, every part some of the tensors, and each
names its place in ``split.no``/``split.count``.

The header is read here rather than with ``gguf.GGUFReader``, which builds one numpy view per vocabulary
entry and needs half a minute for a 150k-token vocabulary; the ``gguf`` package does the dequantizing.
Nothing is read from a tensor until :func:`tensor_array` asks for it (the files are memory-mapped).
"""

from __future__ import annotations

import mmap
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from runtime.errors import ModelNotAvailable

GGUF_MAGIC = b"GGUF"
SPLIT_NAME = re.compile(r"^(?P<base>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


class GGUFImportError(ModelNotAvailable):
    """A GGUF file cannot be imported; the message says why and what to do instead."""


def is_gguf_reference(ref: str) -> bool:
    """True when a model reference names a GGUF file (by its extension)."""
    return ref.lower().endswith(".gguf")


def gguf_model_name(ref: str) -> str:
    """The name a GGUF is served under: its file name without ``.gguf`` and the split suffix."""
    name = Path(ref).name
    split = SPLIT_NAME.match(name)
    if split is not None:
        return split["base"]
    return name[: -len(".gguf")] if is_gguf_reference(name) else name


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: where its bytes are and what they hold."""

    name: str
    dims: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    qtype: GGMLQuantizationType
    part: int  # index into GGUFSource.parts
    offset: int  # of its first byte in that part
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy / MLX order."""
        return tuple(reversed(self.dims))

    @property
    def elements(self) -> int:
        return int(np.prod(self.dims)) if self.dims else 1


class Metadata:
    """The key/value metadata of a GGUF, read with the type each key must have."""

    def __init__(self, values: Mapping[str, object], source: str) -> None:
        self.values = dict(values)
        self.source = source

    def _checked(self, key: str, accepts: Callable[[object], bool], what: str) -> object:
        value = self.values.get(key)
        if value is not None and not accepts(value):
            raise GGUFImportError(f"{self.source}: metadata {key!r} is {value!r:.80}, expected {what}")
        return value

    def _missing(self, key: str) -> GGUFImportError:
        return GGUFImportError(f"{self.source}: the metadata has no {key!r}; the file is incomplete or not a model")

    def optional_integer(self, key: str) -> int | None:
        value = self._checked(key, lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer")
        return value if isinstance(value, int) else None

    def integer(self, key: str, default: int | None = None) -> int:
        value = self.optional_integer(key)
        if value is not None:
            return value
        if default is None:
            raise self._missing(key)
        return default

    def number(self, key: str, default: float | None = None) -> float:
        value = self._checked(key, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number")
        if isinstance(value, (int, float)):
            return _float32_decimal(float(value))
        if default is None:
            raise self._missing(key)
        return default

    def text(self, key: str) -> str | None:
        value = self._checked(key, lambda v: isinstance(v, str), "a string")
        return value if isinstance(value, str) else None

    def flag(self, key: str, default: bool) -> bool:
        value = self._checked(key, lambda v: isinstance(v, bool), "true or false")
        return value if isinstance(value, bool) else default

    def strings(self, key: str) -> list[str] | None:
        return self._list(key, str, "strings")

    def integers(self, key: str) -> list[int] | None:
        return self._list(key, int, "integers")

    def numbers(self, key: str) -> list[float] | None:
        return self._list(key, float, "numbers")

    def _list(self, key: str, kind: type[Any], what: str) -> list[Any] | None:
        value = self._checked(key, lambda v: isinstance(v, list) and all(isinstance(x, kind) for x in v[:1]),
                              f"a list of {what}")
        return value if isinstance(value, list) else None


def _float32_decimal(value: float) -> float:
    """GGUF stores float32: 9.999999747378752e-06 was written as 1e-05; give back what was written."""
    return float(str(np.float32(value)))


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF (all its parts): metadata from the first, tensors from all."""

    parts: tuple[Path, ...]
    metadata: Metadata
    tensors: tuple[TensorInfo, ...]

    @property
    def architecture(self) -> str:
        arch = self.metadata.text("general.architecture")
        if arch is None:
            raise GGUFImportError(f"{self.metadata.source}: the metadata names no architecture "
                                  "(general.architecture); it is not a model file")
        return arch


def gguf_parts(path: Path) -> tuple[Path, ...]:
    """The file, or all parts of the split GGUF that ``path`` is one part of, in order."""
    if not path.is_file():
        raise GGUFImportError(f"{path}: no such GGUF file")
    split = SPLIT_NAME.match(path.name)
    if split is None:
        return (path,)
    count = int(split["count"])
    parts = tuple(path.with_name(f"{split['base']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1))
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise GGUFImportError(f"{path} is part of a GGUF split in {count} files, and {', '.join(missing)} "
                              f"{'is' if len(missing) == 1 else 'are'} missing beside it")
    return parts


def read_source(parts: tuple[Path, ...]) -> GGUFSource:
    """Metadata and tensor table of every part (no tensor data is read)."""
    headers = [_read_header(part, index) for index, part in enumerate(parts)]
    metadata = Metadata(headers[0][0], str(parts[0]))
    _check_split(parts, [h[0] for h in headers], sum(len(h[1]) for h in headers))
    return GGUFSource(parts, metadata, tuple(t for _, tensors in headers for t in tensors))


def _check_split(parts: tuple[Path, ...], metadata: list[dict[str, object]], tensor_count: int) -> None:
    for index, (part, values) in enumerate(zip(parts, metadata)):
        count, number = values.get("split.count", 1), values.get("split.no", 0)
        if count != len(parts) or number != index:
            raise GGUFImportError(f"{part}: its split metadata says part {number} of {count} (counting from 0), "
                                  f"but it was found as part {index} of {len(parts)}; the files do not belong together")
    expected = metadata[0].get("split.tensors.count", tensor_count)
    if expected != tensor_count:
        raise GGUFImportError(f"{parts[0]}: the split should hold {expected} tensors, its parts hold {tensor_count}")


class _HeaderReader:
    """A cursor over a GGUF header (little-endian, versions 2 and 3)."""

    SCALARS: dict[int, str] = {
        GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
        GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
        GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
    }

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        length = self.unpack("Q")
        if self.pos + length > len(self.buffer):
            raise ValueError("a string runs past the end of the file")
        raw = self.buffer[self.pos:self.pos + length]
        self.pos += length
        return raw.decode("utf-8", "replace")  # a few vocabularies hold invalid UTF-8 pieces

    def value(self, kind: int) -> object:
        if kind in self.SCALARS:
            return self.unpack(self.SCALARS[kind])
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            return self.array()
        raise ValueError(f"unknown metadata value type {kind}")

    def array(self) -> list[Any]:
        kind, count = self.unpack("I"), self.unpack("Q")
        if kind in self.SCALARS:  # numbers in one read: vocabularies hold hundreds of thousands
            dtype = np.dtype("<" + self.SCALARS[kind])
            values = np.frombuffer(self.buffer, dtype, count, self.pos)
            self.pos += dtype.itemsize * count
            items: list[Any] = values.tolist()
            return items
        return [self.value(kind) for _ in range(count)]


def _read_header(path: Path, part: int) -> tuple[dict[str, object], list[TensorInfo]]:
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            return _parse_header(_HeaderReader(buffer), part, len(buffer))
    except (ValueError, struct.error, OverflowError) as exc:
        raise GGUFImportError(f"{path}: not a readable GGUF file ({exc})") from None


def _parse_header(reader: _HeaderReader, part: int, size: int) -> tuple[dict[str, object], list[TensorInfo]]:
    if bytes(reader.buffer[:4]) != GGUF_MAGIC:
        raise ValueError("it does not start with the GGUF magic")
    reader.pos = 4
    version = reader.unpack("I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (big-endian or too new); flow reads little-endian versions 2 and 3")
    tensor_count, kv_count = reader.unpack("Q"), reader.unpack("Q")
    metadata: dict[str, object] = {}
    for _ in range(kv_count):
        key = reader.string()
        metadata[key] = reader.value(reader.unpack("I"))
    raw = [(reader.string(), [reader.unpack("Q") for _ in range(reader.unpack("I"))], reader.unpack("I"),
            reader.unpack("Q")) for _ in range(tensor_count)]
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"general.alignment is {alignment!r}")
    data_start = -(-reader.pos // alignment) * alignment
    tensors = [_tensor_info(name, dims, kind, data_start + offset, part) for name, dims, kind, offset in raw]
    for t in tensors:
        if t.offset + t.n_bytes > size:
            raise ValueError(f"tensor {t.name} runs past the end of the file (truncated?)")
    return metadata, tensors


def _tensor_info(name: str, dims: list[int], kind: int, offset: int, part: int) -> TensorInfo:
    try:
        qtype = GGMLQuantizationType(kind)
    except ValueError:
        raise ValueError(f"tensor {name} has an unknown type {kind}") from None
    block, type_size = GGML_QUANT_SIZES[qtype]
    elements = int(np.prod(dims)) if dims else 1
    if dims and dims[0] % block:
        raise ValueError(f"tensor {name}: {dims[0]} values per row is not a whole number of {qtype.name} blocks")
    return TensorInfo(name, tuple(dims), qtype, part, offset, elements // block * type_size)


def tensor_array(source: GGUFSource, tensor: TensorInfo) -> np.ndarray[Any, np.dtype[np.float32]]:
    """The tensor as float32 in numpy/MLX shape, dequantized by the gguf package."""
    raw = np.memmap(source.parts[tensor.part], np.uint8, "r", tensor.offset, tensor.n_bytes)
    rows = tensor.shape[:-1] if tensor.dims else ()
    try:
        values = dequantize(raw.reshape(*rows, -1), tensor.qtype)
    except NotImplementedError:
        raise GGUFImportError(f"{source.metadata.source}: tensor {tensor.name} is {tensor.qtype.name}, which the "
                              "gguf package cannot dequantize; re-quantize the GGUF with llama.cpp "
                              "(llama-quantize … Q8_0) and import that") from None
    return np.asarray(values, dtype=np.float32).reshape(tensor.shape)
