"""``calibrate``: float32 export + calibration text -> INT8 Q/DQ ONNX, TensorRT cache, calib.json.

Input: an export directory (float32) and a directory of calibration text. Output directory::

    model.int8.onnx, model.int8.onnx.data   Q/DQ graph (same contract as the export; float32, or
                                            float16 with ``graph_dtype``: TensorRT's form)
    calibration.cache                       TensorRT <= 10 text format: amax/127 per linear input
                                            of the export's float model.onnx (entropy)
    calib.json                              amax per tensor, method, smoothing, float layers,
                                            SHA-256 of model and data, timings, gate results
    export.json                             the export's record, pointing at model.int8.onnx
    tokenizer files

Steps, each its own module: token windows -> ``statistics`` (one streamed pass; SmoothQuant
vectors from the first batch) -> ``thresholds`` (amax per tensor: entropy / max / percentile /
auto) -> ``int8_graph`` (rebuilt from the export's weights) -> ``accuracy`` (gate on held-back
calibration windows against the float graph; the fewest most sensitive linears kept in float
until it holds) -> ``record`` (calib.json).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..artifacts import CALIB_RECORD, CalibRecord, ExportRecord, copy_tokenizer_files
from ..errors import AutoGLMError
from ..fileutil import available_memory_bytes, staged_directory
from ..graph.decoder import write_int8_graph
from ..graph.exported_weights import OpenedExport
from ..graph.names import KINDS
from ..model.text import TokenWindows, token_windows
from ..precisions import precision
from ..quant.plan import QuantPlan
from .accuracy import GateSettings, search_and_check
from .cache import ALGORITHMS, trt_version, write_cache
from .collect import CalibPlan, kv_head_amax
from .histogram import METHODS, entropy_amax
from .image_windows import calibration_images, image_digest, with_image_windows
from .record import float_fraction, float_reasons, versions, weight_bytes
from .statistics import Statistics, gather, quantizable_inputs, rotation_blocks
from .thresholds import bias_corrections, choose_amax, int8_errors

# What this code computes from the same settings; a cached calibration of another version is redone.
# 2: Hadamard-rotated linear inputs, LM head in the sensitivity search.
# 3: histograms keep full resolution when the range grows; the TensorRT cache names float-graph tensors.
# 4: K/V amax per layer and KV head (INT8 KV cache). 5: V's amax as the smoothed graph stores it.
# 6: K/V thresholds: 99.99th percentile per KV head. 7: histograms of token rows sampled by
# window (``collect.Accumulator._rows``), the Q/DQ ones one row in ``hist_row_stride``.
# 8: plans pass under two roundings, the final check in float Q/DQ, bias corrections, rotated
# weights summed in float64. 9: the gate judges the expected ppl ratio (exp of the mean KL), ranks
# linears by the KL with each alone INT8, keeps bias corrections by a margin; statistics rotated in float64.
CALIB_VERSION = 9
DEFAULT_DATA = Path(__file__).with_name("data")  # the shipped set: package data, in the wheel too


@dataclass
class CalibConfig:
    export_dir: Path
    data: Path
    out_dir: Path
    method: str = "entropy"
    num_samples: int = 128
    seq_len: int = 128
    batch_size: int = 8
    percentile: float = 99.99
    smoothquant_alpha: float | None = 0.8  # None: off (SmolLM2: 0.8 beats 0.5 on top-1, README)
    quantize_lm_head: bool = True
    # linear kinds whose input gets a Hadamard rotation (all: README, "Calibration and accuracy")
    rotate: list[str] = field(default_factory=lambda: list(KINDS))
    max_rotation_block: int = 128
    # the Q/DQ histograms take one token row in this many of each window, rotating over windows
    # (1: every row). 2 halves the statistics pass's numpy work; on SmolLM2 it scores within
    # run-to-run noise of 1 on every kind of held-out text (README, "Calibration and accuracy")
    hist_row_stride: int = 2
    keep_float: list[str] = field(default_factory=list)
    gate: bool = True
    # offer each linear's mean INT8 output error as a bias correction; the gate keeps those of a
    # kind of linear where they improve its metric (none without the gate)
    bias_correction: bool = True
    # a margin under the acceptance gate (1.02 / 0.90 on held-out text): the search measures
    # on calibration text, the acceptance on other text
    target_ppl_ratio: float = 1.015
    target_top1: float = 0.91
    gate_windows: int = 12
    gate_seq_len: int = 256
    threads: int | None = None
    # weights of one statistics graph: a larger model is calibrated in groups of layers up to this size
    max_graph_bytes: int = 1024**3
    device: str = "cpu"  # where the statistics pass runs: cpu, or cuda (onnxruntime-gpu)
    force: bool = False  # recompute even if a matching result exists; replace a mismatching one
    replace_mismatch: bool = False  # replace a result of another model/data without --force (build's cache)
    # the INT8 graph written: float32, or float16 (TensorRT's form: Q/DQ, GEMMs, attention and KV cache
    # in float16, ``write_int8_graph``); the gate judges the float32 graph of the same plan either way
    graph_dtype: str = "float32"

    def settings(self) -> dict:
        """The settings that decide the result (hashed with the data; recorded in calib.json). The
        graph's dtype is among them where it is not float32, so float32 results keep their identity."""
        out = {k: v for k, v in asdict(self).items()
               if k not in ("export_dir", "data", "out_dir", "threads", "max_graph_bytes", "device", "force",
                            "replace_mismatch", "graph_dtype")}
        if self.graph_dtype != "float32":
            out["graph_dtype"] = self.graph_dtype
        out["version"] = CALIB_VERSION
        return out


class CalibrationMismatchError(AutoGLMError):
    """A calibration result does not belong to this model or data."""


def model_sha256(export_dir: Path) -> str:
    """Identity of an export: the hash of its export.json, which records its files' hashes."""
    return ExportRecord.read(export_dir).identity()


def check_calibration(calib_dir: Path, export_dir: Path, data_sha256: str | None = None) -> dict:
    """Load ``calib.json`` and check it was made from this export (and data, if given)."""
    if not (Path(calib_dir) / CALIB_RECORD).is_file():
        raise CalibrationMismatchError(f"{calib_dir} has no calib.json; it is not a calibration result")
    record = CalibRecord.read(calib_dir)
    current = model_sha256(export_dir)
    if record.model_sha256 != current:
        raise CalibrationMismatchError(
            f"the calibration in {calib_dir} was made from another model (model SHA-256 "
            f"{record.model_sha256[:12]}…, this export {current[:12]}…); calibrate again")
    if data_sha256 is not None and record.data_sha256 != data_sha256:
        raise CalibrationMismatchError(f"the calibration in {calib_dir} was made from other calibration data")
    return record.data


def _check_config(cfg: CalibConfig, export: ExportRecord) -> None:
    for name in ("num_samples", "batch_size", "gate_windows", "max_rotation_block", "hist_row_stride"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise AutoGLMError(f"{name} must be an integer >= 1, got {value!r}")
    for name in ("seq_len", "gate_seq_len"):
        if getattr(cfg, name) < 2:
            raise AutoGLMError(f"{name} must be at least 2 tokens, got {getattr(cfg, name)!r}")
    if not (math.isfinite(cfg.percentile) and 0 < cfg.percentile <= 100):
        raise AutoGLMError(f"percentile must be in (0, 100], got {cfg.percentile!r}")
    alpha = cfg.smoothquant_alpha
    if alpha is not None and not (math.isfinite(alpha) and 0 < alpha <= 1):
        raise AutoGLMError(f"the SmoothQuant alpha must be in (0, 1] (or 0 to turn it off), got {alpha!r}")
    if not (math.isfinite(cfg.target_ppl_ratio) and cfg.target_ppl_ratio >= 1):
        raise AutoGLMError(f"target ppl ratio must be a number >= 1, got {cfg.target_ppl_ratio!r}")
    if not (math.isfinite(cfg.target_top1) and 0 <= cfg.target_top1 <= 1):
        raise AutoGLMError(f"target top-1 agreement must be in [0, 1], got {cfg.target_top1!r}")
    if cfg.method not in (*METHODS, "auto"):
        raise AutoGLMError(f"method '{cfg.method}' is not supported; choose one of {', '.join(METHODS)}, auto")
    if cfg.graph_dtype not in ("float32", "float16"):
        raise AutoGLMError(f"the INT8 graph is written in float32 or float16 (TensorRT's form), not {cfg.graph_dtype}")
    if export.dtype != "float32" or precision(export.precision).quantized:
        raise AutoGLMError(f"{cfg.export_dir} is not a float32 export; calibrate a float32 export "
                           "(autoglm-trt export CHECKPOINT -o DIR)")


# The gate holds the switchable graph (float weights and their INT8 copies), the float
# reference and the INT8 graph at once: about this many times the export's float32 weights;
# and the float graph's log-probabilities on its windows, twice (search and final check).
GATE_MEMORY_FACTOR = 2.5


def _check_gate_memory(cfg: CalibConfig, export: OpenedExport) -> None:
    """Refuse, before the statistics pass, a gate this machine's memory cannot hold."""
    weights, vocab_size = export.weights.total_bytes(), export.spec.vocab_size
    log_probs = 2 * cfg.gate_windows * cfg.gate_seq_len * vocab_size * 4
    need, have = GATE_MEMORY_FACTOR * weights + log_probs, available_memory_bytes()
    if have is not None and need > have:
        raise AutoGLMError(
            f"the accuracy gate runs the whole float graph and INT8 graphs of this export at once: about "
            f"{need / 1e9:.1f} GB for its {weights / 1e9:.1f} GB of float32 weights and {log_probs / 1e9:.1f} GB of "
            f"reference log-probabilities, and this machine has "
            f"{have / 1e9:.1f} GB available. Calibrate with --no-gate (the statistics then run layer by layer "
            "in bounded memory; score the INT8 graph afterwards with `autoglm-trt eval` where it fits), or on a larger host")


def _existing(cfg: CalibConfig, msha: str, data_sha: str, log: Callable[[str], None]) -> tuple[dict | None, bool]:
    """(a reusable record, whether an existing result is to be replaced)."""
    if not (Path(cfg.out_dir) / CALIB_RECORD).is_file():
        return None, cfg.force
    record = CalibRecord.read(cfg.out_dir)
    if record.model_sha256 == msha and record.data_sha256 == data_sha and not cfg.force:
        log(f"reusing calibration in {cfg.out_dir} (model and data hashes match)")
        return {**record.data, "reused": True}, False
    if not (cfg.force or cfg.replace_mismatch):
        raise CalibrationMismatchError(f"{cfg.out_dir} holds a calibration of another model or other "
                                       "data/settings; pass --force to replace it")
    return None, True


def calibrate(cfg: CalibConfig, log: Callable[[str], None] = print) -> dict:
    """Calibrate and write ``cfg.out_dir`` atomically; returns the calib.json record."""
    export = ExportRecord.read(cfg.export_dir)
    _check_config(cfg, export)
    opened, spec = OpenedExport.of(export), export.spec
    separator = spec.eos_token_ids[0] if spec.eos_token_ids else None
    windows = token_windows(cfg.data, cfg.export_dir, cfg.num_samples, cfg.seq_len, separator)
    settings = cfg.settings()
    images = calibration_images(cfg.data) if spec.vision else []
    data_sha = hashlib.sha256((windows.sha256 + json.dumps(settings, sort_keys=True)
                               + "".join(image_digest(i) for i in images)).encode()).hexdigest()
    msha = export.identity()
    reused, replace = _existing(cfg, msha, data_sha, log)
    if reused is not None:
        return reused
    if cfg.gate:
        _check_gate_memory(cfg, opened)

    log(f"calibrating {cfg.export_dir} with {len(windows.windows)} windows of {cfg.seq_len} tokens "
        f"({windows.total_tokens} tokens of text), method {cfg.method}, SmoothQuant "
        f"{'off' if cfg.smoothquant_alpha is None else f'alpha={cfg.smoothquant_alpha}'}")
    t0 = time.perf_counter()
    inputs = quantizable_inputs(cfg.export_dir, cfg.quantize_lm_head, cfg.keep_float)
    plan = CalibPlan(inputs, rotation_blocks(spec, list(inputs), cfg.rotate, cfg.max_rotation_block),
                     cfg.smoothquant_alpha, row_stride=cfg.hist_row_stride, batch_size=cfg.batch_size,
                     threads=cfg.threads, device=cfg.device, max_graph_bytes=cfg.max_graph_bytes)
    all_windows, with_images = windows.windows, None
    if images:  # a vision family: windows with images too, after the text ones
        all_windows, with_images = with_image_windows(opened, windows.windows, images)
        log(f"  and {len(images)} windows with an image each (their encoder's output in the image tokens' place)")
    st = gather(opened, all_windows, plan, with_images)
    t_search = time.perf_counter()
    amax, amax_method = choose_amax(st, cfg.method, cfg.percentile)
    timings = {"collect_s": round(st.seconds, 3), "search_s": round(time.perf_counter() - t_search, 3),
               "batches": st.stats.batches, "tokens": st.stats.tokens, "layer_by_layer": st.layerwise}
    log(f"statistics{' (layer by layer)' if st.layerwise else ''}: {st.stats.batches} batches in "
        f"{timings['collect_s']:.1f} s, threshold search "
        f"{timings['search_s']:.2f} s")
    errors = int8_errors(st, amax)
    with staged_directory(Path(cfg.out_dir), replace) as tmp:
        record = _write(cfg, export, tmp, st, amax, amax_method, errors, log)
        record.update(model_sha256=msha, data_sha256=data_sha, settings=settings,
                      data={**_data_info(cfg, windows), "image_windows": len(images)})
        record["timings"] = {**timings, "total_s": round(time.perf_counter() - t0, 2)}
        CalibRecord.write(tmp, _ordered(record))
    log(f"calibration written to {cfg.out_dir}: {len(record['amax'])} linears INT8, "
        f"{len(record['float_linears']) - len(cfg.keep_float)} kept in float")
    return record


def _write(cfg: CalibConfig, export: ExportRecord, tmp: Path, st: Statistics, amax: dict[str, float],
           amax_method: dict[str, str], errors: dict[str, float], log: Callable[[str], None]) -> dict:
    """The INT8 graph (gated), the cache, the export record and tokenizer in ``tmp``; the record's body."""
    spec = export.spec
    graph = {"file": "model.int8.onnx", "data_file": "model.int8.onnx.data", "precision": "int8"}
    ExportRecord.write(tmp, export.derived(**graph))  # float32: what the gate runs
    copy_tokenizer_files(cfg.export_dir, tmp)
    plan = QuantPlan({n: a for n, a in amax.items() if n not in cfg.keep_float}, False, st.rotate)
    if cfg.gate and cfg.bias_correction:
        plan = replace(plan, bias_correction=bias_corrections(st, plan.act_amax))
    keep: list[str] = []
    gate_report: dict = {"enabled": False}
    if cfg.gate:
        separator = spec.eos_token_ids[0] if spec.eos_token_ids else None
        gate_windows = token_windows(cfg.data, cfg.export_dir, cfg.gate_windows, cfg.gate_seq_len, separator).windows
        keep, gate_report = search_and_check(tmp, cfg.export_dir, spec, st.weights, plan, export.max_seq_len,
                                             gate_windows,
                                             GateSettings(cfg.target_ppl_ratio, cfg.target_top1, cfg.threads), log)
        plan = plan.corrected(gate_report["bias_correction"])
    if not cfg.gate or cfg.graph_dtype != "float32":
        write_int8_graph(tmp, "model.int8.onnx", spec, st.weights, plan.without(keep), export.max_seq_len,
                         cfg.graph_dtype)
        ExportRecord.write(tmp, export.derived(**graph, dtype=cfg.graph_dtype))
    quantized = plan.without(keep).act_amax
    cache = write_trt_cache(tmp, st, quantized)
    return {
        "format": "autoglm-trt/calib/1",
        "method": cfg.method,
        "amax": quantized,
        "amax_method": amax_method if cfg.method == "auto" else {n: cfg.method for n in quantized},
        "activation_tensors": {n: st.inputs[n] for n in quantized},
        "float_linears": float_reasons(keep, cfg.keep_float, gate_report.get("sensitivity"), errors),
        "float_weight_fraction": float_fraction(spec, keep + cfg.keep_float),
        "weight_bytes_per_token": weight_bytes(spec, set(quantized)),
        "int8_output_error": errors,
        "bias_correction": gate_report.get("bias_correction", []),
        "smoothquant": {"alpha": cfg.smoothquant_alpha, "linears": sorted(st.stats.smooth)},
        # amax of these is that of the rotated input (x / s) R, R block-diagonal Hadamard
        "hadamard_block": {n: b for n, b in st.rotate.items() if n in quantized},
        # per-layer, per-KV-head threshold of |K| (after rope) and |V| (99.99th percentile): an INT8 KV cache's
        "kv_amax": kv_head_amax(st.stats.kv_hist),
        "gate": gate_report,
        "tensorrt_cache": cache,
        "versions": versions(),
    }


def write_trt_cache(tmp: Path, st: Statistics, quantized: dict[str, float]) -> dict:
    """``calibration.cache`` for TensorRT <= 10's implicit INT8 on the float ``model.onnx`` of the export.

    Its tensors are the float graph's inputs of the quantized linears (not smoothed, not
    rotated: those exist only inside the Q/DQ graph), thresholds from the entropy search on
    their own histograms, whatever method chose the Q/DQ graph's. TensorRT 11 has no
    implicit INT8 and reads no cache: it builds the Q/DQ graph.
    """
    version, source = trt_version()
    amax = {st.inputs[n]: entropy_amax(st.stats.raw_hist[n]) for n in quantized}
    write_cache(tmp / "calibration.cache", amax, "entropy", version)
    return {"file": "calibration.cache", "header": f"TRT-{version}-{ALGORITHMS['entropy']}", "tensorrt": source,
            "model": "model.onnx of the float32 export (its tensor names)", "tensors": len(amax),
            "method": "entropy, on the float graph's linear inputs"}


def _data_info(cfg: CalibConfig, windows: TokenWindows) -> dict:
    return {"path": str(Path(cfg.data).resolve()), "windows": len(windows.windows), "seq_len": cfg.seq_len,
            "text_tokens": windows.total_tokens}


_KEY_ORDER = ("format", "method", "model_sha256", "data_sha256", "settings", "data", "amax", "amax_method",
              "activation_tensors", "float_linears", "float_weight_fraction", "weight_bytes_per_token",
              "int8_output_error", "bias_correction", "smoothquant", "hadamard_block", "kv_amax", "timings", "gate",
              "tensorrt_cache", "versions")


def _ordered(record: dict) -> dict:
    return {k: record[k] for k in _KEY_ORDER if k in record}
