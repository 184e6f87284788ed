"""What the passes share: the operator domain, and small questions about a graph."""

from __future__ import annotations

import onnx
from onnx import helper

DOMAIN = "autoglm.trt"  # the native library's operators
MICROSOFT = "com.microsoft"  # ONNX Runtime's contrib operators
DECODE_CONDITION = "native.decode"  # true when every sequence has one new token (``attention.py``)
SLOTS = "native.slots"  # [batch] int64: where each sequence's new token's K/V go (decode); -1: nowhere


def use_domain(model: onnx.ModelProto, domain: str = DOMAIN) -> None:
    """Declare ``domain`` (version 1) in the model's opsets, once."""
    if not any(o.domain == domain for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(domain, 1))


def graph_inputs(graph: onnx.GraphProto) -> set[str]:
    """Every name the graph's nodes read, those of nodes in subgraphs (``If`` branches) included."""
    names: set[str] = set()
    for node in graph.node:
        names.update(node.input)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                names |= graph_inputs(attr.g)
    return names


def other_input(node: onnx.NodeProto, name: str) -> str:
    """The input of a two-input node that is not ``name``."""
    return node.input[1] if node.input[0] == name else node.input[0]


def all_nodes(graph: onnx.GraphProto):
    """Every node of the graph, those in subgraphs included."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from all_nodes(attr.g)


def live_nodes(nodes: list[onnx.NodeProto], outputs: set[str]) -> list[onnx.NodeProto]:
    """Of ``nodes`` (in order), those some of ``outputs`` depends on."""
    producer = {o: n for n in nodes for o in n.output if o}
    live: dict[int, onnx.NodeProto] = {}
    todo = list(outputs)
    while todo:
        node = producer.get(todo.pop())
        if node is not None and id(node) not in live:
            live[id(node)] = node
            todo.extend(node.input)
    return [n for n in nodes if id(n) in live]
