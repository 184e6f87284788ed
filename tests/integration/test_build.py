"""`autoglm-trt build`: config, profiles, reuse of stages, backends, manifest, inspect/doctor."""

import json

import pytest
from conftest import run_cli

from autoglm_trt.backends.trt.loader import summarize_layers
from autoglm_trt.backends.trt.probe import tensorrt_available
from autoglm_trt.builder.config import BuildConfig, BuildConfigError, load_config
from autoglm_trt.builder.profiles import profile_shapes
from autoglm_trt.model.spec import spec_from_dict

HAS_TRT = tensorrt_available()[0]


def tiny_spec():
    return spec_from_dict({"family": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
                           "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
                           "rope": {"theta": 1e4, "rotary_dim": 16, "rope_type": "default", "scaling": {}},
                           "max_position_embeddings": 256, "tie_word_embeddings": True, "bos_token_id": 1,
                           "eos_token_ids": [2]})


def test_yaml_config_with_overrides(tmp_path):
    f = tmp_path / "b.yaml"
    f.write_text("max_batch_size: 4\nmax_seq_len: 512\nkv_num_blocks: 100\n")
    cfg = load_config(f, {"max_batch_size": 2, "max_input_len": None})
    assert (cfg.max_batch_size, cfg.max_seq_len, cfg.kv_num_blocks, cfg.max_input_len) == (2, 512, 100, None)
    assert cfg.resolved(tiny_spec(), 8192, 4, None, print).max_input_len == 512  # a text model's 1,024 at most


def test_limits_left_unset_follow_the_model():
    """A text model keeps 2,048 / 1,024 / 512 MiB; an image-text model takes the sequences its export
    allows, chunks of 4,096 and a pool that holds one whole sequence, within half the memory available
    (and says what it chose)."""
    import types

    text = tiny_spec()  # a KV block: 8,192 bytes (2 layers, 2 KV heads of 16, float32, 16 tokens)
    cfg = BuildConfig().resolved(text, 8192, 4, 10**12, print)
    assert (cfg.max_seq_len, cfg.max_input_len, cfg.kv_memory_bytes) == (2048, 1024, 512 << 20)
    images = types.SimpleNamespace(vision=True, num_layers=2, num_kv_heads=2, head_dim=16)  # what sizing reads
    said: list[str] = []
    cfg = BuildConfig().resolved(images, 65536, 4, 10**12, said.append)
    assert (cfg.max_seq_len, cfg.max_input_len) == (65536, 4096)
    assert cfg.num_blocks(images, 4) == (512 << 20) // 8192 and "sequences of up to 65,536 tokens" in said[-1]
    big = BuildConfig().resolved(images, 2**20, 4, 10**12, print)  # one sequence is more than 512 MiB: the pool holds it
    assert big.max_seq_len == 2**20 and big.num_blocks(images, 4) == 2**20 // 16
    small = 2 * (512 << 20)  # half of what is available holds 1,048,576 tokens
    said.clear()
    cfg = BuildConfig().resolved(images, 10**7, 4, small, said.append)
    assert cfg.max_seq_len == (512 << 20) // 8192 * 16 and cfg.kv_memory_bytes == 512 << 20
    assert "the model allows 10,000,000" in said[0]
    fixed = BuildConfig(max_seq_len=1000, max_input_len=500).resolved(images, 65536, 4, 10**12, print)
    assert (fixed.max_seq_len, fixed.max_input_len) == (1000, 500)


@pytest.mark.parametrize("text, message", [
    ("max_batch: 4\n", "unknown key 'max_batch'"),
    ("max_batch_size: four\n", "'max_batch_size' must be int, got str"),
    ("kv_num_blocks: 1.5\n", "'kv_num_blocks' must be int or null"),
    ("max_input_len: 4096\nmax_seq_len: 1024\n", "exceeds max_seq_len"),
    ("- a list\n", "must hold a mapping"),
    ("vision_dtype: half\n", "vision_dtype must be one of bfloat16, float16, float32, got 'half'"),
    ("vision_linears: int4\n", "vision_linears must be one of auto, int8, float32, got 'int4'"),
])
def test_bad_yaml_config(tmp_path, text, message):
    f = tmp_path / "b.yaml"
    f.write_text(text)
    with pytest.raises(BuildConfigError, match=message):
        load_config(f, {})
    r = run_cli("build", "nowhere", "--config", str(f))
    assert r.returncode == 1 and r.stderr.startswith("Error: ") and message in r.stderr, r.stderr


def test_print_config_shows_effective_values():
    r = run_cli("build", "nowhere", "--max-batch-size", "3", "--print-config")
    assert r.returncode == 0 and "max_batch_size: 3" in r.stdout and "kv_block_size: 16" in r.stdout


def test_profile_shapes_map_the_config():
    spec = tiny_spec()
    cfg = BuildConfig(max_batch_size=8, max_input_len=128, max_seq_len=300, kv_block_size=16, prefill_opt_tokens=64,
                      decode_opt_batch=4)
    p = profile_shapes(cfg, spec, num_blocks=40)
    assert p["prefill"]["input_ids"] == ((1, 1), (1, 64), (8, 128))
    assert p["prefill"]["block_tables"] == ((1, 1), (1, 1), (8, 19))  # ceil(300 / 16) blocks per sequence
    assert p["decode"]["input_ids"] == ((1, 1), (4, 1), (8, 1))
    assert p["decode"]["logits_indices"] == ((1, 1), (4, 1), (8, 1))
    assert p["decode"]["past_value.1"] == ((2, 40, 16, 16),) * 3  # [kv_heads, num_blocks, block_size, head_dim]
    assert set(p["prefill"]) == {"input_ids", "position_ids", "context_lens", "query_lens", "block_tables",
                                 "logits_indices", "past_key.0", "past_value.0", "past_key.1", "past_value.1"}


def test_kv_pool_from_memory_budget():
    spec = tiny_spec()
    # one block: 2 (K,V) x 2 layers x 16 tokens x 2 heads x 16 dims x 4 bytes = 8192 bytes
    assert BuildConfig(kv_memory_bytes=8192 * 100, max_seq_len=256).num_blocks(spec, 4) == 100
    with pytest.raises(BuildConfigError, match="fewer than one sequence"):
        BuildConfig(kv_memory_bytes=8192 * 3, max_seq_len=256).num_blocks(spec, 4)


def test_int8_build_reuses_stages_and_recalibrates_on_new_data(tiny_dir, tmp_path):
    ckpt = tiny_dir("glm")
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 400)
    args = ["build", str(ckpt), "--precision", "int8", "--calib", str(data), "--backend", "onnxruntime",
            "--max-seq-len", "128", "--max-input-len", "64", "--kv-num-blocks", "32"]
    first = run_cli(*args, "-o", str(tmp_path / "e1"))
    assert first.returncode == 0, first.stderr
    assert "exporting glm model" in first.stderr and "calibrating" in first.stderr
    second = run_cli(*args, "-o", str(tmp_path / "e2"))
    assert second.returncode == 0, second.stderr
    assert "reusing export" in second.stderr and "reusing calibration" in second.stderr
    assert "exporting glm model" not in second.stderr
    (data / "b.txt").write_text("New calibration text changes the data hash. " * 100)
    third = run_cli(*args, "-o", str(tmp_path / "e3"))
    assert third.returncode == 0, third.stderr
    assert "reusing export" in third.stderr and "reusing calibration" not in third.stderr
    m1 = json.loads((tmp_path / "e1" / "manifest.json").read_text())
    m3 = json.loads((tmp_path / "e3" / "manifest.json").read_text())
    assert m1["precision"] == "int8" and m1["backend"] == "onnxruntime"
    assert m1["files"]["calib.json"] != m3["files"]["calib.json"]
    assert set(m1["files"]) >= {"model.opt.onnx", "model.opt.onnx.data", "export.json", "tokenizer.json",
                                "fusion_report.json", "calib.json", "calibration.cache"}
    assert m1["kv_cache"]["num_blocks"] == 32 and m1["limits"]["max_seq_len"] == 128
    assert m1["versions"]["onnxruntime"] and len(m1["source"]["checkpoint_sha256"]["model.safetensors"]) == 64
    out = run_cli("inspect", str(tmp_path / "e1"))
    assert out.returncode == 0 and "precision int8" in out.stdout and "fusions" in out.stdout
    assert not list(tmp_path.glob(".e*"))  # no temporary directories left behind


def test_unknown_precision_and_missing_source(tmp_path):
    r = run_cli("build", str(tmp_path), "--precision", "int4")
    assert r.returncode == 2 and "int4" in r.stderr
    r = run_cli("build", str(tmp_path / "nope"), "--precision", "fp32", "-o", str(tmp_path / "e"))
    assert r.returncode == 1 and "neither a Hugging Face checkpoint" in r.stderr


@pytest.mark.skipif(HAS_TRT, reason="this machine has TensorRT and a GPU; the error path is for machines without")
def test_tensorrt_backend_without_tensorrt_says_what_is_missing(tiny_dir, tmp_path):
    r = run_cli("build", str(tiny_dir("llama")), "--precision", "fp32", "--backend", "tensorrt", "-o",
                str(tmp_path / "e"))
    assert r.returncode == 1
    assert "TensorRT backend cannot run here" in r.stderr and "--backend onnxruntime" in r.stderr
    assert not (tmp_path / "e").exists()


def test_auto_backend_falls_back_to_onnxruntime_and_says_why(tiny_dir, tmp_path):
    r = run_cli("build", str(tiny_dir("llama")), "--precision", "fp16", "-o", str(tmp_path / "e"),
                "--max-seq-len", "128", "--max-input-len", "64", "--kv-num-blocks", "16")
    assert r.returncode == 0, r.stderr
    expected = "tensorrt" if HAS_TRT else "onnxruntime"
    assert f"backend auto: {expected}" in r.stderr
    m = json.loads((tmp_path / "e" / "manifest.json").read_text())
    assert m["kv_cache"]["dtype"] == "float16"


def test_engine_inspector_summary():
    info = {"Layers": [{"Name": "layers.0.qkv + layers.0.qkv_bias", "LayerType": "CaskGemm"},
                       {"Name": "softmax", "LayerType": "CaskSoftMax"}, "Reformat 1"]}
    s = summarize_layers(info)
    assert s["layers"] == 3 and s["fused_count"] == 1 and s["layer_types"]["CaskGemm"] == 1


@pytest.mark.tensorrt
@pytest.mark.skipif(not HAS_TRT, reason="needs TensorRT >= 10 and an NVIDIA GPU (not on the CI machines)")
def test_tensorrt_engine_builds_and_matches_onnxruntime(tiny_dir, tmp_path):  # pragma: no cover - GPU machines
    from autoglm_trt.runtime import Engine, SamplingParams

    common = ["--precision", "fp16", "--max-seq-len", "128", "--max-input-len", "64", "--kv-num-blocks", "32"]
    for backend, name in (("tensorrt", "t"), ("onnxruntime", "o")):
        r = run_cli("build", str(tiny_dir("llama")), *common, "--backend", backend, "-o", str(tmp_path / name))
        assert r.returncode == 0, r.stderr
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    with Engine.load(tmp_path / "t") as trt_engine, Engine.load(tmp_path / "o") as ort_engine:
        assert trt_engine.generate(["hello"], params)[0].token_ids == ort_engine.generate(["hello"], params)[0].token_ids


def test_the_optimizing_session_packs_no_weights_and_saves_the_same_graph(tiny_dir, tmp_path):
    """``loader.optimize`` only saves ONNX Runtime's optimized graph: its session is made with the
    kernels' weight prepacking off (a second copy of every weight, which a 9B's build cannot hold
    beside the first), and saves the graph and weights a session with prepacking saves, byte for byte."""
    import onnxruntime as ort

    from autoglm_trt.backends.onnxrt import loader, session
    from autoglm_trt.export.pipeline import ExportConfig, export_checkpoint

    assert session.session_options(prepacking=False).get_session_config_entry("session.disable_prepacking") == "1"
    with pytest.raises(RuntimeError, match="does not have configuration"):  # a run's sessions pack
        session.session_options().get_session_config_entry("session.disable_prepacking")
    export_checkpoint(ExportConfig(tiny_dir("glm"), tmp_path / "export"), log=lambda m: None)
    (tmp_path / "made").mkdir()
    (tmp_path / "packed").mkdir()
    loader.optimize(tmp_path / "export" / "model.onnx", tmp_path / "made")
    so = session.session_options(save_optimized=tmp_path / "packed" / "model.opt.onnx")
    ort.InferenceSession(str(tmp_path / "export" / "model.onnx"), so, providers=["CPUExecutionProvider"])
    for name in ("model.opt.onnx", "model.opt.onnx.data"):
        assert (tmp_path / "made" / name).read_bytes() == (tmp_path / "packed" / name).read_bytes()
