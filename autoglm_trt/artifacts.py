"""The artifacts the stages exchange, each read and checked in one place.

Stages talk only through directories: an export (``export.json``, the ONNX graph, the
tokenizer files), a calibration (the same plus ``calib.json`` and ``calibration.cache``) and
an engine (the same plus ``manifest.json`` and the engine file). This module is their one
reader: ``ExportRecord.read``, ``CalibRecord.read`` and ``Manifest.read`` parse the JSON, check
the keys and types every later stage relies on, parse the model spec once, and resolve every
file a record names *inside* its directory (``inside``): an absolute path, a ``..`` or a
symbolic link that leads out is refused with a clear error. ``TOKENIZER_FILES`` is the one
list of tokenizer files that travels with a model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from .errors import AutoGLMError
from .fileutil import sha256_file, write_json
from .model.spec import ModelSpec, spec_from_dict
from .model.vision import VisionSpec
from .precisions import PRECISIONS
from .record_schema import (
    CALIB_KEYS,
    EXPORT_KEYS,
    MADE_BY,
    ORT_GRAPHS_KEYS,
    TRT_KEYS,
    BuildSettings,
    BuildSource,
    Calibration,
    ExportedModel,
    GraphRecord,
    Key,
    KVCache,
    Limits,
    OrtGraphs,
    VisionForms,
    brief,
    check,
    file_digests,
    keys_of,
    made,
    one_of,
    optional,
    rule,
    typed,
)

EXPORT_RECORD = "export.json"
CALIB_RECORD = "calib.json"
MANIFEST = "manifest.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "preprocessor_config.json",  # an image-text model's image settings (``model.image.ImageConfig``)
)
ENGINE_FORMAT = "autoglm-trt/engine/2"  # manifest.json's schema; an engine of another is refused: rebuild it
MAX_RECORD_BYTES = 64 * 1024 * 1024  # a record is a few kB to a few MB; refuse to parse anything absurd


class ArtifactError(AutoGLMError):
    """An artifact directory is missing, incomplete, corrupt or names files outside itself."""


class EngineError(ArtifactError):
    """The engine directory is missing, corrupt, or built for another machine."""


def inside(root: Path, name: object, what: str, error: type[ArtifactError] = ArtifactError) -> Path:
    """``root / name``, refusing a name that is not a plain relative path that stays inside ``root``."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise error(f"{what} must be a file name inside {root}, got {brief(name)}")
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts:
        raise error(f"{what} names {brief(name)}, which is not inside {root}; an artifact may only name its own files")
    path = Path(root) / rel
    if not path.resolve().is_relative_to(Path(root).resolve()):
        raise error(f"{what} names {brief(name)}, which leads out of {root} (a symbolic link?); "
                    "an artifact may only name its own files")
    return path


def read_json_object(path: Path, what: str, error: type[ArtifactError] = ArtifactError) -> dict:
    """A JSON object from ``path``, or ``error`` saying what is wrong with the file."""
    if not path.is_file():
        raise error(f"{path.parent} has no {path.name}; {what}")
    if path.stat().st_size > MAX_RECORD_BYTES:
        raise error(f"{path} is {path.stat().st_size} bytes, too large for a record made by autoglm-trt")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        json.dumps(data, ensure_ascii=False).encode("utf-8")  # a lone surrogate ("\ud800") is no text
    except (ValueError, UnicodeError, RecursionError) as exc:  # ValueError: also a number of > 4,300 digits
        raise error(f"{path} is corrupt ({str(exc)[:200]}); make it again") from exc
    if not isinstance(data, dict):
        raise error(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _spec(data: dict, where: Path, error: type[ArtifactError]) -> ModelSpec:
    try:
        return spec_from_dict(data["spec"])
    except (TypeError, KeyError, ValueError) as exc:
        raise error(f"{where}: the model spec is invalid ({str(exc)[:200]})") from exc


@dataclass(frozen=True)
class EngineRecord:
    """``manifest.json``'s top level, typed (``record_schema``); its backend's own section is
    checked by that backend's check (``BACKEND_SECTIONS``), its spec by ``model.spec``."""

    backend: str = field(metadata=rule(one_of(lambda: BACKEND_SECTIONS)))
    precision: str = field(metadata=rule(one_of(PRECISIONS)))
    spec: dict
    files: dict = field(metadata=rule(file_digests))  # the engine's files but the manifest, and their SHA-256
    engine_file: str
    limits: Limits
    kv_cache: KVCache
    source: BuildSource | None = optional()
    versions: dict | None = optional()  # the libraries' versions the build ran with
    build_config: BuildSettings | None = optional()
    vision: VisionForms | None = optional()  # the encoder graphs an ONNX Runtime build made


MANIFEST_KEYS = keys_of(EngineRecord)


def tokenizer_files(model_dir: Path) -> list[Path]:
    """The tokenizer files present in a checkpoint or model directory."""
    return [Path(model_dir) / n for n in TOKENIZER_FILES if (Path(model_dir) / n).is_file()]


def copy_tokenizer_files(src: Path, dst: Path) -> None:
    """The tokenizer files of ``src``, and the vision encoder's files its ``export.json`` names (an
    image-text model's), copied into ``dst``: what travels with a model from stage to stage."""
    import shutil

    vision = ExportRecord.read(src).vision_files() if (Path(src) / EXPORT_RECORD).is_file() else []
    for f in [*tokenizer_files(src), *vision]:
        shutil.copy2(f, Path(dst) / f.name)


@dataclass(frozen=True)
class ExportRecord:
    """``export.json`` of an export, calibration or engine directory: its keys typed (``record``),
    its model spec parsed, the record as read (``data``)."""

    dir: Path
    data: dict
    spec: ModelSpec
    record: ExportedModel

    @classmethod
    def read(cls, model_dir: Path | str) -> ExportRecord:
        model_dir = Path(model_dir)
        path = model_dir / EXPORT_RECORD
        data = read_json_object(path, "expected an export, calibration or engine directory made by autoglm-trt")
        spec = cls.checked(data, model_dir)
        return cls(model_dir, data, spec, made(ExportedModel, data))  # checked with the record

    @staticmethod
    def checked(data: dict, model_dir: Path) -> ModelSpec:
        """The spec of ``data``, an export record of ``model_dir``, once its keys and files are checked."""
        path = model_dir / EXPORT_RECORD
        check(data, EXPORT_KEYS, path, ArtifactError, "delete the directory and make it again")
        inside(model_dir, data["graph"]["file"], f"{path} graph.file")
        for key in ("graph", "positions") if "vision" in data else ():
            inside(model_dir, data["vision"][key], f"{path} vision.{key}")
        return _spec(data, path, ArtifactError)

    @staticmethod
    def write(model_dir: Path, data: dict) -> None:
        """``data`` as ``model_dir``'s export record, checked as ``read`` checks it."""
        ExportRecord.checked(data, model_dir)
        write_json(model_dir / EXPORT_RECORD, data)

    @property
    def graph(self) -> GraphRecord:
        return self.record.graph

    @property
    def graph_file(self) -> Path:
        return inside(self.dir, self.graph.file, f"{self.dir / EXPORT_RECORD} graph.file")

    @property
    def dtype(self) -> str:
        return self.graph.dtype

    @property
    def kv_dtype(self) -> str:
        """The KV pools' dtype: the graph's float dtype, or int8."""
        return self.graph.kv_dtype or self.dtype

    @property
    def precision(self) -> str:
        return self.graph.precision or ("fp32" if self.dtype == "float32" else "fp16")

    @property
    def max_seq_len(self) -> int:
        """The longest sequence the graph allows (``export --max-seq-len``; an engine's limit is at most this)."""
        return self.graph.max_seq_len

    @property
    def graph_version(self) -> int | None:
        return self.graph.version

    @property
    def source_sha256(self) -> dict:
        source = self.record.source
        return dict(source.sha256 or {}) if source is not None else {}

    def vision(self) -> VisionSpec | None:
        """An image-text model's vision tower (``export.json`` ``vision``), or None."""
        v = self.record.vision
        if v is None:
            return None
        try:
            return VisionSpec.from_json(v.spec)
        except (KeyError, TypeError, ValueError) as exc:
            raise ArtifactError(f"{self.dir / EXPORT_RECORD}: vision.spec is malformed ({exc}); re-export the "
                                "model") from exc

    def vision_files(self) -> list[Path]:
        """The vision encoder's graph, its weights and its position table (each inside the directory)."""
        v = self.record.vision
        if v is None or self.vision() is None:
            return []
        where = f"{self.dir / EXPORT_RECORD} vision"
        graph = inside(self.dir, v.graph, f"{where}.graph")
        files = [graph, inside(self.dir, v.positions, f"{where}.positions")]
        data = graph.with_name(graph.name + ".data")
        return files + ([data] if data.is_file() else [])

    def made_by(self, step: str) -> dict:
        """What the build step ``step`` (one of ``MADE_BY``) that made this model recorded; else {}."""
        assert step in MADE_BY, step
        return getattr(self.record, step) or {}

    @property
    def spec_data(self) -> dict:  # the model's spec as recorded (``model.spec.spec_from_dict``)
        return self.data["spec"]

    def identity(self) -> str:
        """SHA-256 of ``export.json``, which records the hashes of the files it describes."""
        return sha256_file(self.dir / EXPORT_RECORD)

    def derived(self, **graph: object) -> dict:
        """A copy of the record for a model made from this one (its ``graph`` keys replaced)."""
        out = json.loads(json.dumps(self.data))
        out["graph"].update(graph)
        return out


@dataclass(frozen=True)
class CalibRecord:
    """``calib.json`` of a calibration directory: its keys typed (``fields``), the record as read (``data``)."""

    dir: Path
    data: dict
    fields: Calibration

    @classmethod
    def read(cls, calib_dir: Path | str) -> CalibRecord:
        calib_dir = Path(calib_dir)
        path = calib_dir / CALIB_RECORD
        data = read_json_object(path, "it is not a calibration result")
        return cls(calib_dir, data, typed(Calibration, data, path, ArtifactError, "calibrate again"))

    @staticmethod
    def write(calib_dir: Path, data: dict) -> None:
        """``data`` as ``calib_dir``'s calibration record, checked as ``read`` checks it."""
        check(data, CALIB_KEYS, calib_dir / CALIB_RECORD, ArtifactError, "calibrate again")
        write_json(calib_dir / CALIB_RECORD, data)

    @property
    def model_sha256(self) -> str:
        return self.fields.model_sha256

    @property
    def kv_amax(self) -> dict[str, list[float]]:
        if self.fields.kv_amax is None:
            raise ArtifactError(f"{self.dir / CALIB_RECORD} has no kv_amax (made before the INT8 KV cache): "
                                "calibrate again")
        return self.fields.kv_amax

    @property
    def data_sha256(self) -> str:
        return self.fields.data_sha256


@dataclass(frozen=True)
class Manifest:
    """``manifest.json`` of an engine directory: what it was built from, with, and for."""

    dir: Path
    data: dict
    spec: ModelSpec
    record: EngineRecord

    @classmethod
    def read(cls, engine_dir: Path | str) -> Manifest:
        engine_dir = Path(engine_dir)
        if not engine_dir.is_dir():
            raise EngineError(f"engine directory {engine_dir} does not exist; build one with `autoglm-trt build`")
        path = engine_dir / MANIFEST
        data = read_json_object(path, "it is not an engine directory made by `autoglm-trt build`", EngineError)
        if data.get("format") != ENGINE_FORMAT:
            raise EngineError(f"{engine_dir} was built by another version of autoglm-trt (format "
                              f"{brief(data.get('format'))}, this one reads {ENGINE_FORMAT}); rebuild it with "
                              "`autoglm-trt build`")
        spec = cls.checked(data, engine_dir)
        return cls(engine_dir, data, spec, made(EngineRecord, data))  # checked with the record

    @staticmethod
    def checked(data: dict, engine_dir: Path) -> ModelSpec:
        """The spec of ``data``, ``engine_dir``'s manifest, once its keys, files and backend section
        are checked (the engine's export record read for its spec and KV dtype)."""
        path, remedy = engine_dir / MANIFEST, "rebuild the engine"
        check(data, MANIFEST_KEYS, path, EngineError, remedy)
        for name in data["files"]:
            inside(engine_dir, name, f"{path} files", EngineError)
        named = {"engine_file": data["engine_file"], **(made(VisionForms, v).files() if (v := data.get("vision")) else {})}
        for key, name in named.items():  # every file it names: inside the engine, and hashed
            inside(engine_dir, name, f"{path} {key}", EngineError)
            if name not in data["files"]:
                raise EngineError(f"{path}: {key} {brief(name)} is not one of the engine's hashed files; {remedy}")
        spec = _spec(data, path, EngineError)
        graph = _engine_export(engine_dir)
        if data["spec"] != graph.spec_data:
            raise EngineError(f"{path}: spec differs from the engine graph's ({EXPORT_RECORD}); the engine was edited "
                              f"or is corrupt: {remedy}")
        kv = data["kv_cache"]
        if kv["dtype"] != graph.kv_dtype:
            raise EngineError(f"{path}: kv_cache.dtype {kv['dtype']} differs from the engine graph's "
                              f"({graph.kv_dtype}, {EXPORT_RECORD}); the engine was edited or is corrupt: {remedy}")
        if kv["bytes"] % kv["num_blocks"]:  # the builder writes num_blocks x the bytes of one block
            raise EngineError(f"{path}: kv_cache.bytes {kv['bytes']} is not the same whole number of bytes for each of "
                              f"its {kv['num_blocks']} blocks; the engine was edited or is corrupt: {remedy}")
        backend = data["backend"]
        check(data, (Key(backend, dict),), path, EngineError, remedy)  # the backend's own section
        BACKEND_SECTIONS[backend](data[backend], engine_dir, path)
        return spec

    @staticmethod
    def write(engine_dir: Path, data: dict) -> None:
        """``data`` as ``engine_dir``'s manifest (its files hashed already), checked as ``read`` checks it."""
        if data.get("format") != ENGINE_FORMAT:
            raise EngineError(f"a manifest must say format {ENGINE_FORMAT}, got {brief(data.get('format'))}")
        Manifest.checked(data, engine_dir)
        write_json(engine_dir / MANIFEST, data)

    @property
    def backend(self) -> str:
        return self.record.backend

    @property
    def precision(self) -> str:
        return self.record.precision

    @property
    def engine_path(self) -> Path:
        return self.dir / self.record.engine_file

    @property
    def limits(self) -> Limits:
        return self.record.limits

    @property
    def kv(self) -> KVCache:
        return self.record.kv_cache

    @property
    def build_config(self) -> BuildSettings:
        return self.record.build_config or BuildSettings()

    @property
    def vision_forms(self) -> VisionForms | None:
        return self.record.vision

    def section(self, backend: str) -> dict:  # the backend's own section, checked as the manifest was read
        return self.data[backend]

    @property
    def files(self) -> dict[str, str]:
        return self.record.files

    @cached_property
    def ort_graphs(self) -> OrtGraphs:
        """An ONNX Runtime engine's graphs (``loader.write_graphs``): native (or why not), plain, passes."""
        if not isinstance(self.data.get("onnxruntime"), dict):
            raise EngineError(f"{self.dir} is a {self.backend} engine, which has no ONNX Runtime graphs")
        return typed(OrtGraphs, self.data["onnxruntime"], self.dir / MANIFEST, EngineError, "rebuild the engine",
                     "onnxruntime.")

    def verify_files(self) -> list[str]:
        """Problems with the engine's files (missing, or a SHA-256 that differs from the manifest)."""
        problems = []
        graphs = self.section(self.backend)  # its graphs, where the backend's section names them (checked at read)
        for key in ("plain_graph", "native_graph", "native_weights"):
            if isinstance(graphs.get(key), str) and graphs[key] not in self.data["files"]:
                problems.append(f"{self.backend}.{key} {brief(graphs[key])} is not one of the engine's hashed files")
        for name, digest in self.data["files"].items():
            p = self.dir / name
            if not p.is_file():
                problems.append(f"{name} is missing")
            elif sha256_file(p) != digest:
                problems.append(f"{name} is corrupt or was modified (SHA-256 differs from the manifest)")
        return problems


def _engine_export(engine_dir: Path) -> ExportRecord:
    """The record of the graph the engine was made from (its ``export.json``, which every engine holds)."""
    try:
        return ExportRecord.read(engine_dir)
    except EngineError:
        raise
    except ArtifactError as exc:  # the engine's record of its graph, refused as the engine's
        raise EngineError(str(exc)) from exc


def _ort_graphs(graphs: dict, engine_dir: Path, path: Path) -> None:
    check(graphs, ORT_GRAPHS_KEYS, path, EngineError, "rebuild the engine", "onnxruntime.")
    for key in ("plain_graph", "native_graph", "native_weights"):
        name = graphs.get(key)
        if name is not None:
            inside(engine_dir, name, f"{path} onnxruntime.{key}", EngineError)


def _trt_section(trt: dict, engine_dir: Path, path: Path) -> None:
    check(trt, TRT_KEYS, path, EngineError, "rebuild the engine", "tensorrt.")


# each backend's manifest section (named after it) and its check; ``backends.registry.register`` adds one
BACKEND_SECTIONS: dict[str, Callable[[dict, Path, Path], None]] = {"onnxruntime": _ort_graphs, "tensorrt": _trt_section}


def hash_dir(engine_dir: Path) -> dict[str, str]:
    """SHA-256 of every file of a directory but the manifest."""
    return {p.name: sha256_file(p) for p in sorted(Path(engine_dir).iterdir()) if p.is_file() and p.name != MANIFEST}
