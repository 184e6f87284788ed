"""Give an INT8 KV cache with per-token scales one ``QuantizeKVRows`` node per new K or V.

Input: the engine graph. ``graph/kv_int8.py`` quantizes each layer's new K and V per token with
seven nodes (``<new_key.i>.kv_abs``, ``.kv_amax``, ``.kv_amax_floored``, ``.kv_scale``,
``.kv_scaled``, ``.kv_q``, and the Squeeze that makes ``new_key_scale.<i>``). Output: the same
graph with those nodes replaced by one ``autoglm.trt.QuantizeKVRows`` (``csrc/kv_quantize.c``,
the same arithmetic, the same bits) that makes both outputs. A tensor whose nodes are not all
there, or whose intermediate results something else reads, keeps its nodes.
"""

from __future__ import annotations

import onnx
from onnx import helper

from ....graph import names
from .common import DOMAIN, use_domain

OP = "QuantizeKVRows"
PARTS = ("kv_abs", "kv_amax", "kv_amax_floored", "kv_scale", "kv_scaled", "kv_q")


def rewrite(model: onnx.ModelProto) -> int:
    """Rewrite ``model`` in place; how many K and V tensors now come from the operator."""
    graph = model.graph
    by_name = {n.name: n for n in graph.node}
    consumers: dict[str, int] = {}
    for n in graph.node:
        for x in n.input:
            consumers[x] = consumers.get(x, 0) + 1
    outputs = {o.name for o in graph.output}
    replaced: dict[int, onnx.NodeProto | None] = {}
    for out in (o for o in outputs if o.startswith(("new_key.", "new_value."))):
        scale = names.scale_of(out)
        found = [by_name.get(f"{out}.{part}") for part in PARTS] + [by_name.get(scale)]
        chain = [n for n in found if n is not None]
        if len(chain) < len(found) or scale not in outputs or list(chain[-1].output) != [scale] or \
                list(chain[-2].output) != [out]:
            continue
        inner = {o for n in chain[:-2] for o in n.output}  # read only inside the chain
        reads = sum(x in inner for n in chain for x in n.input)
        if sum(consumers.get(o, 0) for o in inner) != reads:
            continue
        x = chain[0].input[0]  # the float K or V
        if chain[4].input[0] != x:
            continue
        for n in chain:
            replaced[id(n)] = None
        replaced[id(chain[-2])] = helper.make_node(OP, [x], [out, scale], name=f"{out}.kv_quantize", domain=DOMAIN)
    if not replaced:
        return 0
    kept = [replaced.get(id(n), n) for n in graph.node]
    del graph.node[:]
    graph.node.extend(n for n in kept if n is not None)
    use_domain(model)
    return sum(1 for n in graph.node if n.op_type == OP)
