"""The package as a user installs it: a wheel, in a fresh virtual environment outside the
repository, builds an INT8 engine without ``--calib``: the shipped calibration set must be
package data, not a path in the repository, which no wheel has."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from conftest import ROOT


def test_a_wheel_outside_the_repository_builds_int8_without_calib(tiny_dir, tmp_path):
    wheels = tmp_path / "wheels"
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT),
                           "-w", str(wheels)], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    [wheel] = wheels.glob("autoglm_trt-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # the wheel alone into the fresh environment; its dependencies from this one's site-packages, added
    # after it (a plain path: this environment's own .pth files, the editable install's among them, are not read)
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                           str(wheel)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (site / "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "AUTOGLM_TRT_TEST_LIBRARY")}
    where = subprocess.run([str(python), "-c", "import autoglm_trt; print(autoglm_trt.__file__)"], capture_output=True,
                           text=True, env=env, cwd=tmp_path)
    assert where.returncode == 0 and where.stdout.startswith(str(site)), where.stdout + where.stderr

    out = tmp_path / "engine"
    done = subprocess.run([str(python), "-m", "autoglm_trt", "build", str(tiny_dir("llama")), "--precision", "int8",
                           "-o", str(out), "--max-batch-size", "4", "--max-input-len", "32", "--max-seq-len", "64",
                           "--kv-num-blocks", "32", "--kv-block-size", "8"],
                          capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["precision"] == "int8"
    calib = json.loads((out / "calib.json").read_text())
    assert str(site / "autoglm_trt" / "calib" / "data") in json.dumps(calib)
