"""The native Int8WeightLinear operator: what ONNX Runtime makes of a weight-only INT8 linear
(DequantizeLinear in blocks of 32 + MatMul -> 8-bit MatMulNBits) rewritten to it: activations
quantized per row and block of 32 to int16, exact integer dot products with the int8 weights,
then the float scaling in a fixed order, the same bits on every build."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import block_linear_reference, run_rewritten

from autoglm_trt.backends.onnxrt.passes import nbits
from autoglm_trt.quant.int4 import Int4Blocks
from autoglm_trt.quant.int8 import quantize_weight_blocks
from autoglm_trt.quant.plan import WEIGHT_BLOCK


def _optimized(k: int, n: int, op: str, tmp: Path, skip_norm: bool = False):
    """``x [1, rows, k]`` times a blocked INT8 weight (``quantize_weight_blocks`` of random floats),
    as ONNX Runtime's optimizer leaves it (a MatMulNBits); ``op`` "MatMul", "Split" or "SiluMul"
    as in ``test_float_linear``; with ``skip_norm`` a residual + RMSNorm after it. Returns the
    optimized model, the weights' dequantized float64 matrix and the weights as ``Int4Blocks``
    (8-bit, no zero points) for the reference."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from autoglm_trt.backends.onnxrt.session import make_session

    rng = np.random.default_rng(k * n)
    q, scale = quantize_weight_blocks((rng.standard_normal((k, n)) * 0.05).astype(np.float32), WEIGHT_BLOCK)
    nodes = [helper.make_node("DequantizeLinear", ["q", "s", "z"], ["w"], name="dq", axis=0, block_size=WEIGHT_BLOCK),
             helper.make_node("MatMul", ["x", "w"], ["y"], name="m")]
    outputs = ["y"]
    if op in ("Split", "SiluMul"):
        nodes.append(helper.make_node("Split", ["y"], ["y0", "y1"], name="sp", axis=-1, num_outputs=2))
        outputs = ["y0", "y1"]
    if op == "SiluMul":
        nodes += [helper.make_node("QuickGelu", ["y0"], ["a"], name="qg", domain="com.microsoft", alpha=1.0),
                  helper.make_node("Mul", ["a", "y1"], ["out"], name="u")]
        outputs = ["out"]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "R", k])]
    inits = [numpy_helper.from_array(q, "q"), numpy_helper.from_array(scale, "s"),
             numpy_helper.from_array(np.zeros_like(q[: len(scale)]), "z")]
    if skip_norm:
        nodes.append(helper.make_node("SkipSimplifiedLayerNormalization", ["skip", "y", "gamma"],
                                      ["normalized", "", "", "sum"], name="norm", domain="com.microsoft", epsilon=1e-5))
        inputs.append(helper.make_tensor_value_info("skip", TensorProto.FLOAT, [1, "R", n]))
        inits.append(numpy_helper.from_array(np.linspace(0.5, 2.0, n, dtype=np.float32), "gamma"))
        outputs = ["normalized", "sum"]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
                                                   for o in outputs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    make_session(model.SerializeToString(), threads=2, save_optimized=tmp / "opt.onnx")
    optimized = onnx.load(str(tmp / "opt.onnx"))
    assert "MatMulNBits" in [node.op_type for node in optimized.graph.node]
    dequantized = q.astype(np.float64) * np.repeat(scale, WEIGHT_BLOCK, axis=0)[:k]
    return optimized, dequantized, Int4Blocks(q, scale, None, WEIGHT_BLOCK)


def _run(model, library: Path, feeds: dict) -> list[np.ndarray]:
    return run_rewritten(model, library, feeds, "Int8WeightLinear")


@pytest.mark.parametrize("k,n,op", [
    (576, 960, "MatMul"),  # SmolLM2's QKV: 18 blocks of 32 inputs, 60 tiles
    (1536, 576, "MatMul"),  # its down projection
    (576, 3072, "Split"),  # its gate/up projection: Int8WeightLinearSplit
    (576, 3072, "SiluMul"),  # and the activation: Int8WeightLinearSiluMul
    (100, 16, "MatMul"),  # K not a multiple of 32 (the last block has 4 inputs), one tile
    (40, 48, "MatMul"),  # three tiles
])
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 16, 37, 300])
def test_it_computes_the_reference_bit_for_bit(kernel_library, tmp_path, k, n, op, rows):
    """Every row count the kernel splits differently (a decode step, groups of 4 and 8 with rows
    left over, a prefill's work items) gives numpy's float32 arithmetic exactly, on every build;
    and that is the dequantized weights' product to within the activations' 16-bit rounding:
    ONNX Runtime's MatMulNBits at accuracy level 4 (activations to int8) is off by over 50 times
    more."""
    from autoglm_trt.backends.onnxrt.session import make_session

    model, w, qw = _optimized(k, n, op, tmp_path)
    x = np.random.default_rng(rows).standard_normal((1, rows, k)).astype(np.float32)
    if rows > 1:
        x[0, 1, :32] = 0.0  # a block of zeros: scale 0
        if k >= 64:  # a block of 32767s with output 0's signs: as large a sum as its weights allow
            x[0, 1, 32:64] = np.where(qw.q[32:64, 0] < 0, -3.0, 3.0)
    y = block_linear_reference(x[0], qw, 32767)[None]
    if op == "Split":
        want = [y[..., : n // 2], y[..., n // 2:]]
    elif op == "SiluMul":
        gate = y[..., : n // 2].astype(np.float64)
        want = [gate / (1 + np.exp(-gate)) * y[..., n // 2:]]
    else:
        want = [y]
    got = _run(model, kernel_library, {"x": x})
    for a, b in zip(want, got):
        assert b.shape == a.shape and b.dtype == np.float32
        if op == "SiluMul":
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(b, a)
    if rows and op == "MatMul":
        exact = x.astype(np.float64) @ w
        theirs = make_session(model.SerializeToString(), threads=2).run(None, {"x": x})[0]
        assert np.abs(theirs - exact).max() > 50 * np.abs(got[0] - exact).max()


@pytest.mark.parametrize("rows", [0, 1, 37])
def test_the_skip_norm_form_adds_the_residual_and_normalizes(kernel_library, tmp_path, rows):
    """Int8WeightLinearSkipNorm: the linear's sum with the skip, and its RMSNorm (gamma from 0.5 to 2)."""
    k, n = 1536, 576
    model, _, qw = _optimized(k, n, "MatMul", tmp_path, skip_norm=True)
    rng = np.random.default_rng(rows)
    feeds = {"x": rng.standard_normal((1, rows, k)).astype(np.float32),
             "skip": (rng.standard_normal((1, rows, n)) * 4).astype(np.float32)}
    normalized, total = _run(model, kernel_library, feeds)
    assert normalized.shape == total.shape == (1, rows, n)
    want = (feeds["skip"][0] + block_linear_reference(feeds["x"][0], qw, 32767))[None]
    np.testing.assert_array_equal(total, want)
    rms = np.sqrt(np.mean(want.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(normalized, want / rms * np.linspace(0.5, 2.0, n), rtol=0, atol=1e-4)


def test_only_8_bit_blocks_of_32_with_the_default_zero_point_are_taken(tmp_path):
    """A MatMulNBits of other zero points, or of scales that are not float16 values, is left to
    ONNX Runtime; the weights and scales (float16) the operator gets are the graph's own, in its layout."""
    from onnx import numpy_helper

    model, w, _ = _optimized(64, 32, "MatMul", tmp_path)
    node = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    inits = {t.name: t for t in model.graph.initializer}
    got = nbits.int8_blocks(node, inits, numpy_helper.to_array)
    assert got is not None
    q, scales = got
    assert q.shape == (32, 64) and scales.shape == (2, 32) and scales.dtype == np.float16
    np.testing.assert_array_equal(q.T.astype(np.float64) * np.repeat(scales, 32, axis=0), w)
    tiles, by_tile = (nbits.int8_block_tiles(q, scales)[part] for part in nbits.INT8_PARTS)
    assert tiles.shape == (2, 2, 16, 32) and by_tile.shape == (2, 2, 16)
    for k in (0, 1, 31, 32, 63):
        for c in (0, 15, 16, 31):  # input pair p of block b: byte 2 (c % 16) + k % 2 of [c // 16, b, p]
            assert tiles[c // 16, k // 32, k % 32 // 2, 2 * (c % 16) + k % 2] == q[c, k]
            assert by_tile[c // 16, k // 32, c % 16] == scales[k // 32, c]
    scale_init = inits[node.input[2]]
    off_half = numpy_helper.to_array(scale_init).copy()
    off_half.flat[3] = np.nextafter(off_half.flat[3], np.float32(1))  # a float32 scale float16 does not hold
    inits[node.input[2]] = numpy_helper.from_array(off_half, scale_init.name)
    assert nbits.int8_blocks(node, inits, numpy_helper.to_array) is None
    inits[node.input[2]] = scale_init
    if len(node.input) == 4:
        zeros = inits[node.input[3]]
        zeros.CopyFrom(numpy_helper.from_array(np.full(numpy_helper.to_array(zeros).shape, 127, np.uint8), zeros.name))
        assert nbits.int8_blocks(node, inits, numpy_helper.to_array) is None
