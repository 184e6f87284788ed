"""Block Hadamard rotations for INT8 activations with outliers (QuaRot-style). Pure numpy.

For a linear ``y = x W`` (W is ``[in, out]``) and an orthogonal R, ``y = (x R) (R^T W)``.
With R block-diagonal, each block a normalized Sylvester Hadamard matrix H (entries
``+-1/sqrt(b)``, ``H = H^T = H^-1``), every block of b input channels of x is mixed
evenly: a channel b times larger than its neighbours ends up spread over all b of them, so a
per-tensor INT8 scale no longer has to cover it alone. ``R^T W`` is computed once, offline;
``x R`` is one small ``[b, b]`` MatMul per token in the graph (a SwiGLU output cannot have R
folded into the weight before it: silu(gate) * up is not linear).
"""

from __future__ import annotations

import functools

import numpy as np


def sylvester(b: int) -> np.ndarray:
    """The ``b x b`` Hadamard matrix of Sylvester's construction, entries +-1 (b a power of 2)."""
    if b < 1 or b & (b - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two size, not {b}")
    h = np.ones((1, 1), np.int64)
    while h.shape[0] < b:
        h = np.block([[h, h], [h, -h]])
    return h


@functools.lru_cache(maxsize=16)
def hadamard(b: int) -> np.ndarray:
    """Normalized (orthonormal, symmetric) ``b x b`` Hadamard matrix, float32 (read only)."""
    h = (sylvester(b) / np.sqrt(b)).astype(np.float32)
    h.flags.writeable = False
    return h


def block_size(channels: int, max_block: int) -> int:
    """Largest power of two that divides ``channels`` and is at most ``max_block``."""
    b = channels & -channels
    while b > max_block:
        b //= 2
    return b


ROTATE_CHUNK = 4096  # rows of ``rotate_rows`` widened to float64 at a time


def rotate_rows(x: np.ndarray, b: int, out: np.ndarray | None = None) -> np.ndarray:
    """``x R`` over the last axis (R block-diagonal with blocks H of size b): each block's fast
    Walsh-Hadamard transform in float64 (log2 b rounds of sums and differences of entries h = 1,
    2, 4, ... apart), times H's float32 entry, rounded once to float32. Sums in float64 make the
    statistics independent of any BLAS's order of summation (OpenBLAS's Haswell and SkylakeX
    float32 kernels moved an activation range by an ulp, and the INT8 plan with it); the native
    statistics (``calib_stats.c``) do the same operations in the same order, so their values equal
    these bit for bit. ``b log2 b`` additions per block where a GEMM by H takes ``2 b^2``.

    ``out``: a C-contiguous float32 array of x's shape to write into.
    """
    x = np.ascontiguousarray(x, np.float32)
    if out is None:
        out = np.empty(x.shape, np.float32)
    entry = np.float64(hadamard(b)[0, 0])
    rows, dst = x.reshape(-1, b), out.reshape(-1, b)
    for i in range(0, len(rows), ROTATE_CHUNK):
        y = rows[i : i + ROTATE_CHUNK].astype(np.float64)
        h = 1
        while h < b:
            pairs = y.reshape(len(y), b // (2 * h), 2, h)
            first = pairs[:, :, 0].copy()
            pairs[:, :, 0] += pairs[:, :, 1]
            np.subtract(first, pairs[:, :, 1], out=pairs[:, :, 1])
            h *= 2
        np.multiply(y, entry, out=y)
        dst[i : i + ROTATE_CHUNK] = y
    return out


def rotate_weight_rows(rows: np.ndarray, b: int) -> np.ndarray:
    """``rotate_rows`` of weight rows ``[out, in]`` (``(R^T W)^T = W^T R``), summed in float64 as
    ``rotate_weight`` is."""
    n = rows.shape[-1]
    return (np.asarray(rows, np.float64).reshape(-1, n // b, b) @ hadamard(b).astype(np.float64)).reshape(
        rows.shape).astype(np.float32)


def rotate_weight(w: np.ndarray, b: int) -> np.ndarray:
    """``R^T W`` for W ``[in, out]``: each block of b input rows multiplied by H (= H^T), summed
    in float64 and rounded once to float32, so the weights' bits do not depend on the BLAS's
    order of summation (an INT8 graph turns one ulp into another accuracy-gate verdict)."""
    n, m = w.shape
    blocks = np.asarray(w, np.float64).reshape(n // b, b, m)
    return np.matmul(hadamard(b).astype(np.float64), blocks).reshape(n, m).astype(np.float32)
