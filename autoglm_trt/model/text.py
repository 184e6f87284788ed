"""Calibration and evaluation text: files -> token windows, with the model's tokenizer.

Input: a directory of ``.txt`` files and ``.jsonl`` files (one JSON object per line with a
``text`` field, or a ``messages`` list of ``{"role", "content"}`` turns that is rendered with
the model's own chat template, or as ``Role: content`` lines for a model without one), read in
sorted path order, and the model's ``tokenizer.json``. Output: fixed-length token windows.
All texts are tokenized and joined (separated by the EOS/BOS token when the model has one),
cut into non-overlapping windows of ``seq_len`` tokens, and ``num_samples`` windows are
taken evenly spaced over the whole stream, so the selection is deterministic and covers
every file.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import AutoGLMError


class CalibrationDataError(AutoGLMError):
    """The calibration or evaluation text cannot be used."""


Text = str | list[dict]  # plain text, or a conversation's messages


def read_texts(path: Path) -> list[tuple[str, Text]]:
    """``[(relative name, text or messages)]`` from a directory (or a single file) of .txt / .jsonl."""
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
                out.append((f"{name}:{n}", _json_line(line, f"{f}:{n}")))
        else:
            out.append((name, raw))
    if not any(isinstance(t, list) or t.strip() for _, t in out):
        raise CalibrationDataError(f"the files in {path} are empty")
    return out


def _json_line(line: str, where: str) -> Text:
    expected = "expected a JSON object with a 'text' string or a 'messages' list of {'role', 'content'} strings"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise CalibrationDataError(f"{where}: {expected} ({exc})") from exc
    if isinstance(obj, dict) and isinstance(obj.get("messages"), list):
        turns = obj["messages"]
        if turns and all(isinstance(t, dict) and isinstance(t.get("role"), str) and isinstance(t.get("content"), str)
                         for t in turns):
            return [{"role": t["role"], "content": t["content"]} for t in turns]
    elif isinstance(obj, dict) and "text" in obj:
        return str(obj["text"])
    raise CalibrationDataError(f"{where}: {expected}")


class _Encoder:
    """Token ids of a text, or of a conversation rendered with the model's chat template."""

    def __init__(self, model_dir: Path):
        self.model_dir, self.tok = Path(model_dir), load_tokenizer(model_dir)
        self._chat: Any = None  # tokenizer.TextTokenizer, made on the first conversation
        self.template = ""  # how conversations were rendered: the chat template, or "Role: content" lines

    def ids(self, text: Text, where: str) -> list[int]:
        if isinstance(text, str):
            return self.tok.encode(text, add_special_tokens=False).ids
        if self._chat is None:
            from .tokenizer import TextTokenizer

            self._chat = TextTokenizer(self.model_dir)
            self.template = self._chat.chat_template or "Role: content"
        if not self._chat.chat_template:  # a base model: the conversation as plain lines
            plain = "\n".join(f"{turn['role'].capitalize()}: {turn['content']}" for turn in text)
            return self.tok.encode(plain, add_special_tokens=False).ids
        try:
            return self._chat.apply_chat_template(text, add_generation_prompt=False)
        except AutoGLMError as exc:  # the checkpoint's template refuses these messages
            raise CalibrationDataError(f"{where}: the model's chat template cannot render this conversation: {exc}; "
                                       "fix the messages or give the conversation as 'text'") from exc


def _digest(text: Text) -> bytes:
    raw = text if isinstance(text, str) else json.dumps(text, ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(raw.encode()).digest()


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
    enc = _Encoder(model_dir)
    h = hashlib.sha256()
    h.update(hashlib.sha256((Path(model_dir) / "tokenizer.json").read_bytes()).digest())
    stream: list[int] = []
    for name, text in texts:
        h.update(name.encode() + b"\0" + _digest(text))
        ids = enc.ids(text, name)
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
    h.update(f"{take}:{seq_len}:{separator}".encode() + enc.template.encode())  # a new template, new windows
    return TokenWindows(windows, len(arr), h.hexdigest())


def text_chunks(text_file: Path, model_dir: Path, seq_len: int, max_chunks: int | None = None) -> np.ndarray:
    """The whole text tokenized and cut into non-overlapping windows of ``seq_len`` (eval)."""
    enc = _Encoder(model_dir)
    ids: list[int] = []
    for name, text in read_texts(text_file):
        ids.extend(enc.ids(text, name))
    n = len(ids) // seq_len
    if n == 0:
        raise CalibrationDataError(f"{text_file} has {len(ids)} tokens, fewer than one chunk of {seq_len}")
    if max_chunks:
        n = min(n, max_chunks)
    return np.asarray(ids[: n * seq_len], np.int64).reshape(n, seq_len)
