"""The project's checks that need an NVIDIA GPU, in one run (for a machine lent for minutes).

    python scripts/gpu_check.py --out DIR

1. the machine: GPU, driver, CUDA bindings, numpy, CPU; what ``backends/trt/probe.py`` sees
   (the GPU and its compute capability; TensorRT itself is not expected on such a machine);
2. ``tests/gpu`` under pytest, which must pass every test and skip none (a skip there means the
   GPU was not found);
3. the same checks as a table with timings (``tests/gpu/test_cuda_runtime.py --json``);
4. the correctness checks again under ``compute-sanitizer --tool memcheck`` where it is installed
   (out-of-bounds or misaligned accesses of the NVRTC kernels, leaks of device memory).

Writes ``DIR/gpu_check.json`` (every step's result and output) and exits non-zero when a step fails.
Needs only numpy, pytest and cuda-python (``cuda.bindings``); neither torch nor TensorRT.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "tests" / "gpu" / "test_cuda_runtime.py"


# what the package sees of this machine, asked in a child that imports the checkout's package
PROBE = """import json
from autoglm_trt.backends.trt.probe import cuda_device, tensorrt_available
from autoglm_trt.fileutil import cpu_model
print(json.dumps({"cpu": cpu_model(), "gpu": cuda_device(), "tensorrt": tensorrt_available()[1]}, default=str))"""


def checkout_env() -> dict[str, str]:
    """This environment with the checkout first on PYTHONPATH (the package need not be installed)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def machine() -> dict:
    import numpy

    probe = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=checkout_env(), capture_output=True,
                           text=True, timeout=120)
    if probe.returncode != 0:
        sys.exit(f"the package's probe of this machine failed:\n{probe.stderr[-2000:]}")
    info = {"python": platform.python_version(), "numpy": numpy.__version__,
            **json.loads(probe.stdout.strip().splitlines()[-1])}
    try:
        from importlib.metadata import version

        info["cuda-bindings"] = version("cuda-bindings")
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        info["cuda-bindings"] = f"not found ({exc})"
    smi = shutil.which("nvidia-smi")
    if smi:
        out = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
        info["nvidia-smi"] = out.stdout.strip() or out.stderr.strip()
    return info


def step(name: str, cmd: list[str], timeout: int) -> dict:
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    try:
        run = subprocess.run(cmd, cwd=ROOT, env=checkout_env(), capture_output=True, text=True, timeout=timeout)
        rc, out = run.returncode, run.stdout + run.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = 124, f"timed out after {timeout} s\n{exc.stdout or ''}"
    print(out, flush=True)
    return {"step": name, "rc": rc, "ok": rc == 0, "output": out}


def pytest_step(out: Path) -> dict:
    junit = out / "gpu_tests.xml"
    row = step("pytest tests/gpu", [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                                    "--noconftest", f"--junitxml={junit}", "tests/gpu"], timeout=300)
    if junit.is_file():
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        row["counts"] = counts
        row["ok"] = row["ok"] and counts["tests"] > 0 and counts["skipped"] == 0
    else:
        row["ok"] = False
    return row


def sanitizer_step() -> dict:
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        return {"step": "compute-sanitizer memcheck", "ok": True, "rc": None, "output": "not installed: skipped"}
    # API errors off: cuda-bindings looks up driver entry points this driver lacks (cuGetProcAddress
    # answers "invalid argument" for each); memory errors of the kernels and leaks are what is checked
    cmd = [tool, "--tool", "memcheck", "--leak-check", "full", "--report-api-errors", "no", "--error-exitcode", "3",
           sys.executable, str(TABLE), "--no-timing"]
    row = step("compute-sanitizer memcheck", cmd, timeout=400)
    row["ok"] = row["rc"] == 0 and "ERROR SUMMARY: 0 errors" in row["output"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json and the tests' junit XML")
    ap.add_argument("--no-sanitizer", action="store_true", help="skip the compute-sanitizer run")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    info = machine()
    print(json.dumps(info, indent=1), flush=True)
    if info["gpu"] is None:
        sys.exit("no NVIDIA GPU is visible to cuda-python (cuda.bindings) here: this check needs one; "
                 "on a machine without a GPU `make test` skips the same tests (marked gpu)")
    steps = [pytest_step(args.out),
             step("table", [sys.executable, str(TABLE), "--json", str(args.out / "gpu_table.json")], timeout=300)]
    if not args.no_sanitizer:
        steps.append(sanitizer_step())
    (args.out / "gpu_check.json").write_text(json.dumps({"machine": info, "steps": steps}, indent=1))
    for s in steps:
        print(f"{'ok  ' if s['ok'] else 'FAIL'} {s['step']}  {s.get('counts', '')}")
    sys.exit(0 if all(s["ok"] for s in steps) else 1)


if __name__ == "__main__":
    main()
