"""GLM-4.1V's vision encoder with INT8 linears: each image token's activations quantized on the
fly, per token (row), each weight per output channel, the products on the CPU's integer
dot-product units (ONNX Runtime's ``MatMulIntegerToFloat``: MLAS's u8 x s8 GEMM).

Every ``MatMul`` of ``graph.vision``'s graph by a checkpoint weight becomes::

    s  = max(max|x| over the row / 127, TINY)        [rows, 1]
    xq = round(x / s) + 128                           uint8 (zero point 128: x / s in [-127, 127])
    y  = MatMulIntegerToFloat(xq, wq, 1, w_scale, 128) * s

so ``y[r, n] = s[r] * w_scale[n] * sum_k (xq[r, k] - 128) wq[k, n]``: the integer sums are exact,
the rest is float32 rounding (``row_quantize`` and ``reference_linear`` are the same in numpy).
The down projections (``ROTATED``), whose inputs are SiLU-gated products with outlier channels
that one scale a token would round the rest of the row by, first rotate their input by a
block-diagonal Hadamard matrix (``x H``, blocks of up to ``ROTATION``) and take ``H^T W`` as their
weight: the same product, the outliers spread over their block. On the 9B-width tower of
``benchmarks.vision_forms`` that raised the lowest per-token cosine against the float32 encoder
past 0.999, and rotating every linear lowered it.
MLAS sums unsigned-by-signed byte pairs exactly only with VNNI (AVX512-VNNI, AVX-VNNI, AMX);
elsewhere its ``vpmaddubsw`` path saturates 16-bit pair sums, so the runtime runs this graph only
where the CPU has VNNI (``runtime.images``) and the float32 graph otherwise.
"""

from __future__ import annotations

import numpy as np
from onnx import ModelProto, TensorProto, helper, numpy_helper

from ..quant.hadamard import block_size, hadamard, rotate_rows, rotate_weight
from ..quant.int8 import quantize_weight_per_channel
from .vision import MICROSOFT

INT8_VISION_GRAPH = "vision.int8.onnx"
TINY = np.float32(1e-12)  # a row of zeros gets this scale (its codes are all 128: its products 0)
ZERO_POINT = 128
# the linears whose inputs are rotated first: the down projections, fed the SiLU-gated products,
# whose outliers a per-token scale alone rounds the rest of the row by (blocks of up to ROTATION)
ROTATED = "down_proj.weight"
ROTATION = 128


def row_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``x`` [rows, K] float32 as the graph quantizes it: (uint8 codes, float32 scales [rows, 1])."""
    x = np.asarray(x, np.float32)
    scale = np.maximum(np.max(np.abs(x), axis=-1, keepdims=True) / np.float32(127.0), TINY).astype(np.float32)
    return (np.rint(x / scale) + np.float32(ZERO_POINT)).astype(np.uint8), scale


def reference_linear(x: np.ndarray, w: np.ndarray, block: int = 0) -> np.ndarray:
    """What one rewritten linear computes of ``x`` [rows, K] and a float ``w`` [K, N] (``block``:
    the size of its Hadamard rotation, 0 for none): the exact integer sums scaled as
    ``MatMulIntegerToFloat`` and the row scale's ``Mul`` do."""
    x, w = np.asarray(x, np.float32), np.asarray(w, np.float32)
    if block:
        x, w = rotate_rows(x, block), rotate_weight(w, block)
    q, s = row_quantize(x)
    wq, ws = quantize_weight_per_channel(w)
    sums = (q.astype(np.int64) - ZERO_POINT) @ wq.astype(np.int64)
    return (sums.astype(np.float32) * ws) * s


def int8_vision_graph(model: ModelProto) -> tuple[ModelProto, int]:
    """``model`` (the float32 encoder with its weights loaded) with every linear by a ``visual.*``
    weight rewritten as above, and how many were; ``model`` itself is left as it was."""
    out = ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    weights = {t.name: t for t in graph.initializer}
    shared = {"visual_int8_127": np.float32(127.0), "visual_int8_tiny": TINY, "visual_int8_one": np.float32(1.0),
              "visual_int8_half": np.float32(ZERO_POINT), "visual_int8_zero": np.uint8(ZERO_POINT)}
    nodes, dropped, count = [], set(), 0
    for node in graph.node:
        w = weights.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if (w is None or not w.name.startswith("visual.") or len(w.dims) != 2
                or w.data_type != TensorProto.FLOAT):
            nodes.append(node)
            continue
        weight, x = numpy_helper.to_array(w), node.input[0]
        block = block_size(weight.shape[0], ROTATION) if w.name.endswith(ROTATED) else 0
        if block > 1:  # x H and H^T W: the same product, the activations' outliers spread over the block
            weight = rotate_weight(weight, block)
            x, rotation = _rotated(graph, node.name, x, block)
            nodes += rotation
        wq, ws = quantize_weight_per_channel(weight)
        graph.initializer.extend([numpy_helper.from_array(wq, f"{w.name}.int8"),
                                  numpy_helper.from_array(ws, f"{w.name}.int8_scale")])
        dropped.add(w.name)
        nodes += _quantized(node.name, x, w.name, node.output[0])
        count += 1
    graph.initializer.extend(numpy_helper.from_array(np.asarray(v), k) for k, v in shared.items())
    kept = [t for t in graph.initializer if t.name not in dropped]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    del graph.node[:]
    graph.node.extend(nodes)
    if not any(o.domain == MICROSOFT for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(MICROSOFT, 1))
    return out, count


def _rotated(graph, name: str, x: str, block: int) -> tuple[str, list]:
    """``x`` [rows, K] times the block-diagonal Hadamard rotation of ``block``: (its name, the nodes)."""
    h = f"visual_int8_hadamard_{block}"
    if not any(t.name == h for t in graph.initializer):
        graph.initializer.extend([numpy_helper.from_array(np.ascontiguousarray(hadamard(block)), h),
                                  numpy_helper.from_array(np.array([0, -1, block], np.int64), f"{h}_blocks"),
                                  numpy_helper.from_array(np.array([0, -1], np.int64), f"{h}_rows")])
    make = helper.make_node
    return f"{name}/int8_rotated", [
        make("Reshape", [x, f"{h}_blocks"], [f"{name}/int8_blocks"], f"{name}/int8_blocks"),
        make("MatMul", [f"{name}/int8_blocks", h], [f"{name}/int8_turned"], f"{name}/int8_turned"),
        make("Reshape", [f"{name}/int8_turned", f"{h}_rows"], [f"{name}/int8_rotated"], f"{name}/int8_rotated")]


def _quantized(name: str, x: str, weight: str, y: str) -> list:
    def t(suffix: str) -> str:
        return f"{name}/int8_{suffix}"

    make = helper.make_node
    return [make("Abs", [x], [t("abs")], t("abs")),
            make("ReduceMax", [t("abs")], [t("amax")], t("amax"), axes=[-1], keepdims=1),
            make("Div", [t("amax"), "visual_int8_127"], [t("step")], t("step")),
            make("Max", [t("step"), "visual_int8_tiny"], [t("scale")], t("scale")),
            make("Div", [x, t("scale")], [t("scaled")], t("scaled")),
            make("Round", [t("scaled")], [t("rounded")], t("rounded")),
            make("Add", [t("rounded"), "visual_int8_half"], [t("shifted")], t("shifted")),
            make("Cast", [t("shifted")], [t("codes")], t("codes"), to=TensorProto.UINT8),
            make("MatMulIntegerToFloat", [t("codes"), f"{weight}.int8", "visual_int8_one", f"{weight}.int8_scale",
                                          "visual_int8_zero"], [t("sums")], t("sums"), domain=MICROSOFT),
            make("Mul", [t("sums"), t("scale")], [y], t("out"))]
