"""Calibration step 2: an activation amax per linear from its histogram, and the INT8 error.

Methods: ``entropy`` (TensorRT's KL search), ``max``, ``percentile``, and ``auto``: per tensor,
the candidate threshold with the least INT8 output error on real rows of that linear.
"""

from __future__ import annotations

import numpy as np

from ..graph.decoder import LM_HEAD_STREAM_BYTES
from ..graph.names import kind_of, layer_of
from ..graph.qdq import ROW_CHUNK
from ..quant.hadamard import rotate_weight, rotate_weight_rows
from .histogram import METHODS, percentile_amax
from .sensitivity import mean_output_error, output_error, output_error_norms
from .smooth import SmoothedWeights
from .statistics import Statistics

AUTO_CANDIDATES = {
    "entropy": METHODS["entropy"],
    "max": METHODS["max"],
    "percentile-99.99": lambda h: percentile_amax(h, 99.99),
    "percentile-99.999": lambda h: percentile_amax(h, 99.999),
}


def linear_matrix(weights: SmoothedWeights, name: str, rotate: dict[str, int]) -> np.ndarray:
    """The ``[in, out]`` weight of a linear as its INT8 graph has it (smoothed; rotated if planned)."""
    if name == "lm_head":
        src = weights.lm_head_name() or weights.embedding_name()
        w = np.asarray(weights.rows(src, 0, weights.spec.vocab_size), np.float32).T
    else:
        kind = kind_of(name)
        w = getattr(weights, kind)(layer_of(name))
        w = w[0] if kind in ("qkv", "o_proj") else w
    return rotate_weight(w, rotate[name]) if name in rotate else w


def choose_amax(st: Statistics, method: str, percentile: float) -> tuple[dict[str, float], dict[str, str]]:
    """(amax per linear, the method each came from)."""
    if method == "auto":
        amax, chosen = {}, {}
        for n, h in st.stats.hist.items():
            w = linear_matrix(st.weights, n, st.rotate)
            options = {m: f(h) for m, f in AUTO_CANDIDATES.items()}
            best = min(options, key=lambda m: output_error(st.stats.sample[n], w, options[m]))
            amax[n], chosen[n] = float(options[best]), best
        return amax, chosen
    fn = METHODS[method]
    amax = {n: float(fn(h) if method != "percentile" else percentile_amax(h, percentile))
            for n, h in st.stats.hist.items()}
    return amax, {n: method for n in amax}


def int8_errors(st: Statistics, amax: dict[str, float]) -> dict[str, float]:
    """Relative INT8 output error of each linear on its sampled rows (a large LM head's in column chunks)."""
    out = {}
    for n in amax:
        if n == "lm_head" and _large_head(st.weights):
            out[n] = head_error(st.weights, st.stats.sample[n], amax[n], st.rotate.get(n))
        else:
            out[n] = output_error(st.stats.sample[n], linear_matrix(st.weights, n, st.rotate), amax[n])
    return out


def bias_corrections(st: Statistics, amax: dict[str, float]) -> dict[str, np.ndarray]:
    """``mean_output_error`` of each linear but the LM head on its sampled rows."""
    return {n: mean_output_error(st.stats.sample[n], linear_matrix(st.weights, n, st.rotate), amax[n])
            for n in amax if n != "lm_head"}


def _large_head(weights: SmoothedWeights) -> bool:
    return weights.spec.vocab_size * weights.spec.hidden_size * 4 > LM_HEAD_STREAM_BYTES


def head_error(weights: SmoothedWeights, x: np.ndarray, amax: float, block: int | None) -> float:
    """``output_error`` of the LM head, its [vocab, hidden] rows read ``ROW_CHUNK`` at a time: the errors of
    column chunks of ``x @ W`` add up in squares, so the float matrix is never whole in memory."""
    src = weights.lm_head_name() or weights.embedding_name()
    vocab = weights.spec.vocab_size
    diff2 = ref2 = 0.0
    for a in range(0, vocab, ROW_CHUNK):
        rows = np.asarray(weights.rows(src, a, min(a + ROW_CHUNK, vocab)), np.float32)
        diff, ref = output_error_norms(x, (rotate_weight_rows(rows, block) if block else rows).T, amax)
        diff2, ref2 = diff2 + diff**2, ref2 + ref**2
    return float(np.sqrt(diff2) / max(np.sqrt(ref2), 1e-30))
