"""A small ONNX graph builder that streams weights into an external-data file.

Input: ops and numpy weights, one at a time. Output: an ``onnx.ModelProto`` whose
initializers point into one external data file, written as the weights arrive, so the
model never has to be held in memory whole. Weight offsets are aligned to 4096 bytes so
that runtimes can memory-map them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ALIGN = 4096
NP_TO_ONNX = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.int8): TensorProto.INT8,
    np.dtype(np.bool_): TensorProto.BOOL,
}


class GraphBuilder:
    """Collects nodes, inputs and outputs; writes initializers to ``data_path`` on the fly."""

    def __init__(self, data_path: Path, location: str | None = None):
        self.data_path = Path(data_path)
        self.location = location or self.data_path.name
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.initializers: list[TensorProto] = []
        self._file = open(self.data_path, "wb")
        self._offset = 0
        self._counts: dict[str, int] = {}
        self._consts: dict[tuple, str] = {}
        self.bytes_written = 0

    # -- names ---------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        n = self._counts.get(hint, 0)
        self._counts[hint] = n + 1
        return hint if n == 0 else f"{hint}_{n}"

    # -- graph I/O -----------------------------------------------------------
    def input(self, name: str, elem_type: int, shape: Sequence[int | str]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))
        return name

    def output(self, name: str, elem_type: int, shape: Sequence[int | str]) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))

    # -- weights ---------------------------------------------------------------
    def weight(self, name: str, array: np.ndarray) -> str:
        """Append one weight to the data file and declare it as an external initializer."""
        array = np.ascontiguousarray(array)
        return self.weight_chunks(name, array.shape, array.dtype, iter([array]))

    def weight_chunks(self, name: str, shape: Sequence[int], dtype: np.dtype, chunks: Iterator[np.ndarray]) -> str:
        """Like ``weight`` but from row chunks, so a large tensor is never whole in memory."""
        dtype = np.dtype(dtype)
        start = self._aligned()
        for chunk in chunks:
            chunk = np.ascontiguousarray(chunk, dtype=dtype)
            self._file.write(chunk.data)
            self._offset += chunk.nbytes
        length = self._offset - start
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        assert length == expected, f"{name}: wrote {length} bytes, expected {expected}"
        return self._external(name, shape, NP_TO_ONNX[dtype], start, length)

    def packed_weight(self, name: str, shape: Sequence[int], data_type: int, packed: np.ndarray) -> str:
        """A weight of a sub-byte ONNX type (INT4, UINT4) from its packed bytes."""
        start = self._aligned()
        self._file.write(np.ascontiguousarray(packed, np.uint8).data)
        self._offset += packed.nbytes
        return self._external(name, shape, data_type, start, packed.nbytes)

    def _aligned(self) -> int:
        """Pad the data file to ``ALIGN``; the offset the next weight starts at."""
        pad = (-self._offset) % ALIGN
        if pad:
            self._file.write(b"\0" * pad)
            self._offset += pad
        return self._offset

    def _external(self, name: str, shape: Sequence[int], data_type: int, start: int, length: int) -> str:
        tensor = TensorProto()
        tensor.name = name
        tensor.data_type = data_type
        tensor.dims.extend(int(d) for d in shape)
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.location), ("offset", str(start)), ("length", str(length))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        self.initializers.append(tensor)
        self.bytes_written += length
        return name

    def const(self, value: Any, hint: str = "const") -> str:
        """A small constant stored inside the model; equal constants are shared."""
        arr = np.asarray(value)
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            name = self.fresh(hint)
            self.initializers.append(numpy_helper.from_array(arr, name))
            self._consts[key] = name
        return self._consts[key]

    def ints(self, values: Sequence[int], hint: str = "shape") -> str:
        return self.const(np.asarray(values, dtype=np.int64), hint)

    # -- nodes ---------------------------------------------------------------
    def op(self, op_type: str, inputs: Sequence[str], hint: str | None = None, **attrs: Any) -> str:
        """Add a node with one output and return the output's name."""
        return self.op_n(op_type, inputs, hint, 1, **attrs)[0]

    def op_n(self, op_type: str, inputs: Sequence[str], hint: str | None, n_out: int, **attrs: Any) -> list[str]:
        """Add a node with ``n_out`` outputs and return their names."""
        base = self.fresh(hint or op_type.lower())
        outs = [base] if n_out == 1 else [f"{base}_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=f"{base}_node", **attrs))
        return outs

    @contextmanager
    def apart(self) -> Iterator[list[onnx.NodeProto]]:
        """The nodes added inside go to the list yielded (a branch of an ``If``), not to the graph;
        the weights and constants they take stay the graph's, read from the branch by name."""
        kept, self.nodes = self.nodes, []
        try:
            yield self.nodes
        finally:
            self.nodes = kept

    def if_op(self, cond: str, then: tuple[list[onnx.NodeProto], str], other: tuple[list[onnx.NodeProto], str],
              elem_type: int, hint: str) -> str:
        """``then``'s result where the boolean scalar ``cond`` holds, else ``other``'s: each a branch's
        nodes (``apart``) and its result, of ``elem_type``. Only the branch taken runs."""
        out = self.fresh(hint)

        def branch(nodes: list[onnx.NodeProto], result: str, label: str) -> onnx.GraphProto:
            return helper.make_graph(nodes, f"{out}.{label}", [], [helper.make_tensor_value_info(result, elem_type, None)])

        self.nodes.append(helper.make_node("If", [cond], [out], name=f"{out}_node", then_branch=branch(*then, "then"),
                                           else_branch=branch(*other, "else")))
        return out

    def rename_output(self, tensor: str, name: str) -> str:
        """Give an intermediate tensor a graph-output name; use the returned name from then on.

        The producing node's output is renamed in place when nothing has consumed the tensor yet
        (no extra node for the runtime to schedule); otherwise an Identity node is added.
        """
        if not any(_reads(n, tensor) for n in self.nodes):
            for node in reversed(self.nodes):
                if tensor in node.output:
                    node.output[list(node.output).index(tensor)] = name
                    return name
        self.nodes.append(helper.make_node("Identity", [tensor], [name], name=f"{name}_identity"))
        return name

    # -- finish --------------------------------------------------------------
    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            self._file.close()

    def model(self, graph_name: str, opset: int, metadata: dict[str, str] | None = None) -> onnx.ModelProto:
        self.close()
        graph = helper.make_graph(self.nodes, graph_name, self.inputs, self.outputs, self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                                  producer_name="autoglm-trt")
        model.ir_version = 8 if opset < 21 else 10  # readable by ONNX Runtime >= 1.14 and TensorRT 10; opset 21 needs 10
        for key, value in (metadata or {}).items():
            entry = model.metadata_props.add()
            entry.key, entry.value = key, value
        return model


def row_chunks(read: Callable[[int, int], np.ndarray], rows: int, chunk_rows: int) -> Iterator[np.ndarray]:
    """Yield ``read(start, stop)`` over ``[0, rows)`` in pieces of ``chunk_rows``."""
    for start in range(0, rows, chunk_rows):
        yield read(start, min(rows, start + chunk_rows))


def _reads(node: onnx.NodeProto, tensor: str) -> bool:
    """Whether ``node`` takes ``tensor``, as an input or inside a branch (an ``If``'s)."""
    return tensor in node.input or any(_reads(n, tensor) for a in node.attribute if a.type == onnx.AttributeProto.GRAPH
                                       for n in a.g.node)
