"""The ONNX Runtime rewrite passes run when an engine is built; loading it only chooses a saved graph."""

from __future__ import annotations

import json
import shutil

import pytest

from autoglm_trt.artifacts import Manifest
from autoglm_trt.backends import open_runner
from autoglm_trt.backends.onnxrt import passes


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
