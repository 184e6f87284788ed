"""What ``inspect`` prints: an engine's manifest and fusion report, summarised."""

from __future__ import annotations

import json
from pathlib import Path

from ..backends.registry import backend


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
        lines += backend(manifest["backend"]).build_lines(report)
    return "\n".join(lines)


def load_report(engine_dir: Path) -> dict | None:
    p = Path(engine_dir) / "fusion_report.json"
    if not p.is_file():
        return None
    try:
        report = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return None
    return report if isinstance(report, dict) else None
