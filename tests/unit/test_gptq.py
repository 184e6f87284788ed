"""GPTQ's INT4 rounding (graph/gptq.py) and the Gram matrices the statistics pass sums for it."""

import numpy as np
import pytest

from autoglm_trt.graph.gptq import gptq_int4_blocks, inverse_factor
from autoglm_trt.graph.int4 import block_params, quantize_int4_blocks, round_to_grid


def textbook(w, gram, block, symmetric):
    """The paper's loop without lazy batches: every correction as soon as its input is rounded."""
    u, dead = inverse_factor(gram)
    rest = np.array(w, np.float64)
    rest[dead] = 0
    q = np.empty(w.shape, np.int8)
    for i in range(len(w)):
        if i % block == 0:  # a short last block padded with its first row, as plain rounding pads it
            group = rest[i:i + block].astype(np.float32)
            group = np.concatenate([group, np.repeat(group[:1], block - len(group), axis=0)])
            s, z = block_params(group, symmetric)
        level = round_to_grid(rest[i:i + 1].astype(np.float32), s, z, symmetric)[0]
        q[i] = level
        err = (rest[i] - (level - z).astype(np.float64) * s) / u[i, i]
        rest[i + 1:] -= np.outer(u[i, i + 1:], err)
    return q


def correlated(rng, rows, n_in):
    mix = rng.standard_normal((n_in, n_in)).astype(np.float32) / np.sqrt(n_in)
    return rng.standard_normal((rows, n_in)).astype(np.float32) @ (np.eye(n_in, dtype=np.float32) + 2 * mix)


@pytest.mark.parametrize(("n_in", "block", "symmetric"), [(40, 16, False), (64, 32, True), (96, 32, False)])
def test_a_gram_matrix_c_times_identity_corrects_nothing(n_in, block, symmetric):
    """No input predicts another: GPTQ is plain rounding, bit for bit (short last block included)."""
    w = np.random.default_rng(n_in).standard_normal((n_in, 5)).astype(np.float32)
    got, plain = gptq_int4_blocks(w, 3.0 * np.eye(n_in), block, symmetric), quantize_int4_blocks(w, block, symmetric)
    assert np.array_equal(got.q, plain.q) and np.array_equal(got.scale, plain.scale)
    assert (got.zero is None and plain.zero is None) or np.array_equal(got.zero, plain.zero)


@pytest.mark.parametrize("block", [32, 256])
def test_lazy_batches_round_as_the_textbook_loop(block):
    """300 inputs cross two lazy batches of 128 (blocks of 32) or one of 256, and end in a short block."""
    rng = np.random.default_rng(1)
    x, w = correlated(rng, 400, 300), rng.standard_normal((300, 7)).astype(np.float32)
    got = gptq_int4_blocks(w, x.T @ x, block, False)
    assert np.array_equal(got.q, textbook(w, x.T @ x, block, False))


@pytest.mark.parametrize("symmetric", [False, True])
def test_output_error_on_correlated_inputs_is_lower_than_rounding_to_nearest(symmetric):
    rng = np.random.default_rng(2)
    x, w = correlated(rng, 512, 128), rng.standard_normal((128, 16)).astype(np.float32)
    ref = x @ w
    gptq = np.sum((x @ gptq_int4_blocks(w, x.T @ x, 32, symmetric).dequantized() - ref) ** 2)
    nearest = np.sum((x @ quantize_int4_blocks(w, 32, symmetric).dequantized() - ref) ** 2)
    assert gptq < 0.7 * nearest


def test_an_input_that_is_always_zero_gets_zero_weights():
    rng = np.random.default_rng(3)
    x, w = correlated(rng, 256, 64), rng.standard_normal((64, 4)).astype(np.float32)
    x[:, [5, 40]] = 0
    got = gptq_int4_blocks(w, x.T @ x, 32, False)
    assert np.all(got.dequantized()[[5, 40]] == 0)
    assert np.all(np.isfinite(got.dequantized()))


def test_the_gram_matrix_must_fit_the_weights():
    with pytest.raises(ValueError, match="does not fit a weight of 8 inputs"):
        gptq_int4_blocks(np.zeros((8, 2), np.float32), np.eye(9), 8, False)


def test_a_gram_matrix_that_is_not_positive_semidefinite_is_damped_more_or_refused():
    """A slightly negative eigenvalue (float32 sums) is damped away; a NaN is refused with the reason."""
    gram = np.diag([1.0, 1.0, -0.02, 1.0])
    u, dead = inverse_factor(gram)
    assert np.all(np.isfinite(u)) and not dead.any()
    with pytest.raises(ValueError, match="NaN or infinity"):
        inverse_factor(np.full((4, 4), np.nan))
    with pytest.raises(ValueError, match="not positive definite"):
        inverse_factor(np.diag([1.0, 1.0, -100.0, 1.0]))
