"""The checkpoint's tokenizer and chat template, without transformers.

Input: an engine (or export) directory with ``tokenizer.json`` and, optionally,
``tokenizer_config.json`` and ``chat_template.jinja``. Output: token ids for text or chat
messages, and text for ids, including an incremental decoder for streaming that holds back
an incomplete UTF-8 character.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import AutoGLMError


class TokenizerError(AutoGLMError):
    """The tokenizer or chat template is missing or cannot be used."""


class TextTokenizer:
    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{model_dir} has no tokenizer.json; pass token ids instead of text")
        self.tok = Tokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = model_dir / "chat_template.jinja"
        self.chat_template = template.read_text() if template.is_file() else self.config.get("chat_template")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if not self.chat_template:
            raise TokenizerError("this model has no chat template; pass plain text or token ids")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)

        def raise_exception(msg: str) -> None:
            raise TokenizerError(f"chat template: {msg}")

        env.globals["raise_exception"] = raise_exception
        try:
            text = env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=_token_text(self.config.get("bos_token")), eos_token=_token_text(self.config.get("eos_token")))
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"chat template failed: {exc}") from exc
        return self.tok.encode(text, add_special_tokens=False).ids


def _token_text(tok: object) -> str:
    if isinstance(tok, dict):
        return str(tok.get("content", ""))
    return "" if tok is None else str(tok)


class IncrementalDecoder:
    """Text pieces for a growing list of ids, O(1) tokens decoded per step.

    Decodes a short window (from ``prefix`` to the end) and emits what it adds beyond the
    window's already-emitted part; a piece ending in an incomplete UTF-8 character (U+FFFD) is
    held back until the next token completes it.
    """

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # start of the decode window
        self.read = 0  # ids before this index have been emitted

    def add(self, token: int) -> str:
        self.ids.append(token)
        done = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done) :]

    def flush(self) -> str:
        """Whatever is still held back (at the end of generation)."""
        done = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(done) :] if len(text) > len(done) else ""
