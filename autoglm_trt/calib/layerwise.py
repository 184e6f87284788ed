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

from ..errors import AutoGLMError
from ..graph.exported_weights import ExportedWeights
from ..graph.names import input_channels, layer_of
from ..graph.runner import WindowImages, prefill_feeds
from ..graph.session import make_session
from ..model.spec import ModelSpec
from ..progress import Progress
from .collect import Accumulator, ActivationStats, Smoothing

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


class _GroupRunner:
    """One group's session; runs a batch with its outputs bound to buffers (the stream's to ``out``)."""

    def __init__(self, model: onnx.ModelProto, export_dir: Path, stream_in: str, outputs: list[str],
                 shapes: list[Callable[[int, int], tuple[int, ...]]], threads: int | None, device: str):
        self.session = make_session(model.SerializeToString(), threads=threads, external_data_dir=export_dir,
                                    device=device)
        self.wanted = {i.name for i in self.session.get_inputs()}
        self.stream_in, self.outputs, self.shapes = stream_in, outputs, shapes
        self.buffers: dict[tuple[int, int], list[np.ndarray]] = {}

    def run(self, feeds: dict[str, np.ndarray], hidden: np.ndarray, out: dict[str, np.ndarray]) -> list[np.ndarray]:
        batch, tokens = hidden.shape[:2]
        if (batch, tokens) not in self.buffers:
            self.buffers = {(batch, tokens): [np.empty(s(batch, tokens), np.float32) for s in self.shapes]}
        bufs = self.buffers[(batch, tokens)]
        binding = self.session.io_binding()
        for name, arr in feeds.items():
            if name in self.wanted:
                binding.bind_cpu_input(name, arr)
        binding.bind_cpu_input(self.stream_in, hidden)
        for name, arr in [*zip(self.outputs, bufs), *out.items()]:
            binding.bind_output(name, "cpu", 0, np.float32, list(arr.shape), arr.ctypes.data)
        self.session.run_with_iobinding(binding)
        return bufs


def gather_layerwise(export_dir: Path, spec: ModelSpec, windows: np.ndarray, inputs: dict[str, str],
                     rotate: dict[str, int], smoothing_for: Callable[[list[int]], Smoothing | None], batch_size: int,
                     threads: int | None, max_graph_bytes: int, device: str = "cpu",
                     show_progress: bool = True, row_stride: int = 1,
                     images: WindowImages | None = None, gram: tuple[str, ...] = (),
                     on_group: Callable[[list[str], ActivationStats], None] | None = None) -> ActivationStats:
    """The statistics of ``collect`` over the windows, group of layers by group of layers
    (``images``: the windows' images, whose rows replace the image tokens' embeddings).

    ``smoothing_for(layers)`` gives the SmoothQuant callback of those layers' linears (None: off).
    ``gram``: the linears whose input Gram matrices to sum; ``on_group(linears, stats)``, called
    when a group's windows are all through, may take its linears' statistics out of ``stats`` (GPTQ
    rounds them there, so that only one group's Gram matrices are ever held).
    """
    model = onnx.load(str(Path(export_dir) / "model.onnx"), load_external_data=False)
    weights = ExportedWeights(export_dir)
    batches = [(b, min(b + batch_size, len(windows))) for b in range(0, len(windows), batch_size)]
    feeds = [prefill_feeds(spec, windows[a:b], "float32", images=None if images is None else images.take(a, b))
             for a, b in batches]
    hidden = embed(weights, windows)
    if images is not None:
        images.substitute(hidden)
    stats = ActivationStats()
    groups = layer_groups(weights, spec.num_layers, max_graph_bytes)
    progress = Progress(len(groups) * len(batches), "calibrating, layer by layer") if show_progress else None
    stream = EMBED_OUTPUT
    for group in groups:
        names = [n for n in inputs if layer_of(n) in group]
        kv = [f"new_{kind}.{i}" for i in group for kind in ("key", "value")]
        out_name = residual_name(group[-1])
        shapes = [_shape(input_channels(spec, n)) for n in names]
        shapes += [lambda b, t: (b, t, spec.num_kv_heads, spec.head_dim)] * len(kv)
        runner = _GroupRunner(subgraph(model, [stream], [inputs[n] for n in names] + kv + [out_name]),
                              Path(export_dir), stream, [inputs[n] for n in names] + kv, shapes, threads, device)
        acc = Accumulator(stats, spec, names, smoothing_for(group), rotate, row_stride, gram)
        nxt = np.empty_like(hidden)
        for (a, b), f in zip(batches, feeds):
            outs = runner.run(f, hidden[a:b], {out_name: nxt[a:b]})
            acc.add(outs[: len(names)], dict(zip(kv, outs[len(names):])))
            if progress:
                progress.update()
        hidden, stream = nxt, out_name
        del runner
        if on_group is not None:
            on_group(names, stats)
    if "lm_head" in inputs:
        _head_statistics(model, Path(export_dir), spec, stats, inputs, stream, hidden, batches, feeds, rotate,
                         threads, device)
    stats.batches, stats.tokens = len(batches), int(windows.size)
    return stats


def _head_statistics(model: onnx.ModelProto, export_dir: Path, spec: ModelSpec, stats: ActivationStats,
                     inputs: dict[str, str], stream: str, hidden: np.ndarray, batches: list[tuple[int, int]],
                     feeds: list[dict[str, np.ndarray]], rotate: dict[str, int], threads: int | None,
                     device: str) -> None:
    """The LM head's input: the final norm of each window's last token (never smoothed)."""
    runner = _GroupRunner(subgraph(model, [stream], [inputs["lm_head"]]), export_dir, stream, [inputs["lm_head"]],
                          [lambda b, t: (b, spec.hidden_size)], threads, device)
    acc = Accumulator(stats, spec, ["lm_head"], None, rotate)
    for (a, b), f in zip(batches, feeds):
        acc.add(runner.run(f, hidden[a:b], {}), {})


def _shape(channels: int) -> Callable[[int, int], tuple[int, ...]]:
    return lambda b, t: (b, t, channels)
