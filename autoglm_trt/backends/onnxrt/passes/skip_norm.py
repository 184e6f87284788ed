"""Residual add + RMSNorm as one node, a fusion ONNX Runtime's optimizer does not make here.

``skip_rms_norm``: each residual ``Add`` (``layers.<i>.attn_residual``, ``layers.<i>.mlp_residual``)
followed by the RMSNorm that reads it becomes one ``com.microsoft.SkipSimplifiedLayerNormalization``
whose fourth output is the sum, so the residual stream is unchanged. ONNX Runtime's own fusion
does not fire here because the sum has a second reader (the next residual ``Add``). Like the
attention rewrite it applies to the ONNX Runtime backend alone; the saved engine graph, and
the graph TensorRT builds, keep the plain nodes.
"""

from __future__ import annotations

import onnx
from onnx import helper

from ....graph import names
from .common import MICROSOFT, use_domain

RESIDUALS = names.RESIDUAL_SUFFIXES


def skip_rms_norm(model: onnx.ModelProto) -> int:
    """Fuse in place; the number of Add + RMSNorm pairs fused."""
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    gammas = {t.name for t in graph.initializer}
    fused: dict[int, onnx.NodeProto] = {}
    adds: set[int] = set()
    for norm in graph.node:
        add = producer.get(norm.input[0]) if norm.op_type == "SimplifiedLayerNormalization" else None
        if add is None or add.op_type != "Add" or not add.output[0].endswith(RESIDUALS) or id(add) in adds \
                or len(norm.input) != 2 or norm.input[1] not in gammas:
            continue
        node = helper.make_node("SkipSimplifiedLayerNormalization", [add.input[0], add.input[1], norm.input[1]],
                                [norm.output[0], "", "", add.output[0]], name=f"{norm.name}.skip",
                                domain=MICROSOFT)
        node.attribute.extend(a for a in norm.attribute if a.name == "epsilon")
        fused[id(norm)] = node
        adds.add(id(add))
    nodes = [fused.get(id(n), n) for n in graph.node if id(n) not in adds]
    # the Add's sum comes out of the fused node, which sits where the norm was: move each fused
    # node up to its Add's place so that readers of the sum placed between them still follow it
    if fused:
        position = {id(n): k for k, n in enumerate(graph.node)}
        add_of = {id(fused[id(n)]): producer[n.input[0]] for n in graph.node if id(n) in fused}
        nodes.sort(key=lambda n: position[id(add_of[id(n)])] if id(n) in add_of else position[id(n)])
    del graph.node[:]
    graph.node.extend(nodes)
    if fused:
        use_domain(model, MICROSOFT)
    return len(fused)
