"""Layer-by-layer calibration statistics: equal to the whole graph's, group by group,
and the same calibration record end to end; the CUDA device is refused clearly without it."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import onnx
import pytest
from conftest import ROOT

from autoglm_trt.artifacts import ExportRecord
from autoglm_trt.backends.onnxrt.session import make_session
from autoglm_trt.calib.collect import CalibPlan, kv_head_amax
from autoglm_trt.calib.layerwise import layer_groups, residual_name, subgraph
from autoglm_trt.calib.pipeline import CalibConfig, calibrate
from autoglm_trt.calib.statistics import Statistics, gather, quantizable_inputs, rotation_blocks
from autoglm_trt.calib.thresholds import choose_amax
from autoglm_trt.errors import AutoGLMError
from autoglm_trt.export.pipeline import ExportConfig, export_checkpoint
from autoglm_trt.graph.exported_weights import ExportedWeights, OpenedExport
from autoglm_trt.graph.names import KINDS
from autoglm_trt.model.text import token_windows

DATA = ROOT / "autoglm_trt" / "calib" / "data"


def both_ways(export, windows: int, seq_len: int, max_graph_bytes: int,
              row_stride: int = 1) -> tuple[Statistics, Statistics]:
    spec = ExportRecord.read(export).spec
    w = token_windows(DATA, export, windows, seq_len, spec.eos_token_ids[0]).windows
    inputs = quantizable_inputs(export, True, [])
    rotate = rotation_blocks(spec, list(inputs), list(KINDS), 128)
    plan = CalibPlan(inputs, rotate, 0.8, row_stride=row_stride, batch_size=4)
    whole = gather(OpenedExport.open(export), w, plan)
    layered = gather(OpenedExport.open(export), w, replace(plan, max_graph_bytes=max_graph_bytes))
    assert not whole.layerwise and layered.layerwise
    return whole, layered


def assert_same_statistics(a: Statistics, b: Statistics, rtol: float) -> None:
    amax_a, _ = choose_amax(a, "entropy", 99.99)
    amax_b, _ = choose_amax(b, "entropy", 99.99)
    assert amax_a.keys() == amax_b.keys() and len(amax_a) > 0
    for name in amax_a:
        assert amax_b[name] == pytest.approx(amax_a[name], rel=rtol), name
        assert b.stats.raw_hist[name].amax == pytest.approx(a.stats.raw_hist[name].amax, rel=rtol), name
        np.testing.assert_allclose(b.stats.chan_max[name], a.stats.chan_max[name], rtol=rtol)
        np.testing.assert_allclose(b.stats.sample[name], a.stats.sample[name], rtol=rtol, atol=1e-6)
    assert a.stats.smooth.keys() == b.stats.smooth.keys()
    for name in a.stats.smooth:
        np.testing.assert_allclose(b.stats.smooth[name], a.stats.smooth[name], rtol=rtol)
    kv_a, kv_b = kv_head_amax(a.stats.kv_hist), kv_head_amax(b.stats.kv_hist)
    assert kv_a.keys() == kv_b.keys()
    for name in kv_a:
        np.testing.assert_allclose(kv_b[name], kv_a[name], rtol=rtol)
    assert (a.stats.batches, a.stats.tokens) == (b.stats.batches, b.stats.tokens)


@pytest.fixture(scope="module")
def glm_export(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lw") / "export"
    export_checkpoint(ExportConfig(tiny_dir("glm"), out), log=lambda m: None)
    return out


def test_layer_groups_fill_the_budget():
    class Sizes:
        def layer_bytes(self, i: int) -> int:
            return [5, 5, 5, 12, 1][i]

    assert layer_groups(Sizes(), 5, 10) == [[0, 1], [2], [3], [4]]  # type: ignore[arg-type]
    assert layer_groups(Sizes(), 5, 1) == [[0], [1], [2], [3], [4]]  # type: ignore[arg-type]
    assert layer_groups(Sizes(), 5, 100) == [[0, 1, 2, 3, 4]]  # type: ignore[arg-type]


def test_a_layer_subgraph_holds_only_its_weights_by_reference(glm_export):
    model = onnx.load(str(glm_export / "model.onnx"), load_external_data=False)
    sub = subgraph(model, [residual_name(0)], [residual_name(1)])
    names = {t.name for t in sub.graph.initializer}
    assert {"layers.1.qkv.weight", "layers.1.down.weight"} <= names
    assert not any(n.startswith(("layers.0.", "layers.2.", "embed", "lm_head")) for n in names)
    assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in sub.graph.initializer if t.name in names
               and t.name.startswith("layers."))
    assert sub.graph.input[0].name == residual_name(0)
    make_session(sub.SerializeToString(), external_data_dir=glm_export)  # a valid graph
    with pytest.raises(AutoGLMError, match="no tensor 'nope'"):
        subgraph(model, [residual_name(0)], ["nope"])


@pytest.mark.parametrize("per_group", ["one layer", "two layers"])
@pytest.mark.parametrize("row_stride", [1, 2])
def test_tiny_glm_statistics_equal_the_whole_graph(glm_export, per_group, row_stride):
    weights = ExportedWeights(glm_export)
    budget = weights.layer_bytes(0) * (1 if per_group == "one layer" else 2)
    whole, layered = both_ways(glm_export, 12, 32, budget, row_stride)
    assert_same_statistics(whole, layered, rtol=1e-5)


def test_layer_by_layer_calibration_writes_the_same_record(glm_export, tmp_path):
    records = []
    for name, budget in (("whole", 2**40), ("layered", 1)):
        records.append(calibrate(CalibConfig(glm_export, DATA, tmp_path / name, num_samples=8, seq_len=32,
                                             gate=False, max_graph_bytes=budget), log=lambda m: None))
    whole, layered = records
    assert not whole["timings"]["layer_by_layer"] and layered["timings"]["layer_by_layer"]
    assert layered["data_sha256"] == whole["data_sha256"]  # the budget is not a setting of the result
    assert layered["amax"] == pytest.approx(whole["amax"], rel=1e-5)
    on_disk = json.loads((tmp_path / "layered" / "calib.json").read_text())
    assert on_disk["amax"] == layered["amax"]


def test_cuda_device_without_onnxruntime_gpu_is_a_clear_error(glm_export):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has CUDA: the error path cannot be shown here")
    with pytest.raises(AutoGLMError, match="install onnxruntime-gpu"):
        make_session(glm_export / "model.onnx", device="cuda")


@pytest.mark.slow
def test_smollm2_statistics_layer_by_layer_equal_the_whole_graph(smollm2_export):
    whole, layered = both_ways(smollm2_export, 16, 64, 1)  # one layer per graph
    assert_same_statistics(whole, layered, rtol=1e-5)


@pytest.mark.parametrize("block", [None, 8])
def test_lm_head_error_in_column_chunks_equals_the_whole(monkeypatch, block):
    from types import SimpleNamespace

    from autoglm_trt.calib import thresholds
    from autoglm_trt.calib.sensitivity import output_error
    from autoglm_trt.quant.hadamard import rotate_weight

    monkeypatch.setattr(thresholds, "ROW_CHUNK", 40)
    rng = np.random.default_rng(0)
    head = rng.standard_normal((150, 32)).astype(np.float32)  # [vocab, hidden]
    x = rng.standard_normal((20, 32)).astype(np.float32)
    weights = SimpleNamespace(spec=SimpleNamespace(vocab_size=150), lm_head_name=lambda: "lm_head.weight",
                              rows=lambda name, a, b: head[a:b])
    whole = output_error(x, rotate_weight(head.T, block) if block else head.T, 3.0)
    assert thresholds.head_error(weights, x, 3.0, block) == pytest.approx(whole, rel=1e-5)


def test_image_windows_statistics_layer_by_layer_equal_the_whole_graph(tiny_dir, tmp_path):
    """GLM-4.1V's image windows (synthetic screenshots, their encoder rows in the image tokens'
    place, 3-D positions): the layer-by-layer pass substitutes the rows on the host and must match
    the whole graph, which takes them through its image inputs; and the images move the ranges."""
    from autoglm_trt.calib.image_windows import calibration_images, image_windows
    from autoglm_trt.model.screens import ui_screenshot

    export_dir = tmp_path / "export"
    export_checkpoint(ExportConfig(tiny_dir("glm4v"), export_dir, validate=False), log=lambda m: None)
    spec = ExportRecord.read(export_dir).spec
    text = token_windows(DATA, export_dir, 4, 48, spec.eos_token_ids[0]).windows
    assert len(calibration_images(DATA)) == 4  # the folder holds text only: synthetic screenshots
    opened = OpenedExport.open(export_dir)
    shown, images = image_windows(opened, text, [ui_screenshot(s) for s in range(3)])
    assert shown.shape == (3, 48) and all(item is not None and len(item[1]) <= 24 for item in images.items)
    inputs = quantizable_inputs(export_dir, True, [])
    rotate = rotation_blocks(spec, list(inputs), list(KINDS), 128)
    plan = CalibPlan(inputs, rotate, 0.8, batch_size=2)
    whole = gather(opened, shown, plan, images)
    layered = gather(opened, shown, replace(plan, max_graph_bytes=1), images)
    assert not whole.layerwise and layered.layerwise
    assert_same_statistics(whole, layered, 1e-4)
    plain = gather(opened, shown, plan)  # the same ids, no image rows
    name = "layers.0.qkv"
    assert not np.allclose(plain.stats.chan_max[name], whole.stats.chan_max[name], rtol=1e-3)
