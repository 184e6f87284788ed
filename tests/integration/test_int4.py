"""``build --precision int4-awq``: INT4 weights (AWQ scales folded in), the LM head INT8, float activations."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import ROOT, build_tiny_engine, run_cli

DATA = ROOT / "autoglm_trt" / "calib" / "data"


@pytest.fixture(scope="module")
def int4_engines(tiny_dir, tmp_path_factory):
    """The tiny GLM (QKV with a bias) as fp32 and int4-awq engines, from one build cache."""
    root = tmp_path_factory.mktemp("int4")
    return (build_tiny_engine(tiny_dir, root / "fp32", "glm"),
            build_tiny_engine(tiny_dir, root / "int4-awq", "glm", precision="int4-awq"))


@pytest.mark.parametrize("symmetric", [False, True])
def test_the_dequantize_linear_onnx_runtime_runs_is_the_numpy_one(tmp_path, symmetric):
    """An INT4 weight of 80 inputs (blocks of 32, the last short) written as ONNX's packed int4 /
    uint4 DequantizeLinear: ONNX Runtime's product, unoptimized and fused into MatMulNBits,
    is x times the numpy dequantization."""
    from onnx import TensorProto

    from autoglm_trt.backends.onnxrt.session import make_session
    from autoglm_trt.graph.builder import GraphBuilder
    from autoglm_trt.graph.qdq import int4_weight_dq
    from autoglm_trt.quant.int4 import quantize_int4_blocks

    rng = np.random.default_rng(5)
    w = rng.standard_normal((80, 48)).astype(np.float32)
    qw = quantize_int4_blocks(w, 32, symmetric)
    g = GraphBuilder(tmp_path / "m.onnx.data")
    g.input("x", TensorProto.FLOAT, [4, 80])
    y = g.op("MatMul", ["x", int4_weight_dq(g, "lin", qw)])
    g.rename_output(y, "y")
    g.output("y", TensorProto.FLOAT, [4, 48])
    onnx.save_model(g.model("int4", 21), str(tmp_path / "m.onnx"))
    g.close()
    x = rng.standard_normal((4, 80)).astype(np.float32)
    want = x @ qw.dequantized()
    plain = make_session(tmp_path / "m.onnx", optimize=False).run(None, {"x": x})[0]
    np.testing.assert_allclose(plain, want, rtol=1e-5, atol=1e-5)
    fused = make_session(tmp_path / "m.onnx", save_optimized=tmp_path / "opt.onnx")
    assert "MatMulNBits" in {n.op_type for n in onnx.load(str(tmp_path / "opt.onnx"), load_external_data=False).graph.node}
    # accuracy level 4: ONNX Runtime quantizes the activations to INT8 per block of 32
    np.testing.assert_allclose(fused.run(None, {"x": x})[0], want, atol=0.02 * np.abs(want).max())


def test_the_engine_has_int4_linears_an_int8_head_and_answers(int4_engines):
    from autoglm_trt.artifacts import Manifest
    from autoglm_trt.evaluate.perplexity import model_logits

    fp32, int4 = int4_engines
    manifest = Manifest.read(int4)
    assert manifest.precision == "int4-awq"
    record = json.loads((int4 / "export.json").read_text())
    assert record["graph"]["precision"] == "int4-awq" and record["int4"]["settings"]["block"] == 32
    assert record["int4"]["rounding"].startswith("GPTQ, Gram matrices")
    assert len(record["int4"]["awq"]["alpha"]) == record["int4"]["linears"] == 4 * manifest.spec.num_layers
    bits = {n.name: next(a.i for a in n.attribute if a.name == "bits")
            for n in onnx.load(str(int4 / "model.opt.onnx"), load_external_data=False).graph.node
            if n.op_type == "MatMulNBits"}
    assert bits.pop("lm_head_node") == 8 and len(bits) == 4 * manifest.spec.num_layers
    assert set(bits.values()) == {4}
    windows = np.random.default_rng(0).integers(3, manifest.spec.vocab_size, (2, 24))
    got, ref = model_logits(int4)(windows), model_logits(fp32)(windows)
    assert got.shape == ref.shape and np.isfinite(got).all()
    assert np.abs(got - ref).max() > 1e-4 * np.abs(ref).max()  # quantized, not the float graph
    gen = run_cli("generate", str(int4), "hello", "--max-new-tokens", "4")
    assert gen.returncode == 0, gen.stderr
    doctor = run_cli("doctor", str(int4))
    assert doctor.returncode == 0 and "INT4 weights: native Int4WeightLinear operator" in doctor.stdout
    assert "the LM head's INT8: native Int8BlockLinear operator" in doctor.stdout  # its activations quantized too
    from autoglm_trt.backends.onnxrt.passes.common import all_nodes

    nodes = list(all_nodes(onnx.load(str(int4 / "model.native.onnx"), load_external_data=False).graph))
    assert any(n.op_type.startswith("Int4WeightLinear") for n in nodes)
    assert not [n.name for n in nodes if n.op_type == "MatMulNBits" and any(a.i == 4 for a in n.attribute
                                                                          if a.name == "bits")]


def test_the_native_int4_graph_gives_the_plain_graphs_answers(int4_engines, monkeypatch):
    """Int4WeightLinear against ONNX Runtime's MatMulNBits over the same engine: the same
    quantization of weights and activations, other orders of float sums, so logits agree to a
    small fraction of their range and greedy tokens agree."""
    from autoglm_trt.evaluate.perplexity import model_logits

    _, int4 = int4_engines
    windows = np.random.default_rng(1).integers(3, 200, (2, 24))
    native = model_logits(int4)(windows)
    monkeypatch.setenv("AUTOGLM_TRT_NATIVE", "0")
    plain = model_logits(int4)(windows)
    assert np.abs(native - plain).max() > 0  # two graphs ran
    assert np.abs(native - plain).max() <= 0.02 * np.abs(plain).max(), np.abs(native - plain).max()
    assert (native.argmax(-1) == plain.argmax(-1)).mean() >= 0.95


def test_awq_scales_leave_the_float_model_unchanged(int4_engines):
    """The AWQ scales folded into norms and linears, with every weight float: the export's logits."""
    from autoglm_trt.artifacts import Manifest
    from autoglm_trt.backends.onnxrt.offline import GraphRunner
    from autoglm_trt.backends.onnxrt.session import make_session
    from autoglm_trt.builder.int4_rounding import AwqSearch
    from autoglm_trt.calib.collect import CalibPlan
    from autoglm_trt.calib.smooth import SmoothedWeights
    from autoglm_trt.calib.statistics import gather, quantizable_inputs
    from autoglm_trt.graph.decoder import write_int8_graph
    from autoglm_trt.graph.exported_weights import OpenedExport
    from autoglm_trt.model.text import token_windows
    from autoglm_trt.quant.plan import QuantPlan

    _, int4 = int4_engines
    export = next((int4.parent / ".cache").glob("*/export-float32"))
    spec = Manifest.read(int4).spec
    windows = token_windows(DATA, export, 4, 32, None).windows
    st = gather(OpenedExport.open(export), windows, CalibPlan(quantizable_inputs(export, False, []), batch_size=4))
    awq = AwqSearch(spec, 32, False, 4 * spec.num_layers, lambda m: None)
    awq.add(st.stats.sample, st.weights, [n for n in st.stats.sample if n != "lm_head"])
    scales = awq.scales
    assert len(scales) == 4 * spec.num_layers
    assert any(np.abs(s - 1).max() > 0.05 for s in scales.values())
    out = int4.parent / "awq-float"
    out.mkdir()
    path = write_int8_graph(out, "m.onnx", spec, SmoothedWeights(st.weights.base, spec, scales), QuantPlan({}),
                            GraphRunner(export).record.max_seq_len)
    folded = GraphRunner(export, session=make_session(path))
    np.testing.assert_allclose(folded.logits(windows), GraphRunner(export).logits(windows), rtol=1e-3, atol=1e-3)


def test_gptq_gets_each_linears_gram_matrix_and_a_budget(int4_engines, monkeypatch):
    """128 calibration rows in one batch, all of them sampled: each X^T X is the sample's, and in
    two batches their sum is the same; a model whose
    Gram matrices exceed the budget is rounded to nearest, and says why."""
    from autoglm_trt.artifacts import Manifest
    from autoglm_trt.builder import int4_awq
    from autoglm_trt.calib.collect import CalibPlan
    from autoglm_trt.calib.statistics import gather, quantizable_inputs
    from autoglm_trt.graph.exported_weights import OpenedExport
    from autoglm_trt.model.text import token_windows

    _, int4 = int4_engines
    export = next((int4.parent / ".cache").glob("*/export-float32"))
    spec = Manifest.read(int4).spec
    inputs = quantizable_inputs(export, False, [])
    names = [n for n in inputs if n != "lm_head"]
    windows = token_windows(DATA, export, 4, 32, None).windows
    one, two = (gather(OpenedExport.open(export), windows, CalibPlan(inputs, gram=tuple(names), batch_size=batch))
                for batch in (4, 2))
    assert sorted(one.stats.gram) == sorted(two.stats.gram) == sorted(names)
    for n in names:  # one batch: its sample is every row; two batches: the same sum
        x = one.stats.sample[n].astype(np.float64)
        np.testing.assert_allclose(one.stats.gram[n], x.T @ x, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(two.stats.gram[n], one.stats.gram[n], rtol=1e-4, atol=1e-3)
    chosen, how = int4_awq.gptq_linears(spec, names, int4_awq.Int4Settings())
    assert chosen == tuple(sorted(names)) and how.startswith("GPTQ, Gram matrices over 8 + 64 windows")
    monkeypatch.setattr(int4_awq, "GRAM_BYTES", 1000)
    chosen, how = int4_awq.gptq_linears(spec, names, int4_awq.Int4Settings())
    assert chosen == () and "Gram matrices would take" in how and "to nearest" in how


def test_gptq_layer_by_layer_rounds_as_the_whole_model_pass(int4_engines, tmp_path, monkeypatch):
    """The statistics pass forced to go one layer at a time: each layer's AWQ scales and GPTQ
    rounding as its windows are through, the rounded weights kept in a scratch folder until the
    graph is written (then removed). The same rows through other sessions: the same AWQ exponents
    and the INT4 weights of the whole model's pass but for a few roundings."""
    from onnx import numpy_helper

    from autoglm_trt.artifacts import Manifest
    from autoglm_trt.builder import int4_awq

    _, int4 = int4_engines
    export = next((int4.parent / ".cache").glob("*/export-float32"))
    whole = Path(Manifest.read(int4).data["source"]["model_dir"])
    monkeypatch.setattr(int4_awq, "GRAPH_BYTES", 1)
    logs: list[str] = []
    out = int4_awq.int4_export(export, tmp_path / "int4", DATA, int4_awq.Int4Settings(), log=logs.append)
    rec, ref = (json.loads((d / "export.json").read_text())["int4"] for d in (out, whole))
    assert rec["rounding"].startswith("GPTQ layer by layer, Gram matrices over 8 + 64 windows")
    assert ref["rounding"].startswith("GPTQ, Gram matrices")
    assert any("GPTQ rounded 8 linears layer by layer" in m for m in logs), logs
    assert rec["awq"]["alpha"] == ref["awq"]["alpha"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["int4"]  # the scratch folder is gone

    def int4_weights(d: Path) -> dict[str, np.ndarray]:
        model = onnx.load(str(d / "model.int4.onnx"))
        return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name.endswith(".weight_i4")}

    got, want = int4_weights(out), int4_weights(whole)
    assert sorted(got) == sorted(want) and len(got) == 8
    same = np.mean(np.concatenate([(got[n] == want[n]).ravel() for n in got]))
    assert same >= 0.99, same


def test_a_second_build_reuses_the_int4_model_and_a_bad_block_is_refused(tiny_dir, int4_engines):
    _, int4 = int4_engines
    args = ["--backend", "onnxruntime", "--max-seq-len", "96", "--max-input-len", "48", "--kv-num-blocks", "64",
            "--kv-block-size", "8"]
    done = run_cli("build", str(tiny_dir("glm")), "--precision", "int4-awq", *args, "-o", str(int4.parent / "again"))
    assert done.returncode == 0, done.stderr
    assert "reusing the INT4 model" in done.stderr
    bad = run_cli("build", str(tiny_dir("glm")), "--precision", "int4-awq", "--int4-block", "48", *args,
                  "-o", str(int4.parent / "bad"))
    assert bad.returncode == 1 and "power of two of at least 16, got 48" in bad.stderr
    assert "Traceback" not in bad.stderr and not (int4.parent / "bad").exists()


def test_kinds_kept_at_int8_run_as_int8_block_linears(tiny_dir, int4_engines):
    """``--int4-int8 down``: the down projections as 8-bit blocks (Int8BlockLinear in the native
    graph), the others INT4; their answers lie between the all-INT4 engine's and fp32's; an
    unknown kind is refused by name."""
    from autoglm_trt.backends.onnxrt.passes.common import all_nodes
    from autoglm_trt.evaluate.perplexity import model_logits

    fp32, int4 = int4_engines
    args = ["--backend", "onnxruntime", "--max-seq-len", "96", "--max-input-len", "48", "--kv-num-blocks", "64",
            "--kv-block-size", "8"]
    out = int4.parent / "down8"
    done = run_cli("build", str(tiny_dir("glm")), "--precision", "int4-awq", "--int4-int8", "down", *args, "-o", str(out))
    assert done.returncode == 0, done.stderr
    bits = {n.name: next(a.i for a in n.attribute if a.name == "bits")
            for n in onnx.load(str(out / "model.opt.onnx"), load_external_data=False).graph.node
            if n.op_type == "MatMulNBits"}
    assert {name for name, b in bits.items() if b == 8} == {"lm_head_node"} | {n for n in bits if ".down" in n}
    assert any(b == 4 for b in bits.values())
    native = [n.op_type for n in all_nodes(onnx.load(str(out / "model.native.onnx"), load_external_data=False).graph)]
    assert any(op.startswith("Int8BlockLinear") for op in native) and any(op.startswith("Int4WeightLinear")
                                                                          for op in native)
    windows = np.random.default_rng(3).integers(3, 200, (4, 24))
    ref = model_logits(fp32)(windows)
    assert np.mean((model_logits(out)(windows) - ref) ** 2) < np.mean((model_logits(int4)(windows) - ref) ** 2)
    bad = run_cli("build", str(tiny_dir("glm")), "--precision", "int4-awq", "--int4-int8", "mlp", *args,
                  "-o", str(int4.parent / "bad-kind"))
    assert bad.returncode == 1 and "unknown kind of linear mlp" in bad.stderr and "Traceback" not in bad.stderr


def test_the_int4_engines_embedding_is_int8_rows_the_lm_head_quantization(tiny_dir, int4_engines, tmp_path):
    """The INT4 model's token embedding: INT8 in blocks of 32 along each row (no float table left),
    gathered and scaled in the graph to exactly the numpy dequantization of ``embedding_rows``,
    within half a step of the float rows; the fp32 engine's stays float."""
    from safetensors.numpy import load_file

    from autoglm_trt.artifacts import Manifest
    from autoglm_trt.quant.int8 import embedding_rows

    fp32, int4 = int4_engines
    source = json.loads((int4 / "export.json").read_text())
    assert source["int4"]["settings"]["int8_embedding"] and "token embedding int8" in source["int4"]["weights"]
    graph = f"{Manifest.read(int4).data['source']['model_dir']}/model.int4.onnx"
    inits = {t.name: t for t in onnx.load(graph, load_external_data=False).graph.initializer}
    assert "embed_tokens.weight" not in inits and inits["embed_tokens.weight_i8"].data_type == onnx.TensorProto.INT8
    assert "embed_tokens.weight" in {t.name for t in onnx.load(str(fp32 / "model.opt.onnx"),
                                                                load_external_data=False).graph.initializer}
    onnx.utils.extract_model(graph, str(tmp_path / "embed.onnx"), ["input_ids"], ["embed"])
    from autoglm_trt.backends.onnxrt.session import make_session

    ids = np.array([[0, 5, 255, 5], [17, 3, 3, 200]], np.int64)
    got = make_session(tmp_path / "embed.onnx", optimize=False).run(None, {"input_ids": ids})[0]
    table = next(v for k, v in load_file(str(tiny_dir("glm") / "model.safetensors")).items()
                 if k.endswith("embed_tokens.weight")).astype(np.float32)
    q, scale = embedding_rows(table)
    want = (q.astype(np.float32).reshape(len(q), -1, 32) * scale).reshape(table.shape)[ids]
    np.testing.assert_array_equal(got, want)
    step = np.repeat(scale[..., 0], 32, axis=1)[ids]
    assert np.all(np.abs(got - table[ids]) <= step / 2 + 1e-7) and np.abs(got - table[ids]).max() > 0


def test_the_gate_keeps_the_most_sensitive_linears_at_int8(int4_engines, tmp_path, monkeypatch):
    """``--int4-gate``: a target every plan meets keeps none at INT8; one halfway from the all-INT4
    model's expected perplexity ratio to float keeps a prefix of the sensitivity ranking at INT8
    (8-bit weights in the written graph, the others 4-bit) and its final check passes; a target
    no plan meets (float's own 1.0), a bad one, and a model the build takes layer by layer are
    refused with what to do."""
    from autoglm_trt.builder import int4_awq
    from autoglm_trt.errors import AutoGLMError

    _, int4 = int4_engines
    export = next((int4.parent / ".cache").glob("*/export-float32"))

    def gate_record(name: str, target: float) -> tuple[dict, set[str]]:
        out = int4_awq.int4_export(export, tmp_path / name, DATA, int4_awq.Int4Settings(gate=target), log=print)
        model = onnx.load(str(out / "model.int4.onnx"), load_external_data=False)
        return json.loads((out / "export.json").read_text())["int4"], {t.name for t in model.graph.initializer}

    loose, _ = gate_record("loose", 100.0)
    all_int4 = loose["gate"]["sensitivity"]["trials"][0]["expected_ppl_ratio"]
    assert loose["gate"]["kept_at_int8"] == [] and all_int4 > 1.0 and loose["gate"]["result"]["passed"]
    target = 1.0 + (all_int4 - 1.0) / 2
    rec, weights = gate_record("gated", target)
    gate = rec["gate"]
    kept, ranked = gate["kept_at_int8"], gate["sensitivity"]["ranked"]
    assert len(ranked) == 8 and 0 < len(kept) < 8 and sorted(ranked[: len(kept)]) == kept
    assert gate["sensitivity"]["trials"][-1]["expected_ppl_ratio"] <= target and gate["result"]["passed"]
    assert rec["int8_linears"] == kept and f"and {len(kept)} linears the gate kept int8" in rec["weights"]
    for name in ranked:
        assert (f"{name}.weight_i8" in weights, f"{name}.weight_i4" in weights) == ((True, False) if name in kept
                                                                                      else (False, True))
    assert not list(tmp_path.glob("**/switch.int4.onnx*"))
    with pytest.raises(AutoGLMError, match="even with every decoder linear at INT8"):
        int4_awq.int4_export(export, tmp_path / "tight", DATA, int4_awq.Int4Settings(gate=1.0), log=print)
    with pytest.raises(AutoGLMError, match="at least 1.0"):
        int4_awq.int4_export(export, tmp_path / "bad", DATA, int4_awq.Int4Settings(gate=0.5), log=print)
    monkeypatch.setattr(int4_awq, "GRAPH_BYTES", 1)
    with pytest.raises(AutoGLMError, match="build without --int4-gate"):
        int4_awq.int4_export(export, tmp_path / "layers", DATA, int4_awq.Int4Settings(gate=1.04), log=print)


def test_int4_to_nearest_needs_no_calibration_and_takes_a_float16_export(tiny_dir, tmp_path):
    """``--int4-rounding nearest``: each weight rounded to nearest in its block (the numpy
    quantization's bytes), no calibration text read, the float graph never run; from a bfloat16
    checkpoint's float16 export the same graph as from its float32 export, byte for byte, and an
    engine that answers. The calibrated rounding, and the gate, still refuse a float16 export."""
    from tiny_models import bfloat16_copy

    from autoglm_trt.builder.config import BuildConfig
    from autoglm_trt.builder.int4_awq import GRAPH, Int4Settings, int4_export
    from autoglm_trt.builder.pipeline import BuildRequest, build_engine
    from autoglm_trt.calib.thresholds import linear_matrix
    from autoglm_trt.errors import AutoGLMError
    from autoglm_trt.export.pipeline import ExportConfig, export_checkpoint
    from autoglm_trt.graph.exported_weights import ExportedWeights
    from autoglm_trt.quant.int4 import pack_nibbles, quantize_int4_blocks
    from autoglm_trt.runtime import Engine, SamplingParams

    ckpt = bfloat16_copy(tiny_dir("glm"), tmp_path / "bf16")
    nearest, made = Int4Settings(awq=False, gptq=False), {}
    for dtype in ("float32", "float16"):
        export = tmp_path / f"export-{dtype}"
        export_checkpoint(ExportConfig(ckpt, export, dtype=dtype, validate=False), log=lambda m: None)
        made[dtype] = int4_export(export, tmp_path / f"int4-{dtype}", tmp_path / "no-such-data", nearest,
                                  log=lambda m: None)
    assert (made["float16"] / f"{GRAPH}.data").read_bytes() == (made["float32"] / f"{GRAPH}.data").read_bytes()
    assert (made["float16"] / GRAPH).read_bytes() == (made["float32"] / GRAPH).read_bytes()
    record = json.loads((made["float16"] / "export.json").read_text())["int4"]
    assert record["rounding"].startswith("to nearest") and record["data_sha256"] is None
    model = onnx.load(str(made["float32"] / GRAPH))
    inits = {t.name: t.raw_data if t.data_type == onnx.TensorProto.UINT4 else onnx.numpy_helper.to_array(t)
             for t in model.graph.initializer}
    want = quantize_int4_blocks(linear_matrix(ExportedWeights(tmp_path / "export-float32"), "layers.1.down", {}), 32,
                                False)
    [name] = [n for n in inits if "layers.1" in n and "down" in n and n.endswith(".weight_i4")]
    assert inits[name] == pack_nibbles(want.q).tobytes()
    assert inits[name.replace("weight_i4", "weight_zero")] == pack_nibbles(want.zero).tobytes()
    np.testing.assert_array_equal(inits[name.replace("weight_i4", "weight_scale")], want.scale)

    out = tmp_path / "engine"
    build_engine(BuildRequest(tmp_path / "export-float16", out, precision="int4-awq", backend="onnxruntime",
                              int4_rounding="nearest", cache_dir=tmp_path / "cache",
                              config=BuildConfig(max_seq_len=96, max_input_len=48, kv_num_blocks=64, kv_block_size=8)),
                 log=lambda m: None)
    with Engine.load(out) as engine:
        [answer] = engine.generate(["hello there"], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(answer.token_ids) == 4
    with pytest.raises(AutoGLMError, match="is a float16 export; int4-awq's calibration runs the float32 graph"):
        int4_export(tmp_path / "export-float16", tmp_path / "awq", DATA, Int4Settings(), log=lambda m: None)
    refused = run_cli("build", str(tmp_path / "export-float16"), "--precision", "int4-awq", "--int4-rounding",
                      "nearest", "--int4-gate", "1.04", "-o", str(tmp_path / "gated"))
    assert refused.returncode == 1 and "which --int4-rounding nearest does not read" in refused.stderr
