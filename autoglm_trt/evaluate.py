"""``eval``: perplexity of a model on a text, and agreement with a reference model.

Input: a model directory (export, calibration or engine), a UTF-8 text file, optionally a
reference (a Hugging Face checkpoint, run in transformers, or another model directory).
Output: a dict with ``ppl`` and, with a reference, ``ref_ppl``, ``ppl_ratio``,
``top1_agreement`` (teacher-forced: same argmax next token) and ``kl`` (mean KL(ref || model)
per position, nats). The text is tokenized with the model's tokenizer and cut into
non-overlapping chunks of ``seq_len`` tokens; every chunk is scored whole.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from .calib.data import CalibrationDataError, load_tokenizer, read_texts
from .errors import AutoGLMError, require
from .graph_runner import GraphRunner

Logits = Callable[[np.ndarray], np.ndarray]


def text_chunks(text_file: Path, model_dir: Path, seq_len: int, max_chunks: int | None = None) -> np.ndarray:
    tok = load_tokenizer(model_dir)
    ids: list[int] = []
    for _, text in read_texts(text_file):
        ids.extend(tok.encode(text, add_special_tokens=False).ids)
    n = len(ids) // seq_len
    if n == 0:
        raise CalibrationDataError(f"{text_file} has {len(ids)} tokens, fewer than one chunk of {seq_len}")
    if max_chunks:
        n = min(n, max_chunks)
    return np.asarray(ids[: n * seq_len], np.int64).reshape(n, seq_len)


def log_softmax(x: np.ndarray, dtype: type = np.float64) -> np.ndarray:
    """Log-probabilities along the last axis, computed in ``dtype``."""
    y: np.ndarray = x.astype(dtype)
    y -= y.max(axis=-1, keepdims=True)
    return y - np.log(np.exp(y).sum(axis=-1, keepdims=True))


def next_token_scores(logits: np.ndarray, windows: np.ndarray, dtype: type = np.float64) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced scores: log-probabilities of the next token at each position
    ``[batch, seq_len - 1, vocab]`` and the negative log-likelihood of the actual next tokens."""
    lp = log_softmax(logits[:, :-1], dtype)
    return lp, -np.take_along_axis(lp, windows[:, 1:, None], -1)[..., 0]


def hf_logits(checkpoint: Path, allow_pickle: bool = False) -> Logits:
    """Logits function of a checkpoint in transformers, float32 (no remote code)."""
    torch = require("torch", "torch==2.13.0", "A transformers reference")
    transformers = require("transformers", "autoglm-trt[test]", "A transformers reference")
    model = transformers.AutoModelForCausalLM.from_pretrained(  # type: ignore[attr-defined]
        str(checkpoint), dtype=torch.float32, trust_remote_code=False,  # type: ignore[attr-defined]
        use_safetensors=not allow_pickle)
    model.eval()

    def fn(windows: np.ndarray) -> np.ndarray:
        with torch.no_grad():  # type: ignore[attr-defined]
            return model(torch.from_numpy(windows)).logits.float().numpy()  # type: ignore[attr-defined]

    return fn


def model_logits(path: Path, threads: int | None = None) -> Logits:
    """Logits function of a model directory (export.json) or a Hugging Face checkpoint."""
    path = Path(path)
    if (path / "export.json").is_file():
        return GraphRunner(path, threads=threads).logits
    if (path / "config.json").is_file():
        return hf_logits(path)
    raise AutoGLMError(f"{path} is neither a model directory (export.json) nor a Hugging Face checkpoint (config.json)")


def evaluate(model: Path, text: Path, reference: Path | None = None, seq_len: int = 256,
             max_chunks: int | None = None, batch: int = 4, log: Callable[[str], None] | None = None) -> dict:
    chunks = text_chunks(text, model, seq_len, max_chunks)
    run_model = model_logits(model)
    run_ref = model_logits(reference) if reference is not None else None
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
    out: dict = {"tokens": int(sum(x.size for x in nll)), "chunks": int(len(chunks)), "seq_len": seq_len,
                 "ppl": float(np.exp(np.concatenate([x.ravel() for x in nll]).mean()))}
    if run_ref is not None:
        out["ref_ppl"] = float(np.exp(np.concatenate([x.ravel() for x in ref_nll]).mean()))
        out["ppl_ratio"] = out["ppl"] / out["ref_ppl"]
        out["top1_agreement"] = float(np.concatenate([x.ravel() for x in agree]).mean())
        out["kl"] = float(np.concatenate([x.ravel() for x in kl]).mean())
    return out
