"""``calibrate``: float32 export + calibration text -> INT8 Q/DQ ONNX, TensorRT cache, calib.json.

Input: an export directory (float32) and a directory of calibration text. Output directory::

    model.int8.onnx, model.int8.onnx.data   Q/DQ graph (same contract as the export)
    calibration.cache                       TensorRT text format, amax/127 per quantized input
    calib.json                              amax per tensor, method, smoothing, float layers,
                                            SHA-256 of model and data, timings, gate results
    export.json                             the export's record, pointing at model.int8.onnx
    tokenizer files

Steps: token windows -> streamed statistics (one pass; SmoothQuant vectors from the first
batch) -> amax per tensor (entropy / max / percentile) -> INT8 graph rebuilt from the
export's weights -> accuracy gate on held-back calibration windows against the float graph
-> if it fails, keep the fewest most sensitive linears in float until it holds.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..arch import spec_from_dict
from ..errors import AutoGLMError
from ..export.graph import OPSET, DecoderGraph, GraphOptions, QuantPlan
from ..fileutil import library_versions, sha256_file, staged_directory, write_json
from ..graph_runner import GraphRunner, read_model_meta
from ..hadamard import block_size, rotate_weight
from ..onnx_builder import GraphBuilder
from ..ort_session import make_session
from .cache import write_cache
from .collect import calibration_session, collect, linear_inputs
from .data import token_windows
from .exported_weights import ExportedWeights
from .histogram import METHODS, percentile_amax
from .linears import KINDS, all_linears, input_channels, kind_of, num_params
from .sensitivity import Gate, SensitivitySearch, output_error
from .smooth import SmoothedWeights, smoothing_scales, weight_row_max

# "auto": per tensor, the threshold (of these) with the least INT8 output error on real rows
AUTO_CANDIDATES = {
    "entropy": METHODS["entropy"],
    "max": METHODS["max"],
    "percentile-99.99": lambda h: percentile_amax(h, 99.99),
    "percentile-99.999": lambda h: percentile_amax(h, 99.999),
}
# What this code computes from the same settings; a cached calibration of another version is redone.
# 2: Hadamard-rotated linear inputs, LM head in the sensitivity search.
CALIB_VERSION = 2
FINAL_GATE_ATTEMPTS = 4
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "calibration" / "data"


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
    keep_float: list[str] = field(default_factory=list)
    gate: bool = True
    # a margin under the acceptance gate (1.02 / 0.90 on held-out text): the search measures
    # on calibration text, the acceptance on other text
    target_ppl_ratio: float = 1.015
    target_top1: float = 0.91
    gate_windows: int = 12
    gate_seq_len: int = 256
    threads: int | None = None
    force: bool = False  # recompute even if a matching result exists; replace a mismatching one
    replace_mismatch: bool = False  # replace a result of another model/data without --force (build's cache)


class CalibrationMismatchError(AutoGLMError):
    """A calibration result does not belong to this model or data."""


def model_sha256(export_dir: Path) -> str:
    """Identity of an export: the hash of its export.json, which records its files' hashes."""
    return sha256_file(Path(export_dir) / "export.json")


def check_calibration(calib_dir: Path, export_dir: Path, data_sha256: str | None = None) -> dict:
    """Load ``calib.json`` and check it was made from this export (and data, if given)."""
    path = Path(calib_dir) / "calib.json"
    if not path.is_file():
        raise CalibrationMismatchError(f"{calib_dir} has no calib.json; it is not a calibration result")
    record = json.loads(path.read_text())
    if record["model_sha256"] != model_sha256(export_dir):
        raise CalibrationMismatchError(
            f"the calibration in {calib_dir} was made from another model (model SHA-256 "
            f"{record['model_sha256'][:12]}…, this export {model_sha256(export_dir)[:12]}…); calibrate again"
        )
    if data_sha256 is not None and record["data_sha256"] != data_sha256:
        raise CalibrationMismatchError(f"the calibration in {calib_dir} was made from other calibration data")
    return record


def calibrate(cfg: CalibConfig, log: Callable[[str], None] = print) -> dict:
    """Calibrate and write ``cfg.out_dir`` atomically; returns the calib.json record."""
    unknown_kinds = sorted(set(cfg.rotate) - set(KINDS))
    if unknown_kinds:
        raise AutoGLMError(f"cannot rotate {unknown_kinds}: the linear kinds are {', '.join(KINDS)}")
    if cfg.method not in (*METHODS, "auto"):
        raise AutoGLMError(f"method '{cfg.method}' is not supported; choose one of {', '.join(METHODS)}, auto")
    meta = read_model_meta(cfg.export_dir)
    if meta["graph"]["dtype"] != "float32" or meta["graph"].get("precision", "fp32") != "fp32":
        raise AutoGLMError(f"{cfg.export_dir} is not a float32 export; calibrate a float32 export "
                           "(autoglm-trt export CHECKPOINT -o DIR)")
    spec = spec_from_dict(meta["spec"])
    separator = spec.eos_token_ids[0] if spec.eos_token_ids else None
    windows = token_windows(cfg.data, cfg.export_dir, cfg.num_samples, cfg.seq_len, separator)
    settings = {k: v for k, v in asdict(cfg).items()
                if k not in ("export_dir", "data", "out_dir", "threads", "force", "replace_mismatch")}
    settings["version"] = CALIB_VERSION
    data_sha = hashlib.sha256((windows.sha256 + json.dumps(settings, sort_keys=True)).encode()).hexdigest()
    msha = model_sha256(cfg.export_dir)

    replace = cfg.force
    existing = Path(cfg.out_dir) / "calib.json"
    if existing.is_file():
        record = json.loads(existing.read_text())
        if record.get("model_sha256") == msha and record.get("data_sha256") == data_sha and not cfg.force:
            log(f"reusing calibration in {cfg.out_dir} (model and data hashes match)")
            record["reused"] = True
            return record
        if not (cfg.force or cfg.replace_mismatch):
            raise CalibrationMismatchError(
                f"{cfg.out_dir} holds a calibration of another model or other data/settings; "
                "pass --force to replace it")
        replace = True

    log(f"calibrating {cfg.export_dir} with {len(windows.windows)} windows of {cfg.seq_len} tokens "
        f"({windows.total_tokens} tokens of text), method {cfg.method}, SmoothQuant "
        f"{'off' if cfg.smoothquant_alpha is None else f'alpha={cfg.smoothquant_alpha}'}")
    t0 = time.perf_counter()
    base = ExportedWeights(cfg.export_dir)
    import onnx

    inputs = linear_inputs(onnx.load(str(Path(cfg.export_dir) / "model.onnx"), load_external_data=False))
    if not cfg.quantize_lm_head:
        inputs.pop("lm_head", None)
    unknown = [k for k in cfg.keep_float if k not in inputs]
    if unknown:
        raise AutoGLMError(f"--keep-float names unknown linears {unknown}; known: layers.<i>.qkv|o_proj|gate_up|down, "
                           "lm_head")
    session = calibration_session(cfg.export_dir, list(inputs.values()), cfg.threads)
    alpha = cfg.smoothquant_alpha

    # The weight maxima SmoothQuant needs are read while ONNX Runtime runs the first batch.
    w_max: dict[str, dict[str, np.ndarray]] = {}
    reader = threading.Thread(target=lambda: w_max.update(all=weight_row_max(spec, base)), daemon=True)
    if alpha is not None:
        reader.start()

    def smoothing(chan_max: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        reader.join()
        return smoothing_scales(spec, w_max["all"], chan_max, alpha)  # type: ignore[arg-type]

    rotate = {n: block_size(input_channels(spec, n), cfg.max_rotation_block) for n in inputs if kind_of(n) in cfg.rotate}
    rotate = {n: b for n, b in rotate.items() if b > 1}  # an odd width has no Hadamard block to use
    t_collect = time.perf_counter()
    stats = collect(session, spec, inputs, windows.windows, cfg.batch_size, smoothing if alpha is not None else None,
                    rotate=rotate)
    t_search = time.perf_counter()
    weights = SmoothedWeights(base, spec, stats.smooth)
    chosen_method: dict[str, str] = {}
    if cfg.method == "auto":
        amax = {}
        for n, h in stats.hist.items():
            w = _matrix(weights, n, rotate)
            options = {m: f(h) for m, f in AUTO_CANDIDATES.items()}
            best = min(options, key=lambda m: output_error(stats.sample[n], w, options[m]))
            amax[n], chosen_method[n] = float(options[best]), best
    else:
        method = METHODS[cfg.method]
        amax = {n: float(method(h) if cfg.method != "percentile" else percentile_amax(h, cfg.percentile))
                for n, h in stats.hist.items()}
    t_done = time.perf_counter()
    timings = {"collect_s": round(t_search - t_collect, 3), "search_s": round(t_done - t_search, 3),
               "batches": stats.batches, "tokens": stats.tokens}
    log(f"statistics: {stats.batches} batches in {timings['collect_s']:.1f} s, threshold search "
        f"{timings['search_s']:.2f} s")
    del session

    errors = {n: output_error(stats.sample[n], _matrix(weights, n, rotate), amax[n]) for n in amax}

    with staged_directory(Path(cfg.out_dir), replace) as tmp:
        def build(keep: list[str], switchable: bool = False, name: str = "model.int8.onnx") -> Path:
            plan = QuantPlan({n: a for n, a in amax.items() if n not in keep and n not in cfg.keep_float}, switchable,
                             rotate)
            builder = GraphBuilder(tmp / f"{name}.data")
            try:
                DecoderGraph(builder, spec, weights, GraphOptions("float32", meta["graph"]["max_positions"], plan)).build()
                model = builder.model(f"{spec.family}_paged_decoder_int8", OPSET)
            finally:
                builder.close()
            onnx.save_model(model, str(tmp / name))
            return tmp / name

        meta_out = json.loads(json.dumps(meta))
        meta_out["graph"].update({"file": "model.int8.onnx", "data_file": "model.int8.onnx.data", "precision": "int8"})
        write_json(tmp / "export.json", meta_out)
        for f in Path(cfg.export_dir).iterdir():
            if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja",
                                                            "generation_config.json", "vocab.json", "merges.txt"):
                shutil.copy2(f, tmp / f.name)

        gate_report: dict = {"enabled": cfg.gate}
        keep: list[str] = []
        if cfg.gate:
            t_gate = time.perf_counter()
            gate_windows = _gate_windows(cfg, separator)  # tokenized once: the search and the final check
            switch_path = build([], switchable=True, name="switch.onnx")
            search = SensitivitySearch(make_session(switch_path, threads=cfg.threads), spec,
                                       QuantPlan({n: a for n, a in amax.items() if n not in cfg.keep_float}).switch_order,
                                       gate_windows, cfg.target_ppl_ratio, cfg.target_top1)
            chosen = search.run(errors, log)
            if chosen is None:
                raise AutoGLMError("no INT8 plan meets the accuracy gate even with every linear in float; "
                                   "check the export")
            # The search scores fake quantization in float; the final graph runs integer kernels.
            # The two differ by rounding, which can move the result across the target: then keep
            # the next most sensitive linears in float too, a few times at most.
            keep = chosen
            reference = GraphRunner(cfg.export_dir, threads=cfg.threads).logits
            final = Gate(reference, gate_windows, cfg.target_ppl_ratio, cfg.target_top1, reference)
            for attempt in range(FINAL_GATE_ATTEMPTS):
                build(keep)
                result = final.check(GraphRunner(tmp, threads=cfg.threads).logits)
                log(f"gate on the INT8 graph with {len(keep)} linears in float: ppl ratio {result['ppl_ratio']:.4f}, "
                    f"top-1 {result['top1_agreement']:.3f}")
                if result["passed"] or attempt == FINAL_GATE_ATTEMPTS - 1:
                    break
                keep = search.ranked(errors, log)[: len(keep) + max(1, len(keep) // 2)]
            if not result["passed"]:
                raise AutoGLMError(
                    f"the INT8 graph misses the accuracy gate (ppl ratio {result['ppl_ratio']:.4f} > "
                    f"{cfg.target_ppl_ratio} or top-1 {result['top1_agreement']:.3f} < {cfg.target_top1}) with "
                    f"{len(keep)} linears in float; keep more in float (--keep-float) or lower the targets")
            gate_report.update({"target_ppl_ratio": cfg.target_ppl_ratio, "target_top1": cfg.target_top1,
                                "sensitivity": search.report, "result": result,
                                "seconds": round(time.perf_counter() - t_gate, 1)})
            del search  # its session reads the switchable graph's weights
            switch_path.unlink()
            (tmp / "switch.onnx.data").unlink()
        else:
            build([])

        quantized = {n: a for n, a in amax.items() if n not in keep and n not in cfg.keep_float}
        act_names = {n: inputs[n] for n in quantized}
        write_cache(tmp / "calibration.cache", {f"{n}.act_q_input": a for n, a in quantized.items()},
                    "entropy" if cfg.method == "auto" else cfg.method)
        float_layers = [{"linear": n, "reason": "user --keep-float"} for n in cfg.keep_float] + [
            {"linear": n, "reason": _float_reason(k, n, gate_report["sensitivity"], errors[n])}
            for k, n in enumerate(keep)]
        record = {
            "format": "autoglm-trt/calib/1",
            "method": cfg.method,
            "model_sha256": msha,
            "data_sha256": data_sha,
            "settings": settings,
            "data": {"path": str(Path(cfg.data).resolve()), "windows": len(windows.windows), "seq_len": cfg.seq_len,
                     "text_tokens": windows.total_tokens},
            "amax": quantized,
            "amax_method": chosen_method or {n: cfg.method for n in quantized},
            "activation_tensors": act_names,
            "float_linears": float_layers,
            "float_weight_fraction": _float_fraction(spec, keep + cfg.keep_float),
            "weight_bytes_per_token": _weight_bytes(spec, set(quantized)),
            "int8_output_error": errors,
            "smoothquant": {"alpha": alpha, "linears": sorted(stats.smooth)},
            # amax of these is that of the rotated input (x / s) R, R block-diagonal Hadamard
            "hadamard_block": {n: b for n, b in rotate.items() if n in quantized},
            "timings": {**timings, "total_s": round(time.perf_counter() - t0, 2)},
            "gate": gate_report,
            "versions": library_versions("onnx", "onnxruntime", "numpy"),
        }
        write_json(tmp / "calib.json", record)
    log(f"calibration written to {cfg.out_dir}: {len(quantized)} linears INT8, {len(keep)} kept in float")
    return record


def _float_reason(rank: int, name: str, sensitivity: dict, error: float) -> str:
    kind = kind_of(name)
    return (f"sensitivity rank {rank + 1} (kind {kind}: KL gain with the whole kind in float "
            f"{sensitivity['kl_gain_by_kind'][kind]:.4f}; INT8 output error of this linear {error:.4f})")


def _matrix(weights: SmoothedWeights, name: str, rotate: dict[str, int]) -> np.ndarray:
    """The ``[in, out]`` weight of a linear as its INT8 graph has it (smoothed; rotated if planned)."""
    if name == "lm_head":
        src = weights.lm_head_name() or weights.embedding_name()
        w = np.asarray(weights.rows(src, 0, weights.spec.vocab_size), np.float32).T
    else:
        i, kind = name.split(".")[1], name.split(".")[2]
        w = getattr(weights, kind)(int(i))
        w = w[0] if kind in ("qkv", "o_proj") else w
    return rotate_weight(w, rotate[name]) if name in rotate else w


def _weight_bytes(spec, quantized: set[str]) -> dict:
    """What a bandwidth-bound decode step reads per token: linear weights, 1 byte if INT8, else 4."""
    params = {n: num_params(spec, n) for n in all_linears(spec)}
    plan = sum(p * (1 if n in quantized else 4) for n, p in params.items())
    return {"this_plan_mb": round(plan / 1e6, 1), "all_int8_mb": round(sum(params.values()) / 1e6, 1),
            "float32_mb": round(4 * sum(params.values()) / 1e6, 1),
            "note": "linears and LM head only (float32 where not INT8); decode on a CPU is bound by these reads"}


def _float_fraction(spec, keep: list[str]) -> float:
    """Share of the linear weights, LM head included (by parameter count), that stay in float."""
    total = sum(num_params(spec, n) for n in all_linears(spec))
    return round(sum(num_params(spec, n) for n in keep) / total, 4)


def _gate_windows(cfg: CalibConfig, separator: int | None) -> np.ndarray:
    return token_windows(cfg.data, cfg.export_dir, cfg.gate_windows, cfg.gate_seq_len, separator).windows
