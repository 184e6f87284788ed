"""Give the engine graph the native ``RopeQKV`` operator: each layer's QKV split and rope in one node.

Per layer ``i`` the engine graph (``graph/decoder.py``) splits the fused QKV projection and
applies rope in eight nodes: ``Split`` (outputs ``layers.<i>.qkv_split_0`` and ``_1``),
``Reshape`` to heads, ``x * cos + (x @ R) * sin`` (``Mul``, ``MatMul``, ``Mul``, ``Add``), ``Split``
into queries and keys (axis 2), and ``Reshape`` of the values. At batch 1 each node costs more
in ONNX Runtime's dispatch than in arithmetic. ``rewrite`` replaces the eight with one
``autoglm.trt.RopeQKV`` (``csrc/rope_qkv.c``) whose outputs are the same three tensors, equal
to the graph's. A layer whose nodes do not have this shape (or whose intermediate tensors have
other readers) is left as it is. For ONNX Runtime alone, in the engine's native graph.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ....graph import names
from .common import DOMAIN, graph_inputs, other_input, use_domain

OP = "RopeQKV"
HEADS = "rope_qkv.heads"  # int64 [query heads, KV heads]


def turn_entries(rotate: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """R's nonzero entries row by row: int32 ``[count, 2]`` (row, column) and float32 ``[count]``,
    the operator's form of R (a row-by-row product adds them in this order)."""
    rows, cols = np.nonzero(rotate)
    return np.stack([rows, cols], axis=1).astype(np.int32), rotate[rows, cols].astype(np.float32)


def rewrite(model: onnx.ModelProto, num_layers: int, num_heads: int, num_kv_heads: int, weights_dir: Path) -> int:
    """Fuse in place (R read from the graph, external data under ``weights_dir``); the number
    of layers fused."""
    graph = model.graph
    old = list(graph.node)  # holds the nodes' wrappers, so the id()s below stay theirs
    producer = {o: n for n in old for o in n.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in old:
        for name in n.input:
            readers.setdefault(name, []).append(n)
    in_branches = {name for n in old for a in n.attribute if a.type == onnx.AttributeProto.GRAPH
                   for name in graph_inputs(a.g)}
    inits = {t.name: t for t in graph.initializer}

    def only_reader(name: str, op: str) -> onnx.NodeProto | None:
        found = readers.get(name, [])
        return found[0] if len(found) == 1 and found[0].op_type == op and name not in in_branches else None

    def layer(i: int) -> tuple[list[onnx.NodeProto], onnx.NodeProto] | None:
        parts = [names.in_layer(i, f"{names.QKV_SPLIT}_{k}") for k in (0, 1)]  # the graph builder's op_n outputs
        split = producer.get(parts[0])
        if split is None or split.op_type != "Split" or list(split.output) != parts:
            return None
        to_heads, v_heads = only_reader(split.output[0], "Reshape"), only_reader(split.output[1], "Reshape")
        if to_heads is None or v_heads is None:
            return None
        qk = to_heads.output[0]
        uses = {n.op_type: n for n in readers.get(qk, [])}
        if len(readers.get(qk, [])) != 2 or set(uses) != {"Mul", "MatMul"} or qk in in_branches:
            return None
        turn, by_cos = uses["MatMul"], uses["Mul"]
        rotate = inits.get(turn.input[1])
        if turn.input[0] != qk or rotate is None or rotate.data_type != TensorProto.FLOAT or len(rotate.dims) != 2:
            return None
        by_sin = only_reader(turn.output[0], "Mul")
        add = only_reader(by_cos.output[0], "Add")
        if by_sin is None or add is None or set(add.input) != {by_cos.output[0], by_sin.output[0]} or \
                only_reader(by_sin.output[0], "Add") is not add:
            return None
        heads = only_reader(add.output[0], "Split")
        if heads is None or len(heads.output) != 2 or not any(a.name == "axis" and a.i == 2 for a in heads.attribute):
            return None
        cos, sin = other_input(by_cos, qk), other_input(by_sin, turn.output[0])
        index, value = f"{turn.input[1]}.turn_index", f"{turn.input[1]}.turn_value"
        if index not in entries:
            entries[index], entries[value] = turn_entries(numpy_helper.to_array(rotate, base_dir=str(weights_dir)))
        node = helper.make_node(OP, [split.input[0], cos, sin, index, value, HEADS],
                                [heads.output[0], heads.output[1], v_heads.output[0]],
                                name=names.in_layer(i, "rope_qkv"), domain=DOMAIN)
        return [split, to_heads, v_heads, turn, by_cos, by_sin, add, heads], node

    entries: dict[str, np.ndarray] = {}
    replaced: dict[int, onnx.NodeProto] = {}
    dropped: set[int] = set()
    for i in range(num_layers):
        found = layer(i)
        if found is not None:
            nodes, node = found
            replaced[id(nodes[0])] = node
            dropped.update(id(n) for n in nodes[1:])
    if not replaced:
        return 0
    nodes = [replaced.get(id(n), n) for n in old if id(n) not in dropped]
    del graph.node[:]
    graph.node.extend(nodes)
    if HEADS not in inits:
        graph.initializer.append(numpy_helper.from_array(np.array([num_heads, num_kv_heads], np.int64), HEADS))
    graph.initializer.extend(numpy_helper.from_array(arr, name) for name, arr in entries.items())
    use_domain(model)
    return len(replaced)
