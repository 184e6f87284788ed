"""The vision encoder's attention as the native ImageAttentionBf16 (bfloat16 products where the
CPU has AVX512-BF16, ``native/csrc/image_attention.c``) instead of ONNX Runtime's
MultiHeadAttention.

Input: an encoder graph of ``graph.vision`` (float32 or INT8 linears), loaded without its
weights. Each ``com.microsoft`` MultiHeadAttention of three inputs [1, patches, heads x head_dim]
becomes: the three reshaped to [patches, heads, head_dim], ImageAttentionBf16, and its output
reshaped back under the attention's output name. The graph names the same weight file as the
input (its initializers keep their external-data locations), so the native form is a graph
alone beside it.
"""

from __future__ import annotations

import numpy as np
from onnx import ModelProto, helper, numpy_helper

from ....graph.vision import MICROSOFT

DOMAIN = "autoglm.trt"
OP = "ImageAttentionBf16"
HEAD_SIZES = (16, 32, 64, 128)  # what the operator takes


def native_image_attention(model: ModelProto, head_dim: int) -> tuple[ModelProto, int]:
    """``model`` with its attention rewritten as above, and how many nodes were (0 where the head
    size is not one the operator takes: the graph is then ``model`` as it was)."""
    out = ModelProto()
    out.CopyFrom(model)
    if head_dim not in HEAD_SIZES:
        return out, 0
    graph, nodes, count = out.graph, [], 0
    for node in graph.node:
        if node.op_type != "MultiHeadAttention" or node.domain != MICROSOFT or len(node.input) != 3:
            nodes.append(node)
            continue
        heads = next(a.i for a in node.attribute if a.name == "num_heads")
        name = node.name or f"image_attention_{count}"
        split = f"{name}/heads_shape"
        graph.initializer.append(numpy_helper.from_array(np.array([-1, heads, head_dim], np.int64), split))
        graph.initializer.append(numpy_helper.from_array(np.array([1, -1, heads * head_dim], np.int64),
                                                         f"{name}/rows_shape"))
        parts = []
        for x, part in zip(node.input, "qkv"):
            parts.append(f"{name}/{part}_heads")
            nodes.append(helper.make_node("Reshape", [x, split], [parts[-1]], f"{name}/{part}_heads"))
        nodes.append(helper.make_node(OP, parts, [f"{name}/context"], f"{name}/native", domain=DOMAIN))
        nodes.append(helper.make_node("Reshape", [f"{name}/context", f"{name}/rows_shape"], [node.output[0]],
                                      f"{name}/rows"))
        count += 1
    del graph.node[:]
    graph.node.extend(nodes)
    if count and not any(o.domain == DOMAIN for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return out, count
