"""``build --precision int8-wo``: INT8 weights in blocks of 32, float activations, no calibration."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from conftest import build_tiny_engine

from autoglm_trt.graph.quant import WEIGHT_BLOCK, quantize_weight_blocks


def test_blocks_take_one_symmetric_scale_per_32_inputs_of_each_column():
    w = np.zeros((70, 2), np.float32)  # three blocks: 32, 32 and 6 inputs
    w[:32, 0] = np.linspace(-1.0, 0.5, 32)
    w[32:64, 0] = 0.0  # an all-zero block keeps scale 1 and quantizes to zeros
    w[64:, 0] = [0.254, -0.127, 0.0, 0.001, 0.002, 0.003]
    w[:, 1] = 2.0
    q, scale = quantize_weight_blocks(w, WEIGHT_BLOCK)
    assert q.dtype == np.int8 and q.shape == (70, 2) and scale.shape == (3, 2) and scale.dtype == np.float32
    np.testing.assert_array_equal(scale[:, 0], np.float32([1.0 / 127, 1.0, 0.254 / 127]))
    np.testing.assert_array_equal(scale[:, 1], np.float32([2.0 / 127] * 3))
    assert q[0, 0] == -127 and q[31, 0] == 64  # 0.5 * 127 = 63.5 rounds to even
    np.testing.assert_array_equal(q[32:64, 0], 0)
    np.testing.assert_array_equal(q[64:, 0], [127, -64, 0, 0, 1, 2])  # 0.5 and 1.5 round to even
    np.testing.assert_array_equal(q[:, 1], 127)


@pytest.fixture(scope="module")
def wo_engines(tiny_dir, tmp_path_factory):
    """The tiny GLM (QKV with a bias) as fp32 and int8-wo engines, from one build cache."""
    root = tmp_path_factory.mktemp("wo")
    return (build_tiny_engine(tiny_dir, root / "fp32", "glm"),
            build_tiny_engine(tiny_dir, root / "int8-wo", "glm", precision="int8-wo"))


def test_the_engine_computes_what_its_graph_says(wo_engines):
    """The engine (its native graph where this machine runs one: Int8WeightLinear over every
    linear) gives the logits of its weight-only graph run by ONNX Runtime with no optimization,
    where DequantizeLinear and MatMul run as written in float32: to float32's rounding, far
    closer than either is to the fp32 engine."""
    from autoglm_trt.artifacts import Manifest
    from autoglm_trt.evaluate.perplexity import model_logits
    from autoglm_trt.graph.runner import GraphRunner, prefill_feeds
    from autoglm_trt.graph.session import make_session, run

    fp32, wo = wo_engines
    manifest = Manifest.read(wo)
    assert manifest.precision == "int8-wo"
    source = manifest.data["source"]["model_dir"]
    record = json.loads((wo / "export.json").read_text())
    assert record["graph"]["precision"] == "int8-wo" and record["weight_only"]["linears"] > 0
    from autoglm_trt.backends.onnxrt.passes.common import all_nodes

    graph = onnx.load(str(wo / "model.opt.onnx"), load_external_data=False)
    assert "MatMulNBits" in {n.op_type for n in graph.graph.node}
    if manifest.data["onnxruntime"]["native_graph"]:
        native = onnx.load(str(wo / manifest.data["onnxruntime"]["native_graph"]), load_external_data=False)
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
