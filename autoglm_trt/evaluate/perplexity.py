"""``eval``: perplexity of a model on a text, and agreement with a reference model.

Input: a model (an export, calibration or engine directory, or an ONNX file in one), a UTF-8
text file, optionally a reference (a Hugging Face checkpoint, run in transformers, or another
model directory). Output: a dict with ``ppl`` and, with a reference, ``ref_ppl``,
``ppl_ratio``, ``top1_agreement`` (teacher-forced: same argmax next token) and ``kl`` (mean
KL(ref || model) per position, nats). The text is tokenized with the model's tokenizer and
cut into non-overlapping chunks of ``seq_len`` tokens; every chunk is scored whole. An ONNX
Runtime engine is scored as its runtime runs it: its native graph where this machine runs that.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..artifacts import EXPORT_RECORD, MANIFEST, Manifest
from ..backends.onnxrt.offline import GraphRunner
from ..backends.registry import backend
from ..errors import AutoGLMError
from ..graph.metrics import next_token_scores
from ..model.reference import Logits, hf_logits
from ..model.text import text_chunks


def model_logits(path: Path, threads: int | None = None, step_tokens: int | None = None) -> Logits:
    """Logits function of a model directory (export.json), an ONNX file in one, or a Hugging Face
    checkpoint. With ``step_tokens`` a model's text goes through its paged KV pool that many
    tokens per step (see ``GraphRunner.paged_logits``); without, each window is one prefill."""
    path = Path(path)
    runner = None
    if path.is_file() and path.suffix == ".onnx" and (path.parent / EXPORT_RECORD).is_file():
        runner = GraphRunner(path.parent, onnx_file=path.name, threads=threads)
    elif (path / MANIFEST).is_file():  # an engine: its graph as its backend runs it in process, if it does
        manifest = Manifest.read(path)
        runner = backend(manifest.backend).graph_runner(manifest, threads or 0)
    if runner is None and (path / EXPORT_RECORD).is_file():
        runner = GraphRunner(path, threads=threads)
    if runner is not None:
        if step_tokens is None:
            return runner.logits
        return lambda w: runner.paged_logits(w, step_tokens)
    if (path / "config.json").is_file():
        return hf_logits(path)
    raise AutoGLMError(f"{path} is neither a model directory (export.json), an ONNX file in one, nor a Hugging Face "
                       "checkpoint (config.json)")


def evaluate(model: Path, text: Path, reference: Path | None = None, seq_len: int = 256,
             max_chunks: int | None = None, batch: int = 4, log: Callable[[str], None] | None = None,
             step_tokens: int | None = None) -> dict:
    if step_tokens is not None and step_tokens < 1:
        raise AutoGLMError(f"--step-tokens must be >= 1, got {step_tokens}")
    model = Path(model)
    model_dir = model.parent if model.is_file() else model
    chunks = text_chunks(text, model_dir, seq_len, max_chunks)
    run_model = model_logits(model, step_tokens=step_tokens)
    run_ref = model_logits(reference, step_tokens=step_tokens) if reference is not None else None
    return {**score(run_model, chunks, run_ref, batch, log), "seq_len": seq_len, "step_tokens": step_tokens}


def score(run_model: Logits, chunks: np.ndarray, run_ref: Logits | None = None, batch: int = 4,
          log: Callable[[str], None] | None = None) -> dict:
    """Perplexity of ``run_model``'s logits on the token windows ``chunks`` and, with ``run_ref``,
    its agreement with the reference's (the fields ``evaluate`` returns but the lengths)."""
    nll, ref_nll, agree, kl = [], [], [], []
    for start in range(0, len(chunks), batch):
        w = chunks[start : start + batch]
        lp, model_nll = next_token_scores(run_model(w), w)
        nll.append(model_nll)
        if run_ref is not None:
            rlp, r_nll = next_token_scores(run_ref(w), w)
            ref_nll.append(r_nll)
            agree.append(lp.argmax(-1) == rlp.argmax(-1))
            kl.append((np.exp(rlp) * (rlp - lp)).sum(-1))
        if log:
            log(f"  eval: {min(start + batch, len(chunks))}/{len(chunks)} chunks")
    out: dict = {"tokens": int(sum(x.size for x in nll)), "chunks": int(len(chunks)), "ppl": float(np.exp(_mean(nll)))}
    if run_ref is not None:
        out["ref_ppl"] = float(np.exp(_mean(ref_nll)))
        out["ppl_ratio"] = out["ppl"] / out["ref_ppl"]
        out["top1_agreement"] = float(_mean(agree))
        out["kl"] = float(_mean(kl))
    return out


def gate_failures(result: dict, max_ppl_ratio: float | None, min_top1: float | None) -> list[str]:
    """Why ``result`` misses the given bounds (empty when it meets them)."""
    failures = []
    if max_ppl_ratio is not None and result["ppl_ratio"] > max_ppl_ratio:
        failures.append(f"perplexity ratio {result['ppl_ratio']:.4f} > {max_ppl_ratio}")
    if min_top1 is not None and result["top1_agreement"] < min_top1:
        failures.append(f"top-1 agreement {result['top1_agreement']:.4f} < {min_top1}")
    return failures


def _mean(parts: list[np.ndarray]) -> float:
    return float(np.concatenate([x.ravel() for x in parts]).mean())
