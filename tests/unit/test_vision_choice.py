"""Which encoder graph an ONNX Runtime engine runs here (``backends.onnxrt.vision.vision_graph``):
from the manifest's record of the build's forms and this machine's CPU and native library, each
choice with its reason; a malformed record (``record_schema.VisionForms``) or a file outside the
engine refused with one."""

from __future__ import annotations

import json

import pytest

from autoglm_trt.artifacts import EngineError
from autoglm_trt.backends.onnxrt import vision as choice
from autoglm_trt.record_schema import VisionForms, typed

BOTH = {"linears": "int8", "attention": "bfloat16",
        "graphs": {"float32": "vision.onnx", "int8": "vision.int8.onnx"},
        "native_graphs": {"float32": "vision.native.onnx", "int8": "vision.int8.native.onnx"}}


class _Manifest:
    def __init__(self, tmp_path, vision):
        self.dir = tmp_path
        self.vision_forms = None if vision is None else typed(VisionForms, vision, tmp_path / "manifest.json",
                                                              EngineError, "rebuild the engine", "vision.")


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """Set what this 'machine' has: VNNI, a native library, AVX512-BF16."""
    def set_(vnni: bool, library: bool, bf16: bool) -> None:
        monkeypatch.setattr(choice, "int8_pairs_saturate", lambda: not vnni)
        monkeypatch.setattr(choice, "native_library", lambda: (tmp_path / "lib.so", "") if library
                            else (None, "AUTOGLM_TRT_NATIVE=0"))
        monkeypatch.setattr(choice, "image_attention_bf16", lambda path: bf16)
    return set_


@pytest.mark.parametrize("vnni,library,bf16,graph,why", [
    (True, True, True, "vision.int8.native.onnx", "bfloat16 attention"),
    (False, True, True, "vision.native.onnx", "no VNNI"),
    (True, True, False, "vision.int8.onnx", "no AVX512-BF16"),
    (True, False, True, "vision.int8.onnx", "no native library: AUTOGLM_TRT_NATIVE=0"),
    (False, False, False, "vision.onnx", "no VNNI"),
])
def test_the_best_form_this_machine_runs_and_why(tmp_path, machine, vnni, library, bf16, graph, why):
    machine(vnni, library, bf16)
    name, reason, lib = choice.vision_graph(_Manifest(tmp_path, BOTH))
    assert name == graph and why in reason
    assert (lib is not None) == ("native" in graph)


def test_the_switch_and_an_engine_built_without_the_forms(tmp_path, machine, monkeypatch):
    machine(True, True, True)
    monkeypatch.setenv(choice.ENV_VISION_INT8, "0")
    assert choice.vision_graph(_Manifest(tmp_path, BOTH))[:2] == (
        "vision.native.onnx", "float32 linears (AUTOGLM_TRT_VISION_INT8=0), bfloat16 attention (native "
                              "ImageAttentionBf16)")
    for built in (None, {"linears": "float32", "attention": "float32", "graphs": {"float32": "vision.onnx"}}):
        name, reason, lib = choice.vision_graph(_Manifest(tmp_path, built))
        assert (name, lib) == ("vision.onnx", None) and "the build's vision_attention" in reason


FLOAT = {"linears": "float32", "attention": "float32"}


@pytest.mark.parametrize("vision,message", [
    ({**FLOAT, "graphs": ["vision.onnx"]}, "'vision.graphs' must be an object"),
    ({**FLOAT, "graphs": {}}, "vision.graphs must name a graph file for some of the forms float32, int8, got {}"),
    ({**FLOAT, "graphs": {"fp8": "vision.onnx"}}, "vision.graphs must name a graph file"),
    ({**FLOAT, "graphs": {"float32": "vision.onnx"}, "native_graphs": {"float32": 7}},
     "vision.native_graphs must name a graph file"),
    ({**FLOAT, "linears": "fp8", "graphs": {"float32": "vision.onnx"}},
     "vision.linears must be one of float32, int8, got 'fp8'"),
    ({"linears": "float32", "graphs": {"float32": "vision.onnx"}}, "'vision.attention'"),
    ({**FLOAT, "graphs": {"float32": "vision.onnx"}, "int8_linears": -1},
     "vision.int8_linears must be an integer >= 0, got -1"),
    ({**FLOAT, "graphs": {"float32": "../elsewhere.onnx"}}, "not inside"),
    ({"linears": "float32", "attention": "bfloat16", "graphs": {"float32": "vision.onnx"},
      "native_graphs": {"float32": "/etc/passwd"}}, "not inside"),
])
def test_a_malformed_record_is_refused_with_the_reason(tmp_path, machine, vision, message):
    machine(True, True, True)
    with pytest.raises(EngineError, match=message):
        choice.vision_graph(_Manifest(tmp_path, json.loads(json.dumps(vision))))
