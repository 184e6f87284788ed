"""``scripts/gpu_check.py`` on a machine without a GPU: it refuses plainly, before running anything."""

import subprocess
import sys
from pathlib import Path

import pytest

from autoglm_trt.backends.trt.probe import cuda_device

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(cuda_device() is not None, reason="a GPU is visible: the check would run for real")
def test_gpu_check_without_a_gpu_says_so_and_fails(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "no NVIDIA GPU is visible" in done.stderr
    assert '"gpu": null' in done.stdout  # the machine was described first
    assert not (tmp_path / "gpu_check.json").exists()  # no step ran
