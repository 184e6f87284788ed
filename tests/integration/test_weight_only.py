"""``build --precision int8-wo``: INT8 weights in blocks of 32, activations in float (16-bit blocks in
the native operator), no calibration."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from conftest import build_tiny_engine

from autoglm_trt.quant.int8 import quantize_weight_blocks
from autoglm_trt.quant.plan import WEIGHT_BLOCK


def test_blocks_take_the_scale_of_least_error_per_32_inputs_of_each_column():
    from autoglm_trt.quant.int4 import half_scales
    from autoglm_trt.quant.int8 import CLIPS

    rng = np.random.default_rng(3)
    w = np.zeros((70, 3), np.float32)  # three blocks: 32, 32 and 6 inputs
    w[:, 0] = rng.standard_normal(70) * 0.05
    w[32:64, 0] = 0.0  # an all-zero block keeps scale 1 and quantizes to zeros
    w[:, 1] = np.arange(-35, 35) * np.float32(0.01)  # on a grid whose max is 127 steps in no block
    w[:, 2] = 2.0
    q, scale = quantize_weight_blocks(w, WEIGHT_BLOCK)
    assert q.dtype == np.int8 and q.shape == (70, 3) and scale.shape == (3, 3) and scale.dtype == np.float32
    assert scale[1, 0] == 1.0 and not q[32:64, 0].any()
    np.testing.assert_array_equal(scale[:, 2], half_scales(np.float32([2.0 / 127] * 3)))  # any clip < 1 adds error
    np.testing.assert_array_equal(q[:, 2], 127)
    for b, (lo, hi) in enumerate(((0, 32), (32, 64), (64, 70))):
        for c in range(2):
            x = w[lo:hi, c]
            amax = np.abs(x).max()
            if amax == 0:
                continue
            steps = {clip: half_scales(np.float32(clip) * amax / np.float32(127)) for clip in CLIPS}
            errors = {clip: float(np.sum((np.clip(np.rint(x / s), -127, 127) * s - x) ** 2)) for clip, s in steps.items()}
            best = min(errors.values())
            assert scale[b, c] in steps.values()
            got = float(np.sum((q[lo:hi, c] * scale[b, c] - x) ** 2))
            assert got <= best * (1 + 1e-5), (b, c, got, errors)


def test_tensorrts_channels_take_a_float16_scale_of_their_largest_weight():
    """``int8_channels`` (TensorRT's form): one scale per output, max |w| / 127 rounded to a float16
    value before the weights are rounded with it, so the float16 graph's scale is the one used."""
    from autoglm_trt.quant.int8 import quantize_weight_per_channel

    w = np.array([[0.5, 0.0, -3.0], [-1.0, 0.0, 1e-3], [0.25, 0.0, 2.0]], np.float32)
    q, scale = quantize_weight_per_channel(w, half_values=True)
    assert q.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (3,)
    assert scale.tolist() == [float(np.float16(1.0 / 127)), 1.0, float(np.float16(3.0 / 127))]
    assert scale.astype(np.float16).astype(np.float32).tolist() == scale.tolist()
    # np.float16(1/127) lies just below 1/127: the largest weight's level, 127.008, rounds to 127
    assert q[:, 0].tolist() == [64, -127, 32] and not q[:, 1].any() and q[:, 2].tolist() == [-127, 0, 85]


@pytest.fixture(scope="module")
def wo_engines(tiny_dir, tmp_path_factory):
    """The tiny GLM (QKV with a bias) as fp32 and int8-wo engines, from one build cache."""
    root = tmp_path_factory.mktemp("wo")
    return (build_tiny_engine(tiny_dir, root / "fp32", "glm"),
            build_tiny_engine(tiny_dir, root / "int8-wo", "glm", precision="int8-wo"))


def test_the_engine_computes_what_its_graph_says(wo_engines):
    """The engine (its native graph where this machine runs one: Int8WeightLinear over every
    linear, its activations rounded to 16 bits per block; the token embedding INT8 rows, no float
    table) gives the logits of its weight-only
    graph run by ONNX Runtime with no optimization, where DequantizeLinear and MatMul run as
    written in float32: within 1e-4 of the largest, far closer than either is to the fp32
    engine; and doctor names the operator."""
    from autoglm_trt.artifacts import Manifest
    from autoglm_trt.backends.onnxrt.offline import GraphRunner, prefill_feeds
    from autoglm_trt.backends.onnxrt.session import make_session, run
    from autoglm_trt.evaluate.perplexity import model_logits

    fp32, wo = wo_engines
    manifest = Manifest.read(wo)
    assert manifest.precision == "int8-wo"
    source = manifest.data["source"]["model_dir"]
    record = json.loads((wo / "export.json").read_text())
    assert record["graph"]["precision"] == "int8-wo" and record["weight_only"]["linears"] > 0
    assert record["weight_only"]["int8_embedding"] and "token embedding int8" in record["weight_only"]["weights"]
    model = onnx.load(f"{source}/model.int8wo.onnx", load_external_data=False)
    inits = {t.name: t.data_type for t in model.graph.initializer}
    assert "embed_tokens.weight" not in inits and inits["embed_tokens.weight_i8"] == onnx.TensorProto.INT8
    from autoglm_trt.backends.onnxrt.passes.common import all_nodes

    graph = onnx.load(str(wo / "model.opt.onnx"), load_external_data=False)
    assert "MatMulNBits" in {n.op_type for n in graph.graph.node}
    if manifest.ort_graphs.native_graph:
        native = onnx.load(str(wo / manifest.ort_graphs.native_graph), load_external_data=False)
        ops = {n.op_type for n in all_nodes(native.graph)}
        assert any(op.startswith("Int8WeightLinear") for op in ops), ops
    windows = np.random.default_rng(0).integers(3, manifest.spec.vocab_size, (2, 24))
    runner = GraphRunner(source)
    runner.session = make_session(runner.record.graph_file, optimize=False)
    want = run(runner.session, prefill_feeds(runner.spec, windows, runner.kv_dtype, all_logits=True))["logits"]
    got = model_logits(wo)(windows)
    ref = model_logits(fp32)(windows)
    err, quant_err = np.abs(got - want).max(), np.abs(ref - want).max()
    assert err < 1e-4 * np.abs(want).max(), (err, np.abs(want).max())
    assert quant_err > 20 * err
    if manifest.ort_graphs.native_graph:
        from conftest import run_cli

        doctor = run_cli("doctor", str(wo))
        assert "INT8 weights: native Int8WeightLinear operator" in doctor.stdout, doctor.stdout


def test_a_second_build_reuses_the_weights_and_an_int8_kv_cache_builds(tiny_dir, wo_engines):
    """The weight-only stage is reused from the cache, and an INT8 KV cache measures its ranges on
    the float export (a weight-only model has no calibration)."""
    from conftest import run_cli

    _, wo = wo_engines
    out = wo.parent / "int8-wo-kv8"
    done = run_cli("build", str(tiny_dir("glm")), "--precision", "int8-wo", "--backend", "onnxruntime",
                   "--kv-cache-dtype", "int8", "--max-seq-len", "96", "--max-input-len", "48", "--kv-num-blocks", "64",
                   "--kv-block-size", "8", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "reusing the weight-only INT8 model" in done.stderr and "measuring K/V ranges" in done.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["precision"] == "int8-wo" and manifest["kv_cache"]["dtype"] == "int8"
    gen = run_cli("generate", str(out), "hello", "--max-new-tokens", "4")
    assert gen.returncode == 0, gen.stderr


def test_int8_dyn_runs_the_same_weights_with_activations_quantized_per_block(tiny_dir, wo_engines):
    """``int8-dyn``: int8-wo's weights (its cached model reused), every linear an Int8BlockLinear
    in the native graph, whose activations are quantized per block as the plain graph's
    MatMulNBits does: the two graphs agree closely, and both differ from int8-wo's (16-bit)
    activations by more than from each other; TensorRT is refused with what to build instead."""
    from conftest import run_cli

    from autoglm_trt.backends.onnxrt.passes.common import all_nodes
    from autoglm_trt.builder.pipeline import BuildRequest, build_engine
    from autoglm_trt.errors import AutoGLMError
    from autoglm_trt.evaluate.perplexity import model_logits

    _, wo = wo_engines
    dyn = build_tiny_engine(tiny_dir, wo.parent / "int8-dyn", "glm", precision="int8-dyn")
    manifest = json.loads((dyn / "manifest.json").read_text())
    assert manifest["precision"] == "int8-dyn"
    ops = {n.op_type for n in all_nodes(onnx.load(str(dyn / "model.native.onnx"), load_external_data=False).graph)}
    assert any(op.startswith("Int8BlockLinear") for op in ops) and not any(op.startswith("Int8WeightLinear")
                                                                           for op in ops), ops
    windows = np.random.default_rng(2).integers(3, 200, (2, 24))
    native, float_acts = model_logits(dyn)(windows), model_logits(wo)(windows)
    import os

    os.environ["AUTOGLM_TRT_NATIVE"] = "0"
    try:
        plain = model_logits(dyn)(windows)
    finally:
        del os.environ["AUTOGLM_TRT_NATIVE"]
    assert np.abs(native - plain).max() < 0.5 * np.abs(native - float_acts).max()
    doctor = run_cli("doctor", str(dyn))
    assert "INT8 weights and activations: native Int8BlockLinear operator" in doctor.stdout, doctor.stdout
    with pytest.raises(AutoGLMError, match="int8-dyn .* ONNX Runtime's engine only"):
        build_engine(BuildRequest(tiny_dir("glm"), wo.parent / "int8-dyn-trt", precision="int8-dyn",
                                  backend="tensorrt"), log=lambda m: None)


def test_a_bfloat16_checkpoints_float16_export_makes_the_same_int8_weights_as_its_float32_export(tiny_dir, tmp_path):
    """A bfloat16 checkpoint's values are float16 values (here: none below float16's normal range), so
    int8-wo from its float16 export — half the disk of float32's, what a 9B needs on a small disk —
    writes the weight-only graph of its float32 export byte for byte; other precisions still refuse
    a float16 export."""
    from conftest import run_cli
    from tiny_models import bfloat16_copy

    from autoglm_trt.builder.weight_only import GRAPH, weight_only_export
    from autoglm_trt.export.pipeline import ExportConfig, export_checkpoint

    ckpt = bfloat16_copy(tiny_dir("glm"), tmp_path / "bf16")
    made = {}
    for dtype in ("float32", "float16"):
        export_checkpoint(ExportConfig(ckpt, tmp_path / f"export-{dtype}", dtype=dtype, validate=False),
                          log=lambda m: None)
        made[dtype] = weight_only_export(tmp_path / f"export-{dtype}", tmp_path / f"wo-{dtype}", log=lambda m: None)
    assert (made["float16"] / f"{GRAPH}.data").read_bytes() == (made["float32"] / f"{GRAPH}.data").read_bytes()
    assert (made["float16"] / GRAPH).read_bytes() == (made["float32"] / GRAPH).read_bytes()
    assert (tmp_path / "export-float16" / "model.onnx.data").stat().st_size < \
        0.6 * (tmp_path / "export-float32" / "model.onnx.data").stat().st_size
    r = run_cli("build", str(tmp_path / "export-float16"), "--precision", "fp32", "-o", str(tmp_path / "e"))
    assert r.returncode != 0 and "is a float16 export; precision fp32 needs a float32 export" in r.stderr
