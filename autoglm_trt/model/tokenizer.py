"""The checkpoint's tokenizer and chat template, without transformers.

Input: an engine (or export) directory with ``tokenizer.json`` and, optionally,
``tokenizer_config.json`` and ``chat_template.jinja``. Output: token ids for text or chat
messages, and text for ids, including an incremental decoder for streaming that holds back
an incomplete UTF-8 character.

The chat template comes from the checkpoint, so it is rendered in Jinja's immutable sandbox
under a budget (``RenderBudget``): at most ``MAX_RENDER_CHARS`` of output and of any string
or list it builds, ``MAX_LOOP_ITEMS`` iterations of ``range``, ``MAX_RENDER_SECONDS`` of
time. A template that exceeds it, recurses without end or fails on the messages fails that
request with a ``RequestError``; nothing it does can stop the process.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..errors import AutoGLMError, RequestError

MAX_RENDER_CHARS = 4_000_000
MAX_LOOP_ITEMS = 200_000
MAX_RENDER_SECONDS = 2.0


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
        self.chat_template = template.read_text() if template.is_file() else _named_template(self.config)
        # the most characters one token can stand for (a text longer than n times this needs more than n tokens)
        self.max_token_chars = max((len(t) for t in self.tok.get_vocab(with_added_tokens=True)), default=1)
        self._template = None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """One token's text, a special token's included (for log-probabilities)."""
        return self.tok.decode([token], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, max_chars: int | None = None) -> list[int]:
        """The messages rendered by the chat template (``tools``: OpenAI's tool definitions, which
        templates that describe tools to the model read as ``tools``) and tokenized; a rendering of
        more than ``max_chars`` characters is refused before it is tokenized."""
        text = self.render_chat(messages, add_generation_prompt, tools)
        if max_chars is not None and len(text) > max_chars:
            raise RequestError(f"the chat template made {len(text)} characters of these messages and tools, more than "
                               f"the {max_chars} this engine's prompt length can hold; send less")
        return self.tok.encode(text, add_special_tokens=False).ids

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """The messages rendered by the chat template, as text."""
        if not self.chat_template:
            raise RequestError("this model has no chat template; pass plain text or token ids")
        return RenderBudget().render(self._compiled(), messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=_token_text(self.config.get("bos_token")),
                                     eos_token=_token_text(self.config.get("eos_token")), tools=tools)

    def _compiled(self):
        if self._template is None:
            import jinja2

            try:
                self._template = _BudgetSandbox(trim_blocks=True, lstrip_blocks=True,
                                                undefined=jinja2.StrictUndefined).from_string(self.chat_template)
            except jinja2.TemplateError as exc:
                raise RequestError(f"the model's chat template does not compile: {exc}") from exc
        return self._template


def _named_template(config: dict) -> str | None:
    """``chat_template`` of tokenizer_config.json: a string, or a list of {name, template} (the "default" one)."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise TokenizerError(f"tokenizer_config.json has chat templates {sorted(map(str, named))} but no 'default'")
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"tokenizer_config.json chat_template must be a string, got {type(template).__name__}")
    return template


def _token_text(tok: object) -> str:
    if isinstance(tok, dict):
        return str(tok.get("content", ""))
    return "" if tok is None else str(tok)


class RenderBudget:
    """Time, loop and size limits of one render; ``_BudgetSandbox`` checks them as the template runs."""

    def __init__(self) -> None:
        self.deadline = time.monotonic() + MAX_RENDER_SECONDS
        self.loop_items = 0

    def check(self) -> None:
        if time.monotonic() > self.deadline:
            raise RequestError(f"the chat template took more than {MAX_RENDER_SECONDS} s to render; refused")

    def size(self, n: int, what: str) -> None:
        if n > MAX_RENDER_CHARS:
            raise RequestError(f"the chat template built {what} of {n} items (at most {MAX_RENDER_CHARS}); refused")

    def counted_range(self, *args: int):
        r = range(*args)
        self.loop_items += len(r)
        if self.loop_items > MAX_LOOP_ITEMS:
            raise RequestError(f"the chat template loops more than {MAX_LOOP_ITEMS} times; refused")
        for i in r:
            self.check()
            yield i

    def render(self, template, **context: object) -> str:
        import jinja2

        parts: list[str] = []
        total = 0
        try:
            for chunk in template.generate(**context, raise_exception=_raise, range=self.counted_range,
                                           __budget=self):
                total += len(chunk)
                self.size(total, "an output")
                self.check()
                parts.append(chunk)
        except RequestError:
            raise
        except RecursionError as exc:
            raise RequestError("the chat template recursed too deeply; refused") from exc
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError,
                ZeroDivisionError, MemoryError) as exc:
            raise RequestError(f"the chat template failed on these messages: {str(exc)[:200]}") from exc
        return "".join(parts)


def _raise(msg: str) -> None:
    raise RequestError(f"chat template: {msg}")


def _sandbox_class():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BudgetSandbox(ImmutableSandboxedEnvironment):
        """The immutable sandbox, with ``*``, ``**`` and ``+`` and every call checked against the budget."""

        intercepted_binops = frozenset(["*", "**", "+"])

        def call_binop(self, context, operator, left, right):  # type: ignore[override]
            budget = context.get("__budget") or RenderBudget()
            budget.check()
            if operator == "*":
                for a, b in ((left, right), (right, left)):
                    if isinstance(a, str | list | tuple) and isinstance(b, int):
                        budget.size(len(a) * max(b, 0), "a repeated sequence")
            elif operator == "**" and isinstance(right, int) and abs(right) > 64:
                raise RequestError(f"the chat template raised a number to the power {right}; refused")
            elif operator == "+" and isinstance(left, str | list | tuple) and isinstance(right, str | list | tuple):
                budget.size(len(left) + len(right), "a joined sequence")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # type: ignore[override]  # noqa: N805
            budget = __context.get("__budget") or RenderBudget()
            budget.check()
            for a in (*args, *kwargs.values()):
                if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_RENDER_CHARS:
                    raise RequestError(f"the chat template called a function with {a}; refused")
            return super().call(__context, __obj, *args, **kwargs)

    return BudgetSandbox


class _LazySandbox:
    """Builds the sandbox class on first use, so importing this module does not import jinja2."""

    def __call__(self, **kwargs):
        return _sandbox_class()(**kwargs)


_BudgetSandbox = _LazySandbox()


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
