"""``int4-awq``'s accuracy gate: the fewest most sensitive linears kept at INT8 for it to pass.

Input: the INT4 plan and weights ``int4_awq`` made, calibration windows (the INT8 gate's) and a target
expected perplexity ratio. Output: the linears kept at INT8 (blocks of 32, as the LM head), the
INT4 graph with them written, and the gate's report.

The plan is written once as a switchable graph: each decoder linear's weight is its INT4
DequantizeLinear where the graph input ``quant_mask`` is 1 and its 8-bit one where it is 0.
``calib.sensitivity`` ranks the linears by the KL divergence of the logits each adds alone at
INT4 (every other linear INT8) and keeps the fewest of the top at INT8 for which the expected
perplexity ratio against the float graph is at most the target (weight-only: there is no
activation scale to nudge, so each plan is judged once). The INT4 graph of that plan is then
checked as ONNX Runtime runs it (``MatMulNBits``, its activations in 8-bit blocks), as the INT8
calibration's final check does (``calib.accuracy.final_check``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..backends.onnxrt.offline import GraphRunner
from ..backends.onnxrt.session import make_session
from ..calib.accuracy import final_check
from ..calib.sensitivity import Gate, SensitivitySearch
from ..calib.smooth import SmoothedWeights
from ..errors import AutoGLMError
from ..graph.decoder import write_int8_graph
from ..model.spec import ModelSpec
from ..quant.plan import QuantPlan

GATE_WINDOWS = 12  # calibration windows of GATE_SEQ_LEN tokens, as the INT8 calibration's gate
GATE_SEQ_LEN = 256
SWITCH = "switch.int4.onnx"


def gated_plan(scratch: Path, out: Path, graph: str, export_dir: Path, weights: SmoothedWeights, plan: QuantPlan,
               max_seq_len: int, windows: np.ndarray, target: float, threads: int | None,
               log: Callable[[str], None]) -> tuple[QuantPlan, dict]:
    """The plan with the fewest linears at INT8 that meets ``target`` (expected perplexity ratio
    against the float graph in ``export_dir`` on ``windows``), its graph written as ``out/graph``;
    and the gate's report. ``scratch``: a folder for the switchable graph."""
    t0 = time.perf_counter()
    spec: ModelSpec = weights.spec
    switch_plan = replace(plan, switchable=True)
    path = write_int8_graph(scratch, SWITCH, spec, weights, switch_plan, max_seq_len)
    candidates = [n for n in switch_plan.switch_order if n != "lm_head" and n not in plan.int8_linears]
    reference = GraphRunner(export_dir, threads=threads).logits
    search = SensitivitySearch(make_session(path, threads=threads), spec, switch_plan.switch_order, windows, target,
                               0.0, reference=reference, candidates=candidates, nudge=False,
                               labels=("INT4", "at INT8"))
    log(f"INT4 gate: expected perplexity ratio at most {target} against the float graph on {len(windows)} "
        f"calibration windows of {windows.shape[1]} tokens")
    keep = search.run(log)
    if keep is None:
        raise AutoGLMError(f"the INT4 model misses the gate's expected perplexity ratio {target} even with every "
                           "decoder linear at INT8; raise the target (--int4-gate) or build int8-wo")

    def written(keep: list[str]) -> Callable[[np.ndarray], np.ndarray]:
        write_int8_graph(out, graph, spec, weights, kept_at_int8(plan, keep), max_seq_len)
        return GraphRunner(export_dir, session=make_session(out / graph, threads=threads)).logits

    keep, result = final_check(keep, written, Gate(windows, target, 0.0, reference), search, "INT4", log)
    sensitivity = search.report
    del search  # its session reads the switchable graph's weights
    path.unlink()
    Path(f"{path}.data").unlink()
    if not result["passed"]:
        raise AutoGLMError(f"the INT4 graph misses the gate (expected perplexity ratio "
                           f"{result['expected_ppl_ratio']:.4f} > {target}) with {len(keep)} linears at INT8; "
                           "raise the target (--int4-gate) or keep kinds at INT8 (--int4-int8)")
    report = {"target_expected_ppl_ratio": target, "windows": len(windows), "seq_len": int(windows.shape[1]),
              "kept_at_int8": sorted(keep), "result": result, "sensitivity": sensitivity,
              "seconds": round(time.perf_counter() - t0, 1)}
    return kept_at_int8(plan, keep), report


def kept_at_int8(plan: QuantPlan, keep: list[str]) -> QuantPlan:
    """The plan with the linears of ``keep`` at INT8 too."""
    return replace(plan, int8_linears=tuple(sorted({*plan.int8_linears, *keep})))
