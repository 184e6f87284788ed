"""Lazy, torch-free reader of safetensors files.

Input: a ``.safetensors`` file. Output: numpy arrays, one tensor at a time, read with
``os.pread`` so that nothing is memory-mapped and resident memory stays at the size of the
tensor being read (a memory map would count every page touched towards the process's RSS).
bfloat16 is widened to float32 exactly (it is the upper half of a float32).

File layout (https://github.com/huggingface/safetensors, "Format"): 8 bytes little-endian
header length N, N bytes of JSON ``{name: {dtype, shape, data_offsets: [begin, end]}}`` plus an
optional ``__metadata__`` entry, then the data; offsets are relative to the end of the header.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import CheckpointError

# dtype name in the header -> (numpy dtype of the stored bytes, bytes per element)
_STORED: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in a safetensors file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    end: int  # absolute file offset one past the last byte

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Widen bfloat16 values, given as their uint16 bit patterns, to float32 exactly."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def float32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (round to nearest even) and return the uint16 bit patterns."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
    return ((bits + rounding) >> np.uint32(16)).astype(np.uint16)


class SafetensorsFile:
    """One safetensors file, opened for reading single tensors.

    Raises:
        CheckpointError: the file is missing, its header is malformed, or it is shorter than
            its header says (a truncated download or copy).
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"{self.path}: file is {size} bytes, too short to be safetensors")
                (header_len,) = struct.unpack("<Q", head)
                if header_len > _MAX_HEADER or 8 + header_len > size:
                    raise CheckpointError(
                        f"{self.path}: header length {header_len} does not fit a {size}-byte file; "
                        "the file is truncated or not safetensors. Copy or download it again."
                    )
                header = json.loads(f.read(header_len))
        except OSError as exc:
            raise CheckpointError(f"cannot read {self.path}: {exc}") from exc
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise CheckpointError(f"{self.path}: header is not valid JSON ({str(exc)[:120]}); the file is corrupt") from exc
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: header is not a JSON object; the file is corrupt")
        metadata = header.pop("__metadata__", None) or {}
        self.metadata: dict[str, str] = metadata if isinstance(metadata, dict) else {}
        base = 8 + header_len
        self.tensors: dict[str, TensorInfo] = {}
        data_end = base
        for name, entry in header.items():
            try:
                begin, end = (int(x) for x in entry["data_offsets"])
                info = TensorInfo(name, str(entry["dtype"]), tuple(int(d) for d in entry["shape"]),
                                  base + begin, base + end)
            except (KeyError, TypeError, ValueError) as exc:
                raise CheckpointError(f"{self.path}: malformed header entry for '{name[:100]}'") from exc
            if not base <= info.begin <= info.end or any(d < 0 for d in info.shape):
                raise CheckpointError(f"{self.path}: tensor '{name[:100]}' has data_offsets {entry['data_offsets']} and "
                                      f"shape {list(info.shape)[:8]}; offsets must satisfy 0 <= begin <= end and "
                                      "dimensions be >= 0. The file is corrupt.")
            if info.dtype in _STORED and info.nbytes != info.numel * _STORED[info.dtype].itemsize:
                raise CheckpointError(
                    f"{self.path}: tensor '{name}' has {info.nbytes} bytes, expected "
                    f"{info.numel * _STORED[info.dtype].itemsize} for {info.dtype}{list(info.shape)}"
                )
            self.tensors[name] = info
            data_end = max(data_end, info.end)
        spans = sorted((t.begin, t.end, t.name) for t in self.tensors.values() if t.end > t.begin)
        for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:]):
            if begin_b < end_a:
                raise CheckpointError(f"{self.path}: the data of tensors '{a[:100]}' and '{b[:100]}' overlap; "
                                      "the file is corrupt")
        if data_end > size:
            raise CheckpointError(
                f"{self.path} is truncated: its header describes {data_end} bytes but the file has "
                f"{size}. Copy or download the checkpoint again."
            )

    def read(self, name: str, rows: slice | None = None) -> np.ndarray:
        """Read one tensor (or a range of its first dimension) as a numpy array.

        Floating-point tensors come back as float32 (float64 stays float64; float16 stays
        float16); bfloat16 is widened to float32.
        """
        info = self.tensors[name]
        if info.dtype not in _STORED:
            raise CheckpointError(
                f"{self.path}: tensor '{name}' has dtype {info.dtype}, which is not supported "
                f"(supported: {', '.join(_STORED)}). Quantized checkpoints must be dequantized first."
            )
        stored = _STORED[info.dtype]
        shape = list(info.shape)
        begin, count = info.begin, info.numel
        if rows is not None:
            if not shape:
                raise ValueError("cannot slice a scalar tensor")
            start, stop, step = rows.indices(shape[0])
            assert step == 1, "only contiguous row ranges are supported"
            row_elems = count // shape[0] if shape[0] else 0
            begin += start * row_elems * stored.itemsize
            shape[0] = max(0, stop - start)
            count = shape[0] * row_elems
        buf = _pread_exact(self.path, begin, count * stored.itemsize)
        arr = np.frombuffer(buf, dtype=stored, count=count).reshape(shape)
        if info.dtype == "BF16":
            return bf16_bits_to_float32(arr)
        return arr


def _pread_exact(path: Path, offset: int, length: int) -> bytearray:
    buf = bytearray(length)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < length:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise CheckpointError(f"{path}: unexpected end of file at byte {offset + done}")
            done += n
    finally:
        os.close(fd)
    return buf
