"""The vision encoder's native-attention form (``passes/image_attention.py``): each fused
MultiHeadAttention becomes ImageAttentionBf16 between reshapes, the weights stay where the base
graph keeps them, and the form computes the base graph's attention to bfloat16's rounding."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from autoglm_trt.backends.onnxrt.passes.image_attention import native_image_attention

T, H, D = 70, 2, 16


def _model(tmp_path) -> onnx.ModelProto:
    """x [1, T, H * D] -> MultiHeadAttention(x W_q, x W_k, x W_v), its weights in a file of their own."""
    f = TensorProto.FLOAT
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal((H * D, H * D)).astype(np.float32) / 4, f"w{p}")
               for p in "qkv"]
    nodes = [helper.make_node("MatMul", ["x", f"w{p}"], [p]) for p in "qkv"]
    nodes.append(helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["y"], "visual.blocks.0.attn_mha",
                                  domain="com.microsoft", num_heads=H))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, [1, "patches", H * D])],
                              [helper.make_tensor_value_info("y", f, [1, "patches", H * D])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    onnx.save_model(model, str(tmp_path / "base.onnx"), save_as_external_data=True, location="base.onnx.data",
                    size_threshold=0)
    return onnx.load(str(tmp_path / "base.onnx"), load_external_data=False)


def test_the_attention_is_rewritten_and_the_weights_stay_in_the_base_file(tmp_path):
    base = _model(tmp_path)
    native, count = native_image_attention(base, D)
    assert count == 1
    ops = [(n.op_type, n.domain) for n in native.graph.node]
    assert ("MultiHeadAttention", "com.microsoft") not in ops and ("ImageAttentionBf16", "autoglm.trt") in ops
    assert [op for op, _ in ops].count("Reshape") == 4
    shapes = {t.name: numpy_helper.to_array(t).tolist() for t in native.graph.initializer if t.name.endswith("_shape")}
    assert sorted(shapes.values()) == [[-1, H, D], [1, -1, H * D]]
    for t in native.graph.initializer:
        if t.name.startswith("w"):
            assert {e.key: e.value for e in t.external_data}["location"] == "base.onnx.data"
    assert native.graph.node[-1].output[0] == "y"
    assert native_image_attention(base, 48) == (base, 0)  # a head size the operator does not take


def test_the_native_form_computes_the_attention(tmp_path):
    import onnxruntime as ort

    from autoglm_trt.native import image_attention_bf16
    from autoglm_trt.native import library as native_library

    library = native_library()[0]
    if library is None or not image_attention_bf16(library):
        pytest.skip("no native library with AVX512-BF16 here: the runtime keeps MultiHeadAttention")
    native, _ = native_image_attention(_model(tmp_path), D)
    onnx.save_model(native, str(tmp_path / "base.native.onnx"))
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(library))
    x = {"x": np.random.default_rng(1).standard_normal((1, T, H * D)).astype(np.float32)}
    want = ort.InferenceSession(str(tmp_path / "base.onnx"), providers=["CPUExecutionProvider"]).run(None, x)[0]
    got = ort.InferenceSession(str(tmp_path / "base.native.onnx"), so, providers=["CPUExecutionProvider"]).run(None, x)[0]
    assert got.shape == want.shape and not np.array_equal(got, want)
    assert np.sqrt(np.mean((got - want) ** 2)) < 5e-3 * np.sqrt(np.mean(want ** 2))
