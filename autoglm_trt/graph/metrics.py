"""Scores of logits against the text they were computed on (pure numpy).

Used by ``eval``, the export's parity report and calibration's accuracy gate.
"""

from __future__ import annotations

import numpy as np


def log_softmax(x: np.ndarray, dtype: type = np.float64) -> np.ndarray:
    """Log-probabilities along the last axis, computed in ``dtype``."""
    y: np.ndarray = x.astype(dtype)
    y -= y.max(axis=-1, keepdims=True)
    return y - np.log(np.exp(y).sum(axis=-1, keepdims=True))


def next_token_scores(logits: np.ndarray, windows: np.ndarray, dtype: type = np.float64) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced scores: log-probabilities of the next token at each position
    ``[batch, seq_len - 1, vocab]`` and the negative log-likelihood of the actual next tokens."""
    lp = log_softmax(logits[:, :-1], dtype)
    return lp, -np.take_along_axis(lp, windows[:, 1:, None], -1)[..., 0]
