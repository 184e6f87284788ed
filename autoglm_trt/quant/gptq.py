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

from collections.abc import Callable

import numpy as np

from .int4 import Int4Blocks, block_params, round_to_grid

DAMP = 0.01
LAZY = 128
# a Gram matrix of more inputs than this is factored and inverted by blocks, in place
# (``_large_inverse_factor``; GLM-4-9B's down projection, 13,696: 1.5 GB of float64 at a time, not 6)
LARGE = 8192
BLOCK = 1024  # the rows and columns of one step of the large path's factor and inverse


def inverse_factor(gram: np.ndarray | Callable[[], np.ndarray], damp: float = DAMP) -> tuple[np.ndarray, np.ndarray]:
    """(U, dead): the upper Cholesky factor of the damped Gram matrix's inverse, float64, and the
    inputs that are zero on every row. A matrix that float32 sums left not positive definite at
    that damping is damped 10 and 100 times more. Each step lets go of the matrix before it; over
    ``LARGE`` inputs one of H's size is held (GLM-4-9B's down projection: 13,696 inputs, 1.5 GB)
    when ``gram`` is a function that hands over a float64 matrix of its own (worked in place, and
    asked for again if it must be damped more)."""
    h = gram() if callable(gram) else np.array(gram, np.float64)
    if not np.isfinite(h).all():
        raise ValueError("the Gram matrix holds NaN or infinity: the calibration activations were not finite")
    diagonal = np.diag(h).copy()
    dead = diagonal == 0
    diagonal[dead] = 1.0
    mean = float(np.mean(diagonal))
    for k in range(3):
        np.fill_diagonal(h, diagonal + damp * 10**k * mean)
        if len(h) > LARGE:
            held = [h]  # handed over: the factor is computed in this matrix's memory
            del h
            try:
                return _large_inverse_factor(held), dead
            except np.linalg.LinAlgError:
                h = gram() if callable(gram) else np.array(gram, np.float64)  # the failed factor overwrote it
                continue
        try:
            lower = np.linalg.cholesky(h)
        except np.linalg.LinAlgError:
            continue
        del h
        lower_inv = np.linalg.inv(lower)  # H^-1 = L^-T L^-1
        del lower
        inverse = lower_inv.T @ lower_inv
        del lower_inv
        return np.linalg.cholesky(inverse).T, dead
    raise ValueError("the Gram matrix is not positive definite even damped by 100 times more")


def _large_inverse_factor(held: list[np.ndarray]) -> np.ndarray:
    """``inverse_factor``'s U for a damped matrix of more than ``LARGE`` inputs, the only one in
    ``held``, computed in that matrix's memory: with P the reversal of the inputs' order and
    L L^T = P H P, U = P L^-1 P is upper triangular and U^T U = P (P H P)^-1 P = H^-1. So the
    reversal, the factor and the inverse each work in place, and nothing else of H's size is held
    (GLM-4-9B's down projection: 1.5 GB of float64, where numpy's factor and inverse each hold two
    more copies of their input, LAPACK's work arrays)."""
    a = held.pop()
    reverse_in_place(a)
    lower_inverse(cholesky_lower(a, BLOCK), BLOCK, in_place=True)
    return reverse_in_place(a)


def reverse_in_place(a: np.ndarray) -> np.ndarray:
    """``a[::-1, ::-1]`` written into ``a`` (returned), a pair of rows at a time."""
    n = len(a)
    for i in range(n // 2):
        j = n - 1 - i
        row = a[i, ::-1].copy()
        a[i] = a[j, ::-1]
        a[j] = row
    if n % 2:
        a[n // 2] = a[n // 2, ::-1].copy()
    return a


def cholesky_lower(a: np.ndarray, block: int = BLOCK) -> np.ndarray:
    """The lower Cholesky factor of the symmetric positive definite ``a``, computed in ``a``'s own
    memory (returned; its upper triangle zeroed) by blocks of columns: each diagonal block
    factored, the panel below it solved against that factor, the lower part of the rest updated
    block by block. ``np.linalg.LinAlgError`` where ``a`` is not positive definite."""
    n = len(a)
    for i0 in range(0, n, block):
        i1 = min(i0 + block, n)
        diag = np.linalg.cholesky(a[i0:i1, i0:i1])
        a[i0:i1, i0:i1] = diag
        a[i0:i1, i1:] = 0.0
        if i1 == n:
            break
        panel = a[i1:, i0:i1] @ lower_inverse(diag).T  # A21 D^-T
        a[i1:, i0:i1] = panel
        for j0 in range(i1, n, block):
            j1 = min(j0 + block, n)
            a[j0:, j0:j1] -= panel[j0 - i1:] @ panel[j0 - i1:j1 - i1].T
    return a


def lower_inverse(lower: np.ndarray, block: int = BLOCK, in_place: bool = False) -> np.ndarray:
    """The inverse of a lower triangular matrix (zeros above its diagonal) by blocks of rows
    (forward substitution: each diagonal block inverted, each row block below it from the rows of
    the inverse before it), in a new matrix or, ``in_place``, in ``lower``'s memory (each row block
    replaced once the rows before it are); ``np.linalg.inv`` holds two more of that size (LAPACK's
    copy and identity)."""
    n = len(lower)
    out = lower if in_place else np.zeros_like(lower)
    for i0 in range(0, n, block):
        i1 = min(i0 + block, n)
        diag = np.linalg.inv(lower[i0:i1, i0:i1])
        out[i0:i1, i0:i1] = diag
        if i0:
            out[i0:i1, :i0] = -diag @ (lower[i0:i1, :i0] @ out[:i0, :i0])
    return out


def gptq_int4_blocks(w: np.ndarray, gram: np.ndarray | Callable[[], np.ndarray], block: int, symmetric: bool,
                     damp: float = DAMP) -> Int4Blocks:
    """``w`` ``[in, out]`` to INT4 in blocks of ``block`` inputs (as ``quantize_int4_blocks``),
    each input's rounding error made up for in the inputs after it (``gram``: as ``inverse_factor``'s)."""
    n_in, n_out = w.shape
    shape = None if callable(gram) else gram.shape
    if shape is not None and shape != (n_in, n_in):
        raise ValueError(f"a Gram matrix of {shape} does not fit a weight of {n_in} inputs")
    lazy = block * max(1, LAZY // block)  # whole blocks in a lazy batch
    u, dead = inverse_factor(gram, damp)
    if u.shape != (n_in, n_in):
        raise ValueError(f"a Gram matrix of {u.shape} does not fit a weight of {n_in} inputs")
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
