"""The native RopeQKV operator: against numpy, and in the engine graphs of two families."""

from __future__ import annotations

import numpy as np
import pytest

from autoglm_trt.backends.onnxrt.passes.rope_qkv import rewrite, turn_entries
from autoglm_trt.model.rope import rotate_half_matrix


def _rope_session(library, hq: int, hkv: int, d: int):
    from onnx import TensorProto, helper, numpy_helper

    from autoglm_trt.backends.onnxrt.session import make_session

    node = helper.make_node("RopeQKV", ["qkv", "cos", "sin", "index", "value", "heads"], ["q", "k", "v"],
                            domain="autoglm.trt")
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        [node], "rope", [helper.make_tensor_value_info("qkv", f, ["B", "T", (hq + 2 * hkv) * d]),
                         helper.make_tensor_value_info("cos", f, ["B", "T", 1, d]),
                         helper.make_tensor_value_info("sin", f, ["B", "T", 1, d]),
                         helper.make_tensor_value_info("index", TensorProto.INT32, ["E", 2]),
                         helper.make_tensor_value_info("value", f, ["E"])],
        [helper.make_tensor_value_info(n, f, None) for n in ("q", "k", "v")],
        [numpy_helper.from_array(np.array([hq, hkv], np.int64), "heads")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("autoglm.trt", 1)])
    return make_session(model.SerializeToString(), threads=2, custom_ops=library)


@pytest.mark.parametrize("b,t,hq,hkv,d,rotary", [
    (1, 1, 9, 3, 64, 64),  # a SmolLM2 decode step
    (2, 20, 4, 2, 16, 8),  # partial rotary (GLM); enough tokens for ONNX Runtime's threads
    (3, 5, 2, 2, 8, 8),
])
def test_kernel_equals_the_graph_arithmetic(library, b, t, hq, hkv, d, rotary):
    """q, k = x * cos + (x @ R) * sin per head, each product and the sum rounded to float32 as the
    graph's Mul, MatMul and Add nodes round them; v copied: exactly."""
    rng = np.random.default_rng(b * 100 + t)
    qkv = rng.standard_normal((b, t, (hq + 2 * hkv) * d), dtype=np.float32)
    cos = rng.uniform(-1, 1, (b, t, 1, d)).astype(np.float32)
    sin = rng.uniform(-1, 1, (b, t, 1, d)).astype(np.float32)
    r = rotate_half_matrix(d, rotary)
    index, value = turn_entries(r)
    q, k, v = _rope_session(library, hq, hkv, d).run(None, {"qkv": qkv, "cos": cos, "sin": sin, "index": index,
                                                             "value": value})
    heads = qkv.reshape(b, t, hq + 2 * hkv, d)
    qk = heads[:, :, :hq + hkv]
    roped = qk * cos + (qk @ r) * sin
    np.testing.assert_array_equal(q, roped[:, :, :hq])
    np.testing.assert_array_equal(k, roped[:, :, hq:])
    np.testing.assert_array_equal(v, heads[:, :, hq + hkv:])


@pytest.fixture(scope="module")
def glm_engine(tiny_dir, tmp_path_factory):
    from conftest import build_tiny_engine

    return build_tiny_engine(tiny_dir, tmp_path_factory.mktemp("rope") / "glm", family="glm")


@pytest.mark.parametrize("family", ["llama", "glm"])
def test_every_layer_is_fused_and_the_logits_are_unchanged(tiny_engine, glm_engine, library, monkeypatch, family):
    import onnx
    from conftest import logits_over_steps, rewritten_runner

    from autoglm_trt.artifacts import Manifest
    from autoglm_trt.backends import open_runner
    from autoglm_trt.backends.onnxrt.passes import rope_qkv as rope_op

    manifest = Manifest.read(tiny_engine if family == "llama" else glm_engine)
    spec = manifest.spec
    model = onnx.load(str(manifest.engine_path), load_external_data=False)
    before = len(model.graph.node)
    assert rewrite(model, spec.num_layers, spec.num_heads, spec.num_kv_heads, manifest.dir) == spec.num_layers
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("RopeQKV") == spec.num_layers and len(ops) == before - 7 * spec.num_layers

    monkeypatch.setenv("AUTOGLM_TRT_NATIVE", "1")
    fused = open_runner(manifest, num_blocks=32, threads=1)
    monkeypatch.setattr(rope_op, "rewrite", lambda *args: 0)
    plain = rewritten_runner(manifest.dir)
    for with_op, without in logits_over_steps([fused, plain]):  # a prefill, then two decode steps
        np.testing.assert_allclose(with_op, without, atol=1e-6, rtol=1e-6)
    fused.close()
    plain.close()


def test_a_layer_whose_rotated_heads_have_another_reader_is_left_alone(tiny_engine):
    import onnx
    from onnx import helper

    from autoglm_trt.artifacts import Manifest

    manifest = Manifest.read(tiny_engine)
    spec = manifest.spec
    model = onnx.load(str(manifest.engine_path), load_external_data=False)
    model.graph.node.append(helper.make_node("Identity", ["layers.0.qk"], ["spy"], name="spy"))
    assert rewrite(model, spec.num_layers, spec.num_heads, spec.num_kv_heads, manifest.dir) == spec.num_layers - 1
    assert "layers.0.qk" in {o for n in model.graph.node for o in n.output}
