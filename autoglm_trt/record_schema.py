"""The keys of a record (``export.json``, ``calib.json``, ``manifest.json``) declared once: each
key's JSON type, whether it must be there, a rule its value must meet, and an object's own keys.
``artifacts`` checks a record against its declaration where the record is written and where it
is read, so no stage writes what the next one would refuse, and a crafted or damaged record is
refused with the key's dotted name and what it must be."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Key:
    """One key: its JSON type (``int`` refuses a bool), whether it must be present, a rule (what is
    wrong with a value, or None) and, for an object, the keys it holds in turn."""

    name: str
    kind: type | tuple[type, ...]
    required: bool = True
    rule: Callable[[Any], str | None] | None = None
    keys: tuple[Key, ...] = ()


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
        if key.name not in data:
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


def one_of(choices: Collection[str] | Callable[[], Collection[str]]) -> Callable[[object], str | None]:
    """A rule: the value is one of ``choices`` (or of what ``choices()`` gives when checked)."""

    def rule(value: object) -> str | None:
        allowed = choices() if callable(choices) else choices
        return None if value in allowed else f"must be one of {', '.join(allowed)}, got {brief(value)}"

    return rule


def sha256_digest(value: str) -> str | None:
    ok = len(value) == 64 and all(c in "0123456789abcdef" for c in value)
    return None if ok else f"must be a SHA-256 hex digest (64 lowercase hex digits), got {brief(value)}"


# The declarations. manifest.json's top level is in ``artifacts`` (its backend rule reads the registry).
GRAPH_DTYPES = ("float32", "float16")
KV_DTYPES = ("float32", "float16", "int8")
MADE_BY = ("weight_only", "int4")  # the build steps that record how they made a model (``made_by``)
EXPORT_KEYS = (
    Key("spec", dict),
    Key("graph", dict, keys=(
        Key("file", str), Key("dtype", str, rule=one_of(GRAPH_DTYPES)),
        Key("kv_dtype", str, required=False, rule=one_of(KV_DTYPES)), Key("max_seq_len", int, rule=positive),
        Key("precision", str, required=False), Key("version", int, required=False))),
    Key("source", dict, required=False, keys=(Key("sha256", dict, required=False),)),
    Key("vision", dict, required=False, keys=(Key("spec", dict), Key("graph", str), Key("positions", str))),
    *(Key(step, dict, required=False) for step in MADE_BY),
)
CALIB_KEYS = (Key("model_sha256", str), Key("data_sha256", str), Key("amax", dict),
              Key("kv_amax", dict, required=False), Key("float_linears", list, required=False))
LIMITS_KEYS = tuple(Key(k, int, rule=positive) for k in ("max_batch_size", "max_input_len", "max_seq_len"))
KV_CACHE_KEYS = (*(Key(k, int, rule=positive) for k in ("block_size", "num_blocks", "bytes")),
                 Key("dtype", str, rule=one_of(KV_DTYPES)), Key("layout", str, required=False),
                 Key("scales", dict, required=False))
ORT_GRAPHS_KEYS = (Key("passes_version", int), Key("passes", list), Key("requires", list),
                   *(Key(k, str) for k in ("attention", "attention_why", "why", "plain_graph")))
TRT_KEYS = (Key("version", str), Key("gpu", dict))
