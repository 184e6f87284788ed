"""The native FloatLinear operator: ONNX Runtime's own MatMul and Gemm, bit for bit, with every
kernel this CPU can run, and the rewrite of float engines' linears."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from autoglm_trt.backends.onnxrt.passes import linear_epilogues
from autoglm_trt.backends.onnxrt.passes import linears as linear_op
from autoglm_trt.native import float_kernel
from autoglm_trt.native import library as native_library


def _model(k: int, n: int, op: str, w: np.ndarray | None = None):
    """x [rows, k] (MatMul: [1, rows, k]) times a constant (``w``, or random); ``op`` "MatMul",
    "Gemm" (its constant stored transposed, ``transB``), "Split" (a MatMul whose output is split
    in halves) or "SiluMul" (and then SiLU(first half) * second half, as ONNX Runtime's fusion
    writes it: QuickGelu with alpha 1, Mul)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(k + n)
    if w is None:
        w = rng.standard_normal((n, k) if op == "Gemm" else (k, n)).astype(np.float32)
    nodes = [helper.make_node("Gemm", ["x", "w"], ["y"], name="g", transB=1) if op == "Gemm"
             else helper.make_node("MatMul", ["x", "w"], ["y"], name="m")]
    outputs = ["y"]
    if op in ("Split", "SiluMul"):
        nodes.append(helper.make_node("Split", ["y"], ["y0", "y1"], name="s", axis=-1, num_outputs=2))
        outputs = ["y0", "y1"]
    if op == "SiluMul":
        nodes += [helper.make_node("QuickGelu", ["y0"], ["a"], name="q", domain="com.microsoft", alpha=1.0),
                  helper.make_node("Mul", ["a", "y1"], ["z"], name="u")]
        outputs = ["z"]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["R", k] if op == "Gemm" else [1, "R", k])
    graph = helper.make_graph(nodes, "linear", [x],
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs],
                              [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])


@pytest.mark.parametrize("k,n,op", [
    (576, 960, "MatMul"),  # SmolLM2's QKV: 3 blocks of 256 inputs, the last partial
    (1536, 576, "MatMul"),  # its down projection: 6 whole blocks
    (576, 3072, "Split"),  # its gate/up projection and the Split after it: FloatLinearSplit
    (576, 3072, "SiluMul"),  # and its activation too: FloatLinearSiluMul
    (576, 1040, "Gemm"),  # a tied LM head (transB); 65 tiles: the last pair has one
    (40, 16, "MatMul"),  # one partial block, one tile
])
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 16, 37, 300])
def test_it_equals_onnx_runtime_bit_for_bit(kernel_library, k, n, op, rows):
    """Each output is the same float ONNX Runtime's MatMul (MLAS) computes: each block of 256
    inputs summed by fused multiply-adds from zero, the blocks' sums added in order. Rows cover a
    decode step (1), groups of 4 and 8 with rows left over, and a prefill's many rows (300: work
    items of 128 rows, the last partial)."""
    import onnx

    from autoglm_trt.backends.onnxrt.session import make_session

    model = _model(k, n, op)
    plain = make_session(model.SerializeToString(), threads=2)
    fused = onnx.ModelProto.FromString(model.SerializeToString())
    arrays = linear_op.rewrite(fused, Path("."), fma=True)
    want_op = {"Split": "FloatLinearSplit", "SiluMul": "FloatLinearSiluMul"}.get(op, "FloatLinear")
    assert [node.op_type for node in fused.graph.node] == [want_op]
    assert {t.name for t in fused.graph.initializer} == {"w.tiles"}  # the original weights left the graph
    assert arrays["w.tiles"].shape == (n // 16, k, 16)
    session = make_session(fused.SerializeToString(), threads=2, custom_ops=kernel_library, initializers=arrays)
    x = np.random.default_rng(rows).standard_normal((rows, k) if op == "Gemm" else (1, rows, k)).astype(np.float32)
    want, got = plain.run(None, {"x": x}), session.run(None, {"x": x})
    for a, b in zip(want, got):
        assert a.shape == b.shape and b.dtype == np.float32
        np.testing.assert_array_equal(b, a)


def test_silu_times_up_equals_onnx_runtime_over_the_whole_float_range(kernel_library):
    """FloatLinearSiluMul over weights that pass each input through unchanged (gate = up = x), so
    its output is SiLU(x) * x for 4 million inputs: random bit patterns (every exponent, infinities
    and NaNs), values about the logistic's clamp at +-18 and where it rounds to 0 or 1, and
    ordinary activations; bit for bit ONNX Runtime's QuickGelu and Mul (NaN where they give NaN)."""
    import onnx

    from autoglm_trt.backends.onnxrt.session import make_session

    eye = np.eye(16, dtype=np.float32)
    model = _model(16, 32, "SiluMul", np.concatenate([eye, eye], axis=1))
    plain = make_session(model.SerializeToString(), threads=2)
    fused = onnx.ModelProto.FromString(model.SerializeToString())
    arrays = linear_op.rewrite(fused, Path("."), fma=True)
    assert [node.op_type for node in fused.graph.node] == ["FloatLinearSiluMul"]
    session = make_session(fused.SerializeToString(), threads=2, custom_ops=kernel_library, initializers=arrays)
    rng = np.random.default_rng(7)
    n = 2**20
    x = np.concatenate([rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32),
                        rng.uniform(-20, 20, n).astype(np.float32), (rng.standard_normal(n) * 3).astype(np.float32),
                        (18 + rng.uniform(-0.5, 0.5, n) * rng.choice([-1, 1], n)).astype(np.float32),
                        np.array([0, -0.0, np.inf, -np.inf, np.nan, 18, -18, 1e-30, 3.4e38, -3.4e38] + [1] * 6, np.float32)])
    x = x.reshape(1, -1, 16)
    want, got = plain.run(None, {"x": x})[0], session.run(None, {"x": x})[0]
    same = (want.view(np.uint32) == got.view(np.uint32)) | (np.isnan(want) & np.isnan(got))
    assert same.all(), f"{np.count_nonzero(~same)} of {same.size} differ, e.g. at x = {x.reshape(-1)[~same.reshape(-1)][:4]}"


def skip_norm_graph(nodes: list, k: int, n: int, inits: list, extra_inputs: tuple = ()):
    """``nodes`` (which compute ``y`` [1, rows, n] from ``x`` [1, rows, k]) followed by ONNX Runtime's
    SkipSimplifiedLayerNormalization of (skip, y) with random gamma: outputs ``normalized`` and
    ``sum``."""
    from onnx import TensorProto, helper, numpy_helper

    gamma = np.random.default_rng(n).uniform(0.5, 2.0, n).astype(np.float32)
    nodes = nodes + [helper.make_node("SkipSimplifiedLayerNormalization", ["skip", "y", "gamma"],
                                      ["normalized", "", "", "sum"], name="norm", domain="com.microsoft", epsilon=1e-5)]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "R", k]),
              helper.make_tensor_value_info("skip", TensorProto.FLOAT, [1, "R", n]), *extra_inputs]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("normalized", "sum")]
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits + [numpy_helper.from_array(gamma, "gamma")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1),
                                                   helper.make_opsetid("autoglm.trt", 1)])


@pytest.mark.parametrize("rows", [0, 1, 3, 37])
def test_the_skip_norm_form_is_onnx_runtimes_residual_and_rmsnorm(kernel_library, rows):
    """FloatLinearSkipNorm's outputs are ONNX Runtime's SkipSimplifiedLayerNormalization of the
    MatMul's output and the skip: the normalized rows and the sums, bit for bit."""
    import onnx
    from onnx import helper, numpy_helper

    from autoglm_trt.backends.onnxrt.session import make_session

    k, n = 1536, 576
    rng = np.random.default_rng(rows)
    w = numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32) * 0.05, "w")
    model = skip_norm_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="m")], k, n, [w])
    plain = make_session(model.SerializeToString(), threads=2)
    fused = onnx.ModelProto.FromString(model.SerializeToString())
    arrays = linear_op.rewrite(fused, Path("."), fma=True)
    assert linear_epilogues.fuse_skip_norm(fused) == 1
    assert [node.op_type for node in fused.graph.node] == ["FloatLinearSkipNorm"]
    session = make_session(fused.SerializeToString(), threads=2, custom_ops=kernel_library, initializers=arrays)
    feeds = {"x": rng.standard_normal((1, rows, k)).astype(np.float32),
             "skip": (rng.standard_normal((1, rows, n)) * 4).astype(np.float32)}
    for want, got in zip(plain.run(None, feeds), session.run(None, feeds)):
        assert got.shape == (1, rows, n)
        np.testing.assert_array_equal(got, want)


def test_tiles_put_each_weight_where_the_kernel_reads_it():
    from onnx import numpy_helper

    w = np.arange(5 * 32, dtype=np.float32).reshape(5, 32)
    for transposed, t in ((False, w), (True, w.T.copy())):
        tiles = linear_op._pack_all({}, {"w": (numpy_helper.from_array(t, "w"), transposed)}, numpy_helper.to_array)
        got = tiles["w.tiles"]
        assert got.shape == (2, 5, 16)
        for k in range(5):
            for c in range(32):
                assert got[c // 16, k, c % 16] == w[k, c]


def test_linears_it_would_not_compute_exactly_are_left_alone():
    """A Gemm with alpha, a MatMul of 40 columns (not whole tiles) and one over a computed matrix."""
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(np.ones((64, 32), np.float32), "a"),
             numpy_helper.from_array(np.ones((64, 40), np.float32), "b")]
    nodes = [helper.make_node("Gemm", ["x", "a"], ["y0"], name="g", alpha=0.5),
             helper.make_node("MatMul", ["x", "b"], ["y1"], name="m"),
             helper.make_node("MatMul", ["x", "y2"], ["y3"], name="c")]
    value = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, None)  # noqa: E731
    graph = helper.make_graph(nodes, "g", [value("x"), value("y2")], [value(f"y{i}") for i in (0, 1, 3)], inits)
    model = helper.make_model(graph)
    assert linear_op.rewrite(model, Path("."), fma=True) == {}
    assert [n.op_type for n in model.graph.node] == ["Gemm", "MatMul", "MatMul"]


@pytest.mark.parametrize("engine", ["tiny_engine", "tiny_int8_engine"])
def test_an_engine_runs_them_and_keeps_its_logits_bit_for_bit(engine, request, monkeypatch):
    """The tiny fp32 and INT8 engines with FloatLinear (every float linear), the SiluMul forms and
    each residual + RMSNorm in the linear before it (the SkipNorm forms) give the logits of the
    same engines with ONNX Runtime's MatMul, QuickGelu, Mul and SkipSimplifiedLayerNormalization,
    exactly, through a prefill of two prompts and two decode steps."""
    from conftest import logits_over_steps, rewritten_runner

    from autoglm_trt import native
    from autoglm_trt.artifacts import Manifest
    from autoglm_trt.backends import open_runner
    from autoglm_trt.backends.onnxrt import passes

    library, why = native_library()
    if library is None:
        pytest.skip(f"the native operators cannot be built here: {why}")
    if float_kernel(library) == "portable C":
        pytest.skip("this CPU has no fused multiply-add, so the engine keeps ONNX Runtime's nodes")
    manifest = Manifest.read(request.getfixturevalue(engine))
    layers = manifest.spec.num_layers
    rewritten = passes.rewrite(manifest.engine_path, manifest.spec, np.float32, passes.Target.here())
    model, arrays = rewritten.model, rewritten.packed
    counts = passes.decode_nodes(model)
    kind = "FloatLinear" if manifest.precision == "fp32" else "Int8Linear"
    assert counts.get(f"{kind}SiluMul") == layers and "QuickGelu" not in counts
    # each layer's two residual + RMSNorm, but the first layer's first (after the embedding)
    assert counts.get(f"{kind}SkipNorm", 0) + counts.get("FloatLinearSkipNorm", 0) * (kind != "FloatLinear") \
        == 2 * layers - 1 and "SkipSimplifiedLayerNormalization" not in counts
    if manifest.precision == "fp32":
        assert counts.get("FloatLinear", 0) + counts["FloatLinearSkipNorm"] >= 3 * layers
        assert any(name.endswith(".tiles") for name in arrays)
    fused = open_runner(manifest, num_blocks=32, threads=2)
    monkeypatch.setattr(native, "float_kernel", lambda library: "portable C")  # as on a CPU without FMA
    monkeypatch.setattr(linear_epilogues, "fuse_skip_norm", lambda model: 0)
    plain_model = passes.rewrite(manifest.engine_path, manifest.spec, np.float32, passes.Target.here()).model
    plain_counts = passes.decode_nodes(plain_model)
    assert not {"FloatLinear", f"{kind}SiluMul", f"{kind}SkipNorm"} & set(plain_counts)
    assert plain_counts.get("QuickGelu") == layers and plain_counts["SkipSimplifiedLayerNormalization"] == 2 * layers - 1
    plain = rewritten_runner(manifest.dir, threads=2)
    for with_op, without in logits_over_steps([fused, plain]):
        np.testing.assert_array_equal(with_op, without)
    fused.close()
    plain.close()


def test_doctor_says_which_float_kernel_runs(tiny_engine, monkeypatch):
    from conftest import run_cli

    library, why = native_library()
    if library is None:
        pytest.skip(f"the native operators cannot be built here: {why}")
    kernel = float_kernel(library)
    r = run_cli("doctor", str(tiny_engine))
    want = (f"float linears: native FloatLinear operator ({kernel} kernel" if kernel != "portable C"
            else "float linears: ONNX Runtime's MatMul (this CPU has no fused multiply-add)")
    assert r.returncode == 0 and want in r.stdout, r.stdout
    monkeypatch.setenv("AUTOGLM_TRT_NATIVE", "0")
    r = run_cli("doctor", str(tiny_engine))
    assert r.returncode == 0 and "float linears: ONNX Runtime's MatMul\n" in r.stdout
