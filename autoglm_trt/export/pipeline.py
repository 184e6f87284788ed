"""``export``: a Hugging Face checkpoint directory -> ``model.onnx`` + ``export.json``.

Input: the checkpoint directory and an ``ExportConfig``. Output: a directory with
``model.onnx``, ``model.onnx.data`` (the weights, written tensor by tensor as they are read),
the tokenizer files and ``export.json`` (spec, graph I/O, hashes, versions, parity report).
The directory appears only when everything, validation included, succeeded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from ..artifacts import ExportRecord, copy_tokenizer_files, tokenizer_files
from ..errors import ExportError
from ..fileutil import available_memory_bytes, library_versions, sha256_file, sha256_files, staged_directory
from ..graph.builder import GraphBuilder
from ..graph.decoder import GRAPH_VERSION, OPSET, DecoderGraph, GraphOptions, io_names
from ..graph.vision import VISION_GRAPH, VISION_POSITIONS, VISION_PREFIX, write_vision_graph
from ..kvcache.layout import POOL_LAYOUT
from ..model.checkpoint import Checkpoint
from ..model.spec import ModelSpec, spec_from_config
from ..model.vision import VisionSpec
from ..model.weights import WeightReader
from .validate import default_tolerance, validate_export

DTYPES = ("float32", "float16")
DEFAULT_MAX_SEQ_LEN = 8192  # a text model's export, at most
IMAGE_MAX_SEQ_LEN = 65536  # an image-text model's (GLM-4.1V-9B's max_position_embeddings): screenshots are long


def default_max_seq_len(spec) -> int:
    """The longest sequence an export of ``spec`` allows unless told: its max_position_embeddings, at most
    ``DEFAULT_MAX_SEQ_LEN`` (text) or ``IMAGE_MAX_SEQ_LEN`` (image-text)."""
    return min(spec.max_position_embeddings, IMAGE_MAX_SEQ_LEN if spec.vision else DEFAULT_MAX_SEQ_LEN)


@dataclass
class ExportConfig:
    checkpoint: Path
    out_dir: Path
    dtype: str = "float32"
    max_seq_len: int | None = None  # default: default_max_seq_len(spec)
    validate: bool = True
    tolerance: float | None = None
    allow_pickle: bool = False
    force: bool = False


@dataclass
class ExportResult:
    out_dir: Path
    seconds: float
    report: dict | None


def export_checkpoint(cfg: ExportConfig, log: Callable[[str], None] = print) -> ExportResult:
    """Export, validate, and publish ``cfg.out_dir`` atomically.

    Raises:
        CheckpointError, UnsupportedModelError: the checkpoint cannot be exported.
        ValidationError: the graph does not match transformers within tolerance.
        AutoGLMError: the output directory exists and ``force`` is not set.
    """
    if cfg.dtype not in DTYPES:
        raise ExportError(f"dtype '{cfg.dtype}' is not supported; choose one of {', '.join(DTYPES)}")
    t0 = time.perf_counter()
    ckpt = Checkpoint.open(cfg.checkpoint, allow_pickle=cfg.allow_pickle)
    spec = spec_from_config(ckpt.config)
    if cfg.validate:
        _check_reference_fits(spec)
    max_seq_len = cfg.max_seq_len or default_max_seq_len(spec)
    opts = GraphOptions(dtype=cfg.dtype, max_seq_len=max_seq_len)
    log(f"exporting {spec.family} model from {ckpt.path}: {spec.num_layers} layers, hidden {spec.hidden_size}, "
        f"{spec.num_heads} heads / {spec.num_kv_heads} KV heads, vocab {spec.vocab_size}, weights as {cfg.dtype}")

    with staged_directory(Path(cfg.out_dir), cfg.force) as tmp:
        builder = GraphBuilder(tmp / "model.onnx.data")
        try:
            DecoderGraph(builder, spec, WeightReader(ckpt, spec), opts, _layer_progress(log)).build()
            model = builder.model(f"{spec.family}_paged_decoder", OPSET, {"autoglm_trt.spec": spec.family})
        finally:
            builder.close()
        onnx.save_model(model, str(tmp / "model.onnx"))
        del model
        onnx.checker.check_model(str(tmp / "model.onnx"))
        copy_tokenizer_files(ckpt.path, tmp)
        vision = _export_vision(ckpt, tmp, log) if spec.vision else None
        export_s = time.perf_counter() - t0
        log(f"graph written in {export_s:.1f} s ({builder.bytes_written / 1e9:.2f} GB of weights)")

        report = None
        if cfg.validate:
            tol = cfg.tolerance if cfg.tolerance is not None else default_tolerance(cfg.dtype)
            report = validate_export(tmp, ckpt.path, spec, cfg.dtype, tol, cfg.allow_pickle, log)
            if vision is not None:
                from .validate_vision import validate_vision

                report["images"] = validate_vision(tmp, ckpt.path, spec, vision, cfg.dtype, tol, log)

        record = _record(spec, opts, ckpt, tmp, export_s, report)
        if vision is not None:
            record["vision"] = {"graph": VISION_GRAPH, "positions": VISION_POSITIONS, "spec": vision.to_json()}
        ExportRecord.write(tmp, record)
    return ExportResult(Path(cfg.out_dir), time.perf_counter() - t0, report)


def _export_vision(ckpt: Checkpoint, out: Path, log: Callable[[str], None]) -> VisionSpec:
    """The vision encoder's graph and position table beside the decoder (GLM-4.1V)."""
    vision = VisionSpec.from_config(ckpt.config)
    write_vision_graph(ckpt, out, VISION_GRAPH)
    table = np.asarray(ckpt.read(VISION_PREFIX + "embeddings.position_embedding.weight"), np.float32)
    np.save(out / VISION_POSITIONS, table, allow_pickle=False)
    log(f"vision encoder written: {VISION_GRAPH}, position table {table.shape[0]} x {table.shape[1]}")
    return vision


def _layer_progress(log: Callable[[str], None]) -> Callable[[int, int], None]:
    start = time.perf_counter()

    def report(done: int, total: int) -> None:
        if total <= 8 or done % max(1, total // 10) == 0 or done == total:
            log(f"  layer {done}/{total} written ({time.perf_counter() - start:.1f} s)")

    return report


def _check_reference_fits(spec: ModelSpec) -> None:
    need = spec.num_parameters() * 4 * 2  # float32 reference + the ONNX Runtime session
    have = available_memory_bytes()
    if have is not None and need > have:
        raise ExportError(
            f"validation would load the float32 reference model and the graph (~{need / 1e9:.0f} GB) but only "
            f"{have / 1e9:.0f} GB of memory is available; pass --no-validate to export without the parity check"
        )


def _record(spec: ModelSpec, opts: GraphOptions, ckpt: Checkpoint, tmp: Path, export_s: float,
            report: dict | None) -> dict:
    """``export.json``: the spec, the graph's contract, what it was made from, and the parity report."""
    inputs, outputs = io_names(spec.num_layers, spec.vision)
    return {
        "format": "autoglm-trt/export/1",
        "spec": spec.to_json(),
        "graph": {
            "file": "model.onnx", "data_file": "model.onnx.data", "opset": OPSET, "version": GRAPH_VERSION,
            "dtype": opts.dtype,
            "precision": "fp32" if opts.dtype == "float32" else "fp16", "max_seq_len": opts.max_seq_len,
            "inputs": inputs, "outputs": outputs,
            "kv_cache": {"layout": POOL_LAYOUT, "dtype": opts.dtype,
                         "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim},
            "rope_layout": "half" + ("(permuted from interleaved)" if spec.fam.rope_interleaved else ""),
        },
        "source": {
            "checkpoint": str(ckpt.path.resolve()),
            "sha256": sha256_files([ckpt.path / "config.json", *ckpt.weight_files, *tokenizer_files(ckpt.path)],
                                   ckpt.path),
        },
        "outputs_sha256": {"model.onnx": sha256_file(tmp / "model.onnx"),
                           "model.onnx.data": sha256_file(tmp / "model.onnx.data")},
        "versions": library_versions("onnx", "onnxruntime", "numpy", "transformers", "torch"),
        "export_seconds": round(export_s, 2),
        "parity": report,
    }
