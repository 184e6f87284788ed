#!/usr/bin/env python3
"""Install a Triton Inference Server that runs on these CPU machines, into ``.triton/``.

    python tools/install_triton.py [--dest .triton]

PyPI's ``nvidia-pytriton`` 0.7.0 wheel carries the tritonserver 2.51 binary, its Python
backend and a backend stub per Python version. Only those are taken (the wheel is downloaded
with ``--no-deps``: its own Python API pins numpy < 2 and is not used): ``bin/tritonserver``,
``backends/python`` with the stub for this Python (3.11 links the system ``libpython3.11``),
and the shared libraries they load. The Python backend's utilities are compiled against
numpy 1.x, so numpy 1.26 goes into ``.triton/site``, which the model repositories written by
``autoglm-trt triton`` put first on the stub's ``sys.path``. Idempotent: a ``.installed``
marker skips the work.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEEL = "nvidia-pytriton==0.7.0"
NUMPY1 = "numpy==1.26.4"
KEEP = ("pytriton/tritonserver/bin/", "pytriton/tritonserver/backends/python/", "pytriton/tritonserver/caches/",
        "nvidia_pytriton.libs/")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, default=ROOT / ".triton")
    args = ap.parse_args()
    dest: Path = args.dest
    if (dest / ".installed").is_file():
        print(f"tritonserver already installed in {dest}")
        return
    stub = f"pytriton/tritonserver/python_backend_stubs/{sys.version_info.major}.{sys.version_info.minor}/"
    tmp_dest = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp_dest, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", tmp], check=True)
        [wheel] = Path(tmp).glob("nvidia_pytriton-*.whl")
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if name.startswith(KEEP) or name.startswith(stub):
                    z.extract(name, tmp_dest)
    tree = tmp_dest / "pytriton" / "tritonserver"
    shutil.copy2(tree / stub.split("pytriton/tritonserver/")[1] / "triton_python_backend_stub",
                 tree / "backends" / "python" / "triton_python_backend_stub")
    shutil.rmtree(tmp_dest / "pytriton" / "tritonserver" / "python_backend_stubs", ignore_errors=True)
    for f in (tree / "bin" / "tritonserver", tree / "backends" / "python" / "triton_python_backend_stub"):
        f.chmod(0o755)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp_dest / "site"),
                    NUMPY1], check=True)
    (tmp_dest / ".installed").write_text(f"{WHEEL}\n{NUMPY1}\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp_dest.rename(dest)
    print(f"tritonserver installed in {dest}")


if __name__ == "__main__":
    main()
