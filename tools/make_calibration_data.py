#!/usr/bin/env python3
"""Regenerate the default calibration and held-out texts in calibration/ from the
docstrings of CPython's standard library (PSF License 2.0, redistributable).

    python tools/make_calibration_data.py

Calibration and evaluation use disjoint sets of modules, so the accuracy gate is measured
on text the calibration never saw. The output is committed; run this only to change it.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

CALIB_MODULES = [
    "argparse", "asyncio", "collections", "configparser", "csv", "datetime", "decimal", "email.message",
    "functools", "http.client", "json", "logging", "os", "pathlib", "re", "shutil", "socket", "sqlite3",
    "string", "subprocess", "threading", "typing", "unittest", "urllib.parse", "xml.etree.ElementTree",
]
EVAL_MODULES = [
    "abc", "base64", "bisect", "calendar", "cmd", "contextlib", "copy", "difflib", "enum", "fractions",
    "heapq", "itertools", "pprint", "queue", "random", "statistics", "tarfile", "textwrap", "zipfile",
]


def module_text(name: str) -> str:
    mod = importlib.import_module(name)
    parts = [f"Module {name}\n\n{inspect.getdoc(mod) or ''}"]
    for attr in sorted(vars(mod)):
        if attr.startswith("_"):
            continue
        obj = getattr(mod, attr)
        if getattr(obj, "__module__", None) != mod.__name__:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 80:
                parts.append(f"{name}.{attr}\n\n{doc}")
    return "\n\n".join(parts) + "\n"


def main() -> None:
    repo = Path(__file__).resolve().parents[1]
    data, held_out = repo / "autoglm_trt" / "calib" / "data", repo / "calibration" / "eval"  # shipped, and the repo's
    header = (f"# Docstrings of the Python {sys.version.split()[0]} standard library, "
              "(c) Python Software Foundation, PSF License 2.0.\n\n")
    data.mkdir(parents=True, exist_ok=True)
    held_out.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(CALIB_MODULES):
        (data / f"{i:02d}_{name.replace('.', '_')}.txt").write_text(header + module_text(name))
    (held_out / "heldout.txt").write_text(header + "\n\n".join(module_text(n) for n in EVAL_MODULES))
    for p in [*sorted(data.glob("*.txt")), held_out / "heldout.txt"]:
        print(f"{p.relative_to(repo)}: {p.stat().st_size} bytes")

if __name__ == "__main__":
    main()
