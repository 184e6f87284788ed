"""Calibration step 1: the activation statistics of every quantizable linear, in one pass.

Input: a float32 export (opened once, ``OpenedExport``), token windows, the pass's plan
(``CalibPlan``). Output: ``Statistics``: which graph
tensor feeds each linear, the Hadamard block of each rotated linear, the streamed histograms
(of the smoothed, rotated inputs the INT8 graph quantizes) and the smoothed weights. The
weight maxima SmoothQuant needs are read in a thread while ONNX Runtime runs the first batch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from ..backends.onnxrt.offline import WindowImages
from ..errors import AutoGLMError
from ..graph.exported_weights import OpenedExport
from ..graph.names import KINDS, input_channels, kind_of
from ..model.spec import ModelSpec
from ..quant.hadamard import block_size
from .collect import ActivationStats, CalibPlan, Smoothing, calibration_session, collect, linear_inputs
from .layerwise import gather_layerwise
from .smooth import SmoothedWeights, smoothing_scales, weight_row_max


@dataclass
class Statistics:
    inputs: dict[str, str]  # linear -> its input tensor in the float graph
    rotate: dict[str, int]  # linear -> Hadamard block
    stats: ActivationStats
    weights: SmoothedWeights
    seconds: float
    layerwise: bool = False  # gathered group of layers by group of layers (``layerwise``)


def quantizable_inputs(export_dir: Path, quantize_lm_head: bool, keep_float: list[str]) -> dict[str, str]:
    """The linears offered to INT8 and their input tensors; unknown ``keep_float`` names are errors."""
    inputs = linear_inputs(onnx.load(str(Path(export_dir) / "model.onnx"), load_external_data=False))
    if not quantize_lm_head:
        inputs.pop("lm_head", None)
    unknown = [k for k in keep_float if k not in inputs]
    if unknown:
        raise AutoGLMError(f"--keep-float names unknown linears {unknown}; known: layers.<i>.qkv|o_proj|gate_up|down, "
                           "lm_head")
    return inputs


def rotation_blocks(spec: ModelSpec, linears: list[str], kinds: list[str], max_block: int) -> dict[str, int]:
    """Hadamard block per rotated linear (an input width with no block > 1 is left unrotated)."""
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise AutoGLMError(f"cannot rotate {unknown}: the linear kinds are {', '.join(KINDS)}")
    blocks = {n: block_size(input_channels(spec, n), max_block) for n in linears if kind_of(n) in kinds}
    return {n: b for n, b in blocks.items() if b > 1}


def gather(export: OpenedExport, windows: np.ndarray, plan: CalibPlan, images: WindowImages | None = None,
           on_group: Callable[[list[str], ActivationStats], None] | None = None) -> Statistics:
    """Run the windows through the float graph once and accumulate ``plan``'s statistics: the whole
    graph at once, or (when its weights exceed ``plan.max_graph_bytes``) group of layers by group
    of layers. ``on_group``: the layer by layer pass's call when a group is done
    (``gather_layerwise``)."""
    import time

    spec, base, alpha = export.spec, export.weights, plan.alpha
    t0 = time.perf_counter()
    if plan.max_graph_bytes is not None and base.total_bytes() > plan.max_graph_bytes:

        def smoothing_for(layers: list[int]) -> Smoothing | None:
            if alpha is None:
                return None
            return lambda chan_max: smoothing_scales(spec, weight_row_max(spec, base, layers), chan_max, alpha)

        stats = gather_layerwise(export, windows, plan, smoothing_for, images=images, on_group=on_group)
        return Statistics(plan.inputs, plan.rotate, stats, SmoothedWeights(base, spec, stats.smooth),
                          time.perf_counter() - t0, layerwise=True)
    session = calibration_session(export.dir, list(plan.inputs.values()), plan.threads, plan.device)
    t0 = time.perf_counter()  # as the forward baseline of bench_calibration: after the session is made
    w_max: dict[str, dict[str, np.ndarray]] = {}
    reader = threading.Thread(target=lambda: w_max.update(all=weight_row_max(spec, base)), daemon=True)
    smoothing: Smoothing | None = None
    if alpha is not None:
        reader.start()

        def smoothing(chan_max: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            reader.join()
            return smoothing_scales(spec, w_max["all"], chan_max, alpha)

    stats = collect(session, spec, windows, plan, smoothing, images=images)
    seconds = time.perf_counter() - t0
    del session
    return Statistics(plan.inputs, plan.rotate, stats, SmoothedWeights(base, spec, stats.smooth), seconds)
