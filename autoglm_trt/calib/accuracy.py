"""Calibration step 4: the accuracy gate, and the fewest linears to keep in float to pass it.

The search runs on a "switchable" graph (every planned linear's Q/DQ can be turned off by a
``quant_mask`` input), so a plan is tried in one forward pass (``sensitivity``). Its answer
is then checked on the real INT8 graph, whose integer kernels round differently from the
float Q/DQ path (another draw of the same quantization noise, held to the targets loosened by
``sensitivity.CLEAR``): when that misses them, the next most sensitive linears go back to
float too, a few times at most.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..backends.onnxrt.offline import GraphRunner
from ..backends.onnxrt.session import switchable_session
from ..errors import AutoGLMError
from ..graph.decoder import write_int8_graph
from ..model.spec import ModelSpec
from ..model.weights import WeightSource
from ..quant.plan import QuantPlan
from .sensitivity import CLEAR, Gate, SensitivitySearch, describe

FINAL_GATE_ATTEMPTS = 4


@dataclass
class GateSettings:
    target_ppl_ratio: float
    target_top1: float
    threads: int | None


def search_and_check(tmp: Path, export_dir: Path, spec: ModelSpec, weights: WeightSource, plan: QuantPlan,
                     max_seq_len: int, windows: np.ndarray, gs: GateSettings,
                     log: Callable[[str], None]) -> tuple[list[str], dict]:
    """Linears to keep in float and the gate's report; leaves ``model.int8.onnx`` of that plan in ``tmp``."""
    t0 = time.perf_counter()
    switch_plan = replace(plan, switchable=True)
    switch_path = write_int8_graph(tmp, "switch.onnx", spec, weights, switch_plan, max_seq_len)
    search = SensitivitySearch(switchable_session(switch_path, gs.threads), spec, switch_plan.switch_order,
                               windows, gs.target_ppl_ratio, gs.target_top1, sorted(plan.bias_correction))
    plan = plan.corrected(search.choose_corrections(log))
    keep = search.run(log)
    if keep is None:
        raise AutoGLMError("no INT8 plan meets the accuracy gate even with every linear in float; check the export")
    reference = GraphRunner(export_dir, threads=gs.threads).logits

    def written(keep: list[str]) -> Callable[[np.ndarray], np.ndarray]:
        write_int8_graph(tmp, "model.int8.onnx", spec, weights, plan.without(keep), max_seq_len)
        return GraphRunner(tmp, threads=gs.threads).logits

    keep, result = final_check(keep, written, Gate(windows, gs.target_ppl_ratio, gs.target_top1, reference),
                               search, "INT8", log)
    if not result["passed"]:
        raise AutoGLMError(
            f"the INT8 graph misses the accuracy gate (expected ppl ratio {result['expected_ppl_ratio']:.4f} > "
            f"{gs.target_ppl_ratio} + {CLEAR[0]} or top-1 {result['top1_agreement']:.3f} < {gs.target_top1} - {CLEAR[1]}) "
            f"with {len(keep)} linears in float; keep more in float (--keep-float) or lower the targets")
    report = {"enabled": True, "target_ppl_ratio": gs.target_ppl_ratio, "target_top1": gs.target_top1,
              "final_slack": {"expected_ppl_ratio": CLEAR[0], "top1_agreement": CLEAR[1]},
              "sensitivity": search.report, "result": result, "seconds": round(time.perf_counter() - t0, 1),
              "bias_correction": sorted(plan.without(keep).bias_correction)}
    del search  # its session reads the switchable graph's weights
    switch_path.unlink()
    (tmp / "switch.onnx.data").unlink()
    return keep, report


def final_check(keep: list[str], written: Callable[[list[str]], Callable[[np.ndarray], np.ndarray]], gate: Gate,
                search: SensitivitySearch, what: str, log: Callable[[str], None]) -> tuple[list[str], dict]:
    """The search's answer ``keep`` checked on the real graph (``written(keep)`` writes it and
    returns its logits) against the targets loosened by ``CLEAR``; while that misses them, the
    next most sensitive linears are kept too, half as many again (``FINAL_GATE_ATTEMPTS`` checks
    at most). Returns the linears kept and the last check."""
    for attempt in range(FINAL_GATE_ATTEMPTS):
        result = gate.check(written(keep), CLEAR)
        log(f"gate on the {what} graph with {len(keep)} linears {search.labels[1]}: {describe(result)}")
        if result["passed"] or attempt == FINAL_GATE_ATTEMPTS - 1:
            break
        keep = search.ranked(log)[: len(keep) + max(1, len(keep) // 2)]
    return keep, result
