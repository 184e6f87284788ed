"""Calibration and evaluation text: files -> token windows, with the model's tokenizer.

Input: a directory of ``.txt`` files and ``.jsonl`` files (one JSON object per line with a
``text`` field), read in sorted path order, and the model's ``tokenizer.json``. Output:
fixed-length token windows. All texts are tokenized and joined (separated by the EOS/BOS
token when the model has one), cut into non-overlapping windows of ``seq_len`` tokens, and
``num_samples`` windows are taken evenly spaced over the whole stream, so the selection is
deterministic and covers every file.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import AutoGLMError


class CalibrationDataError(AutoGLMError):
    """The calibration or evaluation text cannot be used."""


def read_texts(path: Path) -> list[tuple[str, str]]:
    """``[(relative name, text)]`` from a directory (or a single file) of .txt / .jsonl."""
    path = Path(path)
    if not path.exists():
        raise CalibrationDataError(f"calibration data {path} does not exist; pass a directory of .txt/.jsonl files")
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl"))
    if not files:
        raise CalibrationDataError(
            f"{path} holds no .txt or .jsonl files; calibration needs text (plain .txt, or .jsonl with a 'text' field)"
        )
    out = []
    for f in files:
        try:
            raw = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise CalibrationDataError(f"{f} is not UTF-8 text ({exc}); convert it to UTF-8 or remove it") from exc
        name = f.name if path.is_file() else str(f.relative_to(path))
        if f.suffix == ".jsonl":
            for n, line in enumerate(raw.splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise CalibrationDataError(f"{f}:{n}: expected a JSON object with a 'text' field") from exc
                out.append((f"{name}:{n}", str(text)))
        else:
            out.append((name, raw))
    if not any(t.strip() for _, t in out):
        raise CalibrationDataError(f"the files in {path} are empty")
    return out


@dataclass(frozen=True)
class TokenWindows:
    windows: np.ndarray  # int64 [num_samples, seq_len]
    total_tokens: int
    sha256: str  # of the texts, the tokenizer and the selection parameters


def load_tokenizer(model_dir: Path):
    from tokenizers import Tokenizer

    tok_file = Path(model_dir) / "tokenizer.json"
    if not tok_file.is_file():
        raise CalibrationDataError(f"{model_dir} has no tokenizer.json; export from a checkpoint with a tokenizer")
    return Tokenizer.from_file(str(tok_file))


def token_windows(data: Path, model_dir: Path, num_samples: int, seq_len: int, separator: int | None) -> TokenWindows:
    """Tokenize the texts and select ``num_samples`` windows of ``seq_len`` tokens."""
    if num_samples < 1 or seq_len < 2:
        raise CalibrationDataError("need at least 1 sample of at least 2 tokens")
    texts = read_texts(data)
    tok = load_tokenizer(model_dir)
    h = hashlib.sha256()
    h.update(hashlib.sha256((Path(model_dir) / "tokenizer.json").read_bytes()).digest())
    stream: list[int] = []
    for name, text in texts:
        h.update(name.encode() + b"\0" + hashlib.sha256(text.encode()).digest())
        ids = tok.encode(text, add_special_tokens=False).ids
        if stream and separator is not None:
            stream.append(separator)
        stream.extend(ids)
    if len(stream) < seq_len:
        raise CalibrationDataError(
            f"the texts in {data} hold {len(stream)} tokens, fewer than one sequence of {seq_len}; "
            "add text or lower the sequence length"
        )
    arr = np.asarray(stream, np.int64)
    available = len(arr) // seq_len
    take = min(num_samples, available)
    starts = (np.linspace(0, available - 1, take).round().astype(np.int64)) * seq_len
    windows = np.stack([arr[s : s + seq_len] for s in starts])
    h.update(f"{take}:{seq_len}:{separator}".encode())
    return TokenWindows(windows, len(arr), h.hexdigest())


def text_chunks(text_file: Path, model_dir: Path, seq_len: int, max_chunks: int | None = None) -> np.ndarray:
    """The whole text tokenized and cut into non-overlapping windows of ``seq_len`` (eval)."""
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
