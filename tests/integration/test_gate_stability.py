"""One checkpoint and one calibration set give one INT8 plan: the gate keeps the same linears in
float, with the same bias corrections and activation ranges, with and without the native library,
and with another instruction set's build of it, OpenBLAS's kernels and numpy's dispatch.

A tiny GLM (QKV bias, every input rotated) under a gate that only some float linears meet, so
the search runs; ONNX Runtime's own kernels are the one part no setting here can change."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, cpu_has

CALIBRATE = """
import json, sys
from pathlib import Path
from autoglm_trt import native
from autoglm_trt.calib.pipeline import DEFAULT_DATA, CalibConfig, calibrate
rec = calibrate(CalibConfig(Path(sys.argv[1]), DEFAULT_DATA, Path(sys.argv[2]), num_samples=8, seq_len=64,
                            gate_windows=2, gate_seq_len=64, target_ppl_ratio=1.001, target_top1=0.99),
                log=lambda m: None)
lib = native.library()[0]
print(json.dumps({"float": sorted(k["linear"] for k in rec["float_linears"]), "bias": rec["bias_correction"],
                  "amax": rec["amax"], "library": None if lib is None else native.variant_of(lib),
                  "trials": rec["gate"]["sensitivity"]["trials"]}))
"""


def other_instruction_set() -> dict[str, str]:
    """The environment of a lesser x86 machine than this one: the next build of the native library
    down, OpenBLAS's kernels for that core, numpy's dispatch without the instructions it lacks."""
    if cpu_has("avx512f"):
        return {"AUTOGLM_TRT_NATIVE_VARIANT": "avx2", "OPENBLAS_CORETYPE": "Haswell",
                "NPY_DISABLE_CPU_FEATURES": "AVX512F AVX512CD AVX512_SKX"}
    return {"AUTOGLM_TRT_NATIVE_VARIANT": "generic", "OPENBLAS_CORETYPE": "Sandybridge",
            "NPY_DISABLE_CPU_FEATURES": "AVX2 FMA3"}


def calibrate_in(env: dict[str, str], export, out) -> dict:
    r = subprocess.run([sys.executable, "-c", CALIBRATE, str(export), str(out)], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, **env}, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64", reason="x86-64 instruction sets")
def test_the_plan_is_the_same_on_every_instruction_set_and_without_the_native_library(tiny_dir, tmp_path):
    from autoglm_trt.export.pipeline import ExportConfig, export_checkpoint

    export = tmp_path / "export"
    export_checkpoint(ExportConfig(tiny_dir("glm"), export), log=lambda m: None)
    here = calibrate_in({}, export, tmp_path / "here")
    assert here["library"] is not None, "the native library should load on this machine"
    assert here["float"] and here["amax"], "some linears float and some INT8: the search must have run"
    for name, env in (("no native library", {"AUTOGLM_TRT_NATIVE": "0"}), ("lesser CPU", other_instruction_set())):
        there = calibrate_in(env, export, tmp_path / name.replace(" ", "-"))
        assert there["library"] == env.get("AUTOGLM_TRT_NATIVE_VARIANT"), name
        assert there["float"] == here["float"] and there["bias"] == here["bias"], (name, here["trials"],
                                                                                   there["trials"])
        assert there["amax"] == here["amax"], name
