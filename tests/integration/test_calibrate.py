"""Calibration end to end on a tiny model: outputs, Q/DQ placement, reuse, bad input, eval."""

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import ROOT, run_cli

from autoglm_trt.backends.onnxrt.offline import GraphRunner, prefill_feeds
from autoglm_trt.backends.onnxrt.session import make_session
from autoglm_trt.calib.cache import read_cache
from autoglm_trt.calib.collect import RAW_ROW_STRIDE
from autoglm_trt.calib.histogram import AbsHistogram, entropy_amax
from autoglm_trt.calib.pipeline import CalibConfig, CalibrationMismatchError, calibrate, check_calibration
from autoglm_trt.export.pipeline import ExportConfig, export_checkpoint
from autoglm_trt.model.spec import spec_from_dict
from autoglm_trt.model.text import CalibrationDataError, token_windows

DATA = ROOT / "autoglm_trt" / "calib" / "data"


@pytest.fixture(scope="module")
def tiny_export(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("cal") / "export"
    export_checkpoint(ExportConfig(tiny_dir("glm"), out), log=lambda m: None)
    return out


@pytest.fixture(scope="module")
def calibrated(tiny_export, tmp_path_factory):
    out = tmp_path_factory.mktemp("cal") / "int8"
    record = calibrate(CalibConfig(tiny_export, DATA, out, num_samples=16, seq_len=64, gate=False), log=lambda m: None)
    return out, record


def test_outputs_and_record(calibrated, tiny_export):
    out, record = calibrated
    for f in ("model.int8.onnx", "model.int8.onnx.data", "calibration.cache", "calib.json", "export.json",
              "tokenizer.json"):
        assert (out / f).is_file(), f
    assert record["method"] == "entropy" and record["data"]["windows"] == 16
    assert len(record["model_sha256"]) == 64 and len(record["data_sha256"]) == 64
    layers = json.loads((tiny_export / "export.json").read_text())["spec"]["num_layers"]
    assert len(record["amax"]) == 4 * layers + 1  # qkv, o_proj, gate_up, down of each layer, and the LM head
    assert set(record["hadamard_block"]) == set(record["amax"])  # every linear's input is rotated by default
    assert all(b >= 2 and b & (b - 1) == 0 for b in record["hadamard_block"].values())
    assert all(v > 0 for v in record["amax"].values())

def test_trt_cache_names_float_graph_tensors_with_their_own_thresholds(calibrated, tiny_export):
    """Every name in calibration.cache is a tensor of the export's float model.onnx (a linear's
    input), and its scale is the entropy threshold of that tensor's raw activations / 127 (one
    token row in RAW_ROW_STRIDE, window w taking rows w mod RAW_ROW_STRIDE, ...), recomputed here
    from those rows of all calibration windows, streamed in the calibration's batches of 8."""
    out, record = calibrated
    header, scales = read_cache(out / "calibration.cache")
    assert header == "TRT-101300-EntropyCalibration2" == record["tensorrt_cache"]["header"]
    assert "assumed" in record["tensorrt_cache"]["tensorrt"]
    model = onnx.load(str(tiny_export / "model.onnx"), load_external_data=False)
    tensors = {t for n in model.graph.node for t in (*n.input, *n.output)}
    assert set(scales) <= tensors and len(scales) == len(record["amax"])
    assert set(scales) == {record["activation_tensors"][n] for n in record["amax"]}
    for name in scales:
        model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    session = make_session(model.SerializeToString(), external_data_dir=tiny_export)
    spec = spec_from_dict(json.loads((tiny_export / "export.json").read_text())["spec"])
    windows = token_windows(DATA, tiny_export, 16, 64, spec.eos_token_ids[0] if spec.eos_token_ids else None).windows
    names = list(scales)
    ratios = []
    outs = session.run(names, prefill_feeds(spec, windows, "float32"))
    for name, x in zip(names, outs):
        h = AbsHistogram()
        n = x.shape[1] // RAW_ROW_STRIDE if x.ndim == 3 else 0
        rows = np.stack([x[w, w % RAW_ROW_STRIDE :: RAW_ROW_STRIDE][:n] for w in range(len(x))]) if n else x
        for b in range(0, len(rows), 8):
            h.add(rows[b : b + 8])
        ratios.append(scales[name] / (entropy_amax(h) / 127.0))
    assert max(abs(r - 1) for r in ratios) < 1e-6  # float32 scales in the cache


def test_qdq_placement(calibrated):
    out, record = calibrated
    model = onnx.load(str(out / "model.int8.onnx"), load_external_data=False)
    producer = {o: n for n in model.graph.node for o in n.output}
    inits = {t.name: t for t in model.graph.initializer}
    matmuls = [n for n in model.graph.node if n.op_type == "MatMul" and n.output[0].split(".")[-1] in
               ("qkv", "o_proj", "gate_up", "down", "lm_head")]
    assert len(matmuls) == len(record["amax"])
    rotated = 0
    for mm in matmuls:
        act, weight = producer[mm.input[0]], producer[mm.input[1]]
        assert act.op_type == "DequantizeLinear" and producer[act.input[0]].op_type == "QuantizeLinear"
        # every input is rotated by default: Q <- Reshape <- MatMul by a Hadamard block <- Reshape
        source = producer[producer[act.input[0]].input[0]]
        rot = producer[source.input[0]]
        assert source.op_type == "Reshape" and rot.op_type == "MatMul"
        h = onnx.numpy_helper.to_array(inits[rot.input[1]])
        b = h.shape[0]
        np.testing.assert_allclose(np.abs(h), 1 / np.sqrt(b), rtol=1e-6)
        np.testing.assert_allclose(h @ h.T, np.eye(b), atol=1e-6)
        rotated += 1
        assert weight.op_type == "DequantizeLinear"
        w_int8 = inits[weight.input[0]]
        assert w_int8.data_type == onnx.TensorProto.INT8
        assert [a.i for a in weight.attribute if a.name == "axis"] == [1]  # per output channel of [in, out]
        assert list(inits[weight.input[1]].dims) == [w_int8.dims[1]]
        assert inits[weight.input[2]].data_type == onnx.TensorProto.INT8  # symmetric: zero points are int8 0
    assert rotated == len(matmuls)
    # nothing else is quantized: one QuantizeLinear per quantized MatMul, none before softmax/norms/residuals
    assert sum(n.op_type == "QuantizeLinear" for n in model.graph.node) == len(matmuls)
    for n in model.graph.node:
        if n.op_type in ("Softmax", "Add", "Gather", "ReduceMean", "Gemm"):
            assert all(producer.get(i) is None or producer[i].op_type != "DequantizeLinear" or n.op_type == "Add"
                       and i.endswith("_bias") for i in n.input), n.name


def test_int8_graph_runs_close_to_float(calibrated, tiny_export):
    out, _ = calibrated
    windows = token_windows(DATA, tiny_export, 2, 32, None).windows
    ref = GraphRunner(tiny_export).logits(windows)
    got = GraphRunner(out).logits(windows)
    assert got.shape == ref.shape
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert 0 < rel < 0.1
    assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.8


def test_reuse_and_invalidation(calibrated, tiny_export, tmp_path):
    out, record = calibrated
    again = calibrate(CalibConfig(tiny_export, DATA, out, num_samples=16, seq_len=64, gate=False), log=lambda m: None)
    assert again.get("reused") and again["data_sha256"] == record["data_sha256"]
    other = tmp_path / "data"
    shutil.copytree(DATA, other)
    (other / "extra.txt").write_text("Something new to calibrate on. " * 50)
    with pytest.raises(CalibrationMismatchError, match="--force"):
        calibrate(CalibConfig(tiny_export, other, out, num_samples=16, seq_len=64, gate=False), log=lambda m: None)
    assert check_calibration(out, tiny_export)["data_sha256"] == record["data_sha256"]


def test_calibration_of_another_model_is_refused(calibrated, tiny_dir, tmp_path):
    out, _ = calibrated
    other = tmp_path / "other-export"
    export_checkpoint(ExportConfig(tiny_dir("llama"), other), log=lambda m: None)
    with pytest.raises(CalibrationMismatchError, match="another model"):
        check_calibration(out, other)


def test_sensitivity_pass_keeps_linears_in_float(tiny_export, tmp_path):
    """A gate no all-INT8 plan meets forces the search (all in float meets it: SmoothQuant's folding
    alone moves the perplexity by under 1e-4); its answer must pass on the real graph."""
    rec = calibrate(CalibConfig(tiny_export, DATA, tmp_path / "int8", num_samples=8, seq_len=64, gate_windows=2,
                                gate_seq_len=64, target_ppl_ratio=1.001, target_top1=0.99), log=lambda m: None)
    kept = rec["float_linears"]
    assert kept and all("sensitivity rank" in k["reason"] for k in kept)
    assert rec["gate"]["result"]["passed"]
    # ranked by the KL with each linear alone INT8, largest first; the float ones lead the ranking
    sens = rec["gate"]["sensitivity"]
    alone = [sens["kl_alone"][n] for n in sens["ranked"]]
    assert len(alone) == 9 and all(float(f"{a:.3g}") >= float(f"{b:.3g}") for a, b in zip(alone, alone[1:]))
    assert [k["linear"] for k in kept] == sens["ranked"][: len(kept)]
    trial = sens["trials"][-1]
    assert trial["expected_ppl_ratio"] == pytest.approx(np.exp(trial["kl"])) and trial["expected_ppl_ratio"] >= 1
    assert len(rec["amax"]) + len(kept) == 9
    assert 0 < rec["float_weight_fraction"] <= 1


@pytest.mark.parametrize("case", ["missing", "empty", "not_utf8", "too_short", "bad_jsonl", "bad_messages"])
def test_bad_calibration_data(tiny_export, tmp_path, case):
    d = tmp_path / "data"
    if case != "missing":
        d.mkdir()
    if case == "not_utf8":
        (d / "a.txt").write_bytes(b"\xff\xfe\x00 latin-1 \xe9")
    elif case == "too_short":
        (d / "a.txt").write_text("too short")
    elif case == "bad_jsonl":
        (d / "a.jsonl").write_text('{"body": "no text field"}\n')
    elif case == "bad_messages":
        (d / "a.jsonl").write_text('{"messages": [{"role": "user"}]}\n')
    expected_json = "'text' string or a 'messages' list"
    message = {"missing": "does not exist", "empty": "no .txt or .jsonl", "not_utf8": "not UTF-8",
               "too_short": "fewer than one sequence", "bad_jsonl": expected_json, "bad_messages": expected_json}[case]
    with pytest.raises(CalibrationDataError, match=message):
        token_windows(d, tiny_export, 4, 64, None)
    r = run_cli("calibrate", str(tiny_export), "--calib", str(d), "-o", str(tmp_path / "out"), "--no-gate")
    assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_eval_cli_json_and_gate(calibrated, tiny_export, tmp_path):
    out, _ = calibrated
    text = DATA / "10_json.txt"
    r = run_cli("eval", str(out), "--text", str(text), "--reference", str(tiny_export), "--seq-len", "64", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert set(res) >= {"ppl", "ref_ppl", "ppl_ratio", "top1_agreement", "kl"}
    assert res["ppl_ratio"] == pytest.approx(res["ppl"] / res["ref_ppl"])
    strict = run_cli("eval", str(out), "--text", str(text), "--reference", str(tiny_export), "--seq-len", "64",
                     "--min-top1", "1.01")
    assert strict.returncode == 1 and "accuracy gate failed" in strict.stderr


def test_calibrating_a_float16_export_is_refused(tiny_dir, tmp_path):
    fp16 = tmp_path / "fp16"
    export_checkpoint(ExportConfig(tiny_dir("llama"), fp16, dtype="float16"), log=lambda m: None)
    r = run_cli("calibrate", str(fp16), "-o", str(tmp_path / "out"))
    assert r.returncode != 0 and "not a float32 export" in r.stderr


def test_eval_of_hf_reference_matches_export(tiny_export, tiny_dir):
    from autoglm_trt.evaluate.perplexity import evaluate

    res = evaluate(tiny_export, DATA / "10_json.txt", reference=Path(tiny_dir("glm")), seq_len=64, max_chunks=2)
    assert res["ppl_ratio"] == pytest.approx(1.0, abs=1e-4) and res["top1_agreement"] == 1.0


@pytest.mark.parametrize("family", ["glm", "glm4", "llama"])
def test_smoothquant_folding_leaves_the_float_model_unchanged(tiny_dir, tmp_path, family):
    """Random smoothing vectors on all four linears of every layer, folded into norms, V and up:
    the float graph must compute the same logits (only the INT8 error changes)."""
    from autoglm_trt.calib.smooth import SmoothedWeights, expand_groups, group_shared
    from autoglm_trt.graph.builder import GraphBuilder
    from autoglm_trt.graph.decoder import OPSET, DecoderGraph, GraphOptions
    from autoglm_trt.graph.exported_weights import ExportedWeights
    from autoglm_trt.model.spec import spec_from_dict

    export = tmp_path / "export"
    export_checkpoint(ExportConfig(tiny_dir(family), export), log=lambda m: None)
    meta = json.loads((export / "export.json").read_text())
    spec = spec_from_dict(meta["spec"])
    rng = np.random.default_rng(0)
    scales = {}
    for i in range(spec.num_layers):
        p = f"layers.{i}"
        scales[f"{p}.qkv"] = rng.uniform(0.2, 5.0, spec.hidden_size).astype(np.float32)
        scales[f"{p}.gate_up"] = rng.uniform(0.2, 5.0, spec.hidden_size).astype(np.float32)
        scales[f"{p}.down"] = rng.uniform(0.2, 5.0, spec.intermediate_size).astype(np.float32)
        o = rng.uniform(0.2, 5.0, spec.q_size).astype(np.float32)
        scales[f"{p}.o_proj"] = expand_groups(group_shared(o, spec), spec)
    smoothed = tmp_path / "smoothed"
    shutil.copytree(export, smoothed)
    builder = GraphBuilder(smoothed / "model.onnx.data")
    DecoderGraph(builder, spec, SmoothedWeights(ExportedWeights(export), spec, scales),
                 GraphOptions("float32", meta["graph"]["max_seq_len"])).build()
    onnx.save_model(builder.model("smoothed", OPSET), str(smoothed / "model.onnx"))
    windows = token_windows(DATA, export, 2, 48, None).windows
    ref, got = GraphRunner(export).logits(windows), GraphRunner(smoothed).logits(windows)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["glm", "glm4", "llama"])
def test_hadamard_rotation_leaves_the_float_model_unchanged(tiny_dir, tmp_path, family):
    """Every linear's input rotated in the graph and its weight offline (switchable graph, all
    linears switched to float): the logits must equal the export's; with the linears switched to
    INT8 they must differ (the switch works)."""
    from autoglm_trt.backends.onnxrt.offline import prefill_feeds
    from autoglm_trt.backends.onnxrt.session import switchable_session
    from autoglm_trt.graph.builder import GraphBuilder
    from autoglm_trt.graph.decoder import OPSET, DecoderGraph, GraphOptions
    from autoglm_trt.graph.exported_weights import ExportedWeights
    from autoglm_trt.graph.names import all_linears, input_channels
    from autoglm_trt.model.spec import spec_from_dict
    from autoglm_trt.quant.hadamard import block_size
    from autoglm_trt.quant.plan import QuantPlan

    export = tmp_path / "export"
    export_checkpoint(ExportConfig(tiny_dir(family), export), log=lambda m: None)
    meta = json.loads((export / "export.json").read_text())
    spec = spec_from_dict(meta["spec"])
    names = all_linears(spec)
    plan = QuantPlan({n: 4.0 for n in names}, switchable=True,
                     rotate={n: block_size(input_channels(spec, n), 128) for n in names})
    assert min(plan.rotate.values()) >= 16
    builder = GraphBuilder(tmp_path / "rot.onnx.data")
    opts = GraphOptions("float32", meta["graph"]["max_seq_len"], plan)
    DecoderGraph(builder, spec, ExportedWeights(export), opts).build()
    onnx.save_model(builder.model("rotated", OPSET), str(tmp_path / "rot.onnx"))
    session = switchable_session(tmp_path / "rot.onnx")
    windows = token_windows(DATA, export, 2, 48, None).windows

    def logits(mask: float) -> np.ndarray:
        feeds = prefill_feeds(spec, windows, "float32", all_logits=True)
        feeds["quant_mask"] = np.full(len(plan.switch_order), mask, np.float32)
        feeds["scale_nudge"] = np.array(1.0, np.float32)
        return session.run(["logits"], feeds)[0]

    ref = GraphRunner(export).logits(windows)
    np.testing.assert_allclose(logits(0.0), ref, rtol=1e-4, atol=1e-4)
    assert np.abs(logits(1.0) - ref).max() > 1e-3
    # each linear an If whose quantized branch alone dequantizes its weight
    graph = onnx.load(str(tmp_path / "rot.onnx"), load_external_data=False).graph
    switches = [n for n in graph.node if n.op_type == "If"]
    assert len(switches) == len(plan.switch_order) == len(names)
    assert not [n for n in graph.node if n.op_type in ("Where", "DequantizeLinear")
                and any(i.endswith((".weight", "weight_dq", "weight_i8")) for i in n.input)]
    for node in switches:
        quantized, kept = (next(a.g for a in node.attribute if a.name == b) for b in ("then_branch", "else_branch"))
        assert [n.op_type for n in quantized.node] == ["DequantizeLinear", "MatMul"]
        assert [n.op_type for n in kept.node] == ["MatMul"] and kept.node[0].input[1].endswith(".weight")


def test_unknown_rotation_kind_is_refused(tiny_export, tmp_path):
    r = run_cli("calibrate", str(tiny_export), "-o", str(tmp_path / "out"), "--rotate", "down,mlp", "--no-gate")
    assert r.returncode != 0 and "cannot rotate ['mlp']" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_chat_messages_are_rendered_with_the_models_template(smollm2_export, tiny_export, tmp_path):
    from autoglm_trt.model.text import text_chunks
    from autoglm_trt.model.tokenizer import TextTokenizer

    chat = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."}]
    d = tmp_path / "data"
    d.mkdir()
    (d / "chat.jsonl").write_text(json.dumps({"messages": chat}) + "\n" + json.dumps({"text": "Plain text too."}) + "\n")
    want = TextTokenizer(smollm2_export).apply_chat_template(chat, add_generation_prompt=False)
    want += TextTokenizer(smollm2_export).tok.encode("Plain text too.", add_special_tokens=False).ids
    assert "<|im_start|>assistant" in TextTokenizer(smollm2_export).tok.decode(want, skip_special_tokens=False)
    n = len(want)
    assert text_chunks(d / "chat.jsonl", smollm2_export, n).ravel().tolist() == want
    assert token_windows(d, smollm2_export, 1, n, None).windows.ravel().tolist() == want
    assert not TextTokenizer(tiny_export).chat_template
    plain = "System: You are brief.\nUser: Name a colour.\nAssistant: Blue."  # a model without a template
    from autoglm_trt.model.text import load_tokenizer

    want = load_tokenizer(tiny_export).encode(plain, add_special_tokens=False).ids
    assert text_chunks(d / "chat.jsonl", tiny_export, len(want), max_chunks=1).ravel().tolist() == want


def test_a_conversation_the_template_refuses_is_a_clear_error(smollm2_export, tmp_path):
    from autoglm_trt.model.text import text_chunks

    model = tmp_path / "model"
    shutil.copytree(smollm2_export, model, ignore=shutil.ignore_patterns("*.onnx", "*.data"))
    (model / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "Hi."}]}) + "\n")
    with pytest.raises(CalibrationDataError, match="chat.jsonl:1: the model's chat template cannot render"):
        text_chunks(tmp_path / "chat.jsonl", model, 4)


def test_the_chat_template_is_part_of_the_windows_hash(smollm2_export, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(smollm2_export, model, ignore=shutil.ignore_patterns("*.onnx", "*.data"))
    data = tmp_path / "data"
    data.mkdir()
    (data / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "Hi there."}]}) + "\n")
    before = token_windows(data, model, 1, 4, None).sha256
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}!{% endfor %}")
    assert token_windows(data, model, 1, 4, None).sha256 != before


def test_a_gate_the_memory_cannot_hold_is_refused_before_the_statistics(tiny_export, tmp_path, monkeypatch):
    import autoglm_trt.calib.pipeline as pipeline
    from autoglm_trt.errors import AutoGLMError
    from autoglm_trt.graph.exported_weights import ExportedWeights

    weights = ExportedWeights(tiny_export).total_bytes()
    monkeypatch.setattr(pipeline, "available_memory_bytes", lambda: int(2 * weights))  # under 2.5x the weights
    monkeypatch.setattr(pipeline, "gather", lambda *a, **k: pytest.fail("the statistics pass ran"))
    with pytest.raises(AutoGLMError, match="--no-gate"):
        calibrate(CalibConfig(tiny_export, DATA, tmp_path / "int8", num_samples=8, seq_len=64), log=lambda m: None)
    assert not (tmp_path / "int8").exists()
    # room for 2.5x the weights but not for the reference log-probabilities too
    from autoglm_trt.artifacts import ExportRecord

    cfg = CalibConfig(tiny_export, DATA, tmp_path / "int8", num_samples=8, seq_len=64, gate_windows=2, gate_seq_len=64)
    log_probs = 2 * 2 * 64 * ExportRecord.read(tiny_export).spec.vocab_size * 4
    monkeypatch.setattr(pipeline, "available_memory_bytes", lambda: int(2.5 * weights + log_probs - 1))
    with pytest.raises(AutoGLMError, match="reference log-probabilities"):
        calibrate(cfg, log=lambda m: None)
    with pytest.raises(AutoGLMError, match="hist_row_stride must be an integer >= 1"):
        calibrate(CalibConfig(tiny_export, DATA, tmp_path / "int8", num_samples=8, seq_len=64, gate=False,
                              hist_row_stride=0), log=lambda m: None)


def test_bias_corrections_reach_the_engine(tiny_dir, tmp_path, monkeypatch):
    """A tiny Llama (no biases of its own) with the bias correction of every INT8 linear kept: the
    INT8 graph adds them, and the engine (native operators where this machine has them) gives that
    graph's logits."""
    from conftest import build_tiny_engine

    from autoglm_trt.calib.sensitivity import SensitivitySearch
    from autoglm_trt.evaluate.perplexity import model_logits

    monkeypatch.setattr(SensitivitySearch, "choose_corrections", lambda self, log: list(self.corrected))
    data = tmp_path / "calib"
    data.mkdir()
    (data / "a.txt").write_text("The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 300)
    engine = build_tiny_engine(tiny_dir, tmp_path / "int8", precision="int8", calib=data)
    calib_dir = next((tmp_path / ".cache").glob("*/calib-int8"))
    record = json.loads((calib_dir / "calib.json").read_text())
    assert record["bias_correction"] and set(record["bias_correction"]) <= set(record["amax"])
    model = onnx.load(str(calib_dir / "model.int8.onnx"), load_external_data=False)
    biases = {t.name for t in model.graph.initializer if t.name.endswith(".bias")}
    assert biases == {f"{n}.bias" for n in record["bias_correction"]}
    windows = np.random.default_rng(0).integers(3, 200, (2, 24))
    want = GraphRunner(calib_dir).logits(windows)
    np.testing.assert_allclose(model_logits(engine)(windows), want, atol=1e-3 * np.abs(want).max(), rtol=0)
