"""The keys of a record (``export.json``, ``calib.json``, ``manifest.json``) declared once: each
key's JSON type, whether it must be there, a rule its value must meet, and an object's own keys.
``artifacts`` checks a record against its declaration where the record is written and where it
is read, so no stage writes what the next one would refuse, and a crafted or damaged record is
refused with the key's dotted name and what it must be.

Each record, and each section the stages read field by field, is a typed dataclass
(``ExportedModel``, ``Calibration``, ``artifacts.EngineRecord`` and the sections they hold), and its
declaration is its fields (``keys_of``): a field's
type is the key's JSON type, a field with a default may be absent or null (it then takes the
default), and a field's ``rule`` metadata is the key's rule. ``typed`` checks a section and makes
the dataclass; ``untyped`` gives its JSON back."""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Key:
    """One key: its JSON type (``int`` refuses a bool), whether it must be present, a rule (what is
    wrong with a value, or None), for an object the keys it holds in turn, and whether null says
    the same as absent (a typed section's optional field: ``keys_of``)."""

    name: str
    kind: type | tuple[type, ...]
    required: bool = True
    rule: Callable[[Any], str | None] | None = None
    keys: tuple[Key, ...] = ()
    nullable: bool = False


def brief(value: object, limit: int = 80) -> str:
    """``repr`` of a value cut to ``limit`` characters, for error messages about untrusted input."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def check(data: dict, keys: tuple[Key, ...], where: Path, error: type[Exception], remedy: str,
          prefix: str = "") -> None:
    """Raise ``error`` for the first key of ``keys`` that ``data`` lacks or holds wrongly, saying
    which key (dotted: ``prefix`` + its name), what it must be, and ``remedy``."""
    for key in keys:
        name = prefix + key.name
        if key.name not in data or key.nullable and data[key.name] is None:
            if key.required:
                raise error(f"{where} lacks the key '{name}'; it was not made by this version of autoglm-trt, "
                            f"or was edited: {remedy}")
            continue
        value = data[key.name]
        if not isinstance(value, key.kind) or isinstance(value, bool) and key.kind is not bool:
            raise error(f"{where}: '{name}' must be {_json_kind(key.kind)}, got {brief(value)}; {remedy}")
        why = key.rule(value) if key.rule is not None else None
        if why is not None:
            raise error(f"{where}: {name} {why}; {remedy}")
        if key.keys:
            assert isinstance(value, dict), name
            check(value, key.keys, where, error, remedy, name + ".")


def _json_kind(kind: type | tuple[type, ...]) -> str:
    names = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number",
             bool: "true or false"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def positive(value: int) -> str | None:
    return None if value >= 1 else f"must be an integer >= 1, got {value}"


def not_negative(value: int) -> str | None:
    return None if value >= 0 else f"must be an integer >= 0, got {value}"


def one_of(choices: Collection[str] | Callable[[], Collection[str]]) -> Callable[[object], str | None]:
    """A rule: the value is one of ``choices`` (or of what ``choices()`` gives when checked)."""

    def rule(value: object) -> str | None:
        allowed = choices() if callable(choices) else choices
        return None if value in allowed else f"must be one of {', '.join(allowed)}, got {brief(value)}"

    return rule


def sha256_digest(value: str) -> str | None:
    ok = len(value) == 64 and all(c in "0123456789abcdef" for c in value)
    return None if ok else f"must be a SHA-256 hex digest (64 lowercase hex digits), got {brief(value)}"


def file_digests(files: dict) -> str | None:
    """A rule: the value maps each file name to its SHA-256 hex digest."""
    return next((f"must map each file to its SHA-256 hex digest; {brief(n)} has {brief(d)}"
                 for n, d in files.items() if not isinstance(d, str) or sha256_digest(d)), None)


def items_of(kind: type, what: str) -> Callable[[Any], str | None]:
    """A rule: each element of a list (each value of an object) is of ``kind`` (an ``int`` or
    ``float`` a number, never a bool), described as ``what``."""
    kinds = (int, float) if kind in (int, float) else (kind,)

    def rule(value: list | dict) -> str | None:
        bad = [v for v in (value.values() if isinstance(value, dict) else value)
               if not isinstance(v, kinds) or isinstance(v, bool)]
        return f"must hold only {what}, got {brief(bad[0])}" if bad else None

    return rule


def pass_entries(value: list) -> str | None:
    """A rule: each rewrite pass as ``loader.write_graphs`` records it, its name and how often it applied."""
    bad = [p for p in value if not isinstance(p, dict) or not isinstance(p.get("name"), str)
           or not isinstance(p.get("applied"), int) or isinstance(p.get("applied"), bool)]
    return f"must hold a name and a count of applications per pass, got {brief(bad[0])}" if bad else None


def rule(check: Callable[[Any], str | None]) -> dict:
    """The metadata of a dataclass field whose value must meet ``check`` (``keys_of``):
    ``x: int = field(metadata=rule(positive))``."""
    return {"rule": check}


def optional(check: Callable[[Any], str | None] | None = None, null: bool = True) -> Any:
    """A dataclass field that may be absent (None), and meets ``check`` where present; ``null``:
    whether a JSON null says the same as absent (else it is refused as a value of the wrong type)."""
    return field(default=None, metadata={"rule": check, "null": null})


@functools.cache
def _fields(cls: type) -> tuple[tuple[dataclasses.Field, tuple[type, ...], type | None], ...]:
    """Each field of a typed section, its JSON types, and the typed section it holds (or None)."""
    hints = typing.get_type_hints(cls)
    out: list[tuple[dataclasses.Field, tuple[type, ...], type | None]] = []
    for f in dataclasses.fields(cls):
        kinds = tuple(k for k in typing.get_args(hints[f.name]) or (hints[f.name],) if k is not type(None))
        section = typing.cast(type, kinds[0]) if len(kinds) == 1 and dataclasses.is_dataclass(kinds[0]) else None
        kinds = (dict,) if section else tuple(typing.get_origin(k) or k for k in kinds)  # dict[str, X]: an object
        out.append((f, kinds, section))
    return tuple(out)


@functools.cache
def keys_of(cls: type) -> tuple[Key, ...]:
    """The keys a typed section's fields declare, in their order (a field that is a typed section
    in turn: an object of its keys)."""
    keys = []
    for f, kinds, section in _fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        keys.append(Key(f.name, kinds[0] if len(kinds) == 1 else kinds, required, f.metadata.get("rule"),
                        keys_of(section) if section else (), nullable=not required and f.metadata.get("null", True)))
    return tuple(keys)


def typed(cls: type[T], data: dict, where: Path, error: type[Exception], remedy: str, prefix: str = "") -> T:
    """``data``, a section declared by the dataclass ``cls``, checked (``check``) and made ``cls``."""
    check(data, keys_of(typing.cast(type, cls)), where, error, remedy, prefix)
    return made(cls, data)


def made(cls: type[T], data: dict) -> T:
    """``cls`` of ``data``, a section already checked against ``keys_of(cls)``."""
    return cls(**{f.name: made(section, data[f.name]) if section else data[f.name]  # type: ignore[arg-type]
                  for f, _, section in _fields(typing.cast(type, cls))
                  if data.get(f.name) is not None})  # absent or null: the field's default


def untyped(section: object) -> dict:
    """A typed section as its record writes it: its fields (a typed section's in turn), but those
    absent (None)."""
    out = {}
    for f in dataclasses.fields(section):  # type: ignore[arg-type]
        value = getattr(section, f.name)
        if value is not None:
            out[f.name] = untyped(value) if dataclasses.is_dataclass(value) else value
    return out


# The declarations. manifest.json's top level is in ``artifacts`` (its backend rule reads the registry).
GRAPH_DTYPES = ("float32", "float16")
KV_DTYPES = ("float32", "float16", "int8")
VISION_DTYPES = ("bfloat16", "float16", "float32")  # the vision encoder's compute dtypes (``graph.vision_trt``)
MADE_BY = ("weight_only", "int4")  # the build steps that record how they made a model (``made_by``)


@dataclass(frozen=True)
class GraphRecord:
    """``export.json``'s ``graph``: the decoder graph a model directory holds."""

    file: str
    dtype: str = field(metadata=rule(one_of(GRAPH_DTYPES)))
    max_seq_len: int = field(metadata=rule(positive))  # the longest sequence it allows (``export --max-seq-len``)
    kv_dtype: str | None = optional(one_of(KV_DTYPES))  # the KV pools' dtype, if not the graph's
    precision: str | None = optional()
    version: int | None = optional()
    data_file: str | None = optional()  # its external weights, where it has them


@dataclass(frozen=True)
class Limits:
    """``manifest.json``'s ``limits``: what one step and one sequence of the engine may hold."""

    max_batch_size: int = field(metadata=rule(positive))
    max_input_len: int = field(metadata=rule(positive))  # the longest prefill chunk
    max_seq_len: int = field(metadata=rule(positive))  # prompt + generated tokens of one sequence


@dataclass(frozen=True)
class KVCache:
    """``manifest.json``'s ``kv_cache``: the block pool the engine was built for. ``dtype`` is the
    graph's (``export.json`` ``graph.kv_dtype``); the manifest's copy must agree with it."""

    block_size: int = field(metadata=rule(positive))
    num_blocks: int = field(metadata=rule(positive))
    bytes: int = field(metadata=rule(positive))
    dtype: str = field(metadata=rule(one_of(KV_DTYPES)))
    layout: str = ""
    scales: dict | None = optional()  # INT8 KV: each layer's K and V scale per KV head


@dataclass(frozen=True)
class BuildSettings:
    """``manifest.json``'s ``build_config`` (``builder.config.BuildConfig``'s fields as the build had
    them): the ones read after the build are typed here, the rest pass by."""

    max_pixels: int | None = optional(positive)  # an image-text engine's largest image
    max_images: int | None = optional(not_negative)  # images per request
    vision_dtype: str | None = optional(one_of(VISION_DTYPES))


VISION_LINEARS = ("float32", "int8")  # the forms of an encoder's linears (``builder.vision``)


def form_files(value: dict) -> str | None:
    """An object of a graph file per form of the encoder's linears."""
    if not value or any(k not in VISION_LINEARS or not isinstance(v, str) for k, v in value.items()):
        return f"must name a graph file for some of the forms {', '.join(VISION_LINEARS)}, got {brief(value)}"
    return None


@dataclass(frozen=True)
class VisionForms:
    """An image-text ONNX Runtime engine's ``manifest.json`` ``vision``: the encoder forms the build
    made (``builder.vision``), each a graph file of the engine (``backends.onnxrt.vision`` picks the
    one this machine runs)."""

    linears: str = field(metadata=rule(one_of(VISION_LINEARS)))  # the build's choice of linears
    attention: str = field(metadata=rule(one_of(("float32", "bfloat16"))))  # and of attention
    graphs: dict = field(metadata=rule(form_files))  # each form's graph, float32 attention
    native_graphs: dict | None = optional(form_files)  # each with the native bfloat16 attention
    int8_linears: int | None = optional(not_negative)

    def files(self) -> dict[str, str]:
        """Each graph file it names, by its dotted key."""
        return {f"vision.{kind}.{form}": name for kind, forms in (("graphs", self.graphs),
                                                                  ("native_graphs", self.native_graphs or {}))
                for form, name in forms.items()}


@dataclass(frozen=True)
class BuildSource:
    """``manifest.json``'s ``source``: what the engine was built from (``autoglm-trt build``'s source,
    the model directory it resolved to, the checkpoint's file hashes that export recorded)."""

    path: str
    model_dir: str | None = optional()
    checkpoint_sha256: dict | None = optional(file_digests)


@dataclass(frozen=True)
class SourceRecord:
    """``export.json``'s ``source``: the checkpoint exported, and its files' SHA-256 (what a build
    compares with the checkpoint it is given)."""

    checkpoint: str | None = optional()
    sha256: dict | None = optional(file_digests)


@dataclass(frozen=True)
class VisionRecord:
    """``export.json``'s ``vision``: an image-text model's vision tower (``model.vision.VisionSpec``)
    and its files."""

    spec: dict
    graph: str
    positions: str  # the position table of its patches


@dataclass(frozen=True)
class ExportedModel:
    """``export.json``: the model an export, calibration or engine directory holds. ``source`` and
    ``vision`` may be absent but not null; a build step that made the model (one of ``MADE_BY``)
    records what it did under its name."""

    spec: dict  # ``model.spec.ModelSpec``'s fields, checked by ``model.spec``
    graph: GraphRecord
    source: SourceRecord | None = optional(null=False)
    vision: VisionRecord | None = optional(null=False)
    weight_only: dict | None = optional()
    int4: dict | None = optional()


EXPORT_KEYS = keys_of(ExportedModel)


@dataclass(frozen=True)
class Calibration:
    """``calib.json``: what it was made from, and the ranges the build reads."""

    model_sha256: str = field(metadata=rule(sha256_digest))  # the export's ``export.json`` (``ExportRecord.identity``)
    data_sha256: str = field(metadata=rule(sha256_digest))
    amax: dict = field(metadata=rule(items_of(float, "numbers")))  # each quantized tensor's range
    kv_amax: dict | None = optional(items_of(list, "lists"))  # K's and V's largest magnitude per layer and KV head
    float_linears: list | None = optional(items_of(dict, "objects"))  # the linears the gate kept in float, and why


CALIB_KEYS = keys_of(Calibration)


@dataclass(frozen=True)
class OrtGraphs:
    """An ONNX Runtime engine's ``manifest.json`` ``onnxruntime``: its graphs (``loader.write_graphs``)."""

    passes_version: int  # of the passes that made the native graph
    passes: list = field(metadata=rule(pass_entries))  # each pass in order: its name, how often it applied
    requires: list = field(metadata=rule(items_of(str, "feature names")))  # what the native graph needs of the library
    attention: str  # what runs a decode step's attention in the native graph
    attention_why: str
    why: str  # why there is no native graph ("" where there is one)
    plain_graph: str
    native_graph: str | None = optional()
    native_weights: str | None = optional()  # its packed weights
    packed_at_load: dict | None = optional()  # an older build's: packed weights left to the load


ORT_GRAPHS_KEYS = keys_of(OrtGraphs)


@dataclass(frozen=True)
class GpuRecord:
    name: str
    compute_capability: str  # "major.minor"


@dataclass(frozen=True)
class TensorRTBuild:
    """A TensorRT engine's ``manifest.json`` ``tensorrt``: what built its plan, for which GPU (a plan
    runs only with that TensorRT version on GPUs of that compute capability)."""

    version: str
    gpu: GpuRecord


TRT_KEYS = keys_of(TensorRTBuild)
