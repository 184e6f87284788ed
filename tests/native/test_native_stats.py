"""Calibration's per-batch statistics in the native library (``calib/native_stats.py``) against
the numpy path they replace: the same rows, the same values, the same bin counts, bit for bit,
in each of the library's builds (AVX-512, AVX2, portable C)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from autoglm_trt.calib import collect
from autoglm_trt.calib.collect import RAW_ROW_STRIDE, Accumulator, ActivationStats
from autoglm_trt.calib.histogram import AbsHistogram
from autoglm_trt.calib.native_stats import HistogramJob, NativeStats
from autoglm_trt.quant.hadamard import rotate_rows


@pytest.fixture(scope="module")
def stats_lib(kernel_library):
    return NativeStats(str(kernel_library))


def taken_rows(x: np.ndarray, stride: int, window0: int) -> np.ndarray:
    """The rows ``Accumulator._rows`` takes: window w rows (window0 + w) % stride, + stride, ..."""
    if x.ndim == 2 or x.shape[1] < stride:
        return x.reshape(-1, x.shape[-1])
    n = x.shape[1] // stride
    return np.concatenate([x[w, (window0 + w) % stride :][:: stride][:n] for w in range(x.shape[0])])


@pytest.mark.parametrize("shape,stride,window0", [((3, 10, 24), 4, 5), ((2, 7, 16), 2, 0), ((4, 3, 8), 4, 1),
                                                   ((5, 40), 4, 2), ((2, 9, 32), 1, 3)])
def test_rows_scaled_and_absolute_equal_numpy(stats_lib, shape, stride, window0):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    scale = rng.uniform(0.3, 3.0, shape[-1]).astype(np.float32)
    for s in (None, scale):
        a, m = stats_lib.abs_rows(HistogramJob(AbsHistogram(), x, stride, s), window0)
        want = np.abs(taken_rows(x, stride, window0) * (s if s is not None else np.float32(1)))
        np.testing.assert_array_equal(a, want.ravel())
        assert m == float(want.max())


def test_a_kv_head_is_read_in_place_from_the_heads_layout(stats_lib):
    rng = np.random.default_rng(1)
    kv = rng.standard_normal((2, 5, 3, 8)).astype(np.float32)  # [batch, tokens, kv_heads, head_dim]
    scales = rng.uniform(0.5, 2, (3, 8)).astype(np.float32)
    for h in range(3):
        a, m = stats_lib.abs_rows(HistogramJob(AbsHistogram(), kv[:, :, h, :], 1, scales[h]), 0)
        np.testing.assert_array_equal(a, np.abs(kv[:, :, h, :] * scales[h]).ravel())


@pytest.mark.parametrize("channels,block", [(576, 64), (1536, 128), (48, 16), (40, 8), (12, 4), (6, 2)])
def test_rotated_rows_are_numpys_butterfly_exactly(stats_lib, channels, block):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((2, 6, channels)) * rng.uniform(0.1, 20, channels)).astype(np.float32)
    scale = rng.uniform(0.3, 3.0, channels).astype(np.float32)
    a, m = stats_lib.abs_rows(HistogramJob(AbsHistogram(), x, 2, scale, block), 1)
    want = np.abs(rotate_rows(taken_rows(x, 2, 1) * scale, block))
    np.testing.assert_array_equal(a, want.ravel())
    assert m == float(want.max())
    rows = taken_rows(x, 1, 0)  # the first batch's samples, rotated apart
    want = rotate_rows(rows, block)
    np.testing.assert_array_equal(stats_lib.rotate(rows, block), want)
    in_place = rows.copy()  # as the first batch rotates its samples: out is the rows themselves
    assert stats_lib.rotate(in_place, block, out=in_place) is in_place
    np.testing.assert_array_equal(in_place, want)
    numpy_in_place = rows.copy()
    np.testing.assert_array_equal(rotate_rows(numpy_in_place, block, out=numpy_in_place), want)
    with pytest.raises(ValueError, match=r"out must be C-contiguous float32 of shape"):
        stats_lib.rotate(rows, block, out=np.empty(rows.shape, np.float64))
    with pytest.raises(ValueError, match="no Hadamard blocks of 48"):
        stats_lib.rotate(rows, 48)
    with pytest.raises(ValueError, match="no Hadamard blocks of 0"):
        stats_lib.rotate(rows, 0)
    with pytest.raises(ValueError, match=f"rows of {channels} channels have no Hadamard blocks of {3 * block}"):
        stats_lib.abs_rows(HistogramJob(AbsHistogram(), x, 2, scale, 3 * block), 1)
    # the library refuses such a block itself, before any memory is touched
    assert stats_lib._rotate(rows.ctypes.data, rows.size, 3, 1.0, rows.ctypes.data) == -2


def test_bin_counts_equal_numpys_including_the_top_bin(stats_lib):
    rng = np.random.default_rng(3)
    fine = 2048 * AbsHistogram.FINE
    a = np.abs(rng.standard_normal(100_003)).astype(np.float32)
    top = a.max()
    a[:5] = [0.0, top, top * 1.5, np.nextafter(top, np.float32(0)), 1e-30]  # on, past and just below the top
    inv = np.float32(fine / float(top))
    got = np.zeros(fine, np.int64)
    got[7] = 3  # added to, not overwritten
    stats_lib.bin_count(a, inv, got)
    index = (a * inv).astype(np.int64)
    want = np.bincount(np.minimum(index, fine - 1), minlength=fine)
    want[7] += 3
    np.testing.assert_array_equal(got, want)
    assert got.sum() == a.size + 3 and got[-1] >= 2  # the top and the one past it folded in


def test_a_nan_is_an_error_not_a_silent_bin(stats_lib):
    x = np.ones((1, 4, 8), np.float32)
    x[0, 2, 3] = np.nan
    h = AbsHistogram()
    with pytest.raises(ValueError, match="inf or NaN"):
        h.add_abs(*stats_lib.abs_rows(HistogramJob(h, x), 0), stats_lib.bin_count)


def test_accumulator_gives_the_histograms_of_the_numpy_path(stats_lib, monkeypatch):
    """Three batches of a layer's inputs with SmoothQuant, rotation, a row stride, a range that
    grows, and K/V: every histogram is numpy's, count for count, max for max."""
    rng = np.random.default_rng(4)
    channels = {"q": 64, "down": 128, "lm_head": 64}
    batches = []
    for b in range(3):
        outs = [(rng.standard_normal((4, 12, channels["q"])) * (1 + 3 * b)).astype(np.float32),
                rng.laplace(size=(4, 12, channels["down"])).astype(np.float32),
                rng.standard_normal((4, channels["lm_head"])).astype(np.float32)]
        kv = {"new_key.0": rng.standard_normal((4, 12, 2, 16)).astype(np.float32),
              "new_value.0": rng.standard_normal((4, 12, 2, 16)).astype(np.float32)}
        batches.append((outs, kv))
    spec = SimpleNamespace(num_layers=1, num_kv_heads=2, head_dim=16)

    def run(native):
        stats = ActivationStats()
        monkeypatch.setattr(collect, "native_stats", lambda: native)
        acc = Accumulator(stats, spec, list(channels), lambda m: {"q": np.sqrt(m["q"]) + 0.5}, {"down": 32},
                          row_stride=2)
        for outs, kv in batches:
            acc.add([o.copy() for o in outs], {k: v.copy() for k, v in kv.items()})
        return stats

    ours, numpy_path = run(stats_lib), run(None)
    pairs = [(ours.raw_hist[n], numpy_path.raw_hist[n]) for n in channels]
    pairs += [(ours.hist[n], numpy_path.hist[n]) for n in channels]
    pairs += [(a, b) for n in ("new_key.0", "new_value.0") for a, b in zip(ours.kv_hist[n], numpy_path.kv_hist[n])]
    assert len(pairs) == 10
    for a, b in pairs:
        np.testing.assert_array_equal(a._fine, b._fine)
        assert a.amax == b.amax and a._fine_width == b._fine_width and a.amax > 0
    assert ours.hist["down"].counts.sum() == 3 * 4 * 6 * 128  # one token row in 2
    assert RAW_ROW_STRIDE == 4 and ours.raw_hist["q"].counts.sum() == 3 * 4 * 3 * 64
