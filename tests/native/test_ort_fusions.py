"""The load-time fusion of residual Add + RMSNorm for ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx

from autoglm_trt.artifacts import Manifest
from autoglm_trt.backends.onnxrt.passes.skip_norm import skip_rms_norm
from autoglm_trt.backends.onnxrt.session import make_session
from autoglm_trt.kvcache.host_pools import KVPools
from autoglm_trt.kvcache.step_inputs import SeqState, step_inputs


def test_residual_add_and_rms_norm_become_one_node_with_the_same_outputs(tiny_engine):
    manifest = Manifest.read(tiny_engine)
    spec = manifest.spec
    plain = onnx.load(str(manifest.engine_path), load_external_data=False)
    fused = onnx.load(str(manifest.engine_path), load_external_data=False)
    norms = sum(n.op_type == "SimplifiedLayerNormalization" for n in plain.graph.node)
    # every layer's MLP norm reads attn_residual, every layer's input norm but the first reads
    # the previous mlp_residual; the final norm reads the gathered last tokens
    assert skip_rms_norm(fused) == 2 * spec.num_layers - 1
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("SkipSimplifiedLayerNormalization") == 2 * spec.num_layers - 1
    assert ops.count("SimplifiedLayerNormalization") == norms - (2 * spec.num_layers - 1)
    pools = KVPools(spec.num_layers, 8, manifest.kv.block_size, spec.num_kv_heads, spec.head_dim)
    pools.data[:] = np.random.default_rng(0).standard_normal(pools.data.shape, np.float32)
    feeds, _ = step_inputs([[3, 5, 7, 9], [11]], [SeqState(5, [0, 1]), SeqState(9, [2, 3])],
                           manifest.kv.block_size)
    feeds.update(pools.feeds())
    outputs = []
    for model in (plain, fused):
        session = make_session(model.SerializeToString(), threads=1, external_data_dir=manifest.dir)
        outputs.append(session.run(None, feeds))
    for a, b in zip(*outputs):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def _rotate_quantize_graph(n: int, b: int, scale: float, zero: int) -> onnx.ModelProto:
    """x -> Reshape to blocks of b -> MatMul by hadamard_<b> -> QuantizeLinear (uint8) -> Reshape back,
    named as the engine graph names them (graph/qdq.py, after ONNX Runtime's s8 -> u8 rewrite)."""
    from onnx import TensorProto, helper, numpy_helper

    from autoglm_trt.quant.hadamard import hadamard

    nodes = [helper.make_node("Reshape", ["x", f"blocks_{b}_3"], ["blocks"], name="lin.rot_blocks"),
             helper.make_node("MatMul", ["blocks", f"hadamard_{b}"], ["rot"], name="lin.rot"),
             helper.make_node("QuantizeLinear", ["rot", "lin.act_scale", "zp"], ["q"], name="lin.rot_q"),
             helper.make_node("Reshape", ["q", "unblocks_3"], ["y"], name="lin.rotated")]
    inits = [numpy_helper.from_array(np.array([0, 0, -1, b], np.int64), f"blocks_{b}_3"),
             numpy_helper.from_array(np.array([0, 0, -1], np.int64), "unblocks_3"),
             numpy_helper.from_array(np.array(hadamard(b)), f"hadamard_{b}"),
             numpy_helper.from_array(np.array(scale, np.float32), "lin.act_scale"),
             numpy_helper.from_array(np.array(zero, np.uint8), "zp")]
    graph = helper.make_graph(nodes, "rotate", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", n])],
                              [helper.make_tensor_value_info("y", TensorProto.UINT8, ["B", "T", n])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_rotation_and_quantization_become_one_native_node(tmp_path):
    import pytest

    from autoglm_trt.backends.onnxrt.passes.hadamard_quantize import hadamard_quantize
    from autoglm_trt.native import library as native_library

    library, why = native_library()
    if library is None:
        pytest.skip(f"the native operators cannot be built here: {why}")
    rng = np.random.default_rng(3)
    for n, b, rows in [(576, 64, 3), (1536, 128, 40), (64, 64, 1)]:  # 40 rows: over ONNX Runtime's threads
        plain = _rotate_quantize_graph(n, b, scale=0.02, zero=128)
        fused = _rotate_quantize_graph(n, b, scale=0.02, zero=128)
        assert hadamard_quantize(fused) == 1
        assert [x.op_type for x in fused.graph.node] == ["HadamardQuantize"]
        x = (rng.standard_normal((1, rows, n)) * rng.uniform(0.1, 3.0, n)).astype(np.float32)  # some saturate
        want = make_session(plain.SerializeToString(), threads=2).run(None, {"x": x})[0]
        got = make_session(fused.SerializeToString(), threads=2, custom_ops=library).run(None, {"x": x})[0]
        assert got.dtype == np.uint8 and got.shape == want.shape
        diff = np.abs(got.astype(np.int16) - want.astype(np.int16))
        # the transform sums in another order than the MatMul: a value within rounding of a
        # half step may land on the other side of it, one step away, and nowhere else
        assert diff.max() <= 1 and (diff > 0).mean() < 1e-3
        assert (want == 255).any() and (want == 0).any()  # saturation exercised


def test_the_chain_is_left_alone_when_its_parts_have_other_readers():
    from onnx import helper

    from autoglm_trt.backends.onnxrt.passes.hadamard_quantize import hadamard_quantize

    model = _rotate_quantize_graph(128, 64, scale=0.02, zero=128)
    model.graph.node.append(helper.make_node("Identity", ["rot"], ["rot_copy"], name="reader"))
    assert hadamard_quantize(model) == 0 and len(model.graph.node) == 5
