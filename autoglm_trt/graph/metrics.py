"""Scores of logits against the text they were computed on (pure numpy).

Used by ``eval``, the export's parity report and calibration's accuracy gate.
"""

from __future__ import annotations

import numpy as np

CHUNK_BYTES = 1 << 21  # the rows worked on at once: their values and exponentials stay in cache


def _chunks(shape: tuple[int, ...], itemsize: int) -> tuple[tuple[int, int, int], int]:
    """``shape`` as (leading, rows, last) and how many rows make about ``CHUNK_BYTES``."""
    rows = shape[-2] if len(shape) > 1 else 1
    lead = int(np.prod(shape[:-2])) if len(shape) > 2 else 1
    return (lead, rows, shape[-1]), max(1, CHUNK_BYTES // max(1, shape[-1] * itemsize))


def log_softmax(x: np.ndarray, dtype: type = np.float64) -> np.ndarray:
    """Log-probabilities along the last axis, computed in ``dtype``: ``y = x - max(x)``, then
    ``y - log(sum(exp(y)))``, a few rows at a time in place (each row's values are those of the
    whole-array expression, bit for bit; the rows' temporaries are never a second whole array)."""
    (lead, rows, last), step = _chunks(x.shape, np.dtype(dtype).itemsize)
    out: np.ndarray = np.empty(x.shape, dtype)
    xs, ys = x.reshape(lead, rows, last), out.reshape(lead, rows, last)
    scratch: np.ndarray = np.empty((min(step, rows), last), dtype)
    for b in range(lead):
        for r in range(0, rows, step):
            y = ys[b, r : r + step]
            np.copyto(y, xs[b, r : r + step], casting="unsafe")
            y -= y.max(axis=-1, keepdims=True)
            y -= np.log(np.exp(y, out=scratch[: len(y)]).sum(axis=-1, keepdims=True))
    return out


def kl_rows(ref_lp: np.ndarray, lp: np.ndarray, ref_p: np.ndarray | None = None) -> np.ndarray:
    """KL(reference || model) at each position: ``sum(exp(ref_lp) * (ref_lp - lp))`` over the last
    axis, summed in float64 (``ref_p``: ``exp(ref_lp)`` when the caller keeps it), a few rows at a
    time (each position's value is the whole-array expression's, bit for bit)."""
    (lead, rows, last), step = _chunks(ref_lp.shape, ref_lp.dtype.itemsize)
    out = np.empty(ref_lp.shape[:-1], np.float64).reshape(lead, rows)
    refs, lps = ref_lp.reshape(lead, rows, last), lp.reshape(lead, rows, last)
    ps = None if ref_p is None else ref_p.reshape(lead, rows, last)
    diff = np.empty((min(step, rows), last), np.result_type(ref_lp, lp))
    weight = np.empty((min(step, rows), last), ref_lp.dtype)
    for b in range(lead):
        for r in range(0, rows, step):
            d = np.subtract(refs[b, r : r + step], lps[b, r : r + step], out=diff[: min(step, rows - r)])
            p = np.exp(refs[b, r : r + step], out=weight[: len(d)]) if ps is None else ps[b, r : r + step]
            out[b, r : r + step] = (p * d).sum(-1, dtype=np.float64)
    return out.reshape(ref_lp.shape[:-1])


def next_token_scores(logits: np.ndarray, windows: np.ndarray, dtype: type = np.float64) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced scores: log-probabilities of the next token at each position
    ``[batch, seq_len - 1, vocab]`` and the negative log-likelihood of the actual next tokens."""
    lp = log_softmax(logits[:, :-1], dtype)
    return lp, -np.take_along_axis(lp, windows[:, 1:, None], -1)[..., 0]
