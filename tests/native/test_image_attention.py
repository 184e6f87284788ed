"""The native ImageAttentionBf16 operator (the vision encoder's attention, bfloat16 products on
AVX512-BF16): against the same attention in float64 numpy with its inputs rounded as the kernel
rounds them, for every head size it takes, patch counts that do and do not fill its steps; and
refused by name where it cannot run."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import float_op_session

LOG2E = 1.4426950408889634


def _session(library):
    return float_op_session(library, "ImageAttentionBf16", ("q", "k", "v"))


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (to nearest, ties to even), as float64."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def rounded_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """softmax(q k^T / sqrt(D)) v per head in float64, from the queries (scaled by log2(e) / sqrt(D)
    in float32), keys and values rounded to bfloat16: the kernel's products but for the weights'
    rounding and the order of sums."""
    d = q.shape[2]
    qs = bf16(q * np.float32(LOG2E / np.sqrt(np.float32(d))))
    scores = np.einsum("thd,uhd->htu", qs, bf16(k))  # in log2 units
    w = np.exp2(scores - scores.max(-1, keepdims=True))
    return np.einsum("htu,uhd->thd", w / w.sum(-1, keepdims=True), bf16(v))


def exact(q, k, v):
    scores = np.einsum("thd,uhd->htu", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(q.shape[2])
    w = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("htu,uhd->thd", w / w.sum(-1, keepdims=True), v.astype(np.float64))


def _here(library) -> None:
    from autoglm_trt.native import image_attention_bf16

    if not image_attention_bf16(library):
        pytest.skip("this build or CPU has no AVX512-BF16 (the operator refuses: tested below)")


@pytest.mark.parametrize("t,h,d", [(1, 1, 16), (37, 2, 16), (64, 3, 32), (200, 4, 64), (129, 2, 128),
                                   (700, 1, 64)])
def test_it_is_the_attention_of_its_bfloat16_inputs(kernel_library, t, h, d):
    _here(kernel_library)
    rng = np.random.default_rng(t * h + d)
    q, k, v = (rng.standard_normal((t, h, d), np.float32) * s for s in (1.5, 1.5, 1.0))
    (got,) = _session(kernel_library).run(None, {"q": q, "k": k, "v": v})
    assert got.shape == (t, h, d) and got.dtype == np.float32
    rounded, want = rounded_reference(q, k, v), exact(q, k, v)
    # within the weights' bfloat16 rounding (2^-9 relative) of the rounded inputs' attention
    assert np.sqrt(np.mean((got - rounded) ** 2)) < 3e-3 * np.sqrt(np.mean(rounded ** 2))
    # and close to the float attention: each row's cosine with it
    cosine = np.sum(got * want, -1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))
    assert cosine.min() > 0.9999


def test_large_scores_and_equal_keys(kernel_library):
    """Scores of hundreds (the running maximum moves a lot between steps), and keys that repeat
    (a flat screenshot's patches): the weights still sum to one."""
    _here(kernel_library)
    rng = np.random.default_rng(5)
    t, h, d = 300, 2, 64
    q = rng.standard_normal((t, h, d), np.float32) * 8
    k = np.repeat(rng.standard_normal((10, h, d), np.float32) * 8, 30, axis=0)
    v = np.ones((t, h, d), np.float32)
    k[-1] *= 3  # the last step's one key dominates some rows
    (got,) = _session(kernel_library).run(None, {"q": q, "k": k, "v": v})
    np.testing.assert_allclose(got, 1.0, rtol=0, atol=1e-6)
    v = rng.standard_normal((t, h, d), np.float32)
    (got,) = _session(kernel_library).run(None, {"q": q, "k": k, "v": v})
    rounded = rounded_reference(q, k, v)
    assert np.sqrt(np.mean((got - rounded) ** 2)) < 3e-3 * np.sqrt(np.mean(rounded ** 2))


@pytest.mark.parametrize("shapes,message", [
    (((4, 2, 48), (4, 2, 48), (4, 2, 48)), "D one of 16, 32, 64, 128"),
    (((4, 2, 64), (5, 2, 64), (4, 2, 64)), "do not fit"),
    (((4, 2, 64), (4, 2, 64)), None),
])
def test_shapes_that_do_not_fit_are_refused_by_name(kernel_library, shapes, message):
    import onnxruntime as ort

    feeds = {n: np.zeros(s, np.float32) for n, s in zip("qkv", shapes)}
    if len(feeds) < 3:
        feeds["v"] = np.zeros((4, 2, 64, 1), np.float32)
        message = "not of rank 3"
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match=f"ImageAttentionBf16: .*{message}"):
        _session(kernel_library).run(None, feeds)


def test_where_it_cannot_run_it_says_so(kernel_library):
    import onnxruntime as ort

    from autoglm_trt.native import image_attention_bf16

    feeds = {n: np.ones((8, 1, 16), np.float32) for n in "qkv"}
    if image_attention_bf16(kernel_library):
        np.testing.assert_allclose(_session(kernel_library).run(None, feeds)[0], 1.0, rtol=0, atol=1e-6)
        return
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match="ImageAttentionBf16: .*no AVX512-BF16"):
        _session(kernel_library).run(None, feeds)
