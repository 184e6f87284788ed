"""Artifacts you can trust: nothing read outside an artifact, one-line errors for
malformed inputs, and nothing half-written on SIGTERM. Each case is a crafted copy of a real
artifact, checked through the library and the command line."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from conftest import ROOT, run_cli

from autoglm_trt.artifacts import ArtifactError, CalibRecord, EngineError, ExportRecord, Manifest
from autoglm_trt.errors import CheckpointError, UnsupportedModelError
from autoglm_trt.graph.exported_weights import ExportedWeights
from autoglm_trt.model.checkpoint import Checkpoint
from autoglm_trt.model.safetensors import SafetensorsFile
from autoglm_trt.model.spec import spec_from_config
from autoglm_trt.runtime import Engine


def edited_copy(src, dst, name: str, edit) -> None:
    shutil.copytree(src, dst)
    path = dst / name
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def one_line_error(r: subprocess.CompletedProcess, text: str) -> None:
    """Exit code 1 and, after any progress lines, one short ``Error: ...`` line that says ``text``."""
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: ") and text in last and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(last) < 1000


# -- files outside the artifact ----------------------------------------------------------------------
@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(engine_file="../../other/model.opt.onnx"), "not inside"),
    (lambda m: m.update(engine_file="/etc/hostname"), "not inside"),
    (lambda m: m["files"].update({"../x": "0" * 64}), "not inside"),
    (lambda m: m.update(engine_file="tokenizer.json", files={"tokenizer.json": m["files"]["tokenizer.json"]}),
     None),  # a hashed file of the engine, but not ONNX: doctor must say so
    (lambda m: m.update(engine_file="export.json2"), "not one of the engine's hashed files"),
    (lambda m: m.pop("limits"), "lacks the key 'limits'"),
    (lambda m: m.update(files=list(m["files"])), "'files' must be an object, got"),
    (lambda m: m["files"].update({"model.plain.onnx": "abc"}),
     "files must map each file to its SHA-256 hex digest; 'model.plain.onnx' has 'abc'"),
    (lambda m: m["kv_cache"].update(block_size=0), "kv_cache.block_size must be an integer >= 1"),
    (lambda m: m["limits"].update(max_seq_len=True), "'limits.max_seq_len' must be an integer, got True"),
    (lambda m: m["onnxruntime"].pop("passes"), "lacks the key 'onnxruntime.passes'"),
    (lambda m: m["kv_cache"].update(dtype="float64"), "kv_cache.dtype must be one of"),
    (lambda m: m["kv_cache"].update(bytes=m["kv_cache"]["num_blocks"] - 1),  # 0 bytes a block
     "kv_cache.bytes 63 is not the same whole number of bytes for each of its 64 blocks"),
    (lambda m: m["kv_cache"].update(bytes=m["kv_cache"]["bytes"] + 1), "is not the same whole number of bytes"),
    (lambda m: m.update(backend="cuda"), "backend must be one of"),
    (lambda m: m.update(format="autoglm-trt/engine/1"), "rebuild it with `autoglm-trt build`"),  # an older engine
    (lambda m: m.update(versions=5), "'versions' must be an object, got 5"),
    (lambda m: m["source"].pop("path"), "lacks the key 'source.path'"),
    (lambda m: m["onnxruntime"].update(requires=[{}]), "onnxruntime.requires must hold only feature names, got {}"),
    (lambda m: m["onnxruntime"].update(passes=[5]), "onnxruntime.passes must hold a name and a count"),
    (lambda m: m["onnxruntime"].update(passes=[{"name": "rope_qkv"}]), "onnxruntime.passes must hold a name and a"),
    (lambda m: m.update(precision="int3"), "precision must be one of fp32, fp16, int8"),
    (lambda m: m["spec"].update(eos_token_ids=None), "eos_token_ids must be a list, got None"),
    (lambda m: m["source"].update(path="\ud800"), "is corrupt"),  # a lone surrogate: no text
    (lambda m: m["spec"].update(num_layers="x"), "num_layers must be an integer >= 1"),
    (lambda m: m["spec"].update(family=5), "family must be one of"),
    (lambda m: m["spec"]["rope"].update(theta=0), "rope.theta must be a number > 0"),
    (lambda m: m["spec"].update(num_layers=31), "spec differs from the engine graph's"),
    (lambda m: m["build_config"].update(max_images="x"), "'build_config.max_images' must be an integer, got 'x'"),
    (lambda m: m["build_config"].update(vision_dtype="int4"), "build_config.vision_dtype must be one of"),
])
def test_crafted_manifests_are_refused(tiny_engine, tmp_path, edit, message):
    bad = tmp_path / "engine"
    edited_copy(tiny_engine, bad, "manifest.json", edit)
    r = run_cli("doctor", str(bad))
    if message is None:
        assert r.returncode == 1 and "not a valid ONNX model" in r.stdout, r.stdout
        return
    with pytest.raises(EngineError, match=message):
        Engine.load(bad)
    one_line_error(r, message)


def test_a_number_past_pythons_digit_limit_is_a_corrupt_record(tiny_engine, tmp_path):
    shutil.copytree(tiny_engine, tmp_path / "engine")
    path = tmp_path / "engine" / "manifest.json"
    path.write_text(path.read_text().replace('"max_seq_len": ', '"max_seq_len": ' + "9" * 5000 + ", \"x\": ", 1))
    one_line_error(run_cli("inspect", str(tmp_path / "engine")), "manifest.json is corrupt (Exceeds the limit")


def test_inspect_says_what_a_manifest_does_not_record(tiny_engine, tmp_path):
    """``source`` and ``versions`` are optional keys of a manifest: inspect summarises one without them."""
    edited_copy(tiny_engine, tmp_path / "engine", "manifest.json", lambda m: [m.pop("source"), m.pop("versions")])
    r = run_cli("inspect", str(tmp_path / "engine"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "source       not recorded" in r.stdout and "versions     not recorded" in r.stdout
    (tmp_path / "engine" / "fusion_report.json").write_text('{"nodes_before": 1, "fusions": []}')
    one_line_error(run_cli("inspect", str(tmp_path / "engine")), "fusion_report.json is missing, or differs from "
                                                                   "the one the build wrote")
    report = tmp_path / "engine" / "fusion_report.json"
    report.write_text('{"nodes_before": ' + "9" * 5000 + "}")
    manifest = json.loads((tmp_path / "engine" / "manifest.json").read_text())
    manifest["files"]["fusion_report.json"] = hashlib.sha256(report.read_bytes()).hexdigest()
    manifest["onnxruntime"]["native_graph"] = "tokenizer.json"  # a hashed file of the engine, but no graph
    (tmp_path / "engine" / "manifest.json").write_text(json.dumps(manifest))
    one_line_error(run_cli("inspect", str(tmp_path / "engine")), "fusion_report.json is corrupt (Exceeds the limit")
    report.write_text("{}")
    manifest["files"]["fusion_report.json"] = hashlib.sha256(b"{}").hexdigest()
    (tmp_path / "engine" / "manifest.json").write_text(json.dumps(manifest))
    for command in ("inspect", "doctor"):
        one_line_error(run_cli(command, str(tmp_path / "engine")), "tokenizer.json is missing or not an ONNX graph")
    edited_copy(tiny_engine, tmp_path / "export", "export.json", lambda e: e.update(source=None))
    with pytest.raises(EngineError, match="'source' must be an object, got None"):  # the engine's own record
        Manifest.read(tmp_path / "export")
    one_line_error(run_cli("inspect", str(tmp_path / "export")), "'source' must be an object, got None")


def test_a_vision_graph_the_manifest_names_must_be_a_hashed_file_of_the_engine(glm4v_engine, tmp_path):
    """An image-text engine's ``vision`` names its encoder graphs: one that is not among the hashed
    files (doctor would check nothing, and load fail) or not of its form is refused as it is read."""
    edited_copy(glm4v_engine, tmp_path / "named", "manifest.json",
                lambda m: m["vision"]["graphs"].update(int8="vision.int8.onnx"))
    message = "vision.graphs.int8 'vision.int8.onnx' is not one of the engine's hashed files; rebuild the engine"
    with pytest.raises(EngineError, match=message):
        Manifest.read(tmp_path / "named")
    for command in ("doctor", "inspect"):
        one_line_error(run_cli(command, str(tmp_path / "named")), message)
    edited_copy(glm4v_engine, tmp_path / "form", "manifest.json",
                lambda m: m["vision"].update(native_graphs={"float32": ["vision.onnx"]}))
    one_line_error(run_cli("doctor", str(tmp_path / "form")), "vision.native_graphs must name a graph file")
    assert Manifest.read(glm4v_engine).vision_forms.files() == {"vision.graphs.float32": "vision.onnx"}


def test_malformed_build_records_are_refused_by_name(tiny_engine, tmp_path):
    """A manifest's build_config and an export's record of the build step that made it are objects;
    anything else is refused with the key and what to do, not a TypeError where they are read."""
    edited_copy(tiny_engine, tmp_path / "config", "manifest.json", lambda m: m.update(build_config=["vision_dtype"]))
    with pytest.raises(EngineError, match="'build_config' must be an object, got .*rebuild the engine"):
        _ = Manifest.read(tmp_path / "config").build_config
    edited_copy(tiny_engine, tmp_path / "made", "export.json", lambda e: e.update(int4="rounded"))
    with pytest.raises(ArtifactError, match="'int4' must be an object, got 'rounded'; delete the directory"):
        ExportRecord.read(tmp_path / "made").made_by("int4")


def test_export_record_graph_file_must_be_inside(tiny_engine, tmp_path):
    bad = tmp_path / "engine"
    edited_copy(tiny_engine, bad, "export.json", lambda e: e["graph"].update(file="../../elsewhere/model.onnx"))
    with pytest.raises(ArtifactError, match="not inside"):
        ExportRecord.read(bad)
    one_line_error(run_cli("eval", str(bad), "--text", str(ROOT / "calibration" / "eval" / "heldout.txt")),
                   "not inside")


@pytest.fixture(scope="module")
def tiny_export(tiny_dir, tmp_path_factory):
    from autoglm_trt.export.pipeline import ExportConfig, export_checkpoint

    out = tmp_path_factory.mktemp("exp") / "export"
    export_checkpoint(ExportConfig(tiny_dir("llama"), out, validate=False), log=lambda m: None)
    return out


def test_external_data_outside_the_export_is_refused(tiny_export, tmp_path):
    bad = tmp_path / "export"
    shutil.copytree(tiny_export, bad)
    model = onnx.load(str(bad / "model.onnx"), load_external_data=False)
    for t in model.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../../secret.bin"
        break
    onnx.save_model(model, str(bad / "model.onnx"))
    with pytest.raises(ArtifactError, match="not inside"):
        ExportedWeights(bad)
    one_line_error(run_cli("calibrate", str(bad), "-o", str(tmp_path / "c"), "--calib-samples", "2"), "not inside")


def test_shard_names_must_stay_inside_the_checkpoint(tiny_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dir("llama"), ckpt)
    names = [p.name for p in ckpt.glob("*.safetensors")]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../" + names[0]}}))
    with pytest.raises(CheckpointError, match="not a file inside"):
        Checkpoint.open(ckpt)


# -- one-line errors for malformed inputs ----------------------------------------------------------------
@pytest.mark.parametrize("field, value, message", [
    ("hidden_size", "abc", "'hidden_size' must be an integer >= 1"),
    ("hidden_size", None, "lacks the field 'hidden_size'"),
    ("eos_token_id", "x", "eos_token_id must be a token id"),
    ("rope_parameters", "oops", "'rope_parameters' must be an object"),
    ("vocab_size", -5, "'vocab_size' must be an integer >= 1"),
    ("num_hidden_layers", 0, "'num_hidden_layers' must be an integer >= 1"),
    ("rms_norm_eps", "tiny", "'rms_norm_eps' must be a number"),
    ("model_type", ["llama"], "is not supported"),
])
def test_bad_config_fields(tiny_dir, tmp_path, field, value, message):
    config = json.loads((tiny_dir("llama") / "config.json").read_text())
    config[field] = value
    with pytest.raises(UnsupportedModelError, match=message):
        spec_from_config(config)
    if field in ("hidden_size", "rope_parameters"):
        ckpt = tmp_path / "ckpt"
        shutil.copytree(tiny_dir("llama"), ckpt)
        (ckpt / "config.json").write_text(json.dumps(config))
        one_line_error(run_cli("export", str(ckpt), "-o", str(tmp_path / "out")), message)


def _safetensors(path, header: bytes, data: bytes = b"\0" * 64) -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


@pytest.mark.parametrize("header, message", [
    ({"w": {"dtype": "F32", "shape": [64], "data_offsets": [-256, 0]}}, "0 <= begin <= end"),
    ({"a": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]},
      "b": {"dtype": "F32", "shape": [8], "data_offsets": [16, 48]}}, "overlap"),
    ({"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 0]}}, "dimensions be >= 0"),
])
def test_bad_safetensors_offsets(tmp_path, header, message):
    f = tmp_path / "m.safetensors"
    _safetensors(f, json.dumps(header).encode())
    with pytest.raises(CheckpointError, match=message):
        SafetensorsFile(f)


def test_deeply_nested_safetensors_header(tmp_path):
    f = tmp_path / "m.safetensors"
    _safetensors(f, b"[" * 100_000)
    with pytest.raises(CheckpointError, match="not valid JSON"):
        SafetensorsFile(f)


@pytest.mark.parametrize("args, message", [
    (["--batch-size", "0"], "batch_size must be an integer >= 1"),
    (["--smoothquant", "nan"], "SmoothQuant alpha must be in (0, 1]"),
    (["--percentile", "200"], "percentile must be in (0, 100]"),
])
def test_bad_calibration_options(tiny_export, tmp_path, args, message):
    one_line_error(run_cli("calibrate", str(tiny_export), "-o", str(tmp_path / "c"), *args), message)


def test_bad_build_configs(tiny_dir, tmp_path):
    f = tmp_path / "latin1.yaml"
    f.write_bytes("max_batch_size: 4  # caf\xe9\n".encode("latin-1"))
    one_line_error(run_cli("build", "nowhere", "--config", str(f)), "not UTF-8")
    bomb = tmp_path / "bomb.yaml"
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    bomb.write_text("\n".join(lines) + "\nmax_batch_size: *a8\n")
    t = time.perf_counter()
    r = run_cli("build", "nowhere", "--config", str(bomb))
    assert time.perf_counter() - t < 60  # a bound, not a benchmark: the old message took minutes and GBs
    one_line_error(r, "unknown key 'a0'")
    huge = run_cli("build", str(tiny_dir("llama")), "--precision", "fp32", "--backend", "onnxruntime",
                   "--max-seq-len", "96", "--kv-memory-bytes", str(10**15), "-o", str(tmp_path / "e"))
    one_line_error(huge, "GiB available")


def test_sigterm_during_export_leaves_nothing_behind(tiny_dir, tmp_path):
    for attempt in range(3):  # a signal that lands as the export completes finds nothing to stop: try again
        out = tmp_path / f"out{attempt}"
        proc = subprocess.Popen([sys.executable, "-m", "autoglm_trt", "export", str(tiny_dir("llama")), "-o", str(out)],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            for _ in range(6000):  # 300 s at most: a loaded machine imports torch slowly
                if list(tmp_path.glob(f".{out.name}.partial-*")) or proc.poll() is not None:
                    break
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        finally:
            proc.kill()
        if out.is_dir():  # it completed first (the signal then landed in the interpreter's shutdown, if at all)
            shutil.rmtree(out)
            continue
        assert proc.returncode == 130, proc.stderr.read().decode()[-2000:]
        assert not list(tmp_path.iterdir()), list(tmp_path.iterdir())
        return
    pytest.fail("three exports in a row completed before SIGTERM reached them")


def test_eval_accepts_the_model_file(tiny_export):
    r = run_cli("eval", str(tiny_export / "model.onnx"), "--text", str(ROOT / "calibration" / "eval" / "heldout.txt"),
                "--max-chunks", "1", "--json")
    assert r.returncode == 0, r.stderr
    assert np.isfinite(json.loads(r.stdout)["ppl"])


def test_a_record_is_written_as_it_is_read(tiny_engine, tmp_path):
    """One declaration per record: what ``read`` refuses, ``write`` refuses too, before a file is
    made; what it takes, ``read`` takes back unchanged."""
    engine = tmp_path / "engine"
    shutil.copytree(tiny_engine, engine)
    manifest, export = json.loads((engine / "manifest.json").read_text()), ExportRecord.read(engine).data
    for name in ("manifest.json", "export.json"):
        (engine / name).unlink()
    with pytest.raises(ArtifactError, match="graph.dtype must be one of float32, float16, got 'bfloat16'"):
        ExportRecord.write(engine, {**export, "graph": {**export["graph"], "dtype": "bfloat16"}})
    with pytest.raises(ArtifactError, match="graph.file names '../x.onnx', which is not inside"):
        ExportRecord.write(engine, {**export, "graph": {**export["graph"], "file": "../x.onnx"}})
    for key in ("vision", "source"):  # null only where a typed section's field may be absent
        with pytest.raises(ArtifactError, match=f"'{key}' must be an object, got None"):
            ExportRecord.write(engine, {**export, key: None})
    assert not (engine / "export.json").exists()
    ExportRecord.write(engine, {**export, "graph": {**export["graph"], "kv_dtype": None}})
    assert ExportRecord.read(engine).kv_dtype == ExportRecord.read(engine).dtype
    ExportRecord.write(engine, export)
    with pytest.raises(EngineError, match="lacks the key 'kv_cache'"):
        Manifest.write(engine, {k: v for k, v in manifest.items() if k != "kv_cache"})
    with pytest.raises(EngineError, match="must say format autoglm-trt/engine/2"):
        Manifest.write(engine, {**manifest, "format": "autoglm-trt/engine/1"})
    assert not (engine / "manifest.json").exists()
    Manifest.write(engine, manifest)
    assert Manifest.read(engine).data == manifest and ExportRecord.read(engine).data == export
    with pytest.raises(ArtifactError, match="'amax' must be an object, got \\[\\]; calibrate again"):
        CalibRecord.write(tmp_path, {"model_sha256": "a" * 64, "data_sha256": "b" * 64, "amax": []})
    assert not (tmp_path / "calib.json").exists()


def test_manifest_round_trip(tiny_engine):
    m = Manifest.read(tiny_engine)
    assert m.engine_path.is_file() and m.verify_files() == [] and m.spec.vocab_size == 256
