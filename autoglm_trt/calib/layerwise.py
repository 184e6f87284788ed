"""Calibration statistics one group of decoder layers at a time, in memory bounded by one group.

The way GPTQ-style tools walk a model: the embedding of every calibration window is looked
up once (the rows of the tokens present, read from the export's data file); then for each
group of consecutive layers, a graph of those layers alone takes the residual stream the
previous group left, yields the inputs of their linears and their new K/V (accumulated as the
whole-graph pass accumulates them, ``collect.Accumulator``) and the residual stream the next
group takes. Last, a graph of the final norm yields the LM head's input. ::

    windows -> embedding rows -> [layers 0..a] -> [layers a+1..b] -> ... -> [final norm] -> lm_head input
                                    |                 |
                                linear inputs, K/V: histograms, maxima, samples

Each group's graph is cut out of the export's own ``model.onnx`` (``subgraph``): its weights
stay where the export wrote them and ONNX Runtime reads only that group's, so memory holds
one group's weights plus the residual stream of all windows ([windows, tokens, hidden]
float32, e.g. 16 MB for 8 windows of 128 tokens of a 4096-wide model), whatever the model's
size. A group holds as many layers as fit in ``max_graph_bytes`` of weights (one at least).
The statistics equal the whole graph's to float rounding (``tests/test_layerwise.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..backends.onnxrt.offline import BoundSession, WindowImages, prefill_feeds
from ..backends.onnxrt.session import make_session
from ..errors import AutoGLMError
from ..graph.exported_weights import ExportedWeights, OpenedExport
from ..graph.names import input_channels, layer_of
from ..progress import Progress
from .collect import Accumulator, ActivationStats, CalibPlan, Smoothing

EMBED_OUTPUT = "embed"  # the embedding Gather's output in the export's graph (``graph.decoder``)


def residual_name(i: int) -> str:
    """The residual stream leaving layer i in the export's graph."""
    return f"layers.{i}.mlp_residual"


def subgraph(model: onnx.ModelProto, inputs: list[str], outputs: list[str]) -> onnx.ModelProto:
    """The nodes of ``model`` that compute ``outputs`` from the tensors ``inputs`` (float32
    [batch, new_tokens, hidden]) and whatever graph inputs and weights they reach; the weights
    keep their external-data references, so nothing is copied."""
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    inits = {t.name: t for t in graph.initializer}
    graph_inputs = {v.name: v for v in graph.input}
    kept: set[int] = set()
    used_inits: list[str] = []
    used_inputs: list[str] = []
    seen: set[str] = set()
    stack = list(outputs)
    while stack:
        name = stack.pop()
        if not name or name in seen:
            continue
        seen.add(name)
        if name in inputs:
            continue
        if name in inits:
            used_inits.append(name)
        elif name in graph_inputs:
            used_inputs.append(name)
        elif name in producer:
            node = producer[name]
            if id(node) not in kept:
                kept.add(id(node))
                stack.extend(node.input)
        else:
            raise AutoGLMError(f"the export's graph has no tensor '{name}'; was it made by this version?")
    nodes = [n for n in graph.node if id(n) in kept]
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", "new_tokens", "hidden"]) for n in inputs]
    ins += [graph_inputs[n] for n in graph_inputs if n in used_inputs]  # the graph's order
    outs = [helper.make_empty_tensor_value_info(n) for n in outputs]
    sub = helper.make_graph(nodes, "calibration_group", ins, outs, [inits[n] for n in sorted(set(used_inits))])
    return helper.make_model(sub, opset_imports=model.opset_import, ir_version=model.ir_version)


def layer_groups(weights: ExportedWeights, num_layers: int, max_graph_bytes: int) -> list[list[int]]:
    """Consecutive layers whose weights add up to at most ``max_graph_bytes`` (one layer at least)."""
    groups: list[list[int]] = [[]]
    size = 0
    for i in range(num_layers):
        layer = weights.layer_bytes(i)
        if groups[-1] and size + layer > max_graph_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += layer
    return groups


def embed(weights: ExportedWeights, windows: np.ndarray) -> np.ndarray:
    """[windows, tokens, hidden] float32: the embedding rows of the tokens, read row by row."""
    name = weights.embedding_name()
    uniq, inverse = np.unique(windows, return_inverse=True)
    rows = np.stack([np.asarray(weights.rows(name, int(t), int(t) + 1)[0], np.float32) for t in uniq])
    return rows[inverse.reshape(windows.shape)]


def gather_layerwise(export: OpenedExport, windows: np.ndarray, plan: CalibPlan,
                     smoothing_for: Callable[[list[int]], Smoothing | None], show_progress: bool = True,
                     images: WindowImages | None = None,
                     on_group: Callable[[list[str], ActivationStats], None] | None = None) -> ActivationStats:
    """The statistics of ``collect`` over the windows, group of layers by group of layers of at most
    ``plan.max_graph_bytes`` (``images``: the windows' images, whose rows replace the image tokens'
    embeddings).

    ``smoothing_for(layers)`` gives the SmoothQuant callback of those layers' linears (None: off).
    ``on_group(linears, stats)``, called when a group's windows are all through, may take its
    linears' statistics out of ``stats`` (GPTQ rounds them there, so that only one group's Gram
    matrices are ever held).
    """
    spec, inputs, size = export.spec, plan.inputs, plan.batch_size
    model = onnx.load(str(export.dir / "model.onnx"), load_external_data=False)
    batches = [(b, min(b + size, len(windows))) for b in range(0, len(windows), size)]
    feeds = [prefill_feeds(spec, windows[a:b], "float32", images=None if images is None else images.take(a, b))
             for a, b in batches]
    hidden = embed(export.weights, windows)
    if images is not None:
        images.substitute(hidden)
    stats = ActivationStats()
    groups = layer_groups(export.weights, spec.num_layers, plan.max_graph_bytes or 0)
    progress = Progress(len(groups) * len(batches), "calibrating, layer by layer") if show_progress else None
    stream = EMBED_OUTPUT
    for group in groups:
        names = [n for n in inputs if layer_of(n) in group]
        kv = [f"new_{kind}.{i}" for i in group for kind in ("key", "value")]
        out_name = residual_name(group[-1])
        shapes = [_shape(input_channels(spec, n)) for n in names]
        shapes += [lambda b, t: (b, t, spec.num_kv_heads, spec.head_dim)] * len(kv)
        graph = subgraph(model, [stream], [inputs[n] for n in names] + kv + [out_name])
        runner = BoundSession(_group_session(graph, export.dir, plan), [inputs[n] for n in names] + kv, shapes)
        acc = Accumulator(stats, spec, names, smoothing_for(group), plan.rotate, plan.row_stride, plan.gram)
        nxt = np.empty_like(hidden)
        for (a, b), f in zip(batches, feeds):
            outs = runner.run({**f, stream: hidden[a:b]}, b - a, hidden.shape[1], {out_name: nxt[a:b]})
            acc.add(outs[: len(names)], dict(zip(kv, outs[len(names):])))
            if progress:
                progress.update()
        hidden, stream = nxt, out_name
        del runner
        if on_group is not None:
            on_group(names, stats)
    if "lm_head" in inputs:
        head = BoundSession(_group_session(subgraph(model, [stream], [inputs["lm_head"]]), export.dir, plan),
                            [inputs["lm_head"]], [lambda b, t: (b, spec.hidden_size)])
        acc = Accumulator(stats, spec, ["lm_head"], None, plan.rotate)  # the final norm's rows: never smoothed
        for (a, b), f in zip(batches, feeds):
            acc.add(head.run({**f, stream: hidden[a:b]}, b - a, hidden.shape[1]), {})
    stats.batches, stats.tokens = len(batches), int(windows.size)
    return stats


def _group_session(model: onnx.ModelProto, export_dir: Path, plan: CalibPlan):
    """A session over one group's graph, its weights read where the export wrote them."""
    return make_session(model.SerializeToString(), threads=plan.threads, external_data_dir=export_dir,
                        device=plan.device)


def _shape(channels: int) -> Callable[[int, int], tuple[int, ...]]:
    return lambda b, t: (b, t, channels)
