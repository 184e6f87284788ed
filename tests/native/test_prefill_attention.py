"""The native PrefillAttention operator: a prefill's attention (scores over past and new keys,
mask bias, softmax, weighted values) in one pass without the score tensors, against the same
attention in float64 numpy, on every build that has it; and PrefillAttentionBf16, its products in
bfloat16 on AMX where the CPU has it."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import float_op_session

NEG_INF = -1.0e9  # the engine graph's mask value (graph/decoder.py)
NAMES = ("q", "k_past", "k_new", "v_past", "v_new", "bias")


def _session(library, op: str = "PrefillAttention"):
    return float_op_session(library, op, NAMES)


def reference(feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The graph's attention (graph/decoder.py ``paged_attention``) in float64: [Hkv, B, G, T, D]."""
    q = feeds["q"].astype(np.float64).transpose(2, 0, 3, 1, 4)  # [Hkv, B, G, T, D]
    k = np.concatenate([feeds["k_past"], feeds["k_new"]], axis=3).astype(np.float64)  # [Hkv, B, 1, P+T, D]
    v = np.concatenate([feeds["v_past"], feeds["v_new"]], axis=3).astype(np.float64)
    s = q @ k.swapaxes(-1, -2) + feeds["bias"].astype(np.float64)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)) @ v


def _feeds(rng, hkv: int, b: int, g: int, t: int, p: int, d: int, context: list[int]) -> dict[str, np.ndarray]:
    """Random queries, keys and values, and the engine's bias: each sequence attends to the first
    ``context[b]`` past slots and causally to its new tokens."""
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    ok = np.zeros((b, t, p + t), bool)
    for i, c in enumerate(context):
        ok[i, :, :c] = True
        ok[i, :, p:] = np.tril(np.ones((t, t), bool))
    bias = np.where(ok, np.float32(0), np.float32(NEG_INF)).astype(np.float32)[None, :, None]
    return {"q": f(b, t, hkv, g, d) * 0.5, "k_past": f(hkv, b, 1, p, d), "k_new": f(hkv, b, 1, t, d),
            "v_past": f(hkv, b, 1, p, d), "v_new": f(hkv, b, 1, t, d), "bias": bias}


def _has_it(library) -> None:
    from autoglm_trt.native import float_kernel

    if float_kernel(library) == "portable C":
        pytest.skip("PrefillAttention needs fused multiply-add; this build has none (the rewrite does not use it)")


@pytest.mark.parametrize("hkv,b,g,t,p,d,context", [
    (3, 1, 3, 70, 0, 64, [0]),  # SmolLM2's heads, a prompt with no past: three work items a head
    (1, 2, 2, 17, 32, 64, [32, 5]),  # a chunk after a past, one sequence's past partly unused
    (2, 1, 1, 33, 48, 128, [40]),  # one query head a KV head
    (2, 1, 16, 9, 16, 128, [10]),  # GLM-4.1V's 16 query heads a KV head
    (1, 1, 40, 3, 0, 64, [0]),  # more query heads than rows an item takes
    (1, 1, 4, 1, 16, 64, [16]),  # one new token
])
def test_equals_the_attention_in_float64(kernel_library, hkv, b, g, t, p, d, context):
    _has_it(kernel_library)
    feeds = _feeds(np.random.default_rng(t * 100 + p), hkv, b, g, t, p, d, context)
    (got,) = _session(kernel_library).run(None, feeds)
    want = reference(feeds)
    assert got.shape == want.shape == (hkv, b, g, t, d)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_large_scores_keep_their_weights(kernel_library):
    """Scores that grow along the keys (the running maximum rises step after step) and scores in
    the hundreds: each rescaling keeps the weights a softmax of float64 gives."""
    _has_it(kernel_library)
    feeds = _feeds(np.random.default_rng(7), 1, 1, 2, 40, 24, 64, [24])
    feeds["q"] = np.abs(feeds["q"]) * 3
    feeds["k_past"] += (np.arange(24, dtype=np.float32) * 0.3)[:, None]  # each key's score ~20 above the last
    (got,) = _session(kernel_library).run(None, feeds)
    want = reference(feeds)
    np.testing.assert_allclose(got, want, rtol=0, atol=5e-5 * np.abs(want).max())


def test_a_row_with_every_key_masked_is_zero_and_shapes_that_do_not_fit_fail(kernel_library):
    _has_it(kernel_library)
    sess = _session(kernel_library)
    feeds = _feeds(np.random.default_rng(3), 1, 1, 1, 4, 16, 64, [16])
    feeds["bias"][..., 2, :] = np.float32(NEG_INF)
    (got,) = sess.run(None, feeds)
    assert not got[:, :, :, 2].any() and np.isfinite(got).all()
    np.testing.assert_allclose(np.delete(got, 2, axis=3), np.delete(reference(feeds), 2, axis=3), atol=1e-5)
    bad = dict(feeds, k_new=feeds["k_new"][..., :3, :])
    with pytest.raises(Exception, match="PrefillAttention: .*do not fit"):
        sess.run(None, bad)
    odd = _feeds(np.random.default_rng(3), 1, 1, 1, 4, 16, 48, [16])  # a head size the kernel does not take
    with pytest.raises(Exception, match="D a multiple of 64"):
        sess.run(None, odd)



def test_a_bias_of_any_values_is_added_where_it_is_not_zero(kernel_library):
    """The bias is read once a call and each block of it classed (all zero, all masked, mixed):
    finite values other than 0 in a few blocks, a block of zeros, and masked blocks, on a prompt
    long enough for several blocks each way, against float64."""
    _has_it(kernel_library)
    rng = np.random.default_rng(11)
    feeds = _feeds(rng, 1, 1, 2, 150, 70, 64, [60])
    feeds["bias"][..., 40:80, :130] += rng.uniform(-2, 2, (40, 130)).astype(np.float32)  # some rows' blocks
    feeds["bias"][..., 100, 10] = np.float32(-3.0)  # one value in a block otherwise zero
    (got,) = _session(kernel_library).run(None, feeds)
    np.testing.assert_allclose(got, reference(feeds), rtol=0, atol=2e-5 * np.abs(got).max())


BF16_SHAPES = [(3, 1, 3, 70, 0, 64, [0]), (1, 2, 2, 17, 32, 64, [32, 5]), (2, 1, 16, 40, 16, 128, [10])]


@pytest.mark.parametrize("hkv,b,g,t,p,d,context", BF16_SHAPES)
def test_the_bf16_form_rounds_its_products_to_bfloat16_where_amx_has_them(kernel_library, hkv, b, g, t, p, d,
                                                                          context):
    """PrefillAttentionBf16: on a CPU with AMX-BF16, within bfloat16's rounding of the float64
    attention (and not PrefillAttention's bits: the bfloat16 path ran); elsewhere, and with
    ``AUTOGLM_TRT_AMX=0``, PrefillAttention bit for bit."""
    import os
    import subprocess
    import sys

    from autoglm_trt.native import attention_bf16

    _has_it(kernel_library)
    feeds = _feeds(np.random.default_rng(t + p), hkv, b, g, t, p, d, context)
    (got,) = _session(kernel_library, "PrefillAttentionBf16").run(None, feeds)
    (exact,) = _session(kernel_library).run(None, feeds)
    want = reference(feeds)
    if attention_bf16(kernel_library):
        error = got - want
        assert np.sqrt(np.mean(error**2)) < 5e-3 * np.sqrt(np.mean(want**2))
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())
        assert not np.array_equal(got, exact)
        script = ("import sys, numpy as np; sys.path[:0] = sys.argv[3:4] + sys.argv[1:2]; "
                  "import test_prefill_attention as t; "
                  "f = t._feeds(np.random.default_rng(3), 1, 1, 2, 40, 0, 64, [0]); "
                  "a = t._session(sys.argv[2], 'PrefillAttentionBf16').run(None, f)[0]; "
                  "b = t._session(sys.argv[2]).run(None, f)[0]; sys.exit(0 if np.array_equal(a, b) else 1)")
        done = subprocess.run([sys.executable, "-c", script, os.path.dirname(__file__), str(kernel_library),
                               os.path.dirname(os.path.dirname(__file__))],
                              env=dict(os.environ, AUTOGLM_TRT_AMX="0"), capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    else:
        np.testing.assert_array_equal(got, exact)
