"""Streamed activation statistics of an exported float32 graph.

Input: an export directory and token windows. Output, per quantizable linear (the inputs of
the QKV, o_proj, gate/up, down MatMuls of every layer and of the LM head's Gemm): a 2048-bin
histogram of |x| (after SmoothQuant scaling when enabled); from the first batch, the
per-channel max |x| (for the SmoothQuant vectors) and a few hundred rows of x (for the
sensitivity ranking); and a histogram of the raw |x| as the float graph has it, for the
TensorRT calibration cache (one token row in 4), whose tensors are those of the float graph. The graph runs
batch by batch in ONNX Runtime with those tensors as extra outputs; nothing grows with the
number of batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from ..backends.onnxrt.offline import BoundSession, WindowImages, prefill_feeds
from ..backends.onnxrt.session import make_session
from ..graph.names import input_channels
from ..model.spec import ModelSpec
from ..progress import Progress
from ..quant.gptq import LARGE
from ..quant.hadamard import rotate_rows
from .histogram import AbsHistogram, percentile_amax
from .native_stats import HistogramJob, native_stats
from .smooth import abs_max

SAMPLE_ROWS = 256
# The raw histograms feed only TensorRT's implicit-INT8 cache (the engines build from the Q/DQ
# graph); they take one token row in 4 (``Accumulator._rows``), which cuts the statistics pass's
# histogram work by 3/8.
RAW_ROW_STRIDE = 4
KV_PERCENTILE = 99.99  # of |K|, |V| per KV head: the INT8 KV cache's clipping threshold


def linear_inputs(model: onnx.ModelProto) -> dict[str, str]:
    """``{linear name: input tensor}``: MatMuls on ``<name>.weight`` and the LM head Gemm."""
    weights = {t.name for t in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type == "MatMul" and node.input[1] in weights and node.input[1].endswith(".weight"):
            out[node.input[1][: -len(".weight")]] = node.input[0]
        elif node.op_type == "Gemm" and node.output[0].startswith("logits"):
            out["lm_head"] = node.input[0]
    return out


@dataclass
class ActivationStats:
    hist: dict[str, AbsHistogram] = field(default_factory=dict)
    raw_hist: dict[str, AbsHistogram] = field(default_factory=dict)  # |x| as the float graph has it (TensorRT cache)
    chan_max: dict[str, np.ndarray] = field(default_factory=dict)  # first batch
    sample: dict[str, np.ndarray] = field(default_factory=dict)  # first-batch rows, already smoothed
    smooth: dict[str, np.ndarray] = field(default_factory=dict)
    # new_key.<i> / new_value.<i> -> one histogram per KV head of |K| (after rope) and |V| as the
    # graph stores them (V / s under SmoothQuant)
    kv_hist: dict[str, list[AbsHistogram]] = field(default_factory=dict)
    # linear name -> X^T X of its input rows, float32 [in, in] (asked for by name: GPTQ's)
    gram: dict[str, np.ndarray] = field(default_factory=dict)
    batches: int = 0
    tokens: int = 0


@dataclass(frozen=True)
class CalibPlan:
    """What one statistics pass gathers and how it runs, made once by its caller (``calibrate``,
    the INT4 build) and passed down whole: the linears and their input tensors in the float graph,
    the Hadamard block of each rotated one, SmoothQuant's alpha (None: off), the linears whose
    input Gram matrices to sum (GPTQ's), one token row in ``row_stride`` histogrammed; windows per
    batch, ONNX Runtime's threads and device, and the float32 weights over which the graph runs
    group of layers by group of layers (None: never)."""

    inputs: dict[str, str]
    rotate: dict[str, int] = field(default_factory=dict)
    alpha: float | None = None
    gram: tuple[str, ...] = ()
    row_stride: int = 1
    batch_size: int = 8
    threads: int | None = None
    device: str = "cpu"
    max_graph_bytes: int | None = None


def calibration_session(export_dir: Path, outputs: list[str], threads: int | None = None, device: str = "cpu"):
    """A session over the export with ``outputs`` added as graph outputs (weights read in place)."""
    model = onnx.load(str(Path(export_dir) / "model.onnx"), load_external_data=False)
    for name in outputs:
        model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    return make_session(model.SerializeToString(), threads=threads, external_data_dir=Path(export_dir), device=device)


def collect(session, spec: ModelSpec, windows: np.ndarray, plan: CalibPlan, smoothing: Smoothing | None = None,
            show_progress: bool = True, images: WindowImages | None = None) -> ActivationStats:
    """Run all windows through the graph and accumulate the statistics of ``plan``'s linears (see
    ``Accumulator``); ``images``: the windows' images (a vision family's image windows)."""
    names, batch_size = list(plan.inputs), plan.batch_size
    stats = ActivationStats()
    kv = kv_outputs(spec)
    acc = Accumulator(stats, spec, names, smoothing, plan.rotate, plan.row_stride, plan.gram)
    n_batches = -(-len(windows) // batch_size)
    progress = Progress(n_batches, "calibrating") if show_progress else None
    shapes = [_linear_shape(input_channels(spec, n), "lm_head" in n) for n in names]
    shapes += [lambda b, t: (b, t, spec.num_kv_heads, spec.head_dim)] * len(kv)
    bound = BoundSession(session, [plan.inputs[n] for n in names] + kv, shapes)
    # (Accumulating batch b - 1 in a worker thread while ONNX Runtime ran batch b was tried and
    # measured slower than running them in turn: both are bound by memory bandwidth, which overlap
    # does not add; docs/benchmarks.md, "Calibration cost".)
    for b in range(n_batches):
        a, z = b * batch_size, min((b + 1) * batch_size, len(windows))
        feeds = prefill_feeds(spec, windows[a:z], "float32", images=None if images is None else images.take(a, z))
        outs = bound.run(feeds, *windows[a:z].shape)
        acc.add(outs[: len(names)], dict(zip(kv, outs[len(names):])))
        if progress:
            progress.update()
    stats.batches, stats.tokens = n_batches, int(windows.size)
    return stats


Smoothing = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


def add_gram(grams: dict[str, np.ndarray], name: str, rows: np.ndarray) -> None:
    """``grams[name] += rows^T rows`` (float32). Over ``gptq.LARGE`` inputs (GLM-4-9B's down
    projection: a 750 MB matrix) by blocks of 2,048 columns, so that no second whole matrix is
    made for the sum."""
    n = rows.shape[1]
    if n <= LARGE:
        if name in grams:
            grams[name] += rows.T @ rows
        else:
            grams[name] = rows.T @ rows
        return
    gram = grams.setdefault(name, np.zeros((n, n), np.float32))
    for c in range(0, n, 2048):
        gram[:, c:c + 2048] += rows.T @ rows[:, c:c + 2048]


class Accumulator:
    """Adds batches of some linears' inputs (and K/V) to ``ActivationStats``.

    ``smoothing`` maps the first batch's per-channel maxima to SmoothQuant vectors; every
    batch (the first included) is then histogrammed as ``x / s``. The inputs named in
    ``rotate`` (name -> Hadamard block) are histogrammed and sampled as ``(x / s) R``, which
    is what their quantizer sees in the INT8 graph. These histograms take one token row in
    ``row_stride`` of each window (``_rows``); the first batch's maxima and samples take every row.
    The linears named in ``gram`` have X^T X of every row of their raw inputs summed (float32).
    The whole graph's pass has one accumulator; the layer-by-layer pass one per group of
    layers, over the same batches.
    """

    def __init__(self, stats: ActivationStats, spec: ModelSpec, names: list[str], smoothing: Smoothing | None,
                 rotate: dict[str, int], row_stride: int = 1, gram: tuple[str, ...] = ()):
        if not isinstance(row_stride, int) or isinstance(row_stride, bool) or row_stride < 1:
            raise ValueError(f"hist_row_stride must be a whole number >= 1 (1: every token row), got {row_stride!r}")
        self.stats, self.spec, self.names, self.smoothing, self.rotate = stats, spec, names, smoothing, rotate
        self.row_stride, self.gram = row_stride, [n for n in names if n in set(gram)]
        self.windows = 0  # windows added so far (which token rows a window's histograms take)
        for n in names:
            stats.hist[n], stats.raw_hist[n] = AbsHistogram(), AbsHistogram()
        self.first = True
        self.inv: dict[str, np.ndarray] = {}
        self.v_scales: dict[str, np.ndarray] = {}
        self.scratch: dict[tuple[tuple[int, ...], str], np.ndarray] = {}
        self.native = native_stats()

    def _scratch(self, shape: tuple[int, ...], use: str = "") -> np.ndarray:
        key = (shape, use)
        if key not in self.scratch:
            self.scratch[key] = np.empty(shape, np.float32)
        return self.scratch[key]

    def _first_batch(self, outs: list[np.ndarray]) -> None:
        stats = self.stats
        maxima = self.native.map(_channel_max, outs) if self.native is not None else [_channel_max(x) for x in outs]
        for name, x, m in zip(self.names, outs, maxima):
            stats.chan_max[name] = m
            rows = np.linspace(0, x.size // x.shape[-1] - 1, min(SAMPLE_ROWS, x.size // x.shape[-1])).astype(np.int64)
            stats.sample[name] = x.reshape(-1, x.shape[-1])[rows]  # a new array (x is the run's float32 buffer)
        if self.smoothing is not None:
            smooth = self.smoothing({n: stats.chan_max[n] for n in self.names})
            stats.smooth.update(smooth)
            self.inv = {k: (1.0 / v).astype(np.float32) for k, v in smooth.items()}
            for name in self.names:
                if name in self.inv:
                    stats.sample[name] *= self.inv[name]
        for name in self.names:
            if name in self.rotate:
                rotate = self.native.rotate if self.native is not None else rotate_rows
                stats.sample[name] = rotate(stats.sample[name], self.rotate[name], out=stats.sample[name])
        self.v_scales = value_scales(self.spec, stats.smooth)  # the smoothing is fixed from the first batch on
        self.first = False

    def add(self, outs: list[np.ndarray], kv: dict[str, np.ndarray]) -> None:
        """One batch: the inputs of ``names`` in order (used as scratch: overwritten), new K/V by name."""
        for name in self.gram:  # before the histograms overwrite the inputs
            x = outs[self.names.index(name)]
            add_gram(self.stats.gram, name, x.reshape(-1, x.shape[-1]))
        if self.first:
            self._first_batch(outs)
        if self.native is not None:
            self.native.add(self._jobs(outs, kv), self.windows)
        else:
            self._add_numpy(outs, kv)
        self.windows += len(outs[0]) if outs else 0

    def _add_numpy(self, outs: list[np.ndarray], kv: dict[str, np.ndarray]) -> None:
        """``add``'s histograms in numpy (no native library): the same counts as ``_jobs`` gives."""
        stats, rotate, inv = self.stats, self.rotate, self.inv
        kv_observe(stats.kv_hist, list(kv), list(kv.values()), self.v_scales)
        for name, x in zip(self.names, outs):
            # the raw rows first: smoothing and rotation change x
            stats.raw_hist[name].add(self._rows(x, RAW_ROW_STRIDE, "raw", np.abs), in_place=True, nonnegative=True)
            if self.row_stride > 1 and x.ndim == 3:  # the rows taken, smoothed, in contiguous scratch
                x = self._rows(x, self.row_stride, "rows", (lambda a, out, s=inv[name]: np.multiply(a, s, out=out))
                               if name in inv else (lambda a, out: np.copyto(out, a)))
            elif name in inv:
                np.multiply(x, inv[name], out=x)
            if name in rotate:
                stats.hist[name].add(rotate_rows(x, rotate[name], out=self._scratch(x.shape)), in_place=True)
            else:
                stats.hist[name].add(x, in_place=True)

    def _jobs(self, outs: list[np.ndarray], kv: dict[str, np.ndarray]) -> list[HistogramJob]:
        """The batch's histogram work as ``native_stats`` takes it: what ``_add_numpy`` does in numpy."""
        jobs = []
        for name, x in zip(self.names, outs):
            jobs.append(HistogramJob(self.stats.raw_hist[name], x, RAW_ROW_STRIDE))
            jobs.append(HistogramJob(self.stats.hist[name], x, self.row_stride, self.inv.get(name),
                                     self.rotate.get(name, 0)))
        for name, x in kv.items():
            heads = self.stats.kv_hist.setdefault(name, [AbsHistogram() for _ in range(x.shape[2])])
            scales = self.v_scales.get(name)
            jobs += [HistogramJob(hist, x[:, :, h, :], 1, None if scales is None else scales[h])
                     for h, hist in enumerate(heads)]
        return jobs

    def _rows(self, x: np.ndarray, stride: int, use: str, write: Callable[..., object]) -> np.ndarray:
        """Some token rows of a linear's input ``[batch, tokens, channels]``, through ``write(rows,
        out=...)`` into scratch ``[batch, tokens // stride, channels]``: window w (counted over
        all batches) takes the rows t = w mod stride, that + stride, ... So every position is
        taken in 1/stride of the windows: the first token, whose activations are outliers, is
        neither always taken (which would weigh it stride times over) nor never. The LM head's
        input, one row per window, and windows shorter than ``stride`` are taken whole."""
        if x.ndim != 3 or x.shape[1] < stride:
            stride = 1
        batch, tokens, channels = x.shape if x.ndim == 3 else (x.shape[0], 1, x.shape[1])
        n = tokens // stride
        out = self._scratch((batch, n, channels) if x.ndim == 3 else x.shape, use)
        if stride == 1:
            write(x, out=out)
            return out
        for w in range(batch):
            first = (self.windows + w) % stride
            write(x[w, first : first + n * stride : stride], out=out[w])
        return out


def _channel_max(x: np.ndarray) -> np.ndarray:
    return abs_max(x.reshape(-1, x.shape[-1]), axis=0)


def kv_outputs(spec: ModelSpec) -> list[str]:
    return [f"new_{kind}.{i}" for i in range(spec.num_layers) for kind in ("key", "value")]


def value_scales(spec: ModelSpec, smooth: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``new_value.<i>`` -> 1/s ``[kv_heads, head_dim]``: SmoothQuant of o_proj divides V's channels
    by its vector (shared by a group's query heads), so the INT8 graph stores V / s."""
    from .smooth import group_shared

    return {f"new_value.{i}": (1.0 / group_shared(smooth[f"layers.{i}.o_proj"], spec)).astype(np.float32).reshape(
        spec.num_kv_heads, spec.head_dim) for i in range(spec.num_layers) if f"layers.{i}.o_proj" in smooth}


def kv_observe(hists: dict[str, list[AbsHistogram]], names: list[str], outs: list[np.ndarray],
               scales: dict[str, np.ndarray] | None = None) -> None:
    """Add the new K/V ``[batch, tokens, kv_heads, head_dim]`` (times ``scales`` where given, in
    place) to one histogram per KV head."""
    scratch: np.ndarray | None = None  # one head's |values|, contiguous: the copy and abs in one pass
    for name, x in zip(names, outs):
        if name in (scales or {}):
            np.multiply(x, scales[name], out=x)  # type: ignore[index]
        heads = hists.setdefault(name, [AbsHistogram() for _ in range(x.shape[2])])
        if scratch is None or scratch.shape != x[:, :, 0, :].shape:
            scratch = np.empty(x[:, :, 0, :].shape, np.float32)
        for h, hist in enumerate(heads):
            hist.add(x[:, :, h, :], scratch=scratch)


def kv_head_amax(hists: dict[str, list[AbsHistogram]]) -> dict[str, list[float]]:
    """The clipping threshold of each KV head: the 99.99th percentile of its |values|.
    (Against the plain max on SmolLM2's fp32 engine, held-out text 16 tokens per step through an
    INT8 pool, it gave the higher top-1 agreement with the checkpoint, `benchmarks/bench_kv.py`.)"""
    return {name: [float(percentile_amax(h, KV_PERCENTILE)) for h in heads] for name, heads in hists.items()}


def kv_statistics(export_dir: Path, spec: ModelSpec, windows: np.ndarray, batch_size: int, kv_dtype: str,
                  threads: int | None = None) -> dict[str, list[float]]:
    """Per-layer, per-KV-head thresholds of K (after rope) and V over the windows: the one pass an
    INT8 KV cache needs when the linears are not being calibrated (fp32 and fp16 engines)."""
    session = calibration_session(export_dir, [], threads)
    names = kv_outputs(spec)
    bound = BoundSession(session, names, [lambda b, t: (b, t, spec.num_kv_heads, spec.head_dim)] * len(names),
                         [np.dtype(kv_dtype)] * len(names))
    hists: dict[str, list[AbsHistogram]] = {}
    for b in range(0, len(windows), batch_size):
        batch = windows[b : b + batch_size]
        kv_observe(hists, names, bound.run(prefill_feeds(spec, batch, kv_dtype), *batch.shape))
    return kv_head_amax(hists)


def _linear_shape(channels: int, flat: bool) -> Callable[[int, int], tuple[int, ...]]:
    return (lambda b, t: (b, channels)) if flat else (lambda b, t: (b, t, channels))
