import numpy as np
import pytest

from autoglm_trt.quant.hadamard import block_size, hadamard, rotate_rows, rotate_weight, sylvester


def test_sylvester_small_cases_exactly():
    assert sylvester(1).tolist() == [[1]]
    assert sylvester(2).tolist() == [[1, 1], [1, -1]]
    assert sylvester(4).tolist() == [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]
    h = sylvester(64)
    assert (h @ h.T == 64 * np.eye(64, dtype=np.int64)).all() and (h == h.T).all()
    with pytest.raises(ValueError, match="power-of-two"):
        sylvester(12)


def test_block_sizes():
    assert block_size(1536, 128) == 128  # 1536 = 3 * 512
    assert block_size(1536, 1024) == 512
    assert block_size(576, 128) == 64  # 576 = 9 * 64
    assert block_size(4096, 128) == 128
    assert block_size(13696, 128) == 128  # GLM-4-9B's intermediate size: 13696 = 107 * 128
    assert block_size(1000, 128) == 8
    assert block_size(7, 128) == 1


def test_rotation_spreads_an_outlier_and_keeps_the_product():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    x[:, 5] = 1000.0  # one outlier channel
    w = rng.standard_normal((256, 32)).astype(np.float32)
    xr, wr = rotate_rows(x, 128), rotate_weight(w, 128)
    np.testing.assert_allclose(xr @ wr, x @ w, rtol=1e-4, atol=1e-2)
    # the outlier's block: every channel now carries 1000 / sqrt(128) plus noise; the other block is untouched in scale
    assert np.abs(x[:, :128]).max() / np.abs(x[:, :128]).mean() > 50
    assert np.abs(xr[:, :128]).max() / np.abs(xr[:, :128]).mean() < 1.5
    np.testing.assert_allclose(np.linalg.norm(xr, axis=1), np.linalg.norm(x, axis=1), rtol=1e-5)
    np.testing.assert_allclose(hadamard(128) @ hadamard(128), np.eye(128), atol=1e-6)


def test_rotated_rows_exactly():
    """The butterfly's sums and differences, times H's entry (1/2 for b = 4: exact), and against
    the GEMM by H in float64 at b = 128 (an entry 1/sqrt(128) rounded to float32) within a float32
    rounding."""
    x = np.array([[1, 2, 3, 4, -8, 0.5, 0.25, 3]], np.float32)
    np.testing.assert_array_equal(rotate_rows(x, 4), [[5, -1, -2, 0, -2.125, -5.625, -5.375, -2.875]])
    # x_k = k: H's column j sums to 0 unless j has at most one bit set, -8 * j when it has one
    want = np.zeros(16, np.float32)
    want[[0, 1, 2, 4, 8]] = [30, -2, -4, -8, -16]
    np.testing.assert_array_equal(rotate_rows(np.arange(16, dtype=np.float32)[None], 16)[0], want)
    rng = np.random.default_rng(1)
    y = (rng.standard_normal((64, 256)) * rng.uniform(0.01, 30, 256)).astype(np.float32)
    gemm = (y.reshape(-1, 128).astype(np.float64) @ hadamard(128).astype(np.float64)).reshape(y.shape)
    np.testing.assert_allclose(rotate_rows(y, 128), gemm, rtol=2 ** -23, atol=1e-30)
    out = np.empty_like(y)
    assert rotate_rows(y, 128, out=out) is out and (out == rotate_rows(y, 128)).all()


@pytest.mark.parametrize("block", [None, 16])
def test_lm_head_quantized_in_row_chunks_equals_the_whole_matrix(tmp_path, monkeypatch, block):
    """The chunked INT8 LM head (a 9B vocabulary never whole in float) writes the same INT8
    weight and scales as quantizing the whole [in, out] matrix; with a rotation, W^T R per row
    chunk may round differently from R^T W in the last bit, so a rare value may move by one step."""
    import onnx
    from onnx import numpy_helper

    from autoglm_trt.graph import qdq
    from autoglm_trt.graph.builder import GraphBuilder
    from autoglm_trt.quant.plan import QuantPlan

    monkeypatch.setattr(qdq, "ROW_CHUNK", 70)  # several chunks, the last one short
    rng = np.random.default_rng(3)
    w_rows = rng.standard_normal((300, 64)).astype(np.float32)  # [out, in], as an LM head is stored
    plan = QuantPlan({"lm_head": 4.0}, rotate={"lm_head": block} if block else {})
    arrays = {}
    for way in ("whole", "rows"):
        g = GraphBuilder(tmp_path / f"{way}.data")
        g.input("x", onnx.TensorProto.FLOAT, ["n", 64])
        if way == "whole":
            out = qdq.quantized_matmul(g, "x", w_rows.T, "lm_head", plan, rank=2)
        else:
            out = qdq.quantized_rows_matmul(g, "x", lambda a, b: w_rows[a:b], 300, 64, "lm_head", plan)
        g.output(out, onnx.TensorProto.FLOAT, ["n", 300])
        model = g.model("t", 17)
        arrays[way] = {t.name: numpy_helper.to_array(t, base_dir=str(tmp_path)) for t in model.graph.initializer}
    whole, rows = arrays["whole"], arrays["rows"]
    assert rows["lm_head.weight_i8"].shape == (64, 300) and rows["lm_head.weight_i8"].dtype == np.int8
    np.testing.assert_allclose(rows["lm_head.weight_scale"], whole["lm_head.weight_scale"], rtol=1e-6)
    diff = np.abs(rows["lm_head.weight_i8"].astype(np.int16) - whole["lm_head.weight_i8"])
    if block is None:
        assert not diff.any()
    else:
        assert diff.max() <= 1 and (diff > 0).mean() < 0.002
