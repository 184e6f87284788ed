"""The quantized graphs a TensorRT build is made from (``int8``, ``int4-awq``, ``int8-wo``): float16
GEMMs with their Q/DQ in float16 (W8A8) or the weights dequantized to float16 (W4A16 / W8A16),
float16 attention and KV cache, norms and softmax float32; INT4 in the blocks TensorRT takes. No
TensorRT runs here: the graphs are checked for their types and against the float32 graph of the
same plan on ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import ROOT

from autoglm_trt.backends.registry import backend
from autoglm_trt.errors import AutoGLMError

DATA = ROOT / "autoglm_trt" / "calib" / "data"
F16, F32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
PRECISIONS = ("int8", "int4-awq", "int8-wo")


@pytest.fixture(scope="module")
def forms(tmp_path_factory):
    """precision -> (the TensorRT build's model directory, the float32 graph of the same settings;
    int8: both calibrated with a linear kept in float, "int8 build" the build's own); "export" ->
    the float32 export they are made from."""
    from tiny_models import make_tiny_checkpoint

    from autoglm_trt.artifacts import ExportRecord
    from autoglm_trt.builder.int4_awq import Int4Settings, int4_export
    from autoglm_trt.builder.weight_only import weight_only_export
    from autoglm_trt.calib.pipeline import CalibConfig, calibrate

    root = tmp_path_factory.mktemp("trt-forms")
    # the tiny GLM with an FFN of 128: input widths 64, 64, 128, which INT4 blocks of 64 divide
    source = make_tiny_checkpoint("glm", root / "glm", intermediate_size=128)
    out = {}
    for precision in PRECISIONS:
        float_dir, half = _tensorrt_model(source, root, precision)
        if precision == "int8":  # and a linear kept in float (the gate keeps none of this model's)
            out["int8 build"] = half
            half, full = root / "f16-int8", root / "f32-int8"
            for out_dir, dtype in ((half, "float16"), (full, "float32")):
                calibrate(CalibConfig(float_dir, DATA, out_dir, keep_float=["layers.1.down"], graph_dtype=dtype),
                          log=lambda m: None)
        elif precision == "int4-awq":
            assert ExportRecord.read(half).data["int4"]["settings"]["block"] == 64  # the largest that divides
            full = int4_export(float_dir, root / "f32-int4", DATA,
                               Int4Settings(block=64, symmetric=True, int8_embedding=False, int8_channels=True),
                               log=lambda m: None)
        else:
            full = weight_only_export(float_dir, root / "f32-int8wo", lambda m: None, int8_embedding=False,
                                      int8_channels=True)
        out[precision] = (half, full)
    out["export"] = float_dir
    return out


def _tensorrt_model(source, root, precision: str) -> tuple:
    """(the float32 export, the model a TensorRT build of ``precision`` is made from), in ``root``'s cache."""
    from autoglm_trt.builder import pipeline
    from autoglm_trt.builder.pipeline import BuildRequest

    req = BuildRequest(source, root / precision, precision=precision, backend="tensorrt", cache_dir=root / ".cache")
    cache = pipeline._cache_dir(req)
    float_dir = pipeline._model_dir(req, cache, lambda m: None)
    return float_dir, pipeline._quantized(req, backend("tensorrt"), float_dir, cache, lambda m: None)


def _types(model: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    types = {v.name: v.type.tensor_type.elem_type for v in [*inferred.graph.value_info, *inferred.graph.input,
                                                              *inferred.graph.output]}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    return types


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_tensorrt_graph_runs_its_gemms_attention_and_kv_cache_in_float16(forms, precision):
    from autoglm_trt.artifacts import CalibRecord, ExportRecord

    half_dir, _ = forms[precision]
    record = ExportRecord.read(half_dir)
    assert record.dtype == "float16" and record.kv_dtype == "float16"
    model = onnx.load(str(record.graph_file), load_external_data=False)
    types = _types(model)
    producer = {o: n for n in model.graph.node for o in n.output}
    by_op: dict[str, list] = {}
    for n in model.graph.node:
        by_op.setdefault(n.op_type, []).append(n)
    linears = [n for n in by_op["MatMul"] if n.input[1] in producer and producer[n.input[1]].op_type == "DequantizeLinear"]
    spec = record.spec
    calibrated = CalibRecord.read(half_dir).data if precision == "int8" else None
    # qkv, o_proj, gate_up, down and the LM head; W8A8: those the gate did not keep in float
    assert len(linears) == (len(calibrated["amax"]) if calibrated else 4 * spec.num_layers + 1)
    assert all(types[i] == F16 for n in linears for i in (*n.input, n.output[0]))
    dqs = by_op["DequantizeLinear"]
    assert len(dqs) == len(linears) * (2 if calibrated else 1) and all(types[n.input[1]] == F16 for n in dqs)
    int4 = [n for n in dqs if types[n.input[0]] == onnx.TensorProto.INT4]
    assert len(int4) == (4 * spec.num_layers if precision == "int4-awq" else 0)  # the LM head INT8 either way
    # TensorRT dequantizes blocks of INT4 only: every INT8 weight one scale per output channel
    scale_rank = {t.name: len(t.dims) for t in model.graph.initializer}
    assert all(_attr(n, "block_size") == 64 and scale_rank[n.input[1]] == 2 for n in int4)
    int8_weights = [n for n in dqs if n not in int4 and n.input[0] in scale_rank]
    assert len(int8_weights) == len(linears) - len(int4)
    assert all(_attr(n, "block_size") is None and _attr(n, "axis") == 1 and scale_rank[n.input[1]] == 1
               for n in int8_weights)
    if calibrated:  # the activations' Q/DQ in float16; the linears kept in float run float16 GEMMs
        assert all(producer[n.input[0]].op_type == "DequantizeLinear" for n in linears)
        assert by_op["QuantizeLinear"] and all(types[i] == F16 for n in by_op["QuantizeLinear"] for i in n.input[:2])
        floats = [n for n in by_op["MatMul"] if n.input[1].endswith(".weight")]
        assert [n.output[0] for n in floats] == [f["linear"] for f in calibrated["float_linears"]] == ["layers.1.down"]
        assert all(types[i] == F16 for n in floats for i in n.input)
        build = ExportRecord.read(forms["int8 build"])
        assert (build.dtype, build.dir.name, CalibRecord.read(build.dir).data["settings"]["graph_dtype"]) == \
            ("float16", "calib-int8-float16", "float16")
    assert all(types[n.input[0]] == F32 for op in ("ReduceMean", "Softmax") for n in by_op[op])
    scores = [n for n in by_op["MatMul"] if ".scores" in n.output[0]]
    assert len(scores) == 2 * spec.num_layers and all(types[i] == F16 for n in scores for i in n.input)
    residuals = [n for n in by_op["Add"] if "residual" in n.output[0]]
    assert len(residuals) == 2 * spec.num_layers and all(types[n.output[0]] == F32 for n in residuals)
    kv = {i.name: types[i.name] for i in [*model.graph.input, *model.graph.output] if "key" in i.name or "value" in i.name}
    assert len(kv) == 4 * spec.num_layers and set(kv.values()) == {F16}
    assert types["logits"] == F32
    # a TensorRT build's INT8 KV cache (static scales per KV head) rewrites it into a typed graph too,
    # whose Q/DQ of activations are per tensor (TensorRT takes per-channel Q/DQ on weights only)
    from autoglm_trt.graph.kv_int8 import int8_kv_graph

    amax = {o: [1.0] * spec.num_kv_heads for o in kv if o.startswith("new_")}
    rewritten = int8_kv_graph(model, amax, unit_scales=True)
    assert set(_types(rewritten).values()) >= {onnx.TensorProto.INT8, F16}
    ranks = {t.name: len(t.dims) for t in rewritten.graph.initializer}
    ranks.update({n.output[0]: len(n.attribute[0].t.dims) for n in rewritten.graph.node if n.op_type == "Constant"})
    activations = [n for n in rewritten.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")
                   and n.input[0] not in ranks]
    assert all(ranks[n.input[1]] == 0 for n in activations)
    # K and V quantized where made, dequantized where gathered
    assert sum(".kv_" in n.name for n in activations) == 4 * spec.num_layers


def _attr(node: onnx.NodeProto, name: str):
    return next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name), None)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_float16_graph_holds_the_float32_graphs_weights_and_computes_its_logits(forms, precision):
    """The same quantized weights bit for bit, their float16 scales the float32 graph's values (block
    scales are float16 values already), and logits as close to the float model's as the float32
    graph's, on ONNX Runtime (unoptimized: its MatMulNBits would quantize the activations)."""
    from autoglm_trt.artifacts import ExportRecord
    from autoglm_trt.backends.onnxrt.offline import GraphRunner
    from autoglm_trt.backends.onnxrt.session import make_session

    half_dir, full_dir = forms[precision]
    half, full = (onnx.load(str(ExportRecord.read(d).graph_file)) for d in (half_dir, full_dir))
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in half.graph.initializer}
    reference = {t.name: onnx.numpy_helper.to_array(t) for t in full.graph.initializer}
    quantized = [n for n in weights if n.endswith((".weight_i4", ".weight_i8"))]
    assert sorted(quantized) == sorted(n for n in reference if n.endswith((".weight_i4", ".weight_i8")))
    for name in quantized:
        assert np.array_equal(weights[name], reference[name]), name
        scale = name.rsplit(".", 1)[0] + ".weight_scale"
        assert weights[scale].dtype == np.float16
        # weight-only scales are float16 values; W8A8's per-channel ones are rounded to the nearest
        np.testing.assert_allclose(weights[scale], reference[scale], rtol=0 if precision != "int8" else 2.0 ** -11)

    def logits(model_dir):
        runner = GraphRunner(model_dir)
        runner.session = make_session(runner.record.graph_file, optimize=False)
        return runner.logits(np.random.default_rng(3).integers(0, 256, (2, 24)))

    got, want, ref = logits(half_dir), logits(full_dir), logits(forms["export"])

    def dist(a, b):
        return np.linalg.norm(a - b) / np.linalg.norm(b)

    assert dist(got, want) > 0  # float16 GEMMs, not float32 ones
    assert dist(got, ref) < 1.1 * dist(want, ref)  # as close to the float model as the float32 graph
    if precision == "int8":  # float16 moves some activations to a neighbouring INT8 level: less than INT8 moves them
        assert dist(got, want) < dist(want, ref)
    else:  # weight-only: float16's rounding alone
        assert dist(got, want) < 5e-3


def test_the_kv_caches_per_tensor_form_computes_what_the_per_head_form_does(forms, tmp_path):
    """TensorRT's INT8 KV cache (each KV head's scale outside a Q/DQ of scale 1) against the per-head
    Q/DQ form, on ONNX Runtime through a paged int8 pool: the same logits, bit for bit."""
    import shutil

    from autoglm_trt.backends.onnxrt.offline import GraphRunner
    from autoglm_trt.backends.onnxrt.session import make_session
    from autoglm_trt.graph.kv_int8 import int8_kv_graph

    model_dir = shutil.copytree(forms["export"], tmp_path / "export")
    graph = onnx.load(str(model_dir / "model.onnx"), load_external_data=False)
    rng = np.random.default_rng(5)
    amax = {o.name: rng.uniform(0.5, 3.0, 2).tolist() for o in graph.graph.output if o.name.startswith("new_")}
    windows = rng.integers(3, 250, (2, 24))
    logits = {}
    for unit in (False, True):
        rewritten = int8_kv_graph(onnx.load(str(model_dir / "model.onnx"), load_external_data=False), amax,
                                  unit_scales=unit)
        onnx.save(rewritten, str(model_dir / f"kv-{unit}.onnx"))
        runner = GraphRunner(model_dir, session=make_session(model_dir / f"kv-{unit}.onnx"))
        runner.kv_dtype = "int8"
        logits[unit] = runner.paged_logits(windows, 4)
    np.testing.assert_array_equal(logits[True], logits[False])


def test_tensorrt_takes_int4_blocks_of_64_or_128_that_divide_the_inputs(forms, tiny_dir, tmp_path, monkeypatch):
    """Refused before any work where the block is not one TensorRT takes; once the export says the
    model's widths, refused before the calibration where it does not divide them."""
    from dataclasses import replace

    from autoglm_trt.artifacts import ExportRecord
    from autoglm_trt.builder import pipeline
    from autoglm_trt.builder.pipeline import BuildRequest, build_engine, int4_block

    def req(block):
        return BuildRequest(tiny_dir("glm"), tmp_path / "e", precision="int4-awq", int4_block=block,
                            cache_dir=tmp_path / ".cache")

    assert int4_block(req(None), backend("tensorrt")) == 128 and int4_block(req(None), backend("onnxruntime")) == 32
    assert int4_block(req(64), backend("tensorrt")) == 64 and int4_block(req(16), backend("onnxruntime")) == 16
    spec = ExportRecord.read(forms["export"]).spec  # input widths 64, 64, 128
    assert int4_block(req(None), backend("tensorrt"), spec) == 64
    with pytest.raises(AutoGLMError, match=r"blocks of 128 do not divide .* \(64, 128\).*pass --int4-block 64"):
        int4_block(req(128), backend("tensorrt"), spec)
    with pytest.raises(AutoGLMError, match="no block size TensorRT takes does: build int8-wo"):
        int4_block(req(None), backend("tensorrt"), replace(spec, intermediate_size=96))
    assert int4_block(req(None), backend("onnxruntime"), replace(spec, intermediate_size=96)) == 32
    monkeypatch.setattr(pipeline, "_backend_for", lambda req, p, log: backend("tensorrt"))  # as if installed
    with pytest.raises(AutoGLMError, match="blocks of 64 or 128 inputs, not 32: pass --int4-block 128"):
        build_engine(req(32), log=lambda m: None)
    assert not (tmp_path / ".cache").exists() and not (tmp_path / "e").exists()


def test_the_accuracy_gates_switchable_graph_stays_float32(forms, tmp_path):
    from autoglm_trt.artifacts import ExportRecord
    from autoglm_trt.graph.decoder import write_int8_graph
    from autoglm_trt.graph.exported_weights import ExportedWeights
    from autoglm_trt.quant.plan import QuantPlan

    spec, weights = ExportRecord.read(forms["export"]).spec, ExportedWeights(forms["export"])
    with pytest.raises(ValueError, match="switchable graph .* float32"):
        write_int8_graph(tmp_path, "m.onnx", spec, weights, QuantPlan({"layers.0.qkv": 1.0}, switchable=True), 64,
                         "float16")


def test_float16_scales_stay_positive_and_finite():
    """TensorRT takes strictly positive scales: a float32 scale under float16's smallest subnormal
    (or over its largest value) is stored as that bound, not as 0 (or inf); others round to nearest."""
    from autoglm_trt.graph.qdq import _stored

    scales = np.array([1e-9, 2.0 ** -24, 1e-3, 1.0, 7e4], np.float32)
    got = _stored(scales, np.dtype(np.float16))
    assert got.dtype == np.float16 and np.all(got > 0) and np.all(np.isfinite(got))
    assert got.astype(np.float32).tolist() == [2.0 ** -24, 2.0 ** -24, float(np.float16(1e-3)), 1.0, 65504.0]
    assert _stored(scales, np.dtype(np.float32)) is scales


@pytest.fixture(scope="module")
def glm4v_forms(tmp_path_factory):
    """precision -> the TensorRT build's model directory for a tiny GLM-4.1V (FFN of 128, so INT4
    blocks of 64 divide its inputs); "export" -> its float32 export."""
    from tiny_models import make_tiny_checkpoint


    root = tmp_path_factory.mktemp("trt-forms-glm4v")
    source = make_tiny_checkpoint("glm4v", root / "glm4v", intermediate_size=128)
    out = {}
    for precision in PRECISIONS:
        out["export"], out[precision] = _tensorrt_model(source, root, precision)
    return out


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_glm4v_decoder_for_tensorrt_is_float16_and_takes_float32_image_rows(glm4v_forms, precision):
    """AutoGLM-Phone-9B's architecture: the decoder's quantized GEMMs and KV cache float16, strictly
    typed; the image rows come in as float32 (the vision engine's output, as for every precision) into
    the float32 residual stream; the vision graph is the export's, untouched."""
    from autoglm_trt.artifacts import CalibRecord, ExportRecord

    record = ExportRecord.read(glm4v_forms[precision])
    assert (record.dtype, record.kv_dtype) == ("float16", "float16")
    model = onnx.load(str(record.graph_file), load_external_data=False)
    types = _types(model)  # strict inference: every node's input types agree
    producer = {o: n for n in model.graph.node for o in n.output}
    linears = [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in producer
               and producer[n.input[1]].op_type == "DequantizeLinear"]
    planned = len(CalibRecord.read(record.dir).data["amax"]) if precision == "int8" else 4 * record.spec.num_layers + 1
    assert len(linears) == planned and all(types[i] == F16 for n in linears for i in (*n.input, n.output[0]))
    dqs = [producer[n.input[1]] for n in linears]  # INT4 in blocks, INT8 per output channel
    assert all(_attr(n, "block_size") == (64 if types[n.input[0]] == onnx.TensorProto.INT4 else None) for n in dqs)
    assert types["image_embeds"] == F32 and types["logits"] == F32
    merged = [n for n in model.graph.node if "image_embeds" in n.input]
    assert merged and all(types[o] == F32 for n in merged for o in n.output)
    kv = [i.name for i in [*model.graph.input, *model.graph.output] if "key" in i.name or "value" in i.name]
    assert len(kv) == 4 * record.spec.num_layers and {types[k] for k in kv} == {F16}
    export = glm4v_forms["export"]
    for name in ("vision.onnx", "vision.onnx.data", "vision_positions.npy"):
        assert (record.dir / name).read_bytes() == (export / name).read_bytes(), name
