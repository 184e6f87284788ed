"""The package's layering, checked on the source: nothing imports upward or across stages.

    cli ─► serve ─► runtime;  cli ─► builder ─► export, calib (stage entry points)
           runtime, export, calib, evaluate ─► backends ─► kvcache ─► graph ─► artifacts ─► model ─► errors,
           fileutil, progress, precisions, record_schema
           graph and everything above it ─► quant (numpy only);  backends, calib, cli ─► native (stdlib only)

The ONNX Runtime sessions that run a graph offline (export's validation, calibration, eval) are
the ONNX Runtime backend's (``backends/onnxrt/offline.py``); ``graph`` writes graphs and runs none,
and the KV cache's host side names its pools by the graph's names (``kvcache`` ─► ``graph``).

Every import of an ``autoglm_trt`` module (absolute or relative, at any depth in a function)
is resolved to its top-level part and must be in the importer's allowed set below.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "autoglm_trt"
BASE = {"errors", "fileutil", "progress", "precisions", "record_schema"}
LOWER = {
    "kvcache": {"graph"},  # the pools' names (graph.names)
    "native": set(),
    "quant": set(),
    "model": BASE,
    "artifacts": BASE | {"model"},
    "graph": BASE | {"model", "artifacts", "quant"},
    "backends": BASE | {"model", "artifacts", "graph", "kvcache", "native", "quant"},
}
SERVING = BASE | {"model", "artifacts", "graph", "kvcache", "quant"}  # serve and triton reach backends via runtime
STAGE = SERVING | {"backends"}
ALLOWED: dict[str, set[str]] = {
    "errors": set(), "fileutil": {"errors"}, "progress": set(), "precisions": {"errors"}, "record_schema": set(),
    **LOWER,
    "export": STAGE,
    "calib": STAGE | {"native"},  # the native library's statistics kernels
    "evaluate": STAGE,
    "runtime": STAGE,
    "builder": STAGE | {"export", "calib"},
    "serve": SERVING | {"runtime"},
    "triton": SERVING | {"runtime"},
    "cli": STAGE | {"native", "export", "calib", "evaluate", "runtime", "builder", "serve", "triton"},
    "__main__": {"cli"},
    "__init__": set(),
    "grammars": set(),  # data: the shipped grammars
}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level autoglm_trt part) of every import of this package in a module."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    package = parts[:-1]  # the package a relative import starts from (for __init__ too: its own)
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[list[str]] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                mod = base + (node.module.split(".") if node.module else [])
                targets = [mod] if node.module else [mod + [a.name] for a in node.names]
            elif node.module and node.module.split(".")[0] == "autoglm_trt":
                targets = [node.module.split(".")]
        elif isinstance(node, ast.Import):
            targets = [a.name.split(".") for a in node.names if a.name.split(".")[0] == "autoglm_trt"]
        for t in targets:
            if len(t) > 1:
                is_module = (PACKAGE / t[1]).is_dir() or (PACKAGE / f"{t[1]}.py").is_file()
                out.append((node.lineno, t[1] if is_module else "__init__"))  # e.g. ``from . import __version__``
    return out


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _top(path: Path) -> str:
    return path.relative_to(PACKAGE).with_suffix("").parts[0]


def test_every_top_level_part_has_a_rule():
    assert {_top(p) for p in _modules()} <= set(ALLOWED)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_follow_the_layers(path: Path):
    me = _top(path)
    bad = [f"line {line}: {me} imports {target}" for line, target in _imports(path)
           if target not in (me, "__init__") and target not in ALLOWED[me]]
    assert not bad, f"{path.relative_to(PACKAGE)} imports upward or across stages: {bad}"


def test_the_check_catches_an_upward_import(tmp_path, monkeypatch):
    """The checker itself: a graph module importing the runtime is reported."""
    fake = PACKAGE / "graph" / "_probe_upward.py"
    fake.write_text("from ..runtime import engine\nfrom autoglm_trt.builder import pipeline\n")
    try:
        found = _imports(fake)
    finally:
        fake.unlink()
    assert [t for _, t in found] == ["runtime", "builder"]
    assert all(t not in ALLOWED["graph"] for _, t in found)


def test_modules_stay_small():
    """No module over ~450 lines (a module holds one concern whole); no function over 60 lines in the stage packages."""
    long_modules = [f"{p.relative_to(PACKAGE)}: {n}" for p in _modules()
                    if (n := len(p.read_text().splitlines())) > 450]
    assert not long_modules
    long_functions = []
    for p in _modules():
        if _top(p) not in ("export", "calib", "builder"):
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > 60:
                    long_functions.append(f"{p.relative_to(PACKAGE)}:{node.name} {n} lines")
    assert not long_functions
