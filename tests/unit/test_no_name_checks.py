"""Code reads a backend's or a precision's traits and never compares their names.

The backends (``backends/registry.py``) and precisions (``precisions.py``) are objects with
traits; a comparison of a string constant that names one of them, anywhere else in the package,
is a branch a new backend or precision would have to find. "int8" is also a KV cache's and the
vision encoder's data type, so it counts only where the other side reads a precision, a backend
or a precision's form.
"""

from __future__ import annotations

import ast
from pathlib import Path

from autoglm_trt.backends.registry import names as backend_names
from autoglm_trt.precisions import NAMES, Form

PACKAGE = Path(__file__).resolve().parents[2] / "autoglm_trt"
HOMES = {PACKAGE / "precisions.py", PACKAGE / "backends" / "registry.py"}
SHARED = {"int8"}  # a data type too
NAMED = (set(NAMES) | set(backend_names()) | {f.value for f in Form}) - SHARED
READS_A_NAME = ("precision", "backend", ".model")


def _strings(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def name_checks(source: str) -> list[str]:
    """The comparisons in ``source`` of a backend's or precision's name, as source text."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        for side in sides:
            words = set(_strings(side))
            others = " ".join(ast.unparse(s) for s in sides if s is not side)
            if words & NAMED or (words & SHARED and any(r in others for r in READS_A_NAME)):
                found.append(ast.unparse(node))
                break
    return found


def test_no_backend_or_precision_name_is_compared_outside_its_registry():
    found = [f"{path.relative_to(PACKAGE.parent)}: {check}" for path in sorted(PACKAGE.rglob("*.py"))
             if path not in HOMES for check in name_checks(path.read_text())]
    assert found == []


def test_the_check_catches_name_comparisons():
    source = """
if backend == "tensorrt": pass
if req.precision in ("int8", "fp16"): pass
if p.model == "int8": pass
trt = "onnxruntime" != cfg.backend_name
if kv_dtype == "int8": pass
if linears == "int8": pass
"""
    assert name_checks(source) == ["backend == 'tensorrt'", "req.precision in ('int8', 'fp16')", "p.model == 'int8'",
                                   "'onnxruntime' != cfg.backend_name"]
