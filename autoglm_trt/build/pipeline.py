"""``build``: checkpoint (or export) -> ready engine directory, reusing earlier stages.

Input: a Hugging Face checkpoint or an export directory, a precision, a backend and a build
config. Intermediate results live in ``<engines>/.cache/<checkpoint>-<hash>/``: the float32
(or float16) export and the INT8 calibration. Each is reused when the hashes it recorded
still match (checkpoint files; export + calibration data + settings), and redone otherwise.
The engine directory is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from ..arch import spec_from_dict
from ..checkpoint import Checkpoint
from ..errors import AutoGLMError
from ..export.graph import GRAPH_VERSION
from ..fileutil import library_versions, sha256_files, staged_directory, write_json
from ..graph_runner import read_model_meta
from ..paged_kv import POOL_LAYOUT
from .config import BuildConfig
from .manifest import MANIFEST, hash_dir
from .profiles import profile_shapes

PRECISIONS = ("fp32", "fp16", "int8")
BACKENDS = ("auto", "tensorrt", "onnxruntime")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model")


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


def resolve_backend(requested: str, log: Callable[[str], None]) -> str:
    from .tensorrt_backend import require_tensorrt, tensorrt_available

    if requested not in BACKENDS:
        raise AutoGLMError(f"backend '{requested}' is not one of {', '.join(BACKENDS)}")
    if requested == "tensorrt":
        require_tensorrt()
        return "tensorrt"
    if requested == "onnxruntime":
        return "onnxruntime"
    ok, reason = tensorrt_available()
    log(f"backend auto: {'tensorrt' if ok else 'onnxruntime'} ({reason})")
    return "tensorrt" if ok else "onnxruntime"


def _checkpoint_export(source: Path, dtype: str, cache: Path, log: Callable[[str], None]) -> Path:
    """Export ``source`` into the cache, or reuse an export whose recorded input hashes still match."""
    from ..export.pipeline import ExportConfig, export_checkpoint

    out = cache / f"export-{dtype}"
    if (out / "export.json").is_file():
        ckpt = Checkpoint.open(source)
        current = sha256_files([ckpt.path / "config.json", *ckpt.weight_files, *ckpt.tokenizer_files()], ckpt.path)
        meta = read_model_meta(out)
        if meta["graph"].get("version") != GRAPH_VERSION:
            log(f"{out} was exported by another version of the graph code: exporting again")
        elif meta["source"]["sha256"] == current:
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


def build_engine(req: BuildRequest, log: Callable[[str], None] = print) -> dict:
    """Build the engine directory; returns its manifest."""
    from ..calib.pipeline import DEFAULT_DATA, CalibConfig, calibrate

    if req.precision not in PRECISIONS:
        raise AutoGLMError(f"precision '{req.precision}' is not supported; choose one of {', '.join(PRECISIONS)}")
    cfg = req.config or BuildConfig()
    cfg.check()
    out_dir = Path(req.out_dir)
    if out_dir.exists() and not req.force:
        raise AutoGLMError(f"engine directory {out_dir} already exists; pass --force to rebuild it")
    backend = resolve_backend(req.backend, log)
    t0 = time.perf_counter()
    source = Path(req.source)
    cache = _cache_dir(req)
    dtype = "float16" if req.precision == "fp16" else "float32"

    if (source / "export.json").is_file():
        model_dir = source
        have = read_model_meta(source)["graph"]["dtype"]
        if have != dtype:
            raise AutoGLMError(f"{source} is a {have} export; precision {req.precision} needs a {dtype} export "
                               f"(autoglm-trt export CHECKPOINT -o DIR --dtype {dtype}) or the checkpoint itself")
    elif (source / "config.json").is_file():
        model_dir = _checkpoint_export(source, dtype, cache, log)
    else:
        raise AutoGLMError(f"{source} is neither a Hugging Face checkpoint (config.json) nor an export (export.json)")

    calib_record = None
    if req.precision == "int8":
        data = req.calib
        if data is None:
            data = DEFAULT_DATA
            log(f"no --calib given: calibrating with the default set {data}")
        calib_dir = cache / "calib-int8"
        calib_record = calibrate(CalibConfig(model_dir, data, calib_dir, replace_mismatch=True), log=log)
        model_dir = calib_dir

    meta = read_model_meta(model_dir)
    spec = spec_from_dict(meta["spec"])
    if cfg.max_seq_len > meta["graph"]["max_positions"]:
        raise AutoGLMError(f"max_seq_len {cfg.max_seq_len} exceeds what the export allows "
                           f"({meta['graph']['max_positions']}); export with a larger --max-seq-len")
    kv_bytes = 2 if meta["graph"]["dtype"] == "float16" else 4
    num_blocks = cfg.num_blocks(spec, kv_bytes)
    profiles = profile_shapes(cfg, spec, num_blocks)

    with staged_directory(out_dir, req.force) as tmp:
        graph_file = model_dir / meta["graph"]["file"]
        log(f"building {backend} engine ({req.precision}) from {graph_file}")
        if backend == "onnxruntime":
            from .onnxruntime_backend import optimize

            report = optimize(graph_file, tmp, cfg.threads)
            engine_file = "model.opt.onnx"
        else:
            from .tensorrt_backend import build_plan

            timing = Path(cfg.timing_cache) if cfg.timing_cache else Path(req.out_dir).parent / ".cache" / "timing.cache"
            report = build_plan(graph_file, tmp, profiles, cfg.workspace_bytes, cfg.builder_optimization_level, timing)
            engine_file = "engine.plan"
        for name in TOKENIZER_FILES:
            if (model_dir / name).is_file():
                shutil.copy2(model_dir / name, tmp / name)
        meta["graph"]["file"] = engine_file
        write_json(tmp / "export.json", meta)
        write_json(tmp / "fusion_report.json", report)
        if calib_record is not None:
            shutil.copy2(model_dir / "calib.json", tmp / "calib.json")
            shutil.copy2(model_dir / "calibration.cache", tmp / "calibration.cache")
        manifest = {
            "format": "autoglm-trt/engine/1",
            "backend": backend,
            "precision": req.precision,
            "engine_file": engine_file,
            "source": {"path": str(source.resolve()), "model_dir": str(Path(model_dir).resolve()),
                       "checkpoint_sha256": meta["source"]["sha256"]},
            "spec": meta["spec"],
            "limits": {"max_batch_size": cfg.max_batch_size, "max_input_len": cfg.max_input_len,
                       "max_seq_len": cfg.max_seq_len},
            "kv_cache": {"block_size": cfg.kv_block_size, "num_blocks": num_blocks, "dtype": meta["graph"]["dtype"],
                         "layout": f"{POOL_LAYOUT} per layer, K and V",
                         "bytes": 2 * spec.num_layers * num_blocks * cfg.kv_block_size * spec.num_kv_heads
                         * spec.head_dim * kv_bytes},
            "build_config": asdict(cfg),
            "profiles": {k: {n: [list(s) for s in v] for n, v in p.items() if not n.startswith("past_")}
                         for k, p in profiles.items()},
            "versions": library_versions("onnx", "onnxruntime", "numpy", "tensorrt"),
            "build_seconds": round(time.perf_counter() - t0, 1),
            "fusions": report.get("fusions", report.get("fused_count")),
        }
        if backend == "tensorrt":
            from .tensorrt_backend import cuda_device

            manifest["tensorrt"] = {"version": report["tensorrt_version"], "gpu": cuda_device()}
        manifest["files"] = hash_dir(tmp)
        write_json(tmp / MANIFEST, manifest)
    log(f"engine ready: {out_dir} ({backend}, {req.precision}, {time.perf_counter() - t0:.1f} s)")
    return manifest


def summary(manifest: dict, report: dict | None) -> str:
    """Human-readable summary for ``inspect``."""
    s = manifest["spec"]
    lines = [
        f"backend      {manifest['backend']}   precision {manifest['precision']}   file {manifest['engine_file']}",
        f"model        {s['family']}: {s['num_layers']} layers, hidden {s['hidden_size']}, heads {s['num_heads']}/"
        f"{s['num_kv_heads']} KV, vocab {s['vocab_size']}",
        f"limits       batch {manifest['limits']['max_batch_size']}, input {manifest['limits']['max_input_len']}, "
        f"sequence {manifest['limits']['max_seq_len']}",
        f"KV cache     {manifest['kv_cache']['num_blocks']} blocks x {manifest['kv_cache']['block_size']} tokens, "
        f"{manifest['kv_cache']['dtype']}, {manifest['kv_cache']['bytes'] / 2**20:.0f} MiB",
        f"source       {manifest['source']['path']}",
        "versions     " + ", ".join(f"{k} {v}" for k, v in manifest["versions"].items()),
    ]
    if report:
        if report.get("backend") == "onnxruntime":
            lines.append(f"fusions      nodes {report['nodes_before']} -> {report['nodes_after']}")
            for op, f in report["fusions"].items():
                lines.append(f"             {op} x{f['count']}: {f['what']}")
        else:
            lines.append(f"layers       {report.get('layers')} ({report.get('fused_count')} fused)")
    return "\n".join(lines)


def load_report(engine_dir: Path) -> dict | None:
    p = Path(engine_dir) / "fusion_report.json"
    return json.loads(p.read_text()) if p.is_file() else None
