"""Weights of an export, read back by name: the graph builder's ``WeightSource``.

Input: an export directory (``model.onnx`` + ``model.onnx.data``). Output: the same fused,
transposed arrays the exporter wrote (``layers.<i>.qkv.weight`` is ``[hidden, q+2kv]``, Q rows
already rope-ordered and scaled), so an INT8 graph can be rebuilt from an export without
the original checkpoint. Tensors are read one at a time with ``pread``; ``widen`` returns a
float16 export's tensors as float32 (exact), for a float32 graph built from it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

from ..artifacts import ArtifactError, ExportRecord, inside
from ..errors import AutoGLMError
from ..model.spec import ModelSpec

_DTYPES = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16, TensorProto.INT64: np.int64}


class ExportedWeights:
    def __init__(self, export_dir: Path, onnx_file: str = "model.onnx", widen: bool = False):
        self.dir, self.widen = Path(export_dir), widen
        model = onnx.load(str(self.dir / onnx_file), load_external_data=False)
        self._info: dict[str, tuple[str, int, int, tuple[int, ...], type]] = {}
        for t in model.graph.initializer:
            if t.data_location != TensorProto.EXTERNAL:
                continue
            ext = {e.key: e.value for e in t.external_data}
            inside(self.dir, ext.get("location"), f"{self.dir / onnx_file}: the external data of '{t.name[:80]}'")
            try:
                offset, length = int(ext.get("offset", 0)), int(ext["length"])
            except (KeyError, ValueError) as exc:
                raise ArtifactError(f"{self.dir / onnx_file}: '{t.name[:80]}' has no valid external data offset "
                                    "and length") from exc
            if offset < 0 or length < 0 or t.data_type not in _DTYPES:
                raise ArtifactError(f"{self.dir / onnx_file}: '{t.name[:80]}' has a bad offset, length or type")
            self._info[t.name] = (ext["location"], offset, length, tuple(t.dims), _DTYPES[t.data_type])

    def layer_bytes(self, i: int) -> int:
        """Bytes of layer i's weights in the data file."""
        prefix = f"layers.{i}."
        return sum(length for name, (_, _, length, _, _) in self._info.items() if name.startswith(prefix))

    def total_bytes(self) -> int:
        return sum(length for _, _, length, _, _ in self._info.values())

    def has(self, name: str) -> bool:
        return name in self._info

    def read(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
        if name not in self._info:
            raise AutoGLMError(f"{self.dir}: the export has no weight '{name}'; was it made by this version?")
        location, offset, length, shape, dtype = self._info[name]
        row_bytes = length // shape[0] if shape else length
        if rows is not None:
            offset += rows[0] * row_bytes
            length = (rows[1] - rows[0]) * row_bytes
            shape = (rows[1] - rows[0], *shape[1:])
        buf = bytearray(length)
        view = memoryview(buf)
        fd = os.open(self.dir / location, os.O_RDONLY)
        try:
            got = 0
            while got < length:  # one pread returns at most ~2 GiB on Linux: a large tensor takes several
                n = os.preadv(fd, [view[got:]], offset + got)
                if n == 0:
                    raise AutoGLMError(f"{self.dir / location} is truncated: '{name}' could not be read")
                got += n
        finally:
            os.close(fd)
        out: np.ndarray = np.frombuffer(buf, dtype=dtype).reshape(shape)
        return out.astype(np.float32) if self.widen and dtype is np.float16 else out

    # -- WeightSource ------------------------------------------------------------
    def norm(self, i: int | None, role: str) -> np.ndarray:
        return self.read("final_norm.weight" if i is None else f"layers.{i}.{role}_norm.weight")

    def _linear(self, name: str) -> tuple[np.ndarray, np.ndarray | None]:
        bias = f"{name}.bias"
        return self.read(f"{name}.weight"), (self.read(bias) if self.has(bias) else None)

    def qkv(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        return self._linear(f"layers.{i}.qkv")

    def o_proj(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        return self._linear(f"layers.{i}.o_proj")

    def gate_up(self, i: int) -> np.ndarray:
        return self.read(f"layers.{i}.gate_up.weight")

    def down(self, i: int) -> np.ndarray:
        return self.read(f"layers.{i}.down.weight")

    def embedding_name(self) -> str:
        return "embed_tokens.weight"

    def lm_head_name(self) -> str | None:
        return "lm_head.weight" if self.has("lm_head.weight") else None

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        return self.read(name, (start, stop))


@dataclass(frozen=True)
class OpenedExport:
    """An export directory opened once: its record (and so its model's spec) and its weights'
    index, passed down the stages that read it (calibration's passes, the INT4 build) instead of
    the directory, which each would open again."""

    record: ExportRecord
    weights: ExportedWeights

    @classmethod
    def open(cls, export_dir: Path, widen: bool = False) -> OpenedExport:
        """``widen``: a float16 export's weights read as float32 (``ExportedWeights``)."""
        return cls.of(ExportRecord.read(export_dir), widen)

    @classmethod
    def of(cls, record: ExportRecord, widen: bool = False) -> OpenedExport:
        """The export whose record was read already (and checked: its graph is the float
        ``model.onnx`` whose weights are indexed here)."""
        return cls(record, ExportedWeights(record.dir, widen=widen))

    @property
    def dir(self) -> Path:
        return self.record.dir

    @property
    def spec(self) -> ModelSpec:
        return self.record.spec
