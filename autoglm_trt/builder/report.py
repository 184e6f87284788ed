"""What ``inspect`` prints: an engine's manifest and fusion report, summarised."""

from __future__ import annotations

from ..artifacts import EngineError, Manifest, read_json_object
from ..backends.registry import backend
from ..fileutil import sha256_file


def summary(manifest: Manifest, report: dict | None) -> str:
    """Human-readable summary for ``inspect``."""
    s, record, limits, kv = manifest.spec, manifest.record, manifest.limits, manifest.kv
    lines = [
        f"backend      {record.backend}   precision {record.precision}   file {record.engine_file}",
        f"model        {s.family}: {s.num_layers} layers, hidden {s.hidden_size}, heads {s.num_heads}/"
        f"{s.num_kv_heads} KV, vocab {s.vocab_size}",
        f"limits       batch {limits.max_batch_size}, input {limits.max_input_len}, sequence {limits.max_seq_len}",
        f"KV cache     {kv.num_blocks} blocks x {kv.block_size} tokens, {kv.dtype}, {(kv.bytes + 2**19) // 2**20} MiB",
        f"source       {record.source.path if record.source else 'not recorded'}",
        "versions     " + (", ".join(f"{k} {v}" for k, v in record.versions.items()) if record.versions is not None
                           else "not recorded"),
    ]
    if report:
        try:
            lines += backend(record.backend).build_lines(report)
        except (KeyError, TypeError, AttributeError, ValueError):  # hashed by an edited manifest, or older
            lines.append("fusions      the fusion report is not in the form this version writes")
    return "\n".join(lines)


def load_report(manifest: Manifest) -> dict | None:
    """The engine's fusion report (``fusion_report.json``), or None where the manifest hashes none. A
    report whose SHA-256 differs from the manifest's record of it, or that is no JSON object, is
    refused: it was edited or is corrupt, and what it would say is not what the build found."""
    name = "fusion_report.json"
    p = manifest.dir / name
    if name not in manifest.files:
        return None
    if not p.is_file() or sha256_file(p) != manifest.files[name]:
        raise EngineError(f"{p} is missing, or differs from the one the build wrote (its SHA-256 is not the "
                          "manifest's); `autoglm-trt doctor` lists what else differs: rebuild the engine")
    return read_json_object(p, "rebuild the engine", EngineError)
