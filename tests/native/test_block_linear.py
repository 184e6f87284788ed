"""The native Int4WeightLinear and Int8BlockLinear operators: what ONNX Runtime makes of an INT4
linear (uint4 DequantizeLinear in blocks of 32 with zero points + MatMul -> 4-bit MatMulNBits at
accuracy level 4) rewritten to the first, and 8-bit blocked weights in the second: activations
quantized per row and block of 32 to int8, exact integer dot products, then the float scaling in
a fixed order, the same bits on every build."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import block_linear_reference as reference
from conftest import run_rewritten

from autoglm_trt.backends.onnxrt.passes import nbits
from autoglm_trt.quant.int4 import Int4Blocks, quantize_int4_blocks

F32 = np.float32


def _optimized(k: int, n: int, op: str, tmp: Path, skip_norm: bool = False) -> tuple[onnx.ModelProto, Int4Blocks]:
    """``x [1, rows, k]`` times an INT4 weight of random floats (zero points, blocks of 32) as ONNX
    Runtime's optimizer leaves it (a 4-bit MatMulNBits); ``op`` "MatMul", "Split" (into halves) or
    "SiluMul" (SiLU(first half) * second); ``skip_norm``: a residual + RMSNorm after it."""
    from onnx import TensorProto

    from autoglm_trt.backends.onnxrt.session import make_session
    from autoglm_trt.graph.builder import GraphBuilder
    from autoglm_trt.graph.qdq import int4_weight_dq

    qw = quantize_int4_blocks((np.random.default_rng(k * n).standard_normal((k, n)) * 0.05).astype(F32), 32, False)
    g = GraphBuilder(tmp / "m.onnx.data")
    g.input("x", TensorProto.FLOAT, [1, "R", k])
    y = g.op("MatMul", ["x", int4_weight_dq(g, "lin", qw)])
    outputs = [y]
    if op in ("Split", "SiluMul"):
        outputs = g.op_n("Split", [y], "split", 2, axis=-1, num_outputs=2)
    if op == "SiluMul":
        act = g.op("QuickGelu", [outputs[0]], "act", domain="com.microsoft", alpha=1.0)
        outputs = [g.op("Mul", [act, outputs[1]], "out")]
    if skip_norm:
        g.input("skip", TensorProto.FLOAT, [1, "R", n])
        outputs = [o for i, o in enumerate(g.op_n("SkipSimplifiedLayerNormalization",
                                                  ["skip", y, g.weight("gamma", np.linspace(0.5, 2.0, n, dtype=F32))],
                                                  "norm", 4, domain="com.microsoft", epsilon=1e-5)) if i in (0, 3)]
    for i, name in enumerate(outputs):
        g.output(g.rename_output(name, f"y{i}"), TensorProto.FLOAT, [1, "R", f"N{i}"])
    model = g.model("int4", 21)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.add(domain="com.microsoft", version=1)
    onnx.save_model(model, str(tmp / "m.onnx"))
    g.close()
    make_session(tmp / "m.onnx", threads=2, save_optimized=tmp / "opt.onnx")
    optimized = onnx.load(str(tmp / "opt.onnx"))
    assert "MatMulNBits" in [node.op_type for node in optimized.graph.node]
    return optimized, qw


def _run(model, library: Path, feeds: dict) -> list[np.ndarray]:
    return run_rewritten(model, library, feeds, "Int4WeightLinear")


@pytest.mark.parametrize("k,n,op", [
    (576, 960, "MatMul"),  # SmolLM2's QKV: 18 blocks, 60 tiles
    (1536, 576, "MatMul"),  # its down projection
    (576, 3072, "Split"),  # its gate/up projection: Int4WeightLinearSplit
    (576, 3072, "SiluMul"),  # and the activation: Int4WeightLinearSiluMul
    (80, 48, "MatMul"),  # K not a multiple of 32 (the last block has 16 inputs), three tiles
])
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 16, 37, 300])
def test_it_computes_the_reference_bit_for_bit(kernel_library, tmp_path, k, n, op, rows):
    """Every row count the kernel splits differently (a decode step, groups of 4 with rows left
    over, a prefill's chunks) gives numpy's float32 arithmetic exactly, on every build; ONNX
    Runtime's own MatMulNBits (the same quantization, its own order of sums) is close."""
    from autoglm_trt.backends.onnxrt.session import make_session

    model, qw = _optimized(k, n, op, tmp_path)
    x = np.random.default_rng(rows).standard_normal((1, rows, k)).astype(F32)
    if rows > 1:
        x[0, 1, :32] = 0.0  # a block of zeros: scale 0
    y = reference(x[0], qw)[None]
    got = _run(model, kernel_library, {"x": x})
    if op == "SiluMul":
        gate = y[..., : n // 2].astype(np.float64)
        want = gate / (1 + np.exp(-gate)) * y[..., n // 2:]
        assert got[0].shape == want.shape
        np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-6)
        return
    want = [y[..., : n // 2], y[..., n // 2:]] if op == "Split" else [y]
    for a, b in zip(want, got):
        assert b.shape == a.shape and b.dtype == np.float32
        np.testing.assert_array_equal(b, a)
    if rows and op == "MatMul":
        theirs = make_session(model.SerializeToString(), threads=2).run(None, {"x": x})[0]
        float_product = x[0].astype(np.float64) @ qw.dequantized()
        assert np.abs(theirs - y).max() <= 0.25 * np.abs(theirs - float_product).max() + 1e-6


@pytest.mark.parametrize("rows", [0, 1, 37])
def test_the_skip_norm_form_adds_the_residual_and_normalizes(kernel_library, tmp_path, rows):
    k, n = 1536, 576
    model, qw = _optimized(k, n, "MatMul", tmp_path, skip_norm=True)
    rng = np.random.default_rng(rows)
    feeds = {"x": rng.standard_normal((1, rows, k)).astype(F32),
             "skip": (rng.standard_normal((1, rows, n)) * 4).astype(F32)}
    normalized, total = _run(model, kernel_library, feeds)
    assert normalized.shape == total.shape == (1, rows, n)
    want = (feeds["skip"][0] + reference(feeds["x"][0], qw))[None]
    np.testing.assert_array_equal(total, want)
    rms = np.sqrt(np.mean(want.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(normalized, want / rms * np.linspace(0.5, 2.0, n), rtol=0, atol=1e-4)


def test_only_4_bit_blocks_of_32_at_accuracy_level_4_are_taken(tmp_path):
    """The operator's tiles, scales (float16) and zero points (two to a byte) are the graph's, in
    its layout; a node that computes its activations in float (another accuracy level) or whose
    scales are not float16 values is left to ONNX Runtime."""
    from onnx import helper, numpy_helper

    model, qw = _optimized(80, 48, "MatMul", tmp_path)
    node = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    inits = {t.name: t for t in model.graph.initializer}
    parts = nbits.int4_blocks(node, inits, numpy_helper.to_array)
    assert parts is not None
    tiles, scales, zeros = (parts[p] for p in nbits.INT4_PARTS)
    assert tiles.shape == (3, 3, 8, 32) and scales.shape == (3, 3, 16) and zeros.shape == (3, 3, 8)
    assert scales.dtype == np.float16 and zeros.dtype == np.uint8
    for c in (0, 17, 47):
        for k in (0, 1, 2, 3, 4, 7, 8, 15, 16, 31, 64, 79):  # input i = k % 32: vector i // 8, high nibble if i % 8 >= 4
            i = k % 32
            byte = tiles[c // 16, k // 32].reshape(-1)[64 * (i // 8) + 4 * (c % 16) + i % 4]
            assert (byte >> 4 if i % 8 >= 4 else byte & 0x0F) == qw.q[k, c]
        np.testing.assert_array_equal(scales[c // 16, :, c % 16].astype(F32), qw.scale[:, c])
        np.testing.assert_array_equal(zeros[c // 16, :, c % 16 // 2] >> 4 * (c % 2) & 0x0F, qw.zero[:, c])
    scale_init = inits[node.input[2]]
    off_half = numpy_helper.to_array(scale_init).copy()
    off_half.flat[5] = np.nextafter(off_half.flat[5], F32(1))  # a float32 scale float16 does not hold
    inits[node.input[2]] = numpy_helper.from_array(off_half, scale_init.name)
    assert nbits.int4_blocks(node, inits, numpy_helper.to_array) is None
    inits[node.input[2]] = scale_init
    assert nbits.int4_blocks(node, inits, numpy_helper.to_array) is not None
    for a in node.attribute:
        if a.name == "accuracy_level":
            a.CopyFrom(helper.make_attribute("accuracy_level", 0))
    assert nbits.int4_blocks(node, inits, numpy_helper.to_array) is None


def test_the_tiles_hold_every_weight_where_the_operators_read_it():
    """Every nibble of a 4-bit ``MatMulNBits``' weights, and every byte of 8-bit blocked weights (zeros
    past K), at the place the operators' docstrings give, element by element."""
    rng = np.random.default_rng(3)
    b = rng.integers(0, 256, (32, 3, 16), dtype=np.uint8)  # [N, KB, 16]: inputs 2j (low) and 2j + 1 of byte j
    tiles = nbits.int4_tiles(b)
    assert tiles.shape == (2, 3, 8, 32) and tiles.dtype == np.uint8
    for c in range(32):
        for blk in range(3):
            for i in range(32):
                byte = tiles[c // 16, blk].reshape(-1)[64 * (i // 8) + 4 * (c % 16) + i % 4]
                assert (byte >> 4 if i % 8 >= 4 else byte & 0x0F) == b[c, blk, i // 2] >> 4 * (i % 2) & 0x0F
    q = rng.integers(-127, 128, (32, 70), dtype=np.int8)  # [N, K]: K = 70, three blocks, the last short
    parts = nbits.int8_block_tiles(q, rng.random((3, 32)).astype(np.float16))
    tiles8 = parts["tiles8"]
    assert tiles8.shape == (2, 3, 16, 32) and tiles8.dtype == np.int8
    for c in range(32):
        for k in range(96):
            want = q[c, k] if k < 70 else 0
            assert tiles8[c // 16, k // 32, k % 32 // 2, 2 * (c % 16) + k % 2] == want


@pytest.mark.parametrize("k,n,split", [(576, 960, False), (576, 49152, False), (80, 48, False), (576, 3072, True)])
@pytest.mark.parametrize("rows", [0, 1, 5, 37, 300])
def test_int8_block_linear_computes_the_reference_bit_for_bit(kernel_library, k, n, split, rows):
    """8-bit blocked weights (as ``int8-wo`` writes them; ``nbits.int8_block_tiles`` lays them out)
    with activations quantized per block: numpy's float32 arithmetic exactly, on every build; an
    int4-awq engine's LM head (576 x 49152 on SmolLM2) among the shapes."""
    from onnx import TensorProto, helper, numpy_helper

    from autoglm_trt.backends.onnxrt.session import make_session
    from autoglm_trt.quant.int8 import quantize_weight_blocks
    from autoglm_trt.quant.plan import WEIGHT_BLOCK

    if rows == 300 and n > 10000:
        rows = 3  # enough for the row groups; 300 rows of the head is slow on the portable build
    q, scale = quantize_weight_blocks((np.random.default_rng(k + n).standard_normal((k, n)) * 0.05).astype(F32),
                                      WEIGHT_BLOCK)
    parts = nbits.int8_block_tiles(np.ascontiguousarray(q.T), scale)
    outputs = ["y0", "y1"] if split else ["y0"]
    node = helper.make_node("Int8BlockLinearSplit" if split else "Int8BlockLinear", ["x", *nbits.INT8_PARTS],
                            outputs, domain="autoglm.trt")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["R", k])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
                              [numpy_helper.from_array(a, name) for name, a in parts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("autoglm.trt", 1)])
    x = np.random.default_rng(rows).standard_normal((rows, k)).astype(F32)
    got = make_session(model.SerializeToString(), threads=2, custom_ops=kernel_library).run(None, {"x": x})
    y = reference(x, Int4Blocks(q, scale, None, 32))
    for a, b in zip([y[:, : n // 2], y[:, n // 2:]] if split else [y], got):
        assert b.shape == a.shape
        np.testing.assert_array_equal(b, a)


# float16 subnormals (its smallest, and its largest), its smallest normal, ordinary and large scales
HALF_SCALES = np.array([2.0 ** -24, 1023 * 2.0 ** -24, 2.0 ** -14, 0.0078125, 0.3330078125, 1000.0], F32)


def _int4_parts(q: np.ndarray, zero: np.ndarray, scale: np.ndarray) -> dict[str, np.ndarray]:
    """``Int4WeightLinear``'s inputs, through ``nbits.int4_blocks``, for levels ``q [K, N]`` (K a
    multiple of 32), zero points and scales ``[K / 32, N]``, written as a 4-bit ``MatMulNBits``
    holds them (two inputs, and two blocks' zero points, to a byte, the first low)."""
    from onnx import helper, numpy_helper

    (k, n), kb = q.shape, q.shape[0] // 32
    pairs = q.T.astype(np.uint8).reshape(n, kb, 16, 2)
    zeros = np.zeros((n, 2 * -(-kb // 2)), np.uint8)
    zeros[:, :kb] = zero.T
    inits = {name: numpy_helper.from_array(a, name) for name, a in (
        ("b", pairs[..., 0] | pairs[..., 1] << 4), ("s", np.ascontiguousarray(scale.T).reshape(-1)),
        ("z", zeros[:, 0::2] | zeros[:, 1::2] << 4))}
    node = helper.make_node("MatMulNBits", ["x", "b", "s", "z"], ["y"], domain="com.microsoft", K=k, N=n, bits=4,
                            block_size=32, accuracy_level=4)
    parts = nbits.int4_blocks(node, inits, numpy_helper.to_array)
    assert parts is not None
    return {f"w.{p}": a for p, a in parts.items()}


@pytest.mark.parametrize("op", ["Int4WeightLinear", "Int8BlockLinear", "Int8WeightLinear"])
def test_float16_scales_of_every_size_are_read_exactly(kernel_library, op):
    """Subnormal, smallest normal, ordinary and large float16 scales (and zero points of both
    nibbles): each build's conversion to float32 (vcvtph2ps, or the portable code) gives numpy's
    arithmetic bit for bit."""
    from onnx import TensorProto, helper, numpy_helper

    from autoglm_trt.backends.onnxrt.session import make_session

    k, n, rows = 96, 48, 5
    rng = np.random.default_rng(len(op))
    scale = rng.choice(HALF_SCALES, (k // 32, n)).astype(F32)
    if op == "Int4WeightLinear":
        q, zero = rng.integers(0, 16, (k, n)).astype(np.int8), rng.integers(0, 16, (k // 32, n)).astype(np.uint8)
        parts = _int4_parts(q, zero, scale)
    else:
        q, zero = rng.integers(-127, 128, (k, n)).astype(np.int8), None
        parts = nbits.int8_block_tiles(np.ascontiguousarray(q.T), scale)
    node = helper.make_node(op, ["x", *parts], ["y"], domain="autoglm.trt")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["R", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(a, name) for name, a in parts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("autoglm.trt", 1)])
    x = rng.standard_normal((rows, k)).astype(F32)
    got = make_session(model.SerializeToString(), threads=2, custom_ops=kernel_library).run(None, {"x": x})[0]
    want = reference(x, Int4Blocks(q, scale, zero, 32), 32767 if op == "Int8WeightLinear" else 127)
    np.testing.assert_array_equal(got, want)
