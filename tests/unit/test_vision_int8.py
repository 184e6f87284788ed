"""The vision encoder's INT8 linears (``graph.vision_int8``): the per-token quantization to exact
values, and the rewritten graph against the same arithmetic in numpy."""

from __future__ import annotations

import numpy as np
import pytest

from autoglm_trt.graph.vision_int8 import TINY, int8_vision_graph, reference_linear, row_quantize
from autoglm_trt.native import int8_pairs_saturate


def test_rows_are_quantized_each_by_its_own_absolute_maximum():
    x = np.array([[1.27, -0.635, 0.0, 0.3], [0.0, 0.0, 0.0, 0.0], [-2.54, 0.01, 0.03, 2.54]], np.float32)
    codes, scale = row_quantize(x)
    assert scale.shape == (3, 1) and scale.dtype == np.float32
    assert scale[0, 0] == np.float32(1.27) / np.float32(127) and scale[1, 0] == TINY
    assert scale[2, 0] == np.float32(2.54) / np.float32(127)
    # -0.635 / 0.01 is -63.5 (within float32 rounding of the scale): the nearest integer, ties to even
    assert codes.dtype == np.uint8
    assert codes.tolist() == [[255, np.rint(np.float32(-0.635) / scale[0, 0]) + 128, 128, 158], [128] * 4,
                              [1, 128 + 0, 130, 255]]


def test_reference_linear_is_the_integer_product_scaled():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((5, 7), np.float32), rng.standard_normal((7, 3), np.float32)
    y = reference_linear(x, w)
    codes, s = row_quantize(x)
    wq = np.clip(np.rint(w / (np.abs(w).max(0) / 127)), -127, 127)
    exact = ((codes.astype(np.float64) - 128) @ wq) * s * (np.abs(w).max(0) / 127)
    np.testing.assert_allclose(y, exact, rtol=1e-5)
    assert np.abs(y - x @ w).max() < 0.05 * np.abs(x @ w).max()


def _one_linear(w: np.ndarray, name: str):
    from onnx import TensorProto, helper, numpy_helper

    k, n = w.shape
    graph = helper.make_graph([helper.make_node("MatMul", ["x", name], ["y"], "mm"),
                               helper.make_node("MatMul", ["y", "other"], ["z"], "kept")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", k])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["rows", n])],
                              [numpy_helper.from_array(w, name), numpy_helper.from_array(np.eye(n, dtype=np.float32),
                                                                                         "other")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_rewrite_takes_the_encoders_linears_alone_and_leaves_its_input():
    w = np.random.default_rng(1).standard_normal((16, 8), np.float32)
    model = _one_linear(w, "visual.blocks.0.mlp.up_proj.weight")
    before = model.SerializeToString()
    rewritten, count = int8_vision_graph(model)
    assert count == 1 and model.SerializeToString() == before
    ops = [node.op_type for node in rewritten.graph.node]
    assert ops.count("MatMul") == 1 and "MatMulIntegerToFloat" in ops  # "other" is not the encoder's
    names = {t.name for t in rewritten.graph.initializer}
    assert "visual.blocks.0.mlp.up_proj.weight" not in names and "visual.blocks.0.mlp.up_proj.weight.int8" in names
    assert int8_vision_graph(_one_linear(w, "lm_head.weight"))[1] == 0


def test_a_down_projections_input_is_rotated_and_its_weight_with_it():
    """A Hadamard rotation of the input (blocks of 32 here: 96 = 3 x 32) and the weight rotated to
    match leave the float product as it was; the per-token INT8 product of the rotated pair errs
    less where one input of the row is an outlier."""
    from autoglm_trt.quant.hadamard import hadamard, rotate_weight

    rng = np.random.default_rng(3)
    w = rng.standard_normal((96, 40), np.float32)
    x = rng.standard_normal((50, 96), np.float32)
    x[:, 7] *= 60  # one channel of outliers, as a SiLU-gated product has
    turned = (x.reshape(50, 3, 32) @ hadamard(32)).reshape(50, 96)
    np.testing.assert_allclose(turned @ rotate_weight(w, 32), x @ w, rtol=1e-4, atol=1e-3)
    exact = x.astype(np.float64) @ w
    plain, rotated = reference_linear(x, w), reference_linear(x, w, 32)
    assert np.linalg.norm(rotated - exact) < 0.5 * np.linalg.norm(plain - exact)
    model, count = int8_vision_graph(_one_linear(w, "visual.blocks.0.mlp.down_proj.weight"))
    ops = [node.op_type for node in model.graph.node]
    assert count == 1 and ops.count("MatMul") == 2 and ops.count("Reshape") == 2  # the rotation's, and "other"


@pytest.mark.skipif(int8_pairs_saturate(), reason="ONNX Runtime's INT8 products saturate on this CPU (no VNNI); "
                                                   "the runtime runs the float32 encoder here")
@pytest.mark.parametrize("name,block", [("visual.blocks.0.attn.qkv.weight", 0),
                                        ("visual.blocks.0.mlp.down_proj.weight", 32)])
def test_the_rewritten_linear_computes_the_reference(name, block):
    import onnxruntime as ort

    rng = np.random.default_rng(2)
    w = rng.standard_normal((96, 40), np.float32)
    x = rng.standard_normal((33, 96), np.float32) * rng.uniform(0.01, 100, (33, 1)).astype(np.float32)
    x[4] = 0.0
    rewritten, _ = int8_vision_graph(_one_linear(w, name))
    session = ort.InferenceSession(rewritten.SerializeToString(), providers=["CPUExecutionProvider"])
    [z] = session.run(None, {"x": x})
    want = reference_linear(x, w, block)
    if block:  # ONNX Runtime's float32 rotation sums in another order: a code may differ by one step
        assert np.abs(z - want).max() < 2e-2 * np.abs(want).max()
    else:
        np.testing.assert_allclose(z, want, rtol=2e-6, atol=1e-30)
    assert not z[4].any()
