"""GPTQ (Frantar et al., 2022): INT4 rounding that makes up for each input's rounding error in
the inputs still to be rounded, through the inverse of the linear's input Gram matrix.

For weights ``w`` ``[in, out]`` and ``gram`` = X^T X over calibration rows X ``[rows, in]``, the
output error ||X w - X q||^2 is what is kept small, not ||w - q||^2. Inputs are rounded in order.
When input i starts a block, the block's scale and zero point are chosen as plain rounding
chooses them (``int4.block_params``), from the block's weights as corrected so far. Input i's
row of weights is rounded, and its error divided by U[i, i] times U[i, j] is taken off every
later input j's row, U the upper Cholesky factor of the inverse Gram matrix (U^T U = H^-1). The
corrections within ``LAZY`` inputs (or one block, if longer) go row by row, those past them once
per such batch (the paper's lazy batches: the same sums, in another order). With a Gram matrix c I nothing is
corrected and the result is plain rounding's (test).

The Gram matrix is damped by ``damp`` times its mean diagonal, so that a few hundred rows (fewer
than the inputs) still give an invertible one; an input that is zero on every row has its weights
set to 0 and its diagonal to 1. Pure numpy: the weights and corrections in float64, each block's
scale search and each rounding on float32 values as ``quantize_int4_blocks`` does.
"""

from __future__ import annotations

import numpy as np

from .int4 import Int4Blocks, block_params, round_to_grid

DAMP = 0.01
LAZY = 128


def inverse_factor(gram: np.ndarray, damp: float = DAMP) -> tuple[np.ndarray, np.ndarray]:
    """(U, dead): the upper Cholesky factor of the damped Gram matrix's inverse, float64, and the
    inputs that are zero on every row. A matrix that float32 sums left not positive definite at
    that damping is damped 10 and 100 times more."""
    h = np.array(gram, np.float64)
    if not np.isfinite(h).all():
        raise ValueError("the Gram matrix holds NaN or infinity: the calibration activations were not finite")
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    mean = float(np.mean(np.diag(h)))
    for k in range(3):
        try:
            lower_inv = np.linalg.inv(np.linalg.cholesky(h + damp * 10**k * mean * np.eye(len(h))))  # H^-1 = L^-T L^-1
            return np.linalg.cholesky(lower_inv.T @ lower_inv).T, dead
        except np.linalg.LinAlgError:
            continue
    raise ValueError("the Gram matrix is not positive definite even damped by 100 times more")


def gptq_int4_blocks(w: np.ndarray, gram: np.ndarray, block: int, symmetric: bool, damp: float = DAMP) -> Int4Blocks:
    """``w`` ``[in, out]`` to INT4 in blocks of ``block`` inputs (as ``quantize_int4_blocks``),
    each input's rounding error made up for in the inputs after it."""
    n_in, n_out = w.shape
    if gram.shape != (n_in, n_in):
        raise ValueError(f"a Gram matrix of {gram.shape} does not fit a weight of {n_in} inputs")
    lazy = block * max(1, LAZY // block)  # whole blocks in a lazy batch
    u, dead = inverse_factor(gram, damp)
    rest = np.array(w, np.float64)
    rest[dead] = 0.0
    blocks = -(-n_in // block)
    q = np.empty((n_in, n_out), np.int8)
    scale, zero = np.empty((blocks, n_out), np.float32), np.empty((blocks, n_out), np.float32)
    for b0 in range(0, n_in, lazy):
        b1 = min(b0 + lazy, n_in)
        part, err = rest[b0:b1].copy(), np.empty((b1 - b0, n_out))
        for i in range(b0, b1):
            r = i - b0
            if i % block == 0:
                group = part[r:r + block].astype(np.float32)
                if len(group) < block:  # a short last block, padded as quantize_int4_blocks pads it
                    group = np.concatenate([group, np.repeat(group[:1], block - len(group), axis=0)])
                scale[i // block], zero[i // block] = block_params(group, symmetric)
            s, z = scale[i // block], zero[i // block]
            level = round_to_grid(part[r:r + 1].astype(np.float32), s, z, symmetric)[0]
            q[i] = level.astype(np.int8)
            err[r] = (part[r] - (level - z).astype(np.float64) * s) / u[i, i]
            part[r + 1:] -= np.outer(u[i, i + 1:b1], err[r])
        rest[b1:] -= u[b0:b1, b1:].T @ err
    return Int4Blocks(q, scale, None if symmetric else zero.astype(np.uint8), block)
