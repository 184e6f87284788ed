"""Calibration step 2: an activation amax per linear from its histogram, and the INT8 error.

Methods: ``entropy`` (TensorRT's KL search), ``max``, ``percentile``, and ``auto``: per tensor,
the candidate threshold with the least INT8 output error on real rows of that linear.
"""

from __future__ import annotations

import numpy as np

from ..graph.hadamard import rotate_weight
from .histogram import METHODS, percentile_amax
from .sensitivity import output_error
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
        i, kind = name.split(".")[1], name.split(".")[2]
        w = getattr(weights, kind)(int(i))
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
    """Relative INT8 output error of each linear on its sampled rows."""
    return {n: output_error(st.stats.sample[n], linear_matrix(st.weights, n, st.rotate), amax[n]) for n in amax}
