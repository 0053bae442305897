"""What the loader reads of a GGUF file, its architecture and its tensor table, in one pass over
the header.

gguf's GGUFReader makes a numpy view of every metadata element: a vocabulary of 49,152 strings
and its merges cost 4 s on a 2-core host, on every start, and the loader read the file twice.
This reads the metadata it needs and steps over the rest (an array of strings is one length
read per element); tensor data stays memory-mapped, shaped as GGUFReader shapes it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)
from gguf.quants import quant_shape_to_byte_shape
from kvfleet.runtime.models.errors import ModelLoadError

# Fixed-size metadata value types: struct format (little-endian).
_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}  # fmt: skip
# Tensor types stored as plain numbers; every other type is blocks of bytes.
_PLAIN = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}  # fmt: skip
# Metadata kept (scalars and strings only): what the loader and the data offset need.
_KEPT = {"general.architecture", "general.alignment"}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor: its type, its shape in GGUF order (innermost first) and its data, read-only
    and memory-mapped (plain types as numbers, block types as uint8 rows of blocks)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True, slots=True)
class GGUFIndex:
    path: Path
    architecture: str
    tensors: dict[str, GGUFTensor]


class _Header:
    """A cursor over the file's bytes."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.at = buf, 0

    def unpack(self, fmt: str) -> int | float | bool:
        (value,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = int(self.unpack("<Q"))
        text = bytes(self.buf[self.at : self.at + n]).decode("utf-8")
        self.at += n
        return text

    def value(self, kind: int, keep: bool) -> object:
        """Read (keep) or step over one metadata value of type `kind`."""
        if kind == GGUFValueType.STRING:
            if keep:
                return self.string()
            n = int(self.unpack("<Q"))  # read before `at` moves past it
            self.at += n
            return None
        if kind == GGUFValueType.ARRAY:
            item, count = int(self.unpack("<I")), int(self.unpack("<Q"))
            if item in _SCALARS:
                size = count * struct.calcsize(_SCALARS[GGUFValueType(item)])
                self.at += size
            else:
                for _ in range(count):
                    self.value(item, keep=False)
            return None
        return self.unpack(_SCALARS[GGUFValueType(kind)])


def read_gguf_index(path: Path) -> GGUFIndex:
    """The architecture and tensor table of a little-endian GGUF file (v2 or v3); a
    ModelLoadError naming the file when it is not one."""
    try:
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
        return _parse(path, mapped)
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError, IndexError, struct.error, UnicodeDecodeError) as e:
        raise ModelLoadError(f"model: {path} is not a readable GGUF file ({e})") from None


def _parse(path: Path, mapped: np.ndarray) -> GGUFIndex:
    header = _Header(memoryview(mapped))
    if header.unpack("<I") != GGUF_MAGIC:
        raise ValueError("no GGUF magic number at its start")
    version = int(header.unpack("<I"))
    if version not in (2, 3):
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if swapped in (2, 3):
            raise ModelLoadError(f"model: {path} is a big-endian GGUF file, which is not supported")
        raise ValueError(f"GGUF version {version}; versions 2 and 3 are read")
    n_tensors, n_kv = int(header.unpack("<Q")), int(header.unpack("<Q"))
    meta: dict[str, object] = {}
    for _ in range(n_kv):
        key = header.string()
        kind = int(header.unpack("<I"))
        value = header.value(kind, keep=key in _KEPT)
        if key in _KEPT:
            meta[key] = value
    table = []
    for _ in range(n_tensors):
        name = header.string()
        dims = tuple(int(header.unpack("<Q")) for _ in range(int(header.unpack("<I"))))
        table.append((name, dims, GGMLQuantizationType(header.unpack("<I")), header.unpack("<Q")))
    architecture = meta.get("general.architecture")
    if not isinstance(architecture, str):
        raise ModelLoadError(f"model: {path} has no general.architecture field")
    alignment = int(meta.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))  # type: ignore[call-overload]
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment} is not a power of two")
    start = -(-header.at // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, kind, offset in table:
        if name in tensors:
            raise ValueError(f"the tensor {name!r} is listed twice")
        tensors[name] = GGUFTensor(name, kind, dims, _data(mapped, start + int(offset), dims, kind))
    return GGUFIndex(path, architecture, tensors)


def _data(
    mapped: np.ndarray, at: int, dims: tuple[int, ...], kind: GGMLQuantizationType
) -> np.ndarray:
    """The tensor's bytes as GGUFReader shapes them: numbers [dims reversed], or rows of blocks."""
    elements = int(np.prod(dims))
    block_size, type_size = GGML_QUANT_SIZES[kind]
    n_bytes = elements * type_size // block_size
    if at + n_bytes > mapped.size:
        raise ValueError(f"a tensor runs past the end of the file ({at + n_bytes} > {mapped.size})")
    shape = tuple(reversed(dims))
    raw = mapped[at : at + n_bytes]
    if kind in _PLAIN:
        return raw.view(_PLAIN[kind]).reshape(shape)
    return raw.reshape(quant_shape_to_byte_shape(shape, kind))
