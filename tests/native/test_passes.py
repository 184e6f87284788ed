"""The ONNX Runtime rewrite passes run when an engine is built; loading it only chooses a saved graph
(and, where the build saved no packed weights, runs the same passes again to make them)."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import build_tiny_engine

from autoglm_trt.artifacts import Manifest
from autoglm_trt.backends import open_runner
from autoglm_trt.backends.onnxrt import loader, passes


def test_the_manifest_records_every_pass_in_order(tiny_int8_engine, library):
    graphs = Manifest.read(tiny_int8_engine).ort_graphs
    assert [p["name"] for p in graphs["passes"]] == [name for name, _ in passes.PASSES]
    assert graphs["passes_version"] == passes.PASSES_VERSION
    assert graphs["native_graph"] == "model.native.onnx" and graphs["native_weights"] == "model.native.bin"
    assert all(p["applied"] or p["why_not"] for p in graphs["passes"])  # each says what it did or why not
    done = {p["name"] for p in graphs["passes"] if p["applied"]}
    assert {"attention", "rope_qkv", "hadamard_quantize", "linears", "step_branch"} <= done


def test_loading_runs_the_saved_native_graph_and_rewrites_nothing(tiny_int8_engine, library, monkeypatch):
    def rewrite(*args, **kwargs):
        raise AssertionError("the engine graph was rewritten while loading")

    monkeypatch.setattr(passes, "rewrite", rewrite)
    runner = open_runner(Manifest.read(tiny_int8_engine), num_blocks=32, threads=1)
    assert runner.attention == "native"
    runner.close()


def _edited(engine, tmp_path, edit):
    copy = tmp_path / "engine"
    shutil.copytree(engine, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest["onnxruntime"])
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def test_a_native_graph_made_by_other_passes_gives_way_to_the_plain_graph(tiny_engine, library, tmp_path):
    engine = _edited(tiny_engine, tmp_path, lambda g: g.update(passes_version=passes.PASSES_VERSION + 1))
    runner = open_runner(Manifest.read(engine), num_blocks=32, threads=1)
    assert runner.attention.startswith(f"graph (the engine's native graph was made by passes version "
                                       f"{passes.PASSES_VERSION + 1}")
    assert "rebuild the engine" in runner.attention
    runner.close()


def test_a_native_graph_this_library_cannot_run_gives_way_to_the_plain_graph(tiny_engine, library, monkeypatch):
    from autoglm_trt import native

    requires = Manifest.read(tiny_engine).ort_graphs["requires"]
    if "fma" not in requires:
        pytest.skip("this machine's library has no fused multiply-add, so the engine needs none")
    monkeypatch.setattr(native, "float_kernel", lambda library: "portable C")  # a library without FMA
    runner = open_runner(Manifest.read(tiny_engine), num_blocks=32, threads=1)
    assert runner.attention.startswith("graph (the engine's native graph needs fma")
    runner.close()


def test_packed_weights_over_the_limit_are_made_when_the_engine_loads(tiny_dir, tiny_engine, library, tmp_path,
                                                                       monkeypatch):
    import numpy as np

    from autoglm_trt.backends.onnxrt.backend import BACKEND as ort
    from autoglm_trt.backends.onnxrt.findings import native_report

    saved = Manifest.read(tiny_engine).ort_graphs
    if saved["native_weights"] is None:
        pytest.skip("this machine's library packs no weights for the tiny fp32 engine (no fused multiply-add)")
    monkeypatch.setattr(loader, "PACK_AT_LOAD_BYTES", 0)
    engine = build_tiny_engine(tiny_dir, tmp_path / "at-load")
    graphs = Manifest.read(engine).ort_graphs
    assert graphs["native_weights"] is None and not (engine / "model.native.bin").exists()
    assert graphs["packed_at_load"] == {"kv_dtype": "float32", "dynamic_int8": False, "bf16_attention": False}
    assert (engine / "model.native.onnx").is_file() and graphs["requires"] == saved["requires"]
    window = np.arange(3, 35, dtype=np.int64)[None]
    made, kept = ort.graph_runner(Manifest.read(engine), 1), ort.graph_runner(Manifest.read(tiny_engine), 1)
    assert np.array_equal(made.logits(window), kept.logits(window))  # the same graph and weights, bit for bit
    runner = open_runner(Manifest.read(engine), num_blocks=32, threads=1)
    assert runner.attention == "native"
    runner.close()
    report = native_report(Manifest.read(engine))  # doctor runs the passes again, as loading does
    assert "native weights: packed when the engine loads (the passes give the saved native graph here)" in report
    assert "graph: model.native.onnx (native operators)" in report

    # passes that make another graph than the build saved: the plain graph, and why
    monkeypatch.setattr(passes, "PASSES", tuple(p for p in passes.PASSES if p[0] != "skip_norm"))
    runner = open_runner(Manifest.read(engine), num_blocks=32, threads=1)
    assert runner.attention.startswith("graph (the passes made another native graph here than the engine's build")
    runner.close()
    [line] = [r for r in native_report(Manifest.read(engine)) if r.startswith("graph: ")]
    assert line.startswith("graph: model.plain.onnx (the plain graph: the passes made another native graph here")


def test_a_malformed_packed_at_load_record_is_refused(tiny_engine, tmp_path):
    from autoglm_trt.artifacts import EngineError

    engine = _edited(tiny_engine, tmp_path, lambda g: g.update(packed_at_load={"kv_dtype": "int4"}))
    with pytest.raises(EngineError, match="packed_at_load must name a KV dtype"):
        Manifest.read(engine)
