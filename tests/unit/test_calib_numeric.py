"""Numeric cores of calibration, to exact values: histograms, threshold search, cache format."""

import math

import numpy as np
import pytest

from autoglm_trt.calib.cache import format_cache, read_cache, scale_to_hex, write_cache
from autoglm_trt.calib.histogram import (
    AbsHistogram,
    best_candidate,
    entropy_amax,
    entropy_divergences,
    max_amax,
    percentile_amax,
)


def reference_kl(h: np.ndarray, i: int) -> float:
    """Straightforward loop implementation of the documented algorithm for one candidate."""
    h = h.astype(np.float64)
    p = h[:i].copy()
    p[i - 1] += h[i:].sum()
    w = i // 128
    q = np.zeros(i)
    for j in range(128):
        start = j * w
        stop = i if j == 127 else start + w
        mass = h[start:stop].sum()
        if j == 127 and mass == 0 and p[i - 1] > 0:
            mass = 1.0  # a last level holding only clipped outliers gets one count
        nonzero = np.count_nonzero(p[start:stop])
        if nonzero:
            q[start:stop] = np.where(p[start:stop] > 0, mass / nonzero, 0.0)
    if p.sum() == 0 or q.sum() == 0:
        return math.inf
    p, q = p / p.sum(), q / q.sum()
    kl = 0.0
    for pk, qk in zip(p, q):
        if pk > 0:
            if qk == 0:
                return math.inf
            kl += pk * math.log(pk / qk)
    return kl


def hist_of(values, width=None):
    h = AbsHistogram()
    h.add(np.asarray(values, np.float32))
    return h


@pytest.mark.parametrize("kind", ["gaussian", "laplace_with_outlier", "sparse"])
def test_vectorized_search_equals_reference_loop(kind):
    rng = np.random.default_rng(1)
    if kind == "gaussian":
        counts = np.bincount(np.minimum((np.abs(rng.standard_normal(200_000)) * 300).astype(int), 2047), minlength=2048)
    elif kind == "laplace_with_outlier":
        counts = np.bincount(np.minimum((np.abs(rng.laplace(size=100_000)) * 60).astype(int), 2047), minlength=2048)
        counts[2047] += 3
    else:
        counts = np.zeros(2048, np.int64)
        counts[rng.integers(0, 2048, 300)] = rng.integers(1, 50, 300)
    cand, kl = entropy_divergences(counts)
    ref = np.array([reference_kl(counts, int(i)) for i in cand])
    assert np.array_equal(np.isinf(kl), np.isinf(ref))
    finite = np.isfinite(ref)
    np.testing.assert_allclose(kl[finite], ref[finite], rtol=1e-9, atol=1e-12)
    assert best_candidate(cand, kl) == best_candidate(cand, ref)


def test_uniform_histogram_keeps_everything():
    h = AbsHistogram()
    h.counts[:] = 10
    h.width, h.amax = 1.0 / 2048, 1.0
    cand, kl = entropy_divergences(h.counts)
    assert kl[-1] == pytest.approx(0.0, abs=1e-12)  # i = 2048: 128 levels of 16 equal bins reproduce P exactly
    assert np.all(kl[:-1] > 1e-5)  # every clipping candidate piles 10 x (2048 - i) counts on one bin
    assert entropy_amax(h) == 1.0


def test_gaussian_histogram_threshold():
    """A Gaussian of sigma = 400 bins over 2048 bins (range 5.12 sigma): the search keeps
    1919 bins (4.80 sigma), value found by the reference loop as well."""
    k = np.arange(2048)
    h = AbsHistogram()
    h.counts = np.rint(1e6 * np.exp(-0.5 * (k / 400.0) ** 2)).astype(np.int64)
    h.width, h.amax = 1.0 / 400.0, 2048 / 400.0
    cand, kl = entropy_divergences(h.counts)
    assert best_candidate(cand, kl) == 1919
    assert best_candidate(cand, np.array([reference_kl(h.counts, int(i)) for i in cand])) == 1919
    assert entropy_amax(h) == pytest.approx(1919 / 400.0)


def test_heavy_tail_is_clipped():
    rng = np.random.default_rng(0)
    h = hist_of(rng.laplace(size=200_000))
    assert entropy_amax(h) < 0.9 * h.amax


def test_one_far_outlier_is_clipped_by_entropy_but_not_by_max():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-1, 1, 100_000), [1000.0]]).astype(np.float32)
    h = hist_of(x)
    assert max_amax(h) == 1000.0
    # the bulk fits in the first ~2 bins of a [0, 1000) histogram: the smallest candidate wins
    assert entropy_amax(h) == pytest.approx(128 * h.width)


def test_histogram_growth_keeps_full_resolution():
    """After the range grew, the search bins still span exactly [0, max], and each counts what
    a direct binning counts up to the values of the two fine bins (1/16 of a bin) at its edges."""
    rng = np.random.default_rng(5)
    first, second = rng.uniform(0, 3.9, 20_000).astype(np.float32), rng.uniform(0, 10.0, 20_000).astype(np.float32)
    h = AbsHistogram(num_bins=8)
    h.add(first)
    h.add(second)  # the fine range grows by an integer factor
    x = np.abs(np.concatenate([first, second])).astype(np.float64)
    assert h.amax == pytest.approx(x.max()) and h.range == pytest.approx(x.max())
    assert h.counts.sum() == pytest.approx(x.size)
    direct = np.bincount(np.minimum((x / h.width).astype(np.int64), 7), minlength=8)
    np.testing.assert_allclose(h.counts, direct, rtol=0.02)


def test_growth_keeps_the_entropy_threshold_of_a_one_shot_histogram():
    """200k N(0,1) values in two batches, the larger second: the case that cost the old
    histogram half of its bins (entropy amax 4.50 against 4.09 one-shot)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(200_000).astype(np.float32)
    order = np.argsort(np.abs(x))
    streamed = AbsHistogram()
    streamed.add(x[order[:100_000]])
    streamed.add(x[order[100_000:]])
    one_shot = hist_of(x)
    assert streamed.range == pytest.approx(one_shot.range)
    assert entropy_amax(streamed) == pytest.approx(entropy_amax(one_shot), rel=1e-3)
    assert entropy_amax(one_shot) == pytest.approx(4.09, abs=0.01)


def test_streamed_histogram_equals_one_shot_when_range_is_fixed():
    rng = np.random.default_rng(3)
    x = rng.standard_normal(50_000).astype(np.float32)
    x[0] = 6.0  # first batch sets the range
    one = hist_of(x)
    many = AbsHistogram()
    for part in np.array_split(x, 7):
        many.add(part) if part is not None else None
    # the first part contains x[0], so the range is fixed from the start and bins agree exactly
    np.testing.assert_array_equal(one.counts, many.counts)


def test_percentile_on_known_counts():
    h = AbsHistogram(num_bins=10)
    h.counts = np.array([50, 30, 10, 5, 3, 1, 1, 0, 0, 0])
    h.width, h.amax = 0.1, 0.7
    assert percentile_amax(h, 90.0) == pytest.approx(0.3)  # 50+30+10 = 90 reached in bin 2
    assert percentile_amax(h, 99.0) == pytest.approx(0.6)
    assert percentile_amax(h, 100.0) == pytest.approx(0.7)  # capped at the true max


def test_cache_bytes_and_round_trip(tmp_path):
    assert scale_to_hex(1.0 / 127.0) == "3c010204"
    text = format_cache({"layers.0.input_norm": 1.0, "layers.0.attn": 2.5}, "entropy")
    assert text == "TRT-101300-EntropyCalibration2\nlayers.0.input_norm: 3c010204\nlayers.0.attn: 3ca14285\n"
    write_cache(tmp_path / "calibration.cache", {"a:b": 1.0, "x": 0.125}, "max")
    header, scales = read_cache(tmp_path / "calibration.cache")
    assert header == "TRT-101300-MinMaxCalibration"
    assert scales["a:b"] == np.float32(1.0 / 127.0) and scales["x"] == np.float32(0.125 / 127.0)


def test_raw_histograms_take_one_token_row_in_four_rotating_over_windows():
    from types import SimpleNamespace

    from autoglm_trt.calib.collect import RAW_ROW_STRIDE, Accumulator, ActivationStats

    assert RAW_ROW_STRIDE == 4
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 8, 4)).astype(np.float32)
    x[1, 0, 0] = 9.0  # window 1 does not take its first token: it takes rows 1 and 5 (window 0: rows 0 and 4)
    head = rng.standard_normal((2, 4)).astype(np.float32)
    stats = ActivationStats()
    acc = Accumulator(stats, SimpleNamespace(num_layers=0), ["q", "lm_head"], None, {})
    acc.add([x.copy(), head.copy()], {})
    raw, whole = stats.raw_hist["q"], stats.hist["q"]
    taken = np.concatenate([x[0, 0::4], x[1, 1::4]])
    assert raw.counts.sum() == taken.size and raw.amax == float(np.abs(taken).max()) < 9.0
    assert whole.counts.sum() == x.size and whole.amax == 9.0  # the Q/DQ histograms take every row by default
    assert stats.raw_hist["lm_head"].counts.sum() == head.size  # one row per window: taken whole


def test_qdq_histograms_with_a_row_stride_take_each_position_in_one_window_of_stride():
    from types import SimpleNamespace

    from autoglm_trt.calib.collect import Accumulator, ActivationStats
    from autoglm_trt.calib.histogram import AbsHistogram

    rng = np.random.default_rng(4)
    batches = [rng.standard_normal((3, 6, 4)).astype(np.float32) for _ in range(2)]  # windows 0-2, then 3-5
    inv = rng.uniform(0.5, 2.0, 4).astype(np.float32)
    stats = ActivationStats()
    acc = Accumulator(stats, SimpleNamespace(num_layers=0), ["q"], lambda m: {"q": 1.0 / inv}, {}, row_stride=2)
    for x in batches:
        acc.add([x.copy()], {})
    windows = np.concatenate(batches)
    taken = [windows[w, w % 2 :: 2] for w in range(6)]  # even windows rows 0, 2, 4; odd ones rows 1, 3, 5
    want = AbsHistogram()
    for batch in (taken[:3], taken[3:]):  # streamed as the accumulator streams them
        want.add(np.stack(batch) * inv)
    got = stats.hist["q"]
    assert got.counts.sum() == 6 * 3 * 4
    np.testing.assert_array_equal(got.counts, want.counts)
    assert got.amax == want.amax
    with pytest.raises(ValueError, match="hist_row_stride"):
        Accumulator(ActivationStats(), SimpleNamespace(num_layers=0), ["q"], None, {}, row_stride=0)


def test_abs_max_equals_the_max_of_the_absolute_values():
    from autoglm_trt.calib.smooth import abs_max

    rng = np.random.default_rng(5)
    x = (rng.standard_normal((64, 48)) * rng.uniform(0.1, 10, 48)).astype(np.float32)
    x[3, 7], x[9, 7] = -40.0, 39.0  # a column whose largest magnitude is negative
    for axis in (0, 1):
        np.testing.assert_array_equal(abs_max(x, axis), np.abs(x).max(axis=axis))
    assert abs_max(x, 0)[7] == 40.0


def test_bias_correction_is_the_mean_int8_output_error():
    """Clipped activations (amax 1.27: scale 0.01) and a weight that rounds (0.5 -> 64/127) leave a
    mean error of 2.75 - (1.27 + 0.135 * 64 / 127); values on the grids (scale 1/64) leave none."""
    from autoglm_trt.calib.sensitivity import mean_output_error

    x = np.array([[2.0, 2.0], [3.0, -1.0]], np.float32)
    w = np.array([[1.0], [0.5]], np.float32)
    got = mean_output_error(x, w, 1.27)
    assert got.shape == (1,) and got.dtype == np.float32
    assert got[0] == pytest.approx(2.75 - (1.27 + 0.135 * 64 / 127), abs=1e-6)
    on_grid = np.array([[0.5, -0.25], [1.0, 0.75]], np.float32)
    assert np.array_equal(mean_output_error(on_grid, np.array([[127 / 64], [-0.5]], np.float32), 127 / 64), [0.0])
