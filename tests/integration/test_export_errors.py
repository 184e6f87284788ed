"""Bad input to `autoglm-trt export`: a clear message, exit code != 0, nothing half-written."""

import json
import shutil

import pytest
from conftest import run_cli


@pytest.fixture()
def ckpt(tiny_dir, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_dir("llama"), d)
    return d


def assert_fails(result, *phrases):
    assert result.returncode != 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    for p in phrases:
        assert p in result.stderr, result.stderr


def test_unknown_model_type_lists_supported(ckpt, tmp_path):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert_fails(run_cli("export", str(ckpt), "-o", str(tmp_path / "out")),
                 "model_type 'mamba'", "supported model types: glm, glm4, glm4v, llama")
    assert not (tmp_path / "out").exists()


def test_missing_config(ckpt, tmp_path):
    (ckpt / "config.json").unlink()
    assert_fails(run_cli("export", str(ckpt), "-o", str(tmp_path / "out")), "has no config.json")


def test_truncated_safetensors(ckpt, tmp_path):
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    assert_fails(run_cli("export", str(ckpt), "-o", str(tmp_path / "out")), "truncated")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary directory left


def test_pickle_only_checkpoint_is_refused_unless_allowed(ckpt, tmp_path):
    import torch
    from safetensors.torch import load_file

    state = load_file(ckpt / "model.safetensors")
    torch.save(state, ckpt / "pytorch_model.bin")
    (ckpt / "model.safetensors").unlink()
    assert_fails(run_cli("export", str(ckpt), "-o", str(tmp_path / "out")), "pickled", "--allow-pickle")
    ok = run_cli("export", str(ckpt), "-o", str(tmp_path / "out"), "--allow-pickle")
    assert ok.returncode == 0, ok.stderr
    assert json.loads((tmp_path / "out" / "export.json").read_text())["parity"]["passed"]


def test_existing_output_needs_force(ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_fails(run_cli("export", str(ckpt), "-o", str(out)), "already exists", "--force")
    assert (out / "keep.txt").read_text() == "mine"
    ok = run_cli("export", str(ckpt), "-o", str(out), "--force")
    assert ok.returncode == 0, ok.stderr
    assert (out / "model.onnx").is_file() and not (out / "keep.txt").exists()


def test_missing_checkpoint_directory(tmp_path):
    assert_fails(run_cli("export", str(tmp_path / "nope"), "-o", str(tmp_path / "out")), "does not exist")
