"""Fusions ONNX Runtime's optimizer does not make on the engine graph, made when it is loaded.

``hadamard_quantize`` (below) replaces each INT8 linear's rotation + quantization chain with a
native operator, where the native library can be built.

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

from .attention_op import use_domain

RESIDUALS = (".attn_residual", ".mlp_residual")


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
                                domain="com.microsoft")
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
        use_domain(model, "com.microsoft")
    return len(fused)


def hadamard_quantize(model: onnx.ModelProto) -> int:
    """Each INT8 linear's online rotation and activation quantization (Reshape to blocks of b,
    MatMul by ``hadamard_<b>``, QuantizeLinear to uint8, Reshape back) as one native
    ``autoglm.trt.HadamardQuantize`` (``csrc/hadamard_quantize.c``; needs the native library).
    In place; the number of chains replaced."""
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    readers: dict[str, int] = {}
    for n in graph.node:
        for x in n.input:
            readers[x] = readers.get(x, 0) + 1
    inits = {t.name: t for t in graph.initializer}

    def scalar(name: str, dtype: int) -> bool:
        t = inits.get(name)
        return t is not None and t.data_type == dtype and len(t.dims) == 0

    def chain(unblock: onnx.NodeProto) -> tuple[onnx.NodeProto, onnx.NodeProto, onnx.NodeProto] | None:
        """(Reshape to blocks, MatMul by H, QuantizeLinear) before ``unblock``, each read only by the next."""
        if unblock.op_type != "Reshape" or not unblock.input[1].startswith("unblocks_"):
            return None
        quant = producer.get(unblock.input[0])
        if quant is None or quant.op_type != "QuantizeLinear" or len(quant.input) != 3 or \
                not scalar(quant.input[1], onnx.TensorProto.FLOAT) or not scalar(quant.input[2], onnx.TensorProto.UINT8):
            return None
        matmul = producer.get(quant.input[0])
        if matmul is None or matmul.op_type != "MatMul" or not matmul.input[1].startswith("hadamard_"):
            return None
        blocks = producer.get(matmul.input[0])
        if blocks is None or blocks.op_type != "Reshape" or not blocks.input[1].startswith("blocks_"):
            return None
        return (blocks, matmul, quant) if all(readers.get(n.output[0]) == 1 for n in (blocks, matmul, quant)) else None

    replaced: dict[int, onnx.NodeProto] = {}
    dropped: set[int] = set()
    for unblock in graph.node:
        found = chain(unblock)
        if found is None:
            continue
        blocks, matmul, quant = found
        replaced[id(unblock)] = helper.make_node(
            "HadamardQuantize", [blocks.input[0], matmul.input[1], quant.input[1], quant.input[2]],
            [unblock.output[0]], name=f"{matmul.name}.hadamard_quantize", domain="autoglm.trt")
        dropped.update(id(n) for n in found)
    nodes = [replaced.get(id(n), n) for n in graph.node if id(n) not in dropped]
    del graph.node[:]
    graph.node.extend(nodes)
    if replaced:
        use_domain(model)
    return len(replaced)
