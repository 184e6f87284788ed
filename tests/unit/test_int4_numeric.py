"""INT4 weights: block quantization and ONNX's packing to exact values; AWQ's search."""

import numpy as np
import pytest

from autoglm_trt.calib.awq import awq_scale
from autoglm_trt.quant.gptq import gptq_int4_blocks
from autoglm_trt.quant.int4 import half_scales, pack_nibbles, quantize_int4_blocks
from autoglm_trt.quant.int8 import quantize_weight_blocks


def test_a_block_on_the_asymmetric_grid_is_exact():
    """0, 0.25, ..., 3.75: scale 0.25, zero point 0, q = 0..15; a block of -1.5 .. 2.25 in steps
    of 0.25 has its zero at level 6."""
    w = np.stack([np.arange(16) * 0.25, np.arange(16) * 0.25 - 1.5], axis=1).astype(np.float32)
    qw = quantize_int4_blocks(w, 16, symmetric=False)
    assert qw.scale.tolist() == [[0.25, 0.25]] and qw.zero.tolist() == [[0, 6]]
    assert qw.q[:, 0].tolist() == list(range(16)) and qw.q[:, 1].tolist() == list(range(16))
    assert np.array_equal(qw.dequantized(), w)


def test_a_block_on_the_symmetric_grid_is_exact():
    w = (np.arange(-7, 9) * 0.5).astype(np.float32).reshape(16, 1)
    w[-1] = 0.0  # 8 * 0.5 is out of [-7, 7]: only up to 3.5
    qw = quantize_int4_blocks(w, 16, symmetric=True)
    assert qw.zero is None and qw.scale.tolist() == [[0.5]]
    assert qw.q[:, 0].tolist() == [*range(-7, 8), 0]
    assert np.array_equal(qw.dequantized(), w)


def test_blocks_run_along_the_input_and_the_last_may_be_short():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 3)).astype(np.float32)
    qw = quantize_int4_blocks(w, 16, symmetric=False)
    assert qw.q.shape == (40, 3) and qw.scale.shape == (3, 3) and qw.zero.shape == (3, 3)
    assert qw.q.min() >= 0 and qw.q.max() <= 15
    step = np.repeat(qw.scale, 16, axis=0)[:40]
    levels = qw.dequantized() / step + np.repeat(qw.zero, 16, axis=0)[:40]
    assert np.allclose(levels, qw.q, atol=1e-4)  # each value on its block's grid
    assert np.linalg.norm(qw.dequantized() - w) < 0.15 * np.linalg.norm(w)


def test_an_outlier_is_clipped_when_that_lowers_the_blocks_error():
    w = np.concatenate([np.linspace(-1, 1, 31), [4.0]]).astype(np.float32).reshape(32, 1)
    qw = quantize_int4_blocks(w, 32, symmetric=True)
    full = np.clip(np.rint(w / (4 / 7)), -7, 7) * (4 / 7)
    assert qw.scale[0, 0] < 4 / 7
    assert np.sum((qw.dequantized() - w) ** 2) < np.sum((full - w) ** 2)


def test_scales_are_rounded_to_float16_values():
    """Nearest float16 value, ties to even (2049 / 2048 is halfway between 1 and 1 + 2^-10), and
    float16's positive range: its smallest subnormal below, its largest value above."""
    got = half_scales(np.array([1.0, 2049 / 2048, 2051 / 2048, 0.1, 1e-9, 3.0e-8, 1e6], np.float32))
    assert got.dtype == np.float32
    assert got.tolist() == [1.0, 1.0, 1 + 2 ** -9, float(np.float16(0.1)), 2.0 ** -24, 2.0 ** -24, 65504.0]


def test_every_quantizer_gives_float16_scales_and_levels_on_them():
    """INT4 (asymmetric, symmetric, GPTQ's) and blocked INT8 scales are float16 values, and each
    weight's level is the one its block's rounded scale gives (not the unrounded one)."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((96, 40)) * 0.03).astype(np.float32)
    gram = np.cov(rng.standard_normal((96, 200))).astype(np.float64) + np.eye(96)
    blocks = [quantize_int4_blocks(w, 32, False), quantize_int4_blocks(w, 32, True), gptq_int4_blocks(w, gram, 32, False)]
    q8, s8 = quantize_weight_blocks(w, 32)
    for scale in [qw.scale for qw in blocks] + [s8]:
        assert np.array_equal(scale.astype(np.float16).astype(np.float32), scale)
    assert np.array_equal(q8, np.clip(np.rint(w / np.repeat(s8, 32, axis=0)), -127, 127))
    qw = blocks[0]
    levels = np.rint(w / np.repeat(qw.scale, 32, axis=0)) + np.repeat(qw.zero, 32, axis=0)
    assert np.array_equal(qw.q, np.clip(levels, 0, 15))


@pytest.mark.parametrize(("values", "packed"), [([1, 2, 3], [0x21, 0x03]), ([-1, 7], [0x7F]),
                                                ([15, 0, 8, 9], [0x0F, 0x98]), ([-8], [0x08])])
def test_nibbles_pack_low_first(values, packed):
    assert pack_nibbles(np.array(values, np.int8)).tolist() == packed


def test_awq_prefers_no_scaling_when_rounding_loses_nothing():
    x = np.ones((4, 16), np.float32)
    w = (np.stack([np.arange(16), np.arange(16) - 6], axis=1) * 0.25).astype(np.float32)  # both on a grid of 0.25
    choice = awq_scale(x, w, lambda m: quantize_int4_blocks(m, 16, False).dequantized())
    assert choice.alpha == 0.0 and choice.error == choice.rtn_error == 0.0
    assert np.array_equal(choice.scale, np.ones(16, np.float32))


def test_awq_shields_the_weights_of_a_large_activation():
    """One input channel 50 times the others: scaling it up lowers the output error."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 64)).astype(np.float32)
    x[:, 5] *= 50
    w = rng.standard_normal((64, 32)).astype(np.float32)
    choice = awq_scale(x, w, lambda m: quantize_int4_blocks(m, 32, False).dequantized())
    assert choice.alpha > 0 and choice.error < 0.8 * choice.rtn_error
    assert choice.scale[5] == choice.scale.max()


def test_awq_judges_a_wide_linear_on_evenly_spaced_columns(monkeypatch):
    """Over ``SAMPLED`` outputs the search sees only the judged columns: its errors are those of the
    same search on those columns alone (quantization is per column), and on a weight with an
    outlier channel it picks the exponent the whole search picks. At or below, every column."""
    from autoglm_trt.calib import awq

    rng = np.random.default_rng(5)
    x = rng.standard_normal((64, 64)).astype(np.float32)
    x[:, 9] *= 40
    w = rng.standard_normal((64, 300)).astype(np.float32)

    def rounded(m):
        return quantize_int4_blocks(m, 32, False).dequantized()

    full = awq_scale(x, w, rounded)
    cols = awq.judged_columns(300, 40)
    assert len(cols) == 40 and cols[0] == 0 and cols[-1] == 299 and np.all(np.diff(cols) > 0)
    assert np.array_equal(awq.judged_columns(30, 40), np.arange(30))
    monkeypatch.setattr(awq, "SAMPLED", 40)
    sampled = awq_scale(x, w, rounded)
    alone = awq_scale(x, w[:, cols], rounded)
    assert (sampled.alpha, sampled.error, sampled.rtn_error) == (alone.alpha, alone.error, alone.rtn_error)
    assert np.array_equal(sampled.scale, alone.scale)
    assert sampled.alpha == full.alpha and np.array_equal(sampled.scale, full.scale)
    monkeypatch.setattr(awq, "SAMPLED", 300)
    assert awq_scale(x, w, rounded).error == full.error
