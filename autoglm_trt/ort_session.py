"""ONNX Runtime sessions for exported graphs (CPU execution provider)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def make_session(model_path: Path, threads: int | None = None, optimize: bool = True):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                   else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    if threads:
        so.intra_op_num_threads = threads
    so.log_severity_level = 3
    return ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])


def run(session, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))
