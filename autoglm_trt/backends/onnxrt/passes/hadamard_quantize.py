"""Each INT8 linear's online rotation and activation quantization as one native operator.

The graph rotates the input of each INT8 linear by a block Hadamard matrix and quantizes it
(``graph/qdq.py``): Reshape to blocks of b, MatMul by ``hadamard_<b>``, QuantizeLinear to uint8,
Reshape back. ``hadamard_quantize`` replaces the four with ``autoglm.trt.HadamardQuantize``
(``native/csrc/hadamard_quantize.c``: a fast Walsh-Hadamard transform), which ``linears.py`` then
takes whole into ``Int8Linear`` where it can.
"""

from __future__ import annotations

import onnx
from onnx import helper

from ....graph import names
from .common import DOMAIN, use_domain


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
        if unblock.op_type != "Reshape" or not unblock.input[1].startswith(names.UNBLOCKS_PREFIX):
            return None
        quant = producer.get(unblock.input[0])
        if quant is None or quant.op_type != "QuantizeLinear" or len(quant.input) != 3 or \
                not scalar(quant.input[1], onnx.TensorProto.FLOAT) or not scalar(quant.input[2], onnx.TensorProto.UINT8):
            return None
        matmul = producer.get(quant.input[0])
        if matmul is None or matmul.op_type != "MatMul" or not matmul.input[1].startswith(names.HADAMARD_PREFIX):
            return None
        blocks = producer.get(matmul.input[0])
        if blocks is None or blocks.op_type != "Reshape" or not blocks.input[1].startswith(names.BLOCKS_PREFIX):
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
            [unblock.output[0]], name=f"{matmul.name}.hadamard_quantize", domain=DOMAIN)
        dropped.update(id(n) for n in found)
    nodes = [replaced.get(id(n), n) for n in graph.node if id(n) not in dropped]
    del graph.node[:]
    graph.node.extend(nodes)
    if replaced:
        use_domain(model)
    return len(replaced)
