"""A record's typed sections: the keys each dataclass declares, and the section checked and
made from a record's JSON and given back as it."""

from __future__ import annotations

from pathlib import Path

import pytest

from autoglm_trt.record_schema import (
    CALIB_KEYS,
    EXPORT_KEYS,
    MADE_BY,
    Calibration,
    ExportedModel,
    GpuRecord,
    GraphRecord,
    KVCache,
    Limits,
    SourceRecord,
    TensorRTBuild,
    VisionRecord,
    keys_of,
    typed,
    untyped,
)

WHERE = Path("engine/manifest.json")


class Refused(Exception):
    pass


def test_a_sections_fields_declare_its_keys():
    keys = {k.name: k for k in keys_of(KVCache)}
    assert list(keys) == ["block_size", "num_blocks", "bytes", "dtype", "layout", "scales"]
    assert [k.kind for k in keys.values()] == [int, int, int, str, str, dict]
    assert [k.required for k in keys.values()] == [True, True, True, True, False, False]
    assert keys["block_size"].rule(0) == "must be an integer >= 1, got 0" and keys["block_size"].rule(16) is None
    assert keys["dtype"].rule("bfloat16") == "must be one of float32, float16, int8, got 'bfloat16'"
    assert keys["layout"].rule is None
    assert CALIB_KEYS == keys_of(Calibration)
    graph = next(k for k in EXPORT_KEYS if k.name == "graph")
    assert graph.keys == keys_of(GraphRecord) and {k.name for k in graph.keys if k.required} == {
        "file", "dtype", "max_seq_len"}


def test_a_section_is_checked_made_and_given_back():
    data = {"block_size": 16, "num_blocks": 8, "bytes": 4096, "dtype": "int8", "scales": {"k.0": [0.5]}}
    kv = typed(KVCache, data, WHERE, Refused, "rebuild the engine", "kv_cache.")
    assert kv == KVCache(16, 8, 4096, "int8", "", {"k.0": [0.5]})  # the absent layout takes its default
    assert untyped(kv) == {**data, "layout": ""}
    assert untyped(Limits(1, 2, 3)) == {"max_batch_size": 1, "max_input_len": 2, "max_seq_len": 3}
    graph = typed(GraphRecord, {"file": "model.onnx", "dtype": "float16", "max_seq_len": 64, "opset": 21}, WHERE,
                  Refused, "re-export")
    assert graph == GraphRecord("model.onnx", "float16", 64) and graph.kv_dtype is None  # unknown keys pass by
    assert untyped(graph) == {"file": "model.onnx", "dtype": "float16", "max_seq_len": 64}


@pytest.mark.parametrize("limits,message", [
    ({"max_batch_size": 1, "max_input_len": 2}, "lacks the key 'limits.max_seq_len'"),
    ({"max_batch_size": True, "max_input_len": 2, "max_seq_len": 3}, "'limits.max_batch_size' must be an integer, "
                                                                      "got True; rebuild the engine"),
    ({"max_batch_size": 1, "max_input_len": 0, "max_seq_len": 3}, "limits.max_input_len must be an integer >= 1"),
    ({"max_batch_size": 1, "max_input_len": 2, "max_seq_len": "3"}, "'limits.max_seq_len' must be an integer"),
])
def test_a_bad_section_is_refused_with_its_key(limits, message):
    with pytest.raises(Refused, match=message):
        typed(Limits, limits, WHERE, Refused, "rebuild the engine", "limits.")


def test_an_optional_key_is_checked_where_present():
    older = {"file": "m.onnx", "dtype": "float32", "max_seq_len": 8, "kv_dtype": None}  # null: as if absent
    assert typed(GraphRecord, older, WHERE, Refused, "re-export").kv_dtype is None
    kv = {"block_size": 16, "num_blocks": 8, "bytes": 4096, "dtype": "int8", "layout": None}
    assert typed(KVCache, kv, WHERE, Refused, "rebuild the engine").layout == ""  # its default
    with pytest.raises(Refused, match="'graph.file' must be a string, got None"):  # a required one may not be null
        typed(GraphRecord, {**older, "file": None}, WHERE, Refused, "re-export", "graph.")
    with pytest.raises(Refused, match="graph.kv_dtype must be one of float32, float16, int8, got 'fp8'"):
        typed(GraphRecord, {"file": "m.onnx", "dtype": "float32", "max_seq_len": 8, "kv_dtype": "fp8"}, WHERE,
              Refused, "re-export", "graph.")
    with pytest.raises(Refused, match="'kv_amax' must be an object, got \\[1\\]"):
        typed(Calibration, {"model_sha256": "a" * 64, "data_sha256": "b" * 64, "amax": {}, "kv_amax": [1]}, WHERE, Refused,
              "calibrate again")


def test_a_section_holds_typed_sections_in_turn():
    from autoglm_trt.artifacts import EngineRecord

    keys = {k.name: k for k in keys_of(EngineRecord)}
    assert keys["limits"].kind is dict and keys["limits"].keys == keys_of(Limits)
    assert keys["kv_cache"].keys == keys_of(KVCache) and not keys["vision"].required
    manifest = {"backend": "onnxruntime", "precision": "int8", "spec": {}, "files": {"model.onnx": "0" * 64},
                "engine_file": "model.onnx", "limits": {"max_batch_size": 4, "max_input_len": 64, "max_seq_len": 256},
                "kv_cache": {"block_size": 16, "num_blocks": 8, "bytes": 4096, "dtype": "float32", "layout": "x"},
                "vision": None, "build_seconds": 3.5}
    record = typed(EngineRecord, manifest, WHERE, Refused, "rebuild the engine")
    assert record.limits == Limits(4, 64, 256) and record.kv_cache.num_blocks == 8 and record.vision is None
    assert untyped(record) == {k: v for k, v in manifest.items() if k not in ("vision", "build_seconds")}
    with pytest.raises(Refused, match="kv_cache.block_size must be an integer >= 1, got 0"):
        typed(EngineRecord, {**manifest, "kv_cache": {**manifest["kv_cache"], "block_size": 0}}, WHERE, Refused,
              "rebuild the engine")
    with pytest.raises(Refused, match="backend must be one of .*onnxruntime.*, got 'vllm'"):
        typed(EngineRecord, {**manifest, "backend": "vllm"}, WHERE, Refused, "rebuild the engine")


def test_an_export_record_is_typed_to_its_vision_and_source():
    keys = {k.name: k for k in EXPORT_KEYS}
    assert set(MADE_BY) <= set(keys) and not any(keys[step].required for step in MADE_BY)
    assert keys["vision"].keys == keys_of(VisionRecord) and not keys["vision"].nullable  # absent, never null
    assert keys["weight_only"].nullable
    graph = {"file": "model.onnx", "dtype": "float32", "max_seq_len": 64}
    data = {"spec": {"family": "glm4v"}, "graph": graph, "parity": {"max_abs_diff": 0.0},
            "source": {"checkpoint": "/ckpt", "sha256": {"config.json": "a" * 64}},
            "vision": {"spec": {"depth": 2}, "graph": "vision.onnx", "positions": "vision_positions.npy"},
            "int4": {"version": 2}}
    record = typed(ExportedModel, data, WHERE, Refused, "re-export")
    assert record == ExportedModel({"family": "glm4v"}, GraphRecord("model.onnx", "float32", 64),
                                   SourceRecord("/ckpt", {"config.json": "a" * 64}),
                                   VisionRecord({"depth": 2}, "vision.onnx", "vision_positions.npy"), None,
                                   {"version": 2})
    assert untyped(record) == {k: v for k, v in data.items() if k != "parity"}
    assert typed(ExportedModel, {"spec": {}, "graph": graph, "weight_only": None}, WHERE, Refused,
                 "re-export").weight_only is None
    for bad, message in [({"source": None}, "'source' must be an object, got None"),
                         ({"source": {"sha256": {"model.safetensors": "x"}}},
                          "source.sha256 must map each file to its SHA-256 hex digest; 'model.safetensors' has 'x'"),
                         ({"vision": {"spec": {}, "graph": "vision.onnx"}}, "lacks the key 'vision.positions'"),
                         ({"int4": []}, "'int4' must be an object, got \\[\\]")]:
        with pytest.raises(Refused, match=message):
            typed(ExportedModel, {**data, **bad}, WHERE, Refused, "re-export")


def test_a_tensorrt_section_names_its_gpu():
    built = typed(TensorRTBuild, {"version": "10.13.0", "gpu": {"name": "NVIDIA H200", "compute_capability": "9.0"}},
                  WHERE, Refused, "rebuild the engine", "tensorrt.")
    assert built == TensorRTBuild("10.13.0", GpuRecord("NVIDIA H200", "9.0"))
    with pytest.raises(Refused, match="lacks the key 'tensorrt.gpu.compute_capability'"):
        typed(TensorRTBuild, {"version": "10.13.0", "gpu": {"name": "NVIDIA H200"}}, WHERE, Refused,
              "rebuild the engine", "tensorrt.")


def test_a_calibrations_ranges_are_numbers():
    good = {"model_sha256": "a" * 64, "data_sha256": "b" * 64, "amax": {"layers.0.qkv": 1.5, "lm_head": 2},
            "kv_amax": {"new_key.0": [0.5]}, "float_linears": [{"linear": "layers.0.down", "reason": "rank 1"}]}
    assert typed(Calibration, good, WHERE, Refused, "calibrate again").amax["lm_head"] == 2
    for bad, message in [({"amax": {"layers.0.qkv": "x"}}, "amax must hold only numbers, got 'x'"),
                         ({"amax": {"layers.0.qkv": True}}, "amax must hold only numbers, got True"),
                         ({"kv_amax": {"new_key.0": "x"}}, "kv_amax must hold only lists, got 'x'"),
                         ({"float_linears": [5]}, "float_linears must hold only objects, got 5"),
                         ({"model_sha256": "zz"}, "model_sha256 must be a SHA-256 hex digest")]:
        with pytest.raises(Refused, match=message):
            typed(Calibration, {**good, **bad}, WHERE, Refused, "calibrate again")


def test_a_vision_spec_holds_positive_numbers():
    from autoglm_trt.model.vision import VisionSpec

    spec = VisionSpec(32, 8, 10000.0, 2, 14, 2, 64, 7, 5, 6)
    assert VisionSpec.from_json(spec.to_json()) == spec
    for name, value, message in [("merge_size", "x", "merge_size must be an integer >= 1, got 'x'"),
                                 ("patch_size", 0, "patch_size must be an integer >= 1, got 0"),
                                 ("image_token_id", -1, "image_token_id must be an integer >= 0"),
                                 ("rope_theta", "x", "rope_theta must be a number > 0")]:
        with pytest.raises(ValueError, match=message):
            VisionSpec.from_json({**spec.to_json(), name: value})
