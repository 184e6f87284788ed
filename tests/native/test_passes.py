"""The ONNX Runtime rewrite passes run when an engine is built; loading it, and ``doctor``, only
choose a saved graph and read its packed weights."""

from __future__ import annotations

import json
import shutil

import pytest

from autoglm_trt.artifacts import Manifest
from autoglm_trt.backends import open_runner
from autoglm_trt.backends.onnxrt import passes


def test_the_manifest_records_every_pass_in_order(tiny_int8_engine, library):
    graphs = Manifest.read(tiny_int8_engine).ort_graphs
    assert [p["name"] for p in graphs.passes] == [name for name, _ in passes.PASSES]
    assert graphs.passes_version == passes.PASSES_VERSION
    assert graphs.native_graph == "model.native.onnx" and graphs.native_weights == "model.native.bin"
    assert all(p["applied"] or p["why_not"] for p in graphs.passes)  # each says what it did or why not
    done = {p["name"] for p in graphs.passes if p["applied"]}
    assert {"attention", "rope_qkv", "hadamard_quantize", "linears", "step_branch"} <= done


def _no_rewrite(*args, **kwargs):
    raise AssertionError("the engine graph was rewritten while loading")


def test_loading_runs_the_saved_native_graph_and_rewrites_nothing(tiny_int8_engine, library, monkeypatch):
    from autoglm_trt.backends.onnxrt.findings import native_report

    monkeypatch.setattr(passes, "rewrite", _no_rewrite)
    runner = open_runner(Manifest.read(tiny_int8_engine), num_blocks=32, threads=1)
    assert runner.attention == "native"
    runner.close()
    assert "graph: model.native.onnx (native operators)" in native_report(Manifest.read(tiny_int8_engine))


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

    requires = Manifest.read(tiny_engine).ort_graphs.requires
    if "fma" not in requires:
        pytest.skip("this machine's library has no fused multiply-add, so the engine needs none")
    monkeypatch.setattr(native, "float_kernel", lambda library: "portable C")  # a library without FMA
    runner = open_runner(Manifest.read(tiny_engine), num_blocks=32, threads=1)
    assert runner.attention.startswith("graph (the engine's native graph needs fma")
    runner.close()


def test_an_engine_whose_build_left_its_packed_weights_to_the_load_runs_its_plain_graph(tiny_engine, library,
                                                                                       tmp_path, monkeypatch):
    """An older build saved no ``model.native.bin`` for packed weights over 1 GiB and recorded
    ``packed_at_load``: loading and ``doctor`` rewrite nothing, take the plain graph and say to rebuild."""
    from autoglm_trt.backends.onnxrt.findings import native_report

    def left_to_the_load(graphs):
        graphs.update(native_weights=None, packed_at_load={"kv_dtype": "float32", "dynamic_int8": False,
                                                           "bf16_attention": False})

    engine = _edited(tiny_engine, tmp_path, left_to_the_load)
    (engine / "model.native.bin").unlink(missing_ok=True)
    monkeypatch.setattr(passes, "rewrite", _no_rewrite)
    runner = open_runner(Manifest.read(engine), num_blocks=32, threads=1)
    assert runner.attention.startswith("graph (the engine saved no packed weights for its native graph")
    assert runner.attention.endswith("rebuild the engine for the native operators)")
    runner.close()
    [line] = [r for r in native_report(Manifest.read(engine)) if r.startswith("graph: ")]
    assert line.startswith("graph: model.plain.onnx (the plain graph: the engine saved no packed weights")
