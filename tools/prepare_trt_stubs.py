#!/usr/bin/env python3
"""Copy the installed ``tensorrt-stubs`` (10.13) into ``typings/`` for mypy, repaired.

The published stubs install as ``tensorrt/__init__.pyi`` without a ``py.typed`` marker, so mypy
does not use them from site-packages, and a few plugin methods name a parameter ``in`` (a
Python keyword), and ``add_scale_nd`` puts a parameter without default after defaulted ones;
both are syntax errors. This renames those parameters to ``in_``, gives ``channel_axis`` a
default, and writes the result under ``typings/`` (git-ignored; ``mypy_path`` in pyproject.toml).
"""

from __future__ import annotations

import re
import shutil
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    site = Path(sysconfig.get_paths()["purelib"])
    out = ROOT / "typings"
    shutil.rmtree(out, ignore_errors=True)
    for pkg in ("tensorrt", "tensorrt_bindings"):
        src = site / pkg
        if not any(src.glob("*.pyi")):
            raise SystemExit(f"{src} has no stubs; install them with: pip install --no-deps tensorrt-stubs")
        (out / pkg).mkdir(parents=True)
        for f in src.glob("*.pyi"):
            text = re.sub(r"(?<=[(,] )in(?=: )", "in_", f.read_text())
            # add_scale_nd lists channel_axis (no default) after defaulted parameters
            text = text.replace("power: Weights = None, channel_axis: int)", "power: Weights = None, channel_axis: int = 0)")
            (out / pkg / f.name).write_text(text)
    print(f"TensorRT stubs ready in {out}")


if __name__ == "__main__":
    main()
