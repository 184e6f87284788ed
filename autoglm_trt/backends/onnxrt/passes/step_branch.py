"""Branch a step's graph once, rather than once per layer.

``attention.rewrite`` gives each layer an ``If`` on ``native.decode``: the native operator for
decode steps, the prefill attention (``PrefillAttention`` or the graph's nodes) for prefill
steps. ONNX Runtime runs an ``If`` as a subgraph with an execution frame of its own, and 30 of
them made a decode step of the SmolLM2 INT8 engine measurably slower than one, at batch 1 and 8.
Both branches read the same initializers: loading the SmolLM2 engines this way takes a little
more memory, not a second copy of the weights. Every layer takes the same branch within a step,
so ``branch_once`` moves the whole graph below the condition into one ``If``: its then branch is
the graph with each layer's decode branch in place of that layer's ``If``, its else branch the
graph with each prefill branch; a branch keeps only the nodes its outputs depend on (decode steps drop the
prefill attention's mask). The kernels, and so the outputs, are those of the per-layer form bit
for bit; a step runs one ``If``.

Graph inputs, initializers and the condition's nodes stay in the outer graph, where both
branches read them. A name a branch computes gets the branch's suffix (``.decode``,
``.prefill``), so that every name is assigned once across the model, as ONNX requires.
"""

from __future__ import annotations

import heapq

import onnx
from onnx import helper

from .common import DECODE_CONDITION, live_nodes

BRANCHES = (("then_branch", "decode"), ("else_branch", "prefill"))


def _per_layer(node: onnx.NodeProto) -> bool:
    return node.op_type == "If" and list(node.input) == [DECODE_CONDITION]


def _resolved(nodes: list[onnx.NodeProto], branch: str) -> list[onnx.NodeProto]:
    """Copies of ``nodes`` with each per-layer ``If`` replaced by the nodes of its ``branch``,
    which then write the ``If``'s outputs."""
    out = []
    for node in nodes:
        if not _per_layer(node):
            out.append(onnx.NodeProto.FromString(node.SerializeToString()))
            continue
        graph = next(a.g for a in node.attribute if a.name == branch)
        rename = {o.name: name for o, name in zip(graph.output, node.output)}
        for inner in graph.node:
            inner = onnx.NodeProto.FromString(inner.SerializeToString())
            inner.output[:] = [rename.get(o, o) for o in inner.output]
            out.append(inner)
    return out


def _sorted(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """``nodes`` in an order where each follows the producers of its inputs among them (a
    subgraph must be sorted; ONNX Runtime sorts only the outer graph), otherwise in their order."""
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    waits = [{producer[x] for x in n.input if x in producer} for n in nodes]
    readers: dict[int, list[int]] = {}
    for i, deps in enumerate(waits):
        for d in deps:
            readers.setdefault(d, []).append(i)
    ready = [i for i, deps in enumerate(waits) if not deps]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(nodes[i])
        for r in readers.get(i, []):
            waits[r].discard(i)
            if not waits[r]:
                heapq.heappush(ready, r)
    if len(order) != len(nodes):
        raise ValueError("the graph has a cycle")
    return order


def _branch(body: list[onnx.NodeProto], attr: str, suffix: str, graph: onnx.GraphProto) -> onnx.GraphProto:
    """``body`` with each per-layer ``If``'s ``attr`` branch, as the ``suffix`` branch of the step."""
    nodes = _resolved(body, attr)
    produced = {o for n in nodes for o in n.output if o}

    def renamed(name: str) -> str:
        return f"{name}.{suffix}" if name in produced else name

    for n in nodes:
        n.input[:] = [renamed(x) for x in n.input]
        n.output[:] = [renamed(x) for x in n.output]
    outputs = [onnx.ValueInfoProto.FromString(o.SerializeToString()) for o in graph.output]
    infos = [onnx.ValueInfoProto.FromString(v.SerializeToString()) for v in graph.value_info if v.name in produced]
    for info in outputs + infos:
        info.name = renamed(info.name)
    nodes = _sorted(live_nodes(nodes, {o.name for o in outputs}))  # a decode branch drops the prefill mask
    return helper.make_graph(nodes, f"step_{suffix}", [], outputs, value_info=infos)


def branch_once(model: onnx.ModelProto) -> bool:
    """Rewrite ``model`` in place (see above); False, unchanged, if it has no per-layer ``If``."""
    graph = model.graph
    if not any(_per_layer(n) for n in graph.node):
        return False
    producer = {o: n for n in graph.node for o in n.output}
    condition, todo = {}, [DECODE_CONDITION]
    while todo:  # the nodes the condition is computed by stay outside
        node = producer.get(todo.pop())
        if node is not None and id(node) not in condition:
            condition[id(node)] = node
            todo.extend(node.input)
    body = [n for n in graph.node if id(n) not in condition]
    outer = {i.name for i in graph.input} | {t.name for t in graph.initializer} | \
        {o for n in condition.values() for o in n.output}
    branches = {attr: _branch(body, attr, suffix, graph) for attr, suffix in BRANCHES}
    step = helper.make_node("If", [DECODE_CONDITION], [o.name for o in graph.output], name="native.step", **branches)
    kept_shapes = [v for v in graph.value_info if v.name in outer]
    del graph.value_info[:]
    graph.value_info.extend(kept_shapes)
    kept = [n for n in graph.node if id(n) in condition]
    del graph.node[:]
    graph.node.extend(kept + [step])
    return True
