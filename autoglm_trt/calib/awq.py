"""AWQ (Lin et al., 2024): per-input-channel scales that shield the weights of large activations
from INT4 rounding.

For ``y = x W`` and s > 0 over the input channels, ``y = (x / s) (diag(s) W)``: a channel scaled
up has its weights rounded with a smaller relative error, its activation divided back. The ``1/s``
is folded into whatever produces x exactly as SmoothQuant's vectors are
(``smooth.SmoothedWeights``; with GQA, o_proj's s is shared by each KV group's query heads). Per
linear, ``s = m^a`` normalized to ``s / sqrt(max s * min s)``, m the mean |x| per channel over
calibration rows, and ``a`` from a grid of ``GRID + 1`` points in [0, 1] the one of least
``||x W - (x / s) Q(diag(s) W)||^2`` over those rows (``a = 0``: plain rounding to nearest).
A linear of more than ``SAMPLED`` outputs is judged on ``SAMPLED`` of them, evenly spaced: the
weights are quantized one output column at a time, so each sampled column's error is the one
the whole search would compute, and the search's cost (a quantization of the linear per point of
the grid) no longer grows with the width (GLM-4-9B's gate/up: 27,392 outputs, 8,192 judged).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

GRID = 20
COLUMNS = 4096  # output columns whose error is computed at a time
SAMPLED = 8192  # the most output columns a search is judged on


@dataclass(frozen=True)
class AwqChoice:
    """One linear's search: the scales, the chosen exponent and the output errors (mean squared)
    with them and with plain rounding."""

    scale: np.ndarray
    alpha: float
    error: float
    rtn_error: float


def awq_scale(x: np.ndarray, w: np.ndarray, dequantized: Callable[[np.ndarray], np.ndarray],
              shared: Callable[[np.ndarray], np.ndarray] | None = None, grid: int = GRID) -> AwqChoice:
    """The search for ``x`` ``[rows, in]`` and ``w`` ``[in, out]``; ``dequantized(w)``: w through the
    weights' quantization and back (each output column on its own); ``shared``: makes the
    per-channel means equal where the fold needs one scale for several channels. The error is
    summed ``COLUMNS`` outputs at a time, so a wide linear (GLM-4-9B's gate/up: 27,392) holds a
    few copies of that many columns, not of the whole matrix; over ``SAMPLED`` outputs, on
    ``judged_columns`` of them (the errors are means over the columns judged)."""
    x = np.asarray(x, np.float32)
    if w.shape[1] > SAMPLED:
        w = w[:, judged_columns(w.shape[1])]
    mean = np.abs(x).mean(axis=0)
    if shared is not None:
        mean = shared(mean)
    mean = np.maximum(mean, np.float32(1e-6))
    parts = [slice(c, c + COLUMNS) for c in range(0, w.shape[1], COLUMNS)]
    refs = [x @ w[:, c] for c in parts]
    best: AwqChoice | None = None
    rtn = 0.0
    for k in range(grid + 1):
        alpha = k / grid
        s = (mean.astype(np.float64) ** alpha)
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
        xs = x / s
        total = sum(float(np.sum(np.square(xs @ dequantized(w[:, c] * s[:, None]) - ref, dtype=np.float64)))
                    for c, ref in zip(parts, refs))
        err = total / (x.shape[0] * w.shape[1])
        if k == 0:
            rtn = err
        if best is None or err < best.error:
            best = AwqChoice(s, alpha, err, rtn)
    assert best is not None
    return AwqChoice(best.scale, best.alpha, best.error, rtn)


def judged_columns(n: int, k: int | None = None) -> np.ndarray:
    """``k`` (default ``SAMPLED``) of ``n`` output columns, evenly spaced from the first to the last."""
    k = SAMPLED if k is None else k
    return np.unique(np.linspace(0, n - 1, min(k, n)).round().astype(np.int64))
