"""``graph.metrics``' log-softmax and KL work a few rows at a time: each row's bits must be those
of the whole-array numpy expressions, across chunk boundaries and for every shape they take."""

import numpy as np
import pytest

from autoglm_trt.graph import metrics

VOCAB = 13


def whole_log_softmax(x: np.ndarray, dtype) -> np.ndarray:
    y = x.astype(dtype)
    y -= y.max(axis=-1, keepdims=True)
    return y - np.log(np.exp(y).sum(axis=-1, keepdims=True))


def whole_kl(ref_lp: np.ndarray, lp: np.ndarray) -> np.ndarray:
    return (np.exp(ref_lp) * (ref_lp - lp)).sum(-1, dtype=np.float64)


@pytest.fixture(params=[1, 3, 1 << 20], ids=["row", "rows", "whole"])
def chunk_rows(request, monkeypatch):
    """Chunks of one row, of three (boundaries inside each window, a remainder), or all at once."""
    monkeypatch.setattr(metrics, "CHUNK_BYTES", request.param * VOCAB * 8)
    return request.param


@pytest.mark.parametrize("shape", [(VOCAB,), (5, VOCAB), (2, 7, VOCAB), (2, 3, 4, VOCAB), (2, 0, VOCAB)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_log_softmax_equals_the_whole_array_expression(chunk_rows, shape, dtype):
    x = (np.random.default_rng(1).standard_normal(shape) * 4).astype(np.float32)
    got = metrics.log_softmax(x, dtype)
    assert got.dtype == dtype and got.shape == x.shape
    assert np.array_equal(got, whole_log_softmax(x, dtype))


def test_log_softmax_of_a_slice_across_windows(chunk_rows):
    logits = (np.random.default_rng(2).standard_normal((3, 8, VOCAB)) * 4).astype(np.float32)
    view = logits[:, :-1]  # as next_token_scores takes it: not contiguous across windows
    assert np.array_equal(metrics.log_softmax(view, np.float32), whole_log_softmax(view, np.float32))


@pytest.mark.parametrize("shape", [(VOCAB,), (5, VOCAB), (2, 7, VOCAB)])
def test_kl_rows_equals_the_whole_array_expression(chunk_rows, shape):
    rng = np.random.default_rng(3)
    ref = whole_log_softmax(rng.standard_normal(shape) * 3, np.float32)
    model = whole_log_softmax(rng.standard_normal(shape) * 3, np.float32)
    want = whole_kl(ref, model)
    assert np.array_equal(metrics.kl_rows(ref, model), want)
    assert np.array_equal(metrics.kl_rows(ref, model, np.exp(ref)), want)
    assert metrics.kl_rows(ref, ref).max() == 0.0 and want.min() > 0
