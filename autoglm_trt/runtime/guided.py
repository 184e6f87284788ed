"""Structured output: generation held to a JSON schema, a regex, a list of choices or a Lark
grammar, with llguidance (the grammar engine TensorRT-LLM and vLLM use; Rust, no dependencies).

``Guide`` says what the output must match; ``Grammars`` (one per engine) compiles a guide once
(cached by its text, ``GRAMMAR_CACHE``) and refuses a malformed one with a ``RequestError``
before any work; ``GuidedState`` (one per sequence) masks the logits of every token the grammar
cannot take next, consumes each sampled token, and says when the grammar has ended. A grammar
allows the end-of-sequence tokens exactly where it may end.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from ..errors import RequestError

GRAMMAR_CACHE = 64
KINDS = ("json_schema", "regex", "choice", "lark")
MAX_GUIDE_CHARS = 1_000_000


@dataclass(frozen=True)
class Guide:
    """What the output must match: ``kind`` one of ``KINDS`` and its text (a JSON schema as JSON,
    a regex, a JSON list of choices, a Lark grammar)."""

    kind: str
    text: str

    @classmethod
    def json_schema(cls, schema: dict | str) -> Guide:
        """Properties are generated in the schema's order (a "thought" before an "answer" stays first)."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> Guide:
        """Any JSON object (OpenAI's JSON mode)."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def regex(cls, pattern: str) -> Guide:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: list[str]) -> Guide:
        return cls("choice", json.dumps(list(choices)))

    @classmethod
    def lark(cls, grammar: str) -> Guide:
        return cls("lark", grammar)

    @classmethod
    def shipped(cls, name: str) -> Guide:
        """A Lark grammar shipped in ``autoglm_trt/grammars`` (``autoglm_action``: Open-AutoGLM's answers)."""
        return cls.lark(shipped_grammar(name))

    def check(self) -> None:
        if self.kind not in KINDS:
            raise RequestError(f"a guide's kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.text, str) or not self.text or len(self.text) > MAX_GUIDE_CHARS:
            raise RequestError(f"a {self.kind} guide needs a text of 1 to {MAX_GUIDE_CHARS} characters")

    def grammar(self) -> str:
        """llguidance's grammar for this guide (its errors surface when a matcher is made)."""
        from llguidance import LLMatcher

        if self.kind == "json_schema":
            try:  # compact JSON, as OpenAI's strict mode writes it: no free whitespace to wander in
                return LLMatcher.grammar_from_json_schema(self.text, defaults={"whitespace_flexible": False})
            except ValueError as exc:
                raise RequestError(f"the JSON schema is not valid JSON: {exc}") from exc
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.text)
        if self.kind == "choice":
            choices = json.loads(self.text)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise RequestError("a choice guide needs a non-empty list of non-empty strings")
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        return LLMatcher.grammar_from_lark(self.text)


def shipped_grammar(name: str) -> str:
    """The text of ``autoglm_trt/grammars/<name>.lark``."""
    if not name.replace("_", "").isalnum():
        raise RequestError(f"a shipped grammar's name is letters, digits and underscores, got {name!r}")
    found = resources.files("autoglm_trt.grammars").joinpath(f"{name}.lark")
    if not found.is_file():
        names = sorted(p.name[:-5] for p in resources.files("autoglm_trt.grammars").iterdir() if p.name.endswith(".lark"))
        raise RequestError(f"no shipped grammar named {name!r}; shipped: {', '.join(names)}")
    return found.read_text(encoding="utf-8")


class Grammars:
    """The engine's grammar compiler: its tokenizer's token table for llguidance, and compiled guides."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_ids: list[int]):
        self.path, self.vocab_size, self.eos_ids = Path(tokenizer_json), vocab_size, eos_ids
        self._tokenizer = None
        self._compiled: OrderedDict[Guide, str] = OrderedDict()
        self._lock = threading.Lock()

    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                from llguidance import LLTokenizer

                if not self.path.is_file():
                    raise RequestError("structured output needs the engine's tokenizer.json, which it lacks")
                self._tokenizer = LLTokenizer(str(self.path), n_vocab=self.vocab_size, eos_token=self.eos_ids)
            return self._tokenizer

    def compile(self, guide: Guide) -> str:
        """The guide's grammar, checked against the tokenizer (``RequestError`` if it is malformed)."""
        from llguidance import LLMatcher

        with self._lock:
            if guide in self._compiled:
                self._compiled.move_to_end(guide)
                return self._compiled[guide]
        guide.check()
        grammar = guide.grammar()
        error = LLMatcher.validate_grammar(grammar, self.tokenizer())
        if error:
            raise RequestError(f"the {guide.kind} guide is not usable: {error[:500]}")
        with self._lock:
            self._compiled[guide] = grammar
            while len(self._compiled) > GRAMMAR_CACHE:
                self._compiled.popitem(last=False)
        return grammar

    def state(self, guide: Guide) -> GuidedState:
        from llguidance import LLMatcher

        return GuidedState(LLMatcher(self.tokenizer(), self.compile(guide), log_level=0), self.vocab_size)


class GuidedState:
    """One sequence's place in its grammar."""

    def __init__(self, matcher, vocab_size: int):
        import llguidance.numpy as lln

        self.matcher, self.lln = matcher, lln
        self.mask = lln.allocate_token_bitmask(1, vocab_size)

    def masked(self, logits: np.ndarray, in_place: bool = False) -> np.ndarray:
        """``logits`` (a float32 copy, or themselves with ``in_place``) with every token the grammar
        cannot take next at -inf."""
        self._check()
        self.lln.fill_next_token_bitmask(self.matcher, self.mask, 0)
        out = logits if in_place else np.array(logits, np.float32)
        self.lln.apply_token_bitmask_inplace(out[None], self.mask)
        return out

    def accept(self, token: int) -> bool:
        """Consume a sampled token; True when the grammar has ended (nothing more may follow)."""
        self.matcher.consume_token(token)
        self._check()
        return bool(self.matcher.is_stopped())

    def _check(self) -> None:
        if self.matcher.is_error():
            raise RequestError(f"structured output failed: {self.matcher.get_error()[:300]}")
