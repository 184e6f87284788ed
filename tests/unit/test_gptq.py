"""GPTQ's INT4 rounding (quant/gptq.py) and the Gram matrices the statistics pass sums for it."""

import numpy as np
import pytest

from autoglm_trt.quant.gptq import gptq_int4_blocks, inverse_factor
from autoglm_trt.quant.int4 import block_params, quantize_int4_blocks, round_to_grid


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


def test_the_inverse_factor_is_upper_and_inverts_the_damped_gram_matrix():
    """U upper triangular with U^T U = (H + d I)^-1, d 1 % of the mean diagonal; a dead input's
    diagonal counts as 1."""
    rng = np.random.default_rng(3)
    x = correlated(rng, 300, 48)
    x[:, 5] = 0
    gram = (x.T @ x).astype(np.float64)
    u, dead = inverse_factor(gram)
    assert np.array_equal(np.flatnonzero(dead), [5]) and np.array_equal(u, np.triu(u))
    h = gram.copy()
    h[5, 5] = 1.0
    h += 0.01 * np.mean(np.diag(h)) * np.eye(48)
    np.testing.assert_allclose(u.T @ u @ h, np.eye(48), atol=1e-9)


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


@pytest.mark.parametrize(("n_in", "symmetric"), [(80, False), (81, True), (64, True)])
def test_rounded_weights_saved_for_the_graph_writer_read_back_exactly(tmp_path, n_in, symmetric):
    """GPTQ's layer-by-layer rounding keeps each linear's INT4 weights in a scratch ``.npz`` (values
    two to a byte, no pickles) until the graph is written: read back, the same blocks."""
    from autoglm_trt.builder.int4_rounding import load_blocks, save_blocks

    rng = np.random.default_rng(n_in)
    blocks = quantize_int4_blocks(rng.standard_normal((n_in, 6)).astype(np.float32), 32, symmetric)
    back = load_blocks(save_blocks(tmp_path / "w.npz", blocks))
    assert back.block == 32 and back.q.dtype == np.int8 and np.array_equal(back.q, blocks.q)
    assert np.array_equal(back.scale, blocks.scale)
    assert (back.zero is None) == symmetric and (symmetric or np.array_equal(back.zero, blocks.zero))
    assert np.array_equal(back.dequantized(), blocks.dequantized())


def test_the_blocked_lower_inverse_inverts_a_cholesky_factor():
    """``lower_inverse`` (the path of Gram matrices over ``LARGE`` inputs) against numpy's inverse,
    over blocks that do not divide the size."""
    from autoglm_trt.quant.gptq import lower_inverse

    x = correlated(np.random.default_rng(4), 400, 300).astype(np.float64)
    lower = np.linalg.cholesky(x.T @ x + 3 * np.eye(300))
    got = lower_inverse(lower, block=64)
    assert np.array_equal(got, np.tril(got))
    np.testing.assert_allclose(got, np.linalg.inv(lower), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got @ lower, np.eye(300), atol=1e-10)


def test_a_large_gram_matrix_is_factored_in_place_by_blocks(monkeypatch):
    """Over ``LARGE`` inputs, U comes from the blocked in-place factor and inverse: the same as
    numpy's (to float64 rounding), dead inputs found, and a matrix left indefinite is read again
    from its source and damped more."""
    from autoglm_trt.quant import gptq

    rng = np.random.default_rng(6)
    x = correlated(rng, 500, 300)
    x[:, 7] = 0
    gram = (x.T @ x).astype(np.float64)
    small, dead = inverse_factor(gram)
    monkeypatch.setattr(gptq, "LARGE", 100)
    reads = []

    def source():
        reads.append(1)
        return gram.copy()

    large, large_dead = inverse_factor(source)
    assert np.array_equal(dead, large_dead) and np.array_equal(large, np.triu(large))
    np.testing.assert_allclose(large, small, rtol=1e-7, atol=1e-9 * np.abs(small).max())
    lower = gptq.cholesky_lower(gram + np.eye(300), block=64)
    np.testing.assert_allclose(lower, np.linalg.cholesky(gram + np.eye(300)), rtol=1e-9, atol=1e-9)
    bent = np.diag(np.r_[np.ones(150), [-0.02], np.ones(149)])
    u, _ = inverse_factor(lambda: reads.append(1) or bent.copy())
    assert np.all(np.isfinite(u)) and len(reads) == 3  # once above, twice here (damped 10x more)


@pytest.mark.parametrize("n", [5, 6])
def test_the_in_place_helpers_of_the_large_path(n):
    """``reverse_in_place`` reverses both axes (odd and even sizes); ``lower_inverse`` in place
    gives what it gives in a new matrix, in the factor's own memory."""
    from autoglm_trt.quant.gptq import lower_inverse, reverse_in_place

    a = np.arange(n * n, dtype=np.float64).reshape(n, n)
    want = a[::-1, ::-1].copy()
    assert reverse_in_place(a) is a and np.array_equal(a, want)
    x = correlated(np.random.default_rng(n), 300, 200).astype(np.float64)
    lower = np.linalg.cholesky(x.T @ x + np.eye(200))
    fresh = lower_inverse(lower, block=48)
    work = lower.copy()
    assert lower_inverse(work, block=48, in_place=True) is work
    assert np.array_equal(work, fresh)


def test_the_large_path_holds_one_matrix_of_the_gram_matrix_size(monkeypatch):
    """Over ``LARGE`` inputs U is computed in the memory of the matrix ``gram`` hands over: numpy's
    allocations while it runs (the handed-over matrix included) stay under 1.5 of its size, where
    a separate inverse, or H^-1 formed from it, would take two or three. (Its steps' temporaries are
    a few of ``BLOCK`` rows each: at GLM-4-9B's 13,696 inputs and 1,024 rows, 0.3 of H; here 128
    rows of 2,600.)"""
    import tracemalloc

    from autoglm_trt.quant import gptq

    n = 2600
    x = correlated(np.random.default_rng(7), 3000, n)
    gram = (x.T @ x).astype(np.float64)
    monkeypatch.setattr(gptq, "LARGE", 100)
    monkeypatch.setattr(gptq, "BLOCK", 128)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        u, _ = inverse_factor(gram.copy)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1.5 * gram.nbytes, f"{peak / gram.nbytes:.2f} of the Gram matrix's size"
    h = gram + np.diag(np.full(n, gptq.DAMP * np.mean(np.diag(gram))))
    np.testing.assert_allclose(u.T @ u @ h, np.eye(n), atol=1e-6)


def test_a_wide_inputs_gram_matrix_is_summed_by_blocks_of_columns(monkeypatch):
    """``add_gram`` over ``LARGE`` inputs: the same sums as one product, batch after batch."""
    from autoglm_trt.calib import collect

    rng = np.random.default_rng(8)
    batches = [rng.standard_normal((64, 2100)).astype(np.float32) for _ in range(2)]
    whole: dict = {}
    for rows in batches:
        collect.add_gram(whole, "down", rows)
    monkeypatch.setattr(collect, "LARGE", 1000)
    blocked: dict = {}
    for rows in batches:
        collect.add_gram(blocked, "down", rows)
    np.testing.assert_allclose(blocked["down"], whole["down"], rtol=1e-5, atol=1e-3)
    x = np.concatenate(batches).astype(np.float64)
    np.testing.assert_allclose(blocked["down"], x.T @ x, rtol=1e-4, atol=1e-2)
