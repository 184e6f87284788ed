"""``build``: checkpoint (or export) -> ready engine directory, reusing earlier stages.

Input: a Hugging Face checkpoint or an export directory, a precision, a backend and a build
config. Intermediate results live in ``<engines>/.cache/<checkpoint>-<hash>/``: the float32
(or float16) export and the INT8 calibration. Each is reused when the hashes it recorded
still match (checkpoint files; export + calibration data + settings), and redone otherwise.
The engine directory is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..artifacts import (
    ENGINE_FORMAT,
    EXPORT_RECORD,
    CalibRecord,
    ExportRecord,
    KVCache,
    Limits,
    Manifest,
    copy_tokenizer_files,
    hash_dir,
    tokenizer_files,
)
from ..backends.base import Backend, EngineSettings
from ..backends.registry import choose, having
from ..errors import AutoGLMError
from ..fileutil import available_memory_bytes, library_versions, sha256_files, staged_directory, write_json
from ..graph.decoder import GRAPH_VERSION
from ..graph.kv_int8 import int8_kv_graph
from ..kvcache.layout import POOL_LAYOUT
from ..model.checkpoint import Checkpoint
from ..model.spec import ModelSpec
from ..precisions import Form, Precision, precision
from ..record_schema import untyped
from .config import BuildConfig
from .profiles import profile_shapes
from .vision import vision_engine

if TYPE_CHECKING:
    from .int4_awq import Int4Settings

KV_CALIB_WINDOWS = 32  # windows of 128 tokens for the K/V ranges of an fp32/fp16 engine's INT8 KV cache


@dataclass
class BuildRequest:
    source: Path
    out_dir: Path
    precision: str = "int8"
    calib: Path | None = None
    backend: str = "auto"
    config: BuildConfig | None = None
    cache_dir: Path | None = None  # default: <out_dir parent>/.cache
    force: bool = False
    int4_block: int | None = None  # int4-awq: inputs per weight scale (None: the backend's ``traits.int4_block``)
    int4_int8: tuple[str, ...] = ()  # int4-awq: kinds of linear kept at INT8
    int4_gate: float | None = None  # int4-awq: the accuracy gate's expected perplexity ratio (None: no gate)
    # int4-awq: "awq" (AWQ's scales, GPTQ's rounding: calibrated) or "nearest" (no calibration; a float16
    # export will do)
    int4_rounding: str = "awq"


def _backend_for(req: BuildRequest, p: Precision, log: Callable[[str], None]) -> Backend:
    """The backend that builds ``req`` in precision ``p`` (``registry.choose``)."""
    return choose(req.backend, log, p)


def _checkpoint_export(source: Path, dtype: str, cache: Path, log: Callable[[str], None]) -> Path:
    """Export ``source`` into the cache, or reuse an export whose recorded input hashes still match."""
    from ..export.pipeline import ExportConfig, default_max_seq_len, export_checkpoint

    out = cache / f"export-{dtype}"
    if (out / EXPORT_RECORD).is_file():
        ckpt = Checkpoint.open(source)
        current = sha256_files([ckpt.path / "config.json", *ckpt.weight_files, *tokenizer_files(ckpt.path)], ckpt.path)
        record = ExportRecord.read(out)
        if record.graph_version != GRAPH_VERSION:
            log(f"{out} was exported by another version of the graph code: exporting again")
        elif record.max_seq_len != default_max_seq_len(record.spec):
            log(f"{out} was exported for sequences of {record.max_seq_len} tokens, not the "
                f"{default_max_seq_len(record.spec)} its model takes now: exporting again")
        elif record.source_sha256 == current:
            log(f"reusing export {out} (checkpoint hashes match)")
            return out
        else:
            log(f"checkpoint changed since {out} was exported: exporting again")
    export_checkpoint(ExportConfig(source, out, dtype=dtype, force=True), log=log)
    return out


def _cache_dir(req: BuildRequest) -> Path:
    base = req.cache_dir or Path(req.out_dir).parent / ".cache"
    key = hashlib.sha256(str(Path(req.source).resolve()).encode()).hexdigest()[:12]
    return base / f"{Path(req.source).name}-{key}"


def _model_dir(req: BuildRequest, cache: Path, log: Callable[[str], None]) -> Path:
    """The float export to build from: the source itself, or the checkpoint's export in the cache."""
    source = Path(req.source)
    p = precision(req.precision)
    dtype = p.export_dtype
    if (source / EXPORT_RECORD).is_file():
        have = ExportRecord.read(source).dtype
        float16 = p.float16_export or (p.model is Form.INT4 and req.int4_rounding == "nearest")
        if have != dtype and not (float16 and have == "float16"):
            raise AutoGLMError(f"{source} is a {have} export; precision {req.precision} needs a {dtype} export "
                               f"(autoglm-trt export CHECKPOINT -o DIR --dtype {dtype}) or the checkpoint itself")
        return source
    if (source / "config.json").is_file():
        return _checkpoint_export(source, dtype, cache, log)
    raise AutoGLMError(f"{source} is neither a Hugging Face checkpoint (config.json) nor an export (export.json)")


def _calibrated(req: BuildRequest, backend: Backend, model_dir: Path, cache: Path, log: Callable[[str], None]) -> Path:
    """The INT8 calibration of ``model_dir`` for ``backend`` in the cache (made or reused)."""
    from ..calib.pipeline import DEFAULT_DATA, CalibConfig, calibrate

    data = req.calib
    if data is None:
        data = DEFAULT_DATA
        log(f"no --calib given: calibrating with the default set {data}")
    dtype = backend.traits.graph_dtype
    calib_dir = cache / ("calib-int8" if dtype == "float32" else f"calib-int8-{dtype}")
    calibrate(CalibConfig(model_dir, data, calib_dir, replace_mismatch=True, graph_dtype=dtype), log=log)
    return calib_dir


def _quantized(req: BuildRequest, backend: Backend, float_dir: Path, cache: Path, log: Callable[[str], None]) -> Path:
    """The model the engine is built from: the float export, its INT8 calibration, its
    weight-only INT8 model or its INT4 model (made or reused in the cache)."""
    p, traits = precision(req.precision), backend.traits
    if p.model is Form.INT8:
        return _calibrated(req, backend, float_dir, cache, log)
    if p.model is Form.WEIGHT_ONLY:
        from .weight_only import weight_only_export

        if req.calib is not None:
            log(f"{req.precision} quantizes weights alone: --calib is read only for an INT8 KV cache's ranges")
        return weight_only_export(float_dir, cache / "int8-wo", log, int8_embedding=traits.int8_embedding,
                                  dtype=traits.graph_dtype, int8_channels=traits.int8_channels)
    if p.model is Form.INT4:
        from ..calib.pipeline import DEFAULT_DATA
        from .int4_awq import int4_export

        settings = int4_settings(req, backend, ExportRecord.read(float_dir).spec)
        if not settings.calibrated and req.calib is not None:
            log("--int4-rounding nearest rounds the weights alone: --calib is not read")
        elif req.calib is None and settings.calibrated:
            log(f"no --calib given: AWQ searches its scales on the default set {DEFAULT_DATA}")
        return int4_export(float_dir, cache / "int4-awq", req.calib or DEFAULT_DATA, settings, log=log)
    return float_dir


def int4_settings(req: BuildRequest, backend: Backend, spec: ModelSpec) -> Int4Settings:
    """How an int4-awq build for ``backend`` quantizes the model of ``spec``, from its traits: INT4
    with or without zero points, 8-bit linears in blocks or per output channel, the embedding INT8
    or float, the graph's float type."""
    from .int4_awq import Int4Settings

    t = backend.traits
    if req.int4_rounding not in ("awq", "nearest"):
        raise AutoGLMError(f"--int4-rounding is awq or nearest, not {req.int4_rounding!r}")
    nearest = req.int4_rounding == "nearest"
    if nearest and req.int4_gate is not None:
        raise AutoGLMError("the INT4 gate measures the model on calibration text, which --int4-rounding nearest "
                           "does not read: build with --int4-rounding awq for the gate, or without --int4-gate")
    return Int4Settings(block=int4_block(req, backend, spec), symmetric=t.symmetric_int4, int8_kinds=req.int4_int8,
                        int8_embedding=t.int8_embedding, gate=req.int4_gate, dtype=t.graph_dtype,
                        int8_channels=t.int8_channels, awq=not nearest, gptq=not nearest)


def int4_block(req: BuildRequest, backend: Backend, spec: ModelSpec | None = None) -> int:
    """The INT4 block size of an int4-awq build: the request's, else the backend's default; refused
    where the backend would not build it. A backend with a fixed set of block sizes
    (``traits.int4_blocks``, TensorRT's) also needs them to divide each linear's input width
    (``spec``'s, when known): its default is then the largest of them that does."""
    t = backend.traits
    if not t.int4_blocks:
        return t.int4_block if req.int4_block is None else req.int4_block
    widths = [] if spec is None else sorted({spec.hidden_size, spec.q_size, spec.intermediate_size})
    fits = [b for b in sorted(t.int4_blocks, reverse=True) if all(w % b == 0 for w in widths)]
    block = req.int4_block if req.int4_block is not None else (fits[0] if fits else t.int4_block)
    if block not in t.int4_blocks:
        others = [b.name for b in having(lambda b: not b.traits.int4_blocks)]
        raise AutoGLMError(f"{backend.label} builds INT4 weights in blocks of {' or '.join(map(str, t.int4_blocks))} "
                           f"inputs, not {block}: pass --int4-block {t.int4_block} (its default) or "
                           f"{t.int4_blocks[0]}, or build for another backend (--backend {' or '.join(others)}), "
                           f"which takes {block}")
    if block not in fits:
        raise AutoGLMError(f"INT4 blocks of {block} do not divide this model's linear input widths "
                           f"({', '.join(map(str, widths))}), as {backend.label}'s block quantization needs; "
                           + (f"pass --int4-block {fits[0]}" if fits else
                              f"no block size {backend.label} takes does: build int8-wo, or int4-awq for another backend"))
    return block


def _write_backend(backend: Backend, graph_file: Path, tmp: Path, cfg: BuildConfig, profiles: dict,
                   req: BuildRequest, kv_amax: dict | None) -> tuple[str, dict]:
    """The backend's engine file from the graph, in ``tmp``: (engine file, report). For an INT8 KV
    cache the graph is first rewritten: with the static scales of ``kv_amax``, or per token
    (``cfg.kv_scales``)."""
    rewritten = None
    if kv_amax is not None or cfg.kv_scales == "token":
        import onnx

        rewritten = int8_kv_graph(onnx.load(str(graph_file), load_external_data=False), kv_amax,
                                  unit_scales=backend.traits.unit_kv_scales)
    settings = EngineSettings(cfg.threads, profiles, cfg.workspace_bytes, cfg.builder_optimization_level,
                              _timing_cache(cfg, req))
    return backend.write_engine(graph_file, tmp, settings, rewritten)


def _timing_cache(cfg: BuildConfig, req: BuildRequest) -> Path:
    """TensorRT's timing cache: the config's, else ``.cache/timing.cache`` beside the engine."""
    return Path(cfg.timing_cache) if cfg.timing_cache else Path(req.out_dir).parent / ".cache" / "timing.cache"


def _kv_amax(req: BuildRequest, record: ExportRecord, log: Callable[[str], None]) -> dict:
    """K/V amax per layer and head: from the INT8 calibration, or one statistics pass over the
    calibration text on the float export ``record``."""
    if precision(req.precision).calibrated_kv:
        return CalibRecord.read(record.dir).kv_amax
    from ..calib.collect import kv_statistics
    from ..calib.pipeline import DEFAULT_DATA
    from ..model.text import token_windows

    spec = record.spec
    data = req.calib or DEFAULT_DATA
    windows = token_windows(data, record.dir, KV_CALIB_WINDOWS, 128, spec.eos_token_ids[0] if spec.eos_token_ids
                            else None).windows
    log(f"measuring K/V ranges for the INT8 KV cache on {len(windows)} windows of {data}")
    return kv_statistics(record.dir, spec, windows, 8, record.dtype)


def _refuse_before_work(req: BuildRequest, cfg: BuildConfig, backend: Backend) -> None:
    """What the backend cannot build, refused before any export or calibration."""
    if precision(req.precision).model is Form.INT4:
        int4_block(req, backend)
    if cfg.kv_scales == "token" and not backend.traits.token_kv_scales:
        others = [b.name for b in having(lambda b: b.traits.token_kv_scales)]
        raise AutoGLMError(f"per-token KV scales (kv_scales token) run on the {' or '.join(others)} backend; for "
                           f"{backend.label} use kv_scales head (static, calibrated), which it builds as explicit "
                           "quantization")


def build_engine(req: BuildRequest, log: Callable[[str], None] = print) -> dict:
    """Build the engine directory; returns its manifest."""
    p = precision(req.precision)
    cfg = req.config or BuildConfig()
    cfg.check()
    out_dir = Path(req.out_dir)
    if out_dir.exists() and not req.force:
        raise AutoGLMError(f"engine directory {out_dir} already exists; pass --force to rebuild it")
    backend = _backend_for(req, p, log)
    _refuse_before_work(req, cfg, backend)
    t0 = time.perf_counter()
    cache = _cache_dir(req)
    float_dir = _model_dir(req, cache, log)
    model_dir = _quantized(req, backend, float_dir, cache, log)

    record = ExportRecord.read(model_dir)
    kv_dtype = cfg.kv_cache_dtype or record.dtype
    if kv_dtype not in (record.dtype, "int8"):
        raise AutoGLMError(f"a {record.dtype} engine keeps its KV cache in {record.dtype} or int8, not {kv_dtype}")
    cfg = cfg.resolved(record.spec, record.max_seq_len, kv_bytes_per_elem(kv_dtype), available_memory_bytes(), log)
    assert cfg.max_seq_len is not None and cfg.max_input_len is not None  # resolved
    if cfg.max_seq_len > record.max_seq_len:
        raise AutoGLMError(f"max_seq_len {cfg.max_seq_len} exceeds what the export allows "
                           f"({record.max_seq_len}); export with a larger --max-seq-len")
    num_blocks = cfg.num_blocks(record.spec, kv_bytes_per_elem(kv_dtype))
    if backend.traits.host_memory:
        check_pool_fits(num_blocks * cfg.block_bytes(record.spec, kv_bytes_per_elem(kv_dtype)), AutoGLMError)
    profiles = profile_shapes(cfg, record.spec, num_blocks)
    # K/V ranges: the calibration's (int8), else measured on the float model
    kv_source = record if p.calibrated_kv else ExportRecord.read(float_dir)
    kv_amax = _kv_amax(req, kv_source, log) if kv_dtype == "int8" and cfg.kv_scales == "head" else None

    with staged_directory(out_dir, req.force) as tmp:
        log(f"building {backend.name} engine ({req.precision}) from {record.graph_file}")
        engine_file, report = _write_backend(backend, record.graph_file, tmp, cfg, profiles, req, kv_amax)
        vision_engine(backend, model_dir, record, tmp, cfg, p.eight_bit_activations, _timing_cache(cfg, req),
                      report, log)
        sections = backend.finish(tmp, record, kv_dtype, p.eight_bit_activations, p.dynamic_int8, report, log)
        copy_tokenizer_files(model_dir, tmp)
        ExportRecord.write(tmp, record.derived(file=engine_file, kv_dtype=kv_dtype))
        write_json(tmp / "fusion_report.json", report)
        if p.model is Form.INT8:
            shutil.copy2(model_dir / "calib.json", tmp / "calib.json")
            shutil.copy2(model_dir / "calibration.cache", tmp / "calibration.cache")
        manifest = {**_manifest(req, backend, engine_file, record, cfg, profiles, report), **sections}
        manifest["kv_cache"] = untyped(KVCache(cfg.kv_block_size, num_blocks,
                                       num_blocks * cfg.block_bytes(record.spec, kv_bytes_per_elem(kv_dtype)), kv_dtype,
                                       f"{POOL_LAYOUT} per layer, K and V" + (
                                           ", and a float32 scale per token and KV head" if cfg.kv_scales == "token"
                                           else ""),
                                       None if kv_amax is None else {n: [a / 127.0 for a in v]
                                                                     for n, v in kv_amax.items()}))
        manifest["build_seconds"] = round(time.perf_counter() - t0, 1)
        manifest["files"] = hash_dir(tmp)
        Manifest.write(tmp, manifest)
    log(f"engine ready: {out_dir} ({backend.name}, {req.precision}, {time.perf_counter() - t0:.1f} s)")
    return manifest


def check_pool_fits(pool_bytes: int, error: type[AutoGLMError]) -> None:
    """Refuse a KV pool larger than this machine's available memory (ONNX Runtime keeps it in RAM)."""
    have = available_memory_bytes()
    if have is not None and pool_bytes > have:
        raise error(f"the KV pool would take {pool_bytes / 2**30:.1f} GiB but this machine has {have / 2**30:.1f} GiB "
                    "available; lower kv_memory_bytes or kv_num_blocks")


def kv_bytes_per_elem(dtype: str) -> int:
    return {"float16": 2, "int8": 1}.get(dtype, 4)


def _manifest(req: BuildRequest, backend: Backend, engine_file: str, record: ExportRecord, cfg: BuildConfig,
              profiles: dict, report: dict) -> dict:
    """The manifest's fields but the KV cache, the backend's own section and the file hashes."""
    assert cfg.max_input_len is not None and cfg.max_seq_len is not None, "resolve the config first"
    manifest = {
        "format": ENGINE_FORMAT,
        "backend": backend.name,
        "precision": req.precision,
        "engine_file": engine_file,
        "source": {"path": str(Path(req.source).resolve()), "model_dir": str(record.dir.resolve()),
                   "checkpoint_sha256": record.source_sha256},
        "spec": record.spec_data,
        "limits": untyped(Limits(cfg.max_batch_size, cfg.max_input_len, cfg.max_seq_len)),
        "build_config": asdict(cfg),
        "profiles": {k: {n: [list(s) for s in v] for n, v in p.items() if not n.startswith("past_")}
                     for k, p in profiles.items()},
        "versions": library_versions("onnx", "onnxruntime", "numpy", "tensorrt"),
        "fusions": report.get("fusions", report.get("fused_count")),
    }
    return manifest
