"""The vision encoder's graph as TensorRT builds it (``vision.plan``), rewritten from ``vision.onnx``.

- Each fused ``MultiHeadAttention`` (an ONNX Runtime contrib operator, which TensorRT's parser
  lacks) is written out as MatMul, Softmax, MatMul, the query multiplied by ``head_dim ** -0.5``
  *before* the first MatMul: TensorRT fuses that pattern into one attention kernel that never
  holds the ``heads x patches x patches`` scores (12 x 12,432^2 float32 values, 7.4 GB a layer, at
  a phone screenshot on GLM-4.1V-9B's tower), and its documentation ("Fused Attention") asks for
  the scale on Q or K ahead of that MatMul.
- In a half type (``dtype``: bfloat16, the type GLM-4.1V was trained and is served in, or
  float16), every linear and the attention compute in it: each MatMul on a weight takes its input
  and its weight cast to the half type (TensorRT folds a cast of a weight into the weight when it
  builds, so the graph keeps the export's float32 weights) and casts its output back; q, k and v
  are cast once, the attention's output once. The norms, the residual stream, the rope and the
  merger's LayerNorm and GELU stay float32, as do the graph's inputs and its output. The network
  is strongly typed, so these types are what runs.

``dtype`` float32 gives the attention's rewrite alone. ``half_rounded`` turns a half form into
float32 ONNX that rounds as tensor cores do, to check it where no GPU is.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..record_schema import VISION_DTYPES
from .vision import MICROSOFT

HALF = {"bfloat16": TensorProto.BFLOAT16, "float16": TensorProto.FLOAT16}


def tensorrt_vision_graph(model: onnx.ModelProto, head_dim: int, dtype: str = "bfloat16") -> onnx.ModelProto:
    """A copy of the vision graph ``model`` in the form above; its weights keep their external-data
    references (the rewritten graph is parsed from where ``vision.onnx`` lies)."""
    if dtype not in VISION_DTYPES:
        raise ValueError(f"dtype must be one of {VISION_DTYPES}, got {dtype!r}")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    half = HALF.get(dtype)
    nodes: list[onnx.NodeProto] = []
    from_half: dict[str, str] = {}  # a float32 tensor cast from a half one: that half one
    for node in out.graph.node:
        if node.op_type == "MultiHeadAttention" and node.domain == MICROSOFT:
            nodes += _attention(out.graph, node, head_dim, half, from_half)
        else:
            nodes.append(node)
    if half is not None:
        taken = {t.name for t in out.graph.initializer} | {o for n in nodes for o in n.output} | \
            {i.name for i in out.graph.input}
        nodes = _half_linears(nodes, {t.name for t in out.graph.initializer}, half, from_half, Fresh(taken))
    del out.graph.node[:]
    out.graph.node.extend(_live(nodes, {o.name for o in out.graph.output}))
    kept = [o for o in out.opset_import if o.domain != MICROSOFT]
    del out.opset_import[:]
    out.opset_import.extend(kept)
    return out


def _attention(graph: onnx.GraphProto, node: onnx.NodeProto, head_dim: int, half: int | None,
               from_half: dict[str, str]) -> list[onnx.NodeProto]:
    """``node`` (q, k, v ``[1, patches, heads * head_dim]`` in, the same shape out) in plain ONNX."""
    heads = next(a.i for a in node.attribute if a.name == "num_heads")
    p = node.name
    names = {t.name for t in graph.initializer}
    shape, out_shape, scale = f"{p}_heads_shape", f"{p}_out_shape", f"{p}_scale"
    for name, value in ((shape, np.asarray([-1, heads, head_dim], np.int64)),
                        (out_shape, np.asarray([1, -1, heads * head_dim], np.int64))):
        if name not in names:
            graph.initializer.append(numpy_helper.from_array(value, name))
    graph.initializer.append(scalar(scale, head_dim ** -0.5, half or TensorProto.FLOAT))
    nodes = []
    per_head = []
    for x, perm in zip(node.input[:3], ([1, 0, 2], [1, 2, 0], [1, 0, 2])):  # [heads, n, d]; keys as [heads, d, n]
        if half is not None:
            nodes.append(helper.make_node("Cast", [x], [f"{p}_{x}_half"], to=half))
            x = f"{p}_{x}_half"
        nodes.append(helper.make_node("Reshape", [x, shape], [f"{p}_{x}_h"]))
        nodes.append(helper.make_node("Transpose", [f"{p}_{x}_h"], [f"{p}_{x}_t"], perm=perm))
        per_head.append(f"{p}_{x}_t")
    ctx = f"{p}_ctx_rows" if half is not None else node.output[0]
    nodes += [helper.make_node("Mul", [per_head[0], scale], [f"{p}_q_scaled"]),
              helper.make_node("MatMul", [f"{p}_q_scaled", per_head[1]], [f"{p}_scores"]),
              helper.make_node("Softmax", [f"{p}_scores"], [f"{p}_probs"], axis=-1),
              helper.make_node("MatMul", [f"{p}_probs", per_head[2]], [f"{p}_ctx"]),
              helper.make_node("Transpose", [f"{p}_ctx"], [f"{p}_ctx_t"], perm=[1, 0, 2]),
              helper.make_node("Reshape", [f"{p}_ctx_t", out_shape], [ctx])]
    if half is not None:
        nodes.append(helper.make_node("Cast", [ctx], [node.output[0]], to=TensorProto.FLOAT))
        from_half[node.output[0]] = ctx
    return _named(nodes)


def scalar(name: str, value: float, elem_type: int) -> onnx.TensorProto:
    """A scalar initializer of float32, float16 or bfloat16 ``elem_type`` in ``raw_data`` (bfloat16:
    float32's upper 16 bits, rounded to nearest, ties to even)."""
    f32 = np.asarray(value, np.float32)
    if elem_type == TensorProto.BFLOAT16:
        bits = int(f32.view(np.uint32))
        raw = np.uint16((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).tobytes()
    else:
        raw = f32.astype(np.float16 if elem_type == TensorProto.FLOAT16 else np.float32).tobytes()
    return helper.make_tensor(name, elem_type, [], raw, raw=True)


class Fresh:
    """Names of new tensors: ``base`` and a suffix, none of them ``taken`` already."""

    def __init__(self, taken: set[str]):
        self.taken = taken

    def __call__(self, base: str) -> str:
        name, k = base, 1
        while name in self.taken:
            k += 1
            name = f"{base}_{k}"
        self.taken.add(name)
        return name


def _half_linears(nodes: list[onnx.NodeProto], weights: set[str], half: int, from_half: dict[str, str],
                  fresh: Fresh) -> list[onnx.NodeProto]:
    """Each MatMul on a weight computed in ``half``: its input cast (or, where that input is a cast
    to float32 of a half tensor, the half tensor itself), its weight cast, its output cast back."""
    cast: dict[str, str] = {}
    out: list[onnx.NodeProto] = []

    def halved(x: str) -> str:
        if x in from_half:
            return from_half[x]
        if x not in cast:
            cast[x] = fresh(f"{x}_half")
            out.append(helper.make_node("Cast", [x], [cast[x]], cast[x], to=half))
        return cast[x]

    for node in nodes:
        if node.op_type != "MatMul" or node.input[1] not in weights:
            out.append(node)
            continue
        a, w = halved(node.input[0]), halved(node.input[1])
        y, y_half = node.output[0], fresh(f"{node.output[0]}_half")
        out.append(helper.make_node("MatMul", [a, w], [y_half], node.name))
        out.append(helper.make_node("Cast", [y_half], [y], f"{y}_float", to=TensorProto.FLOAT))
        from_half[y] = y_half
    return out


def _named(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    for n in nodes:
        n.name = n.name or n.output[0]
    return nodes


def _live(nodes: list[onnx.NodeProto], outputs: set[str]) -> list[onnx.NodeProto]:
    """``nodes`` less those whose outputs nothing reads (a cast to float32 the next linear skipped)."""
    while True:
        read = outputs | {i for n in nodes for i in n.input}
        kept = [n for n in nodes if any(o in read for o in n.output)]
        if len(kept) == len(nodes):
            return kept
        nodes = kept


def half_rounded(form: onnx.ModelProto, dtype: str) -> onnx.ModelProto:
    """``form`` (``tensorrt_vision_graph``'s, in the half ``dtype``) computed in float32 on values
    rounded to ``dtype`` where it holds them: each cast to ``dtype`` a round trip through it, and
    each half result cast to float32 rounded likewise first. That is what a GPU's tensor cores
    compute (half operands and results, float32 sums); ONNX's reference evaluator sums bfloat16
    in bfloat16, which overstates the error tenfold, and ONNX Runtime's CPU has no bfloat16 MatMul."""
    half = HALF[dtype]
    out = onnx.ModelProto()
    out.CopyFrom(form)
    nodes = []
    for n in out.graph.node:
        if n.op_type != "Cast" or n.attribute[0].i not in (half, TensorProto.FLOAT):
            nodes.append(n)
            continue
        y = n.output[0]
        nodes += [helper.make_node("Cast", [n.input[0]], [f"{y}_rounded"], f"{y}_rounded", to=half),
                  helper.make_node("Cast", [f"{y}_rounded"], [y], n.name, to=TensorProto.FLOAT)]
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    for t in out.graph.initializer:
        if t.data_type == half:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name))
    return out
