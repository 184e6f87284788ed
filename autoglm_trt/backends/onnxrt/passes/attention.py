"""Give the engine graph the native ``PagedAttention`` operator for decode steps.

Input: the ONNX Runtime engine's graph (``model.opt.onnx``, loaded without its weights). Output:
the same graph in which each layer's attention (Gather of the past from the pools, scores,
mask, softmax, weighted sum: about 20 nodes) sits in the else branch of an ``If`` whose then
branch is one ``autoglm.trt.PagedAttention`` node (``csrc/paged_attention.c``) that reads the
pools in place (``PagedAttentionInt8KV`` for an INT8 KV cache, static or per-token scales). The condition is "one new
token per sequence": decode steps take the operator; prefill steps keep the graph's nodes,
whose GEMMs are faster over many new tokens than the operator's dot products (measured on a
1,000-token prompt): as one ``PrefillAttention`` node where the library has fused multiply-add
and the head size is a multiple of 64 (``prefill_attention.py``),
else with their scores computed query by query (``prefill_scores.py``, the same bits). The ``step_branch`` pass
then hoists the 30 ``If`` nodes into one for the whole step.
Everything else, the INT8 GEMMs included, is untouched, and the portable graph that TensorRT
builds never sees the operator.

The operator also stores a decode step's new K/V in the pools, at the slots of the graph input
``native.slots`` that the rewrite adds (each sequence's block * block size + offset, vLLM's slot
mapping; -1 stores nothing, and every run must feed it); the runner's scatter of them after the
step is left for prefill steps.

Per layer ``i`` the graph names what the operator needs: the queries after RoPE are the input
of ``layers.<i>.q_grouped``, the new keys and values are the outputs ``new_key.<i>`` and
``new_value.<i>``, the result is ``layers.<i>.attn``; the layer's attention nodes are those
before ``layers.<i>.attn`` all of whose outputs are named ``layers.<i>.*``. A graph where any of
this does not hold, or whose queries are not float32 (a float16 graph casts them), is left as
it is.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ....graph import names
from . import prefill_attention, prefill_scores
from .common import DECODE_CONDITION, DOMAIN, SLOTS, use_domain

OP, OP_INT8_KV = "PagedAttention", "PagedAttentionInt8KV"


def _attention_nodes(i: int, producer: dict, consumers: dict) -> list | None:
    """The nodes that only compute layer ``i``'s attention output, or None if they are not closed."""
    attn = names.in_layer(i, names.ATTN)
    prefix, found, todo = names.layer(i) + ".", {}, [attn]
    while todo:
        node = producer.get(todo.pop())
        if node is None or id(node) in found or not all(o.startswith(prefix) for o in node.output):
            continue
        found[id(node)] = node
        todo.extend(node.input)
    outputs = {o for n in found.values() for o in n.output}
    for n in found.values():  # every output is read by these nodes alone (the last one's by the If)
        if any(o != attn and any(id(c) not in found for c in consumers.get(o, [])) for o in n.output):
            return None
    return list(found.values()) if attn in outputs else None


def _kv_inputs(i: int, outputs: dict, producer: dict, initializers: set) -> tuple | None:
    """(operator, new K, new V, [K scales, V scales], [what to store beside the slots]) of layer
    ``i``: float32 K/V, or the INT8 KV cache of ``graph/kv_int8.py`` (float ``new_key.<i>.float``
    quantized to the int8 output with per-head scales ``new_key.<i>.kv_scale``, or with per-token
    scales ``new_key_scale.<i>`` kept in the scale pools ``past_key_scale.<i>``), or None."""
    k, v = names.new_key(i), names.new_value(i)
    if outputs.get(k) == outputs.get(v) == TensorProto.FLOAT:
        return OP, k, v, [], []
    if outputs.get(k) != TensorProto.INT8 or outputs.get(v) != TensorProto.INT8 or \
            not all(producer.get(f"{x}.float") is not None and producer[f"{x}.float"].op_type != "Cast" for x in (k, v)):
        return None
    static = [f"{k}.kv_scale", f"{v}.kv_scale"]
    if all(s in initializers for s in static):
        return OP_INT8_KV, f"{k}.float", f"{v}.float", static, [k, v]
    if all(names.scale_of(x) in outputs for x in (k, v)):
        pools = [names.scale_of(names.past_key(i)), names.scale_of(names.past_value(i))]
        return OP_INT8_KV, f"{k}.float", f"{v}.float", pools, [k, v, names.scale_of(k), names.scale_of(v)]
    return None


def rewrite(model: onnx.ModelProto, num_layers: int, softmax: bool = False,
            fused_prefill: bool = False, bf16: bool = False) -> tuple[bool, str]:
    """Rewrite ``model`` in place; (True, "") or (False, why it was left as it was). ``softmax``:
    the library's ``MaskedSoftmax`` gives Softmax's bits, so the prefill branch may use it
    (``prefill_scores.py``); ``fused_prefill``: the prefill branch's attention becomes one
    ``PrefillAttention`` node (``prefill_attention.py``; ``PrefillAttentionBf16`` with ``bf16``)."""
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list] = {}
    for n in graph.node:
        for x in n.input:
            consumers.setdefault(x, []).append(n)
    outputs = {o.name: o.type.tensor_type.elem_type for o in graph.output}
    plans = []
    for i in range(num_layers):
        grouped = producer.get(names.in_layer(i, names.Q_GROUPED))
        core = _attention_nodes(i, producer, consumers)
        if grouped is None or core is None:
            return False, (f"layer {i}'s attention is not the {names.in_layer(i, names.Q_GROUPED)} ... "
                           f"{names.in_layer(i, names.ATTN)} nodes expected")
        q = grouped.input[0]
        if q in producer and producer[q].op_type == "Cast":
            return False, "the graph computes attention in float16"
        kv = _kv_inputs(i, outputs, producer, {t.name for t in graph.initializer})
        if kv is None:
            return False, f"layer {i}'s K/V are neither float32 nor this project's INT8 KV cache"
        plans.append((i, q, core, kv))
    cond = [helper.make_node("Shape", [names.INPUT_IDS], ["native.ids_shape"], name="native.ids_shape"),
            helper.make_node("Gather", ["native.ids_shape", "native.one"], ["native.new_tokens"], name="native.new_tokens",
                             axis=0),
            helper.make_node("Equal", ["native.new_tokens", "native.one"], [DECODE_CONDITION], name=DECODE_CONDITION)]
    graph.initializer.append(helper.make_tensor("native.one", TensorProto.INT64, [], [1]))
    graph.input.append(helper.make_tensor_value_info(SLOTS, TensorProto.INT64, ["batch"]))
    branch_of: dict[int, onnx.NodeProto] = {}
    dropped: set[int] = set()
    for i, q, core, (op, k, v, scales, stored) in plans:
        attn = names.in_layer(i, names.ATTN)
        store = [SLOTS, *stored]
        native = helper.make_node(op, [q, k, v, names.past_key(i), names.past_value(i), names.BLOCK_TABLES,
                                       names.CONTEXT_LENS, names.QUERY_LENS, *scales, *store], [f"{attn}_native"],
                                  name=names.in_layer(i, "paged_attention"), domain=DOMAIN)
        core_ids = {id(c) for c in core}
        nodes = [onnx.NodeProto.FromString(n.SerializeToString()) for n in graph.node if id(n) in core_ids]
        for n in nodes:
            n.output[:] = [f"{attn}_graph" if o == attn else o for o in n.output]
        fused = prefill_attention.fuse(nodes, i, f"{attn}_graph", bf16) if fused_prefill else None
        nodes = fused if fused is not None else prefill_scores.by_row(nodes, i, softmax)
        out = lambda name: [helper.make_tensor_value_info(name, TensorProto.FLOAT, None)]
        branch = helper.make_node(
            "If", [DECODE_CONDITION], [attn], name=names.in_layer(i, "attention"),
            then_branch=helper.make_graph([native], f"layers_{i}_native", [], out(f"{attn}_native")),
            else_branch=helper.make_graph(nodes, f"layers_{i}_graph", [], out(f"{attn}_graph")))
        branch_of[id(producer[attn])] = branch
        dropped.update(core_ids)
    kept = [branch_of.get(id(n), n) for n in graph.node if id(n) not in dropped or id(n) in branch_of]
    del graph.node[:]
    graph.node.extend(cond + kept)
    use_domain(model)
    use_domain(model, prefill_scores.DOMAIN)
    return True, ""
