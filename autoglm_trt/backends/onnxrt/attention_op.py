"""Swap the engine graph's attention nodes for the native ``PagedAttention`` operator.

Input: the ONNX Runtime engine's graph (``model.opt.onnx``, loaded without its weights). Output:
the same graph in which each layer's attention (Gather of the past from the pools, scores,
mask, softmax, weighted sum: about 20 nodes) is one ``autoglm.trt.PagedAttention`` node
(``csrc/paged_attention.c``) reading the pools in place, and the nodes no longer needed (the
attention mask) are dropped. Everything else, the INT8 GEMMs included, is untouched, and the
portable graph that TensorRT builds never sees the operator.

Per layer ``i`` the graph names what the operator needs: the queries after RoPE are the input
of ``layers.<i>.q_grouped``, the new keys and values are the outputs ``new_key.<i>`` and
``new_value.<i>``, the result replaces ``layers.<i>.attn``. A graph where any of these is
missing, or whose queries are not float32 (a float16 graph casts them), is left as it is.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

DOMAIN = "autoglm.trt"
OP = "PagedAttention"


def rewrite(model: onnx.ModelProto, num_layers: int) -> tuple[bool, str]:
    """Rewrite ``model`` in place; (True, "") or (False, why it was left as it was)."""
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    outputs = {o.name: o.type.tensor_type.elem_type for o in graph.output}
    replaced = {}
    for i in range(num_layers):
        attn, grouped = producer.get(f"layers.{i}.attn"), producer.get(f"layers.{i}.q_grouped")
        if attn is None or grouped is None:
            return False, f"layer {i} has no layers.{i}.attn or layers.{i}.q_grouped tensor"
        if any(outputs.get(f"new_{kv}.{i}") != TensorProto.FLOAT for kv in ("key", "value")):
            return False, "the graph's K/V are not float32"
        q = grouped.input[0]
        if q in producer and producer[q].op_type == "Cast":
            return False, "the graph computes attention in float16"
        replaced[attn.output[0]] = helper.make_node(
            OP, [q, f"new_key.{i}", f"new_value.{i}", f"past_key.{i}", f"past_value.{i}", "block_tables",
                 "context_lens", "query_lens"], [f"layers.{i}.attn"], name=f"layers.{i}.paged_attention", domain=DOMAIN)
    nodes = [replaced.get(n.output[0], n) if n.output else n for n in graph.node]
    needed, kept = {o.name for o in graph.output}, []
    for node in reversed(nodes):  # keep what still reaches an output
        if any(o in needed for o in node.output):
            kept.append(node)
            needed.update(node.input)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return True, ""
