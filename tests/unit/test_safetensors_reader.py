import json
import struct

import numpy as np
import pytest

from autoglm_trt.errors import CheckpointError
from autoglm_trt.model.safetensors import SafetensorsFile, bf16_bits_to_float32, float32_to_bf16_bits


def write_st(path, tensors: dict[str, tuple[str, np.ndarray]]):
    header, blobs, offset = {}, [], 0
    for name, (dtype, arr) in tensors.items():
        raw = arr.tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def test_bf16_widening_is_exact():
    bits = np.array([0x3F80, 0xC000, 0x0000, 0x7F80, 0x3EAB], np.uint16)
    assert bf16_bits_to_float32(bits).tolist() == [1.0, -2.0, 0.0, float("inf"), 0.333984375]


def test_bf16_rounding_to_nearest_even():
    vals = np.array([1.0, 1.00390625, 1.01171875, -3.0], np.float32)  # halfway cases round to even
    assert float32_to_bf16_bits(vals).tolist() == [0x3F80, 0x3F80, 0x3F82, 0xC040]


def test_reads_dtypes_and_row_ranges(tmp_path):
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    b = np.array([[1.5, -2.0], [0.25, 8.0]], np.float32)
    write_st(tmp_path / "m.safetensors", {"a": ("F32", a), "b": ("BF16", float32_to_bf16_bits(b)),
                                          "c": ("F16", a.astype(np.float16))})
    f = SafetensorsFile(tmp_path / "m.safetensors")
    assert f.tensors["a"].shape == (4, 3)
    np.testing.assert_array_equal(f.read("a"), a)
    np.testing.assert_array_equal(f.read("a", slice(1, 3)), a[1:3])
    np.testing.assert_array_equal(f.read("b"), b)
    assert f.read("c").dtype == np.float16


def test_truncated_file_is_reported(tmp_path):
    write_st(tmp_path / "m.safetensors", {"a": ("F32", np.ones((64, 64), np.float32))})
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "m.safetensors").write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        SafetensorsFile(tmp_path / "m.safetensors")


def test_garbage_header_is_reported(tmp_path):
    (tmp_path / "m.safetensors").write_bytes(struct.pack("<Q", 10) + b"not json!!" + b"\0" * 10)
    with pytest.raises(CheckpointError, match="not valid JSON"):
        SafetensorsFile(tmp_path / "m.safetensors")
