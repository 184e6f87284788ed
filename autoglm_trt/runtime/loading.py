"""Open the parts of an engine directory: its checked manifest, a runner for its backend, its tokenizer.

The KV pool may be resized at load for ONNX Runtime engines (``num_blocks`` or
``kv_memory_bytes``); a pool larger than the memory this machine has available is refused
before anything is allocated.
"""

from __future__ import annotations

from pathlib import Path

from ..artifacts import EngineError, Manifest
from ..backends import StepRunner, check_engine, open_runner
from ..fileutil import available_memory_bytes
from ..graph.session import MAX_THREADS
from ..model.tokenizer import TextTokenizer


def open_parts(path: Path, verify: bool, num_blocks: int | None, kv_memory_bytes: int | None,
               threads: int) -> tuple[Manifest, StepRunner, TextTokenizer | None]:
    if isinstance(threads, bool) or not isinstance(threads, int) or not 0 <= threads <= MAX_THREADS:
        raise EngineError(f"threads must be an integer from 0 (one per core) to {MAX_THREADS}, got {threads!r}")
    manifest = check_engine(path, verify_hashes=verify)
    kv = manifest.kv
    per_block = kv["bytes"] // kv["num_blocks"]
    blocks = kv["num_blocks"]
    if num_blocks is not None or kv_memory_bytes is not None:
        if manifest.backend != "onnxruntime":
            raise EngineError("the KV pool of a TensorRT engine is fixed at build time; rebuild to change it")
        blocks = num_blocks if num_blocks is not None else max(1, int(kv_memory_bytes or 0) // per_block)
    if manifest.backend == "onnxruntime":
        pool = blocks * per_block
        have = available_memory_bytes()
        if have is not None and pool > have:
            raise EngineError(f"the KV pool of {blocks} blocks would take {pool / 2**30:.1f} GiB but this machine "
                              f"has {have / 2**30:.1f} GiB available; load with fewer blocks (num_blocks=...)")
    backend = open_runner(manifest, blocks, threads)
    tokenizer = TextTokenizer(path) if (path / "tokenizer.json").is_file() else None
    return manifest, backend, tokenizer
