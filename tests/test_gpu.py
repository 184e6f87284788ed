"""The CUDA side of the TensorRT runtime (device pools, pinned copies, NVRTC scatter kernel)."""

import importlib.util
import subprocess
import sys

import pytest
from conftest import ROOT


def _gpu() -> bool:
    if importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None:
        return False
    from cuda.bindings import runtime

    err, count = runtime.cudaGetDeviceCount()
    return int(err) == 0 and count > 0


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu(), reason="needs an NVIDIA GPU and cuda-python (cuda.bindings); none on the CI machines")
def test_gpu_check_script_passes():  # pragma: no cover - GPU machines only
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FAIL" not in r.stdout
