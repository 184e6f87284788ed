"""What joins an ONNX Runtime engine's native linears (``linears.py`` makes
the linears): the operations right after a linear that read nothing but its output, computed in
the linear operator's last pass instead of nodes of their own, with the floats ONNX Runtime's
own nodes give.

- ``silu_mul``: SiLU(gate) * up after a gate/up projection (``Int8LinearSplit`` or
  ``FloatLinearSplit`` whose halves go on only to ``QuickGelu`` with alpha 1 and a ``Mul``) as
  ``Int8LinearSiluMul`` or ``FloatLinearSiluMul`` (``native/csrc/vec.h``). Its logistic is MLAS's
  polynomial ratio, evaluated with fused multiply-adds, so ``linears.rewrite`` uses it only
  where the native library has them.
- ``fuse_skip_norm``: residual add + RMSNorm after a linear (a
  ``SkipSimplifiedLayerNormalization`` of ``fusions.skip_rms_norm`` reading a plain
  ``Int8Linear`` or ``FloatLinear``) as ``Int8LinearSkipNorm`` or ``FloatLinearSkipNorm``
  (``csrc/skip_norm.h``). The passes use it where they use ``silu_mul``: on the
  x86-64 builds with FMA, where ONNX Runtime's own float code (built without contraction) was
  checked to round as this does; a build that contracts its sum of squares would not.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .common import DOMAIN, MICROSOFT

LINEARS = ("Int8Linear", "FloatLinear", "Int8WeightLinear", "Int4WeightLinear", "Int8BlockLinear")


def silu_mul(nodes: list[onnx.NodeProto], readers: dict[str, int]) -> list[onnx.NodeProto]:
    """Each ``Int8LinearSplit`` or ``FloatLinearSplit`` whose halves (gate, up) are read only by
    ``QuickGelu(gate)`` with alpha 1 (SiLU, as ONNX Runtime's fusion writes it) and a ``Mul`` of
    its output by up, as one ``Int8LinearSiluMul`` or ``FloatLinearSiluMul`` giving the ``Mul``'s
    output."""
    splits = {n.output[0]: n for n in nodes if n.op_type in tuple(f"{op}Split" for op in LINEARS) and n.domain == DOMAIN}
    by_input: dict[str, list[onnx.NodeProto]] = {}
    for node in nodes:
        for name in node.input:
            by_input.setdefault(name, []).append(node)
    merged: dict[int, onnx.NodeProto] = {}
    dropped: set[int] = set()
    for act in nodes:
        split = splits.get(act.input[0]) if act.op_type == "QuickGelu" and act.domain == MICROSOFT else None
        if split is None or readers.get(split.output[0]) != 1 or \
                {a.name: helper.get_attribute_value(a) for a in act.attribute}.get("alpha") != 1.0:
            continue
        gate, up = split.output
        muls = by_input.get(act.output[0], [])
        if readers.get(up) != 1 or readers.get(act.output[0]) != 1 or len(muls) != 1:
            continue
        mul = muls[0]
        if mul.op_type != "Mul" or mul.domain not in ("", "ai.onnx") or sorted(mul.input) != sorted([act.output[0], up]):
            continue
        fused = onnx.NodeProto.FromString(split.SerializeToString())
        fused.op_type, fused.name = split.op_type.replace("Split", "SiluMul"), f"{split.name}.silu_mul"
        fused.output[:] = [mul.output[0]]
        merged[id(split)] = fused
        dropped |= {id(act), id(mul)}
    return [merged.get(id(n), n) for n in nodes if id(n) not in dropped]


def fuse_skip_norm(model: onnx.ModelProto) -> int:
    """Each ``SkipSimplifiedLayerNormalization`` (``fusions.skip_rms_norm``) whose input or skip is
    the output of a plain ``Int8Linear`` or ``FloatLinear`` read by nothing else, as one
    ``Int8LinearSkipNorm`` or ``FloatLinearSkipNorm`` giving its normalized output and its sum
    (computed as ONNX Runtime's node does, ``csrc/skip_norm.h``), in the norm's place. In place;
    the number fused."""
    graph = model.graph
    old = list(graph.node)  # holds the nodes' wrappers, so the id()s below stay theirs
    readers: dict[str, int] = {}
    for node in old:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    linears = {n.output[0]: n for n in old if n.op_type in LINEARS and n.domain == DOMAIN}
    inits = {t.name for t in graph.initializer}
    fused_at: dict[int, onnx.NodeProto] = {}  # by the norm each replaces
    merged: set[int] = set()
    for norm in old:
        if norm.op_type != "SkipSimplifiedLayerNormalization" or norm.domain != MICROSOFT or \
                len(norm.input) != 3 or norm.input[2] not in inits or len(norm.output) < 4 or any(norm.output[1:3]):
            continue
        side = next((i for i in (1, 0) if norm.input[i] in linears and readers.get(norm.input[i]) == 1), None)
        if side is None:
            continue
        linear = linears[norm.input[side]]
        attrs = {a.name: helper.get_attribute_value(a) for a in norm.attribute}
        epsilon = graph.initializer.add()
        epsilon.CopyFrom(numpy_helper.from_array(np.array(attrs.get("epsilon", 1e-5), np.float32), f"{norm.name}.epsilon"))
        fused = onnx.NodeProto.FromString(linear.SerializeToString())
        fused.op_type, fused.name = f"{linear.op_type}SkipNorm", f"{linear.name}.skip_norm"
        fused.input.extend([norm.input[1 - side], norm.input[2], epsilon.name])
        fused.output[:] = [norm.output[0], norm.output[3] or f"{norm.name}.sum"]
        fused_at[id(norm)] = fused
        merged.add(id(linear))
    nodes = [fused_at.get(id(n), n) for n in old if id(n) not in merged]
    del graph.node[:]
    graph.node.extend(nodes)
    return len(fused_at)
