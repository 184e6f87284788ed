import numpy as np

from autoglm_trt.rope import RopeSpec, cos_sin_tables, interleaved_to_half_order


def rope_interleaved(x, cos, sin, rot):  # GLM: pairs (2i, 2i+1)
    out = x.copy()
    a, b = x[..., 0:rot:2], x[..., 1:rot:2]
    out[..., 0:rot:2] = a * cos - b * sin
    out[..., 1:rot:2] = b * cos + a * sin
    return out


def rope_half(x, cos, sin, rot):  # Llama: pairs (i, i + rot/2)
    out = x.copy()
    a, b = x[..., : rot // 2], x[..., rot // 2 : rot]
    out[..., : rot // 2] = a * cos - b * sin
    out[..., rot // 2 : rot] = b * cos + a * sin
    return out


def test_permutation_turns_interleaved_rope_into_half_rope():
    rng = np.random.default_rng(0)
    hd, rot = 16, 8
    q, k = rng.standard_normal((2, 5, hd)), rng.standard_normal((2, 5, hd))
    cos, sin = cos_sin_tables(RopeSpec(10000.0, rot), 5, 256)
    order = interleaved_to_half_order(hd, rot)
    assert order.tolist() == [0, 2, 4, 6, 1, 3, 5, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    ref = np.einsum("bth,bsh->bts", rope_interleaved(q, cos, sin, rot), rope_interleaved(k, cos, sin, rot))
    got = np.einsum("bth,bsh->bts", rope_half(q[..., order], cos, sin, rot), rope_half(k[..., order], cos, sin, rot))
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)


def test_tables_at_known_positions():
    cos, sin = cos_sin_tables(RopeSpec(10000.0, 4), 3, 16)
    assert cos.shape == (3, 2) and cos.dtype == np.float32
    np.testing.assert_array_equal(cos[0], [1.0, 1.0])
    np.testing.assert_allclose(sin[1], [np.sin(1.0), np.sin(0.01)], rtol=1e-6)
