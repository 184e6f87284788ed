"""The native Int8Linear operator: its weight packing, its kernels against exact integer
arithmetic (every instruction set this CPU can run), and the rewrite of an INT8 engine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from autoglm_trt.backends.onnxrt.passes.linears import pack_weights, rewrite
from autoglm_trt.native import float_kernel, int8_kernel, int8_pairs_saturate
from autoglm_trt.native import library as native_library


def test_packed_weights_put_each_weight_where_the_kernel_reads_it():
    rng = np.random.default_rng(0)
    w = rng.integers(-128, 128, (7, 19)).astype(np.int8)  # K = 7, N = 19: both padded
    packed, sums = pack_weights(w)
    assert packed.shape == (2, 2, 16, 4) and packed.dtype == np.int8 and packed.flags.c_contiguous
    for k in range(8):
        for n in range(32):
            want = w[k, n] if k < 7 and n < 19 else 0
            assert packed[n // 16, k // 4, n % 16, k % 4] == want, (k, n)
    assert sums.dtype == np.int32 and sums.tolist() == w.astype(np.int32).sum(0).tolist() + [0] * 13
    with pytest.raises(ValueError, match="int8 weights"):
        pack_weights(w.astype(np.int16))


def _linear_session(library, k: int, n: int, b: int, scale: float, zero: int, w: np.ndarray, w_scale: np.ndarray,
                    split: bool = False, gated: bool = False):
    """x -> HadamardQuantize -> q, and x -> Int8Linear -> y, in one session; with ``split`` also
    x -> Int8LinearSplit -> (y0, y1); with ``gated`` also ONNX Runtime's SiLU(y0) * y1 (QuickGelu
    with alpha 1, Mul) -> silu_ref, and x -> Int8LinearSiluMul -> silu."""
    from onnx import TensorProto, helper, numpy_helper

    from autoglm_trt.backends.onnxrt.session import make_session
    from autoglm_trt.quant.hadamard import hadamard

    packed, sums = pack_weights(w)
    inits = [numpy_helper.from_array(np.array(hadamard(b)), "h"), numpy_helper.from_array(np.float32(scale), "s"),
             numpy_helper.from_array(np.uint8(zero), "z"), numpy_helper.from_array(packed, "wp"),
             numpy_helper.from_array(sums, "cs"), numpy_helper.from_array(w_scale, "ws")]
    nodes = [helper.make_node("HadamardQuantize", ["x", "h", "s", "z"], ["q"], domain="autoglm.trt"),
             helper.make_node("Int8Linear", ["x", "h", "s", "z", "wp", "cs", "ws"], ["y"], domain="autoglm.trt")]
    outputs = [helper.make_tensor_value_info("q", TensorProto.UINT8, None),
               helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if split:
        nodes.append(helper.make_node("Int8LinearSplit", ["x", "h", "s", "z", "wp", "cs", "ws"], ["y0", "y1"],
                                      domain="autoglm.trt"))
        outputs += [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("y0", "y1")]
    if gated:
        nodes += [helper.make_node("QuickGelu", ["y0"], ["a"], domain="com.microsoft", alpha=1.0),
                  helper.make_node("Mul", ["a", "y1"], ["silu_ref"]),
                  helper.make_node("Int8LinearSiluMul", ["x", "h", "s", "z", "wp", "cs", "ws"], ["silu"],
                                   domain="autoglm.trt")]
        outputs += [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("silu_ref", "silu")]
    graph = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", k])],
                              outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("autoglm.trt", 1),
                                                    helper.make_opsetid("com.microsoft", 1)])
    return make_session(model.SerializeToString(), threads=2, custom_ops=library)


def rotated_quantized(x: np.ndarray, b: int, scale: float, zero: int) -> np.ndarray:
    """HadamardQuantize in numpy float32, butterfly by butterfly as the C transform does it:
    at stage h each pair (a, c) = (v[j], v[j + h]) becomes (a + c, a - c)."""
    v = x.astype(np.float32).reshape(*x.shape[:-1], x.shape[-1] // b, b)
    h = 1
    while h < b:
        pairs = v.reshape(*v.shape[:-1], b // (2 * h), 2, h)
        a, c = pairs[..., 0, :], pairs[..., 1, :]
        v = np.stack([a + c, a - c], axis=-2).reshape(v.shape)
        h *= 2
    factor = np.float32(1.0) / (np.sqrt(np.float32(b)) * np.float32(scale))
    q = np.rint(v * factor) + np.float32(zero)
    return np.clip(q, 0, 255).astype(np.uint8).reshape(x.shape)


@pytest.mark.parametrize("rows,k,n,b", [
    (1, 576, 960, 64),  # a decode step of SmolLM2's QKV
    (1, 64, 1000, 64),  # 63 tiles (the last partial): on 2 processors, runs of 4, the last of 3
    (1, 64, 592, 16),  # 37 tiles: on 2 processors, runs of 3, the last of one tile
    (8, 576, 40, 64),  # a batch: rows in groups of the kernel's width
    (5, 1536, 576, 128),
    (37, 64, 40, 16),  # enough rows for ONNX Runtime's threads; N not a multiple of 16
    (300, 576, 96, 64),  # a prefill: work items of 128 rows, the last partial
    (3, 12, 7, 4),  # K and N both padded
    (0, 64, 32, 64),  # no rows at all
])
def test_kernel_equals_exact_integer_arithmetic(kernel_library, rows, k, n, b):
    """y = float32(sum_k (q[k] - zero) W[k, n]) * (scale * w_scale[n]) with the quantized input q of
    HadamardQuantize, exactly: the integer sums are exact and the float product is the same one."""
    rng = np.random.default_rng(rows * 1000 + k + n)
    w = rng.integers(-128, 128, (k, n)).astype(np.int8)
    w_scale = rng.uniform(1e-3, 1e-2, n).astype(np.float32)
    scale, zero = 0.03, 128
    x = (rng.standard_normal((1, rows, k)) * rng.uniform(0.1, 4.0, k)).astype(np.float32)  # some saturate
    q, y = _linear_session(kernel_library, k, n, b, scale, zero, w, w_scale).run(None, {"x": x})
    assert y.shape == (1, rows, n) and y.dtype == np.float32
    if rows:
        assert (q == 0).any() and (q == 255).any()
    np.testing.assert_array_equal(q, rotated_quantized(x, b, scale, zero))  # every build's transform: same bits
    acc = (q.astype(np.int64) - zero) @ w.astype(np.int64)
    want = acc.astype(np.float32) * (np.float32(scale) * w_scale)
    np.testing.assert_array_equal(y, want)


def test_inputs_past_which_the_integer_sums_could_overflow_fail_the_run_with_the_reason(kernel_library):
    """255 x 128 x K must stay below 2^31 on every build: K = 65,536 runs exactly, 65,540 is refused."""
    w_scale = np.random.default_rng(7).uniform(1e-3, 1e-2, 16).astype(np.float32)
    for k in (65536, 65540):
        w = np.full((k, 16), -128, np.int8)
        x = np.zeros((1, 1, k), np.float32)
        x[..., ::4] = -100.0  # each block of 4 rotated to four equal values, all quantized to 0 (zero point 128)
        session = _linear_session(kernel_library, k, 16, 4, 0.03, 128, w, w_scale)
        if k > 65536:
            with pytest.raises(Exception, match="Int8Linear: inputs of 65540 features are more than 65536"):
                session.run(None, {"x": x})
            continue
        q, y = session.run(None, {"x": x})
        assert (q == 0).all()
        acc = (q.astype(np.int64) - 128) @ w.astype(np.int64)
        assert (acc == 2**30).all()  # 128 x 128 x 65,536: exact in 32 bits
        np.testing.assert_array_equal(y, acc.astype(np.float32) * (np.float32(0.03) * w_scale))


@pytest.mark.parametrize("rows,n", [(1, 3072), (7, 64), (2, 48)])
def test_the_split_form_gives_the_two_halves_bit_for_bit(kernel_library, rows, n):
    """Int8LinearSplit's outputs are Int8Linear's halves exactly; halves that would cut a tile of
    16 columns (N = 48) fail the run with the reason."""
    rng = np.random.default_rng(rows + n)
    k, b = 576, 64
    w = rng.integers(-128, 128, (k, n)).astype(np.int8)
    x = rng.standard_normal((1, rows, k)).astype(np.float32)
    session = _linear_session(kernel_library, k, n, b, 0.03, 128, w, rng.uniform(1e-3, 1e-2, n).astype(np.float32),
                              split=True)
    if n % 32:
        with pytest.raises(Exception, match="Int8LinearSplit: 48 output columns do not split into two halves"):
            session.run(None, {"x": x})
        return
    _, y, y0, y1 = session.run(None, {"x": x})
    assert y0.shape == y1.shape == (1, rows, n // 2)
    assert y.any()
    np.testing.assert_array_equal(y0, y[..., : n // 2])
    np.testing.assert_array_equal(y1, y[..., n // 2:])


@pytest.mark.parametrize("rows", [1, 6, 37, 300])
def test_the_gated_form_is_silu_times_up_as_onnx_runtime_computes_it(kernel_library, rows):
    """Int8LinearSiluMul's output is ONNX Runtime's QuickGelu(alpha 1) of Int8LinearSplit's first
    half times its second half, bit for bit (outputs large enough to reach the logistic's clamp)."""
    rng = np.random.default_rng(rows)
    k, n, b = 576, 3072, 64
    w = rng.integers(-128, 128, (k, n)).astype(np.int8)
    x = rng.standard_normal((1, rows, k)).astype(np.float32)
    session = _linear_session(kernel_library, k, n, b, 0.03, 128, w, rng.uniform(1e-3, 2e-2, n).astype(np.float32),
                              split=True, gated=True)
    _, _, y0, _, want, got = session.run(None, {"x": x})
    assert got.shape == (1, rows, n // 2) and np.abs(y0).max() > 18
    np.testing.assert_array_equal(got, want)


def skip_norm_inits(rng: np.random.Generator, k: int, n: int, zero: int, b: int = 64) -> list:
    """Initializers of an INT8 linear with random weights (``h``, ``s``, ``z``, ``wp``, ``cs``,
    ``ws``: Int8Linear's inputs 1-6) and an RMSNorm epsilon (``eps``)."""
    from onnx import numpy_helper

    from autoglm_trt.quant.hadamard import hadamard

    packed, sums = pack_weights(rng.integers(-128, 128, (k, n)).astype(np.int8))
    return [numpy_helper.from_array(np.array(hadamard(b)), "h"), numpy_helper.from_array(np.float32(0.03), "s"),
            numpy_helper.from_array(np.uint8(zero), "z"), numpy_helper.from_array(packed, "wp"),
            numpy_helper.from_array(sums, "cs"), numpy_helper.from_array(np.float32(1e-5), "eps"),
            numpy_helper.from_array(rng.uniform(1e-3, 1e-2, n).astype(np.float32), "ws")]


@pytest.mark.parametrize("rows", [0, 1, 5, 37])
def test_the_skip_norm_form_is_onnx_runtimes_residual_and_rmsnorm(kernel_library, rows):
    """Int8LinearSkipNorm's outputs are ONNX Runtime's SkipSimplifiedLayerNormalization of
    Int8Linear's output and the skip: the normalized rows and the sums, bit for bit."""
    from onnx import helper
    from test_float_linear import skip_norm_graph

    from autoglm_trt.backends.onnxrt.session import make_session

    k, n = 576, 576
    rng = np.random.default_rng(rows)
    inits = skip_norm_inits(rng, k, n, zero=128)
    linear = ["x", "h", "s", "z", "wp", "cs", "ws"]
    plain = skip_norm_graph([helper.make_node("Int8Linear", linear, ["y"], domain="autoglm.trt")], k, n, inits)
    fused = skip_norm_graph([helper.make_node("Int8LinearSkipNorm", linear + ["skip", "gamma", "eps"],
                                              ["normalized", "sum"], domain="autoglm.trt")], k, n, inits)
    del fused.graph.node[1]  # the norm: the fused node computes it
    feeds = {"x": rng.standard_normal((1, rows, k)).astype(np.float32),
             "skip": (rng.standard_normal((1, rows, n)) * 4).astype(np.float32)}
    want = make_session(plain.SerializeToString(), threads=2, custom_ops=kernel_library).run(None, feeds)
    got = make_session(fused.SerializeToString(), threads=2, custom_ops=kernel_library).run(None, feeds)
    for a, g in zip(want, got):
        assert g.shape == (1, rows, n)
        np.testing.assert_array_equal(g, a)


def test_the_engine_rewrite_fuses_every_int8_linear(tiny_int8_engine):
    import onnx

    from autoglm_trt.artifacts import Manifest
    from autoglm_trt.backends.onnxrt.passes.hadamard_quantize import hadamard_quantize

    if native_library()[0] is None:
        pytest.skip(f"the native operators cannot be built here: {native_library()[1]}")
    manifest = Manifest.read(tiny_int8_engine)
    model = onnx.load(str(manifest.engine_path), load_external_data=False)
    hadamard_quantize(model)
    linears = sum(n.op_type == "MatMulIntegerToFloat" for n in model.graph.node)
    weights = {n.input[1] for n in model.graph.node if n.op_type == "MatMulIntegerToFloat"}
    assert linears >= 4 * manifest.spec.num_layers
    splits = sum(n.op_type == "Split" for n in model.graph.node)
    arrays = rewrite(model, manifest.dir)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Int8Linear") + ops.count("Int8LinearSplit") == linears
    assert "MatMulIntegerToFloat" not in ops and "HadamardQuantize" not in ops
    # each layer's gate/up projection takes its Split along
    assert ops.count("Int8LinearSplit") == manifest.spec.num_layers == splits - ops.count("Split")
    inits = {t.name: t for t in model.graph.initializer}
    assert not weights & set(inits), "the unpacked weights must leave the graph"
    assert len(arrays) == 2 * len(weights)
    for name, arr in arrays.items():  # declared as external data of the arrays' type and shape
        assert list(inits[name].dims) == list(arr.shape) and inits[name].data_location == onnx.TensorProto.EXTERNAL


@pytest.mark.skipif(int8_pairs_saturate(), reason="ONNX Runtime's INT8 GEMM saturates 16-bit pair sums on this CPU "
                    "(x86 without VNNI): the graph without the native operator is no reference here")
def test_the_engine_with_int8_linear_keeps_the_logits_of_onnx_runtimes_int8_gemm(tiny_int8_engine, monkeypatch):
    from conftest import logits_over_steps, rewritten_runner

    from autoglm_trt.artifacts import Manifest
    from autoglm_trt.backends import open_runner
    from autoglm_trt.backends.onnxrt.passes import linears as linear_op

    if native_library()[0] is None:
        pytest.skip(f"the native operators cannot be built here: {native_library()[1]}")
    manifest = Manifest.read(tiny_int8_engine)
    monkeypatch.setenv("AUTOGLM_TRT_NATIVE", "1")
    fused = open_runner(manifest, num_blocks=32, threads=1)
    monkeypatch.setattr(linear_op, "rewrite", lambda model, weights_dir, pack=True, fma=False, dynamic_int8=False: {})
    plain = rewritten_runner(manifest.dir)
    for with_op, without in logits_over_steps([fused, plain]):  # a prefill of two prompts, then two decode steps
        np.testing.assert_allclose(with_op, without, atol=1e-3 * np.abs(without).max(), rtol=0)
    fused.close()
    plain.close()


def test_a_linear_with_weight_zero_points_is_left_alone():
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(np.ones((64, 64), np.float32), "h"),
             numpy_helper.from_array(np.float32(0.1), "s"), numpy_helper.from_array(np.uint8(128), "z"),
             numpy_helper.from_array(rng.integers(-128, 128, (64, 32)).astype(np.int8), "w"),
             numpy_helper.from_array(np.full(32, 0.01, np.float32), "ws"),
             numpy_helper.from_array(np.full(32, 3, np.int8), "wz")]  # not zero: not what the kernel computes
    nodes = [helper.make_node("HadamardQuantize", ["x", "h", "s", "z"], ["q"], domain="autoglm.trt"),
             helper.make_node("MatMulIntegerToFloat", ["q", "w", "s", "ws", "z", "wz"], ["y"], domain="com.microsoft")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph)
    assert rewrite(model, Path(".")) == {} and [n.op_type for n in model.graph.node] == ["HadamardQuantize",
                                                                                           "MatMulIntegerToFloat"]


def test_doctor_says_which_int8_kernel_runs(tiny_int8_engine, monkeypatch):
    from conftest import run_cli

    library, why = native_library()
    if library is None:
        pytest.skip(f"the native operators cannot be built here: {why}")
    from autoglm_trt.native import int8_amx

    r = run_cli("doctor", str(tiny_int8_engine))
    amx = "; AMX for 16 rows and more" if int8_amx(library) else ""
    assert r.returncode == 0 and f"INT8 linears: native Int8Linear operator ({int8_kernel(library)} kernel{amx})" in r.stdout
    monkeypatch.setenv("AUTOGLM_TRT_AMX", "0")
    r = run_cli("doctor", str(tiny_int8_engine))
    assert r.returncode == 0 and f"INT8 linears: native Int8Linear operator ({int8_kernel(library)} kernel)" in r.stdout
    monkeypatch.setenv("AUTOGLM_TRT_NATIVE", "0")
    r = run_cli("doctor", str(tiny_int8_engine))
    assert r.returncode == 0 and "INT8 linears: ONNX Runtime's MatMulIntegerToFloat" in r.stdout
    assert ("this CPU has no VNNI" in r.stdout) == int8_pairs_saturate()


@pytest.mark.parametrize(("flags", "saturates"), [({"avx2"}, True), ({"avx2", "avx512_vnni"}, False),
                                                  ({"avx2", "avx_vnni"}, False), ({"asimd"}, False), (set(), False)])
def test_onnx_runtime_int8_saturates_on_x86_without_vnni(flags, saturates):
    assert int8_pairs_saturate(flags) is saturates


def test_inspect_prints_the_decode_step_as_onnx_runtime_runs_it(tiny_int8_engine, monkeypatch):
    import json

    from conftest import run_cli

    from autoglm_trt.artifacts import Manifest

    if native_library()[0] is None:
        pytest.skip(f"the native operators cannot be built here: {native_library()[1]}")
    layers = Manifest.read(tiny_int8_engine).spec.num_layers
    r = run_cli("inspect", str(tiny_int8_engine), "--json")
    assert r.returncode == 0, r.stderr
    decode = json.loads(r.stdout)["decode_graph"]
    ops = decode["nodes_by_op"]
    # the gate/up projection with its Split; where the library has FMA its SiLU * up too, and
    # o_proj and down with the residual + RMSNorm after them (SkipNorm)
    fma = float_kernel(native_library()[0]) != "portable C"
    assert ops["PagedAttention"] == ops["RopeQKV"] == ops["Int8LinearSiluMul" if fma else "Int8LinearSplit"] == layers
    assert ops["Int8Linear"] + ops.get("Int8LinearSkipNorm", 0) + ops.get("FloatLinearSkipNorm", 0) >= 3 * layers
    assert "MatMulIntegerToFloat" not in ops and ("SkipSimplifiedLayerNormalization" in ops) != fma
    assert decode["nodes"] == sum(ops.values()) < decode["saved_nodes"]
    text = run_cli("inspect", str(tiny_int8_engine)).stdout
    assert f"decode step  {decode['nodes']} nodes as ONNX Runtime runs them here" in text
    monkeypatch.setenv("AUTOGLM_TRT_NATIVE", "0")
    plain = json.loads(run_cli("inspect", str(tiny_int8_engine), "--json").stdout)["decode_graph"]
    assert "Int8Linear" not in plain["nodes_by_op"] and plain["nodes"] > decode["nodes"]


def test_batches_without_amx_are_exact_too(library):
    """Where Int8Linear runs its batches on Intel AMX (the tests above then check that path), the
    AVX-512 VNNI path other machines take is checked again: ``AUTOGLM_TRT_AMX=0`` turns AMX off,
    and the exactness tests pass in a process with it set."""
    import os
    import subprocess
    import sys

    from autoglm_trt.native import int8_amx

    if not int8_amx(library):
        pytest.skip("Int8Linear runs no AMX here (no AMX, or Linux does not grant it): the tests above ran its other path")
    env = {**os.environ, "AUTOGLM_TRT_AMX": "0"}
    off = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from autoglm_trt.native import "
                          "int8_amx; print(int8_amx(Path(sys.argv[1])))", str(library)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert off.returncode == 0 and off.stdout.strip() == "False", off.stderr[-2000:]
    tests = "(exact_integer or gated_form) and not avx2 and not portable"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", tests],
                       capture_output=True, text=True, env=env, cwd=Path(__file__).parents[2], timeout=600)
    assert r.returncode == 0 and " passed" in r.stdout and "skipped" not in r.stdout.splitlines()[-1], r.stdout[-2000:]
