"""The native linear and rope operators read their constant inputs (weights, scales, norm
weights, rope entries) once, when ONNX Runtime creates their kernels; fed as graph inputs
instead, the same inputs are read on every run. Both ways must give the same bits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


def _inputs_instead(model, arrays: dict[str, np.ndarray] | None = None):
    """A copy of ``model`` whose initializers are graph inputs, and their values as feeds
    (``arrays``: the values of initializers the graph only declares, read in place)."""
    import onnx
    from onnx import helper, numpy_helper

    out = onnx.ModelProto.FromString(model.SerializeToString())
    values = {t.name: (arrays or {}).get(t.name) for t in out.graph.initializer}
    values = {name: numpy_helper.to_array(t) if values[name] is None else values[name]
              for name, t in zip(values, out.graph.initializer)}
    del out.graph.initializer[:]
    out.graph.input.extend(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                           for name, v in values.items())
    return out, values


def _both_ways(library, model, feeds: dict[str, np.ndarray], arrays: dict | None = None) -> None:
    from autoglm_trt.backends.onnxrt.session import make_session

    constant = make_session(model.SerializeToString(), threads=2, custom_ops=library, initializers=arrays)
    fed, values = _inputs_instead(model, arrays)
    assert {i.name for i in fed.graph.input} > set(feeds)
    per_run = make_session(fed.SerializeToString(), threads=2, custom_ops=library)
    want = per_run.run(None, {**feeds, **values})
    got = constant.run(None, feeds)
    assert len(got) == len(want) and all(g.size for g in got)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("rows", [1, 5])
def test_int8_linear_with_norm(library, rows):
    """Int8LinearSkipNorm: constant inputs 1-6 (rotation, activation scale and zero, packed
    weights, column sums, weight scales) and 8-9 (norm weight, epsilon); input 7 (the skip) is
    not constant."""
    from onnx import helper
    from test_float_linear import skip_norm_graph
    from test_int8_linear import skip_norm_inits

    k, n = 576, 320
    rng = np.random.default_rng(rows)
    inits = skip_norm_inits(rng, k, n, zero=120)
    node = helper.make_node("Int8LinearSkipNorm", ["x", "h", "s", "z", "wp", "cs", "ws", "skip", "gamma", "eps"],
                            ["normalized", "sum"], domain="autoglm.trt")
    model = skip_norm_graph([node], k, n, inits)
    del model.graph.node[1]  # the graph's own norm: the fused node computes it
    feeds = {"x": rng.standard_normal((1, rows, k)).astype(np.float32),
             "skip": rng.standard_normal((1, rows, n)).astype(np.float32)}
    _both_ways(library, model, feeds)


@pytest.mark.parametrize("rows", [1, 5])
def test_float_linear_with_norm(library, rows):
    """FloatLinearSkipNorm: its tiles are read in place (``initializers``), its norm weight and
    epsilon are initializers of the graph."""
    from onnx import helper, numpy_helper
    from test_float_linear import skip_norm_graph

    from autoglm_trt.backends.onnxrt.passes import linear_epilogues
    from autoglm_trt.backends.onnxrt.passes import linears as linear_op
    from autoglm_trt.native import float_kernel

    if float_kernel(library) == "portable C":
        pytest.skip("FloatLinear replaces MatMul only where the library has FMA (x86-64 with AVX2)")
    k, n = 1536, 576
    rng = np.random.default_rng(rows)
    w = numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32) * 0.05, "w")
    model = skip_norm_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="m")], k, n, [w])
    arrays = linear_op.rewrite(model, Path("."), fma=True)
    assert linear_epilogues.fuse_skip_norm(model) == 1
    feeds = {"x": rng.standard_normal((1, rows, k)).astype(np.float32),
             "skip": rng.standard_normal((1, rows, n)).astype(np.float32)}
    _both_ways(library, model, feeds, arrays)


def test_rope(library):
    """RopeQKV: the rotation's entries and the head counts are constant, cos and sin are not."""
    from onnx import TensorProto, helper, numpy_helper

    from autoglm_trt.backends.onnxrt.passes.rope_qkv import turn_entries
    from autoglm_trt.model.rope import rotate_half_matrix

    hq, hkv, d = 9, 3, 64
    index, value = turn_entries(rotate_half_matrix(d, d))
    f = TensorProto.FLOAT
    node = helper.make_node("RopeQKV", ["qkv", "cos", "sin", "index", "value", "heads"], ["q", "k", "v"],
                            domain="autoglm.trt")
    graph = helper.make_graph(
        [node], "rope", [helper.make_tensor_value_info("qkv", f, ["B", "T", (hq + 2 * hkv) * d]),
                         helper.make_tensor_value_info("cos", f, ["B", "T", 1, d]),
                         helper.make_tensor_value_info("sin", f, ["B", "T", 1, d])],
        [helper.make_tensor_value_info(name, f, None) for name in ("q", "k", "v")],
        [numpy_helper.from_array(index, "index"), numpy_helper.from_array(value, "value"),
         numpy_helper.from_array(np.array([hq, hkv], np.int64), "heads")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("autoglm.trt", 1)])
    rng = np.random.default_rng(3)
    feeds = {"qkv": rng.standard_normal((2, 3, (hq + 2 * hkv) * d)).astype(np.float32),
             "cos": rng.uniform(-1, 1, (2, 3, 1, d)).astype(np.float32),
             "sin": rng.uniform(-1, 1, (2, 3, 1, d)).astype(np.float32)}
    _both_ways(library, model, feeds)
