import numpy as np

from autoglm_trt.model.rope import RopeSpec, cos_sin_tables, interleaved_to_half_order


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


def test_four_node_rope_equals_split_rope_bit_for_bit():
    """x * cos_full + (x @ P) * sin_full, as the graph computes it, in float32."""
    from autoglm_trt.model.rope import full_width_tables, rotate_half_matrix

    rng = np.random.default_rng(1)
    for hd, rot in ((16, 16), (16, 8)):  # full rotary (Llama) and partial (GLM)
        cos, sin = cos_sin_tables(RopeSpec(10000.0, rot), 7, 256)
        x = rng.standard_normal((7, 3, hd)).astype(np.float32)  # [positions, heads, head_dim]
        cos_f, sin_f = full_width_tables(cos, sin, hd)
        p = rotate_half_matrix(hd, rot)
        assert set(np.unique(p)) == {-1.0, 0.0, 1.0} and (np.abs(p).sum(0)[:rot] == 1).all()
        got = x * cos_f[:, None] + (x @ p) * sin_f[:, None]
        ref = rope_half(x, cos[:, None], sin[:, None], rot)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, ref)
