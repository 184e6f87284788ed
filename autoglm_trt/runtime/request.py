"""One request in the engine: its prompt checked and encoded, and its text as it is produced.

``PromptEncoder`` turns a prompt (text, chat messages or token ids) into token ids, refusing
anything malformed with a ``RequestError`` before any expensive work: a text longer than the
longest prompt the engine allows could possibly be (``max_prompt_tokens`` x the tokenizer's
longest token, twice over) is refused before it is tokenized.

``Request`` holds a sequence's text. Stop strings are matched on the text as it grows
(``StopStrings``: each new character costs O(1) per stop string, amortized, however long the
text and the stop strings); a streamed piece that might be the beginning of a stop string is
held back until it cannot be, so ``stream`` yields exactly the text ``generate`` returns.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..errors import RequestError
from ..kvcache.layout import blocks_needed
from ..model.tokenizer import IncrementalDecoder, TextTokenizer
from .groups import BeamGroup
from .images import ImageRules, PreparedPrompt, image_url_source
from .sampling import SamplingParams
from .sequence import Sequence

Prompt = str | list[dict] | list[int]
PROMPT_HELP = ("a prompt is a string, a non-empty list of chat messages ({'role': str, 'content': str or a list of "
               "parts}) or a non-empty list of token ids")
PART_HELP = ("a content part is {'type': 'text', 'text': str}, {'type': 'image_url', 'image_url': {'url': "
             "'data:image/png;base64,...'}} or {'type': 'image', 'image': a PIL image, bytes or a path}")


class PromptEncoder:
    def __init__(self, tokenizer: TextTokenizer | None, vocab_size: int, max_prompt_tokens: int,
                 images: ImageRules | None = None):
        self.tokenizer, self.vocab_size, self.max_prompt_tokens = tokenizer, vocab_size, max_prompt_tokens
        self.images = images  # None: the model reads text only
        chars = tokenizer.max_token_chars if tokenizer is not None else 1
        self.max_chars = 2 * max_prompt_tokens * chars + 1024

    def encode(self, prompt: object) -> list[int]:
        """Token ids of a prompt; a chat message's image part becomes the template's placeholder."""
        return self.encode_with_images(prompt)[0]

    def encode_with_images(self, prompt: object, tools: list[dict] | None = None) -> tuple[list[int], list[object]]:
        """Token ids (one placeholder per image) and the images' sources, in order (``tools``: tool
        definitions for the chat template)."""
        images: list[object] = []
        if isinstance(prompt, str):
            ids = self._tok().encode(self._text(prompt, "the prompt"))
        elif isinstance(prompt, dict):
            raise RequestError("a single chat message was passed as the prompt; pass a list of messages "
                               "([{'role': 'user', 'content': ...}])")
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = self._tok().apply_chat_template(self._messages(prompt, images), tools=tools, max_chars=self.max_chars)
        elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        else:
            raise RequestError(f"{PROMPT_HELP}; got {_describe(prompt)}")
        if not ids:
            raise RequestError("the prompt is empty after tokenization")
        return ids, images

    def extra_images(self, images: Seq[object]) -> list[object]:
        """Images given beside a prompt (``Engine.prepare(images=...)``), checked against the rules."""
        if self.images is None:
            raise RequestError("images were given, but this engine's model reads text only")
        if isinstance(images, str | bytes) or not isinstance(images, Seq):
            raise RequestError(f"images must be a list of images, got {type(images).__name__}")
        if len(images) > self.images.max_images:
            raise RequestError(f"the prompt has more than {self.images.max_images} image(s), the most this engine "
                               "takes in one prompt")
        return list(images)

    def _tok(self) -> TextTokenizer:
        if self.tokenizer is None:
            raise RequestError("this engine has no tokenizer; pass token ids")
        return self.tokenizer

    def _text(self, text: str, what: str) -> str:
        if len(text) > self.max_chars:
            raise RequestError(f"{what} has {len(text)} characters; this engine takes at most {self.max_prompt_tokens} "
                               f"prompt tokens, which no text of more than {self.max_chars} characters fits in")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RequestError(f"{what} is not valid Unicode text ({exc.reason} at position {exc.start})") from exc
        return text

    def _messages(self, messages: list[dict], images: list[object]) -> list[dict]:
        """The messages as the chat template takes them (content a string, or for a message with
        images a list of ``{"type": "text", "text"}`` and ``{"type": "image"}`` parts), collecting
        the images' sources into ``images``."""
        total = 0
        out = []
        for k, m in enumerate(messages):
            role, content = m.get("role"), m.get("content")
            if not isinstance(role, str) or not role:
                raise RequestError(f"message {k} needs a 'role' string, got {_describe(role)}")
            if isinstance(content, list) and content:
                content = self._parts(content, k, images)
            elif content is None and m.get("tool_calls"):  # an assistant turn that only called tools
                content = ""
            elif not isinstance(content, str):
                raise RequestError(f"message {k} needs a 'content' string or a non-empty list of parts, got "
                                   f"{_describe(content)}")
            texts = [content] if isinstance(content, str) else [p["text"] for p in content if p["type"] == "text"]
            for text in texts:
                self._text(text, f"message {k}")
                total += len(text)
            out.append({**m, "content": content})
        if total > self.max_chars:
            raise RequestError(f"the messages have {total} characters; this engine takes at most "
                               f"{self.max_prompt_tokens} prompt tokens")
        return out

    def _parts(self, parts: list, k: int, images: list[object]) -> str | list[dict]:
        """One message's content parts: their text joined when it has no image, else the parts."""
        out: list[dict] = []
        for j, part in enumerate(parts):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                out.append({"type": "text", "text": part["text"]})
            elif kind in ("image_url", "image"):
                rules = self.images
                if rules is None:
                    raise RequestError(f"message {k} part {j} is an image, but this engine's model reads text only")
                if kind == "image_url":
                    url = part.get("image_url")
                    images.append(image_url_source(url.get("url") if isinstance(url, dict) else url,
                                                   rules.allowed_local_media_path))
                else:
                    images.append(part.get("image"))
                if len(images) > rules.max_images:
                    raise RequestError(f"the prompt has more than {rules.max_images} image(s), the most this engine "
                                       "takes in one prompt")
                out.append({"type": "image"})
            else:
                raise RequestError(f"message {k} part {j}: {PART_HELP}; got {_describe(part)}")
        if all(p["type"] == "text" for p in out):
            return "".join(p["text"] for p in out)
        return out


def _is_int(t: object) -> bool:
    return isinstance(t, int | np.integer) and not isinstance(t, bool)


def _describe(value: object) -> str:
    if isinstance(value, list):
        kinds = sorted({type(v).__name__ for v in value})
        return f"a list of {', '.join(kinds)}" if value else "an empty list"
    return f"{type(value).__name__} {repr(value)[:40]}"


def split_prompts(prompts: object) -> list[object]:
    """``generate``'s argument as a list of prompts: one prompt, or a list of them."""
    if isinstance(prompts, str | dict) or prompts is None or not isinstance(prompts, Seq):
        return [prompts]
    items = list(prompts)
    if items and not isinstance(items[0], str | list | PreparedPrompt):  # token ids or chat messages: one prompt
        return [items]
    return items


@dataclass
@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability and the most likely alternatives' (``SamplingParams.logprobs``)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Choice:
    """One of a request's outputs: a sample, or a beam (with its score)."""

    text: str
    token_ids: list[int]
    finish_reason: str
    score: float | None = None  # a beam's sum of log-probabilities / length ** length_penalty
    logprobs: list[TokenLogprob] | None = None  # with SamplingParams.logprobs: one per token of token_ids


@dataclass
class GenerationResult:
    """A request's output: the first sample (or best beam), and every one in ``choices``."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string), "length", "timeout" or "cancelled"
    prompt_tokens: int
    token_times: list[float] = field(default_factory=list, repr=False)  # perf_counter at each token
    submitted: float = 0.0
    choices: list[Choice] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.submitted if self.token_times else float("nan")


class Sink(Protocol):
    """Where a streamed request's pieces go: ``put(piece)``, then ``put(None)`` when it ends.
    Called from the engine's loop thread under its lock, so it must not block."""

    def put(self, item: str | None) -> None: ...


class Request:
    """A sequence, its decoder and text, and how its caller waits for it (``done``, ``pieces``)."""

    def __init__(self, seq: Sequence, decoder: IncrementalDecoder | None, stream: bool | Sink,
                 timeout: float | None):
        self.seq = seq
        self.decoder = decoder
        self.text = ""
        self.sent = 0  # characters of ``text`` already streamed
        self.done = threading.Event()
        self.pieces: Sink | None = (queue.Queue() if stream is True else None) if isinstance(stream, bool) else stream
        self.error: BaseException | None = None
        self.token_times: list[float] = []
        self.submitted = time.perf_counter()
        self.deadline = None if timeout is None else self.submitted + timeout
        self.children: list[Request] = []  # the further samples of SamplingParams(n=...)
        self.logprobs: list[TokenLogprob] = []  # with SamplingParams.logprobs, one per generated token
        self.marks: list[int] = []  # for each streamed piece, how many of ``logprobs`` it covers
        self.beam: BeamGroup | None = None  # the beams of SamplingParams(beam_width=...)
        self.stops = StopStrings(seq.params.stop)

    def spawn(self, seq: Sequence, decoder: IncrementalDecoder | None) -> Request:
        """A further sample of this request (``SamplingParams.n``), with its submission time and deadline."""
        child = Request(seq, decoder, False, None)
        child.submitted, child.deadline = self.submitted, self.deadline
        self.children.append(child)
        return child

    def result(self, tokenizer: TextTokenizer | None) -> GenerationResult:
        """The outcome of a finished request and its further samples (``RequestError`` if one failed)."""
        error = next((r.error for r in [self, *self.children] if r.error is not None), None)
        if error is not None:
            if isinstance(error, RequestError):
                raise error
            raise RequestError(f"generation failed: {error}") from error
        if self.beam is not None:
            reason = self.beam.reason or "length"
            choices = [Choice(tokenizer.decode(list(h.tokens)) if tokenizer else "", list(h.tokens),
                              "stop" if h.eos else reason, h.score) for h in self.beam.results(self.seq.params.n)]
        else:
            wanted = self.seq.params.logprobs is not None
            choices = [Choice(r.text, list(r.seq.output_ids), r.seq.finish_reason or "cancelled",
                              logprobs=list(r.logprobs) if wanted else None) for r in [self, *self.children]]
        best = choices[0]
        return GenerationResult(best.text, best.token_ids, best.finish_reason, len(self.seq.prompt_ids),
                                self.token_times, self.submitted, choices)

    def sequences(self) -> list[Sequence]:
        """The sequences this request runs now (its beams, or its one sequence)."""
        return list(self.beam.seqs) if self.beam is not None else [self.seq]

    def add_text(self, piece: str) -> str | None:
        """Append decoded text; return "stop" when a stop string was reached (the text is cut before it)."""
        found = self.stops.feed(piece, len(self.text))
        self.text += piece
        if found is not None:
            self.text = self.text[:found]
            self._send(len(self.text))
            return "stop"
        self._send(len(self.text) - self.stops.held)
        return None

    def finish_text(self, reason: str) -> str:
        """The generation ends for ``reason``: decode what the decoder still holds (unless it stopped),
        send what was held back, and return the final reason (a flushed stop string makes it "stop")."""
        if self.decoder is not None and reason != "stop":
            rest = self.decoder.flush()
            if rest and self.add_text(rest) == "stop":
                reason = "stop"
        self._send(len(self.text))
        return reason

    def _send(self, upto: int) -> None:
        if upto > self.sent:
            if self.pieces is not None:
                # the k-th piece's tokens' log-probabilities end at marks[k] (noted before the piece goes out)
                self.marks.append(len(self.logprobs))
                self.pieces.put(self.text[self.sent : upto])
            self.sent = upto


class StopStrings:
    """Stop strings found in a growing text, one Knuth-Morris-Pratt automaton per string: its state is
    the length of the longest end of the text that begins the string, so a new character costs O(1)
    amortized per string and the text is never searched again."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.fallback = [_prefix_function(s) for s in stops]
        self.state = [0] * len(stops)

    @property
    def held(self) -> int:
        """Characters at the text's end that may begin a stop string (held back from a stream)."""
        return max(self.state, default=0)

    def feed(self, piece: str, offset: int) -> int | None:
        """Read ``piece``, which starts at ``offset`` in the text; the start of the earliest-starting
        stop string that ends in it, or None."""
        found = None
        for k, stop in enumerate(self.stops):
            q, fallback = self.state[k], self.fallback[k]
            for j, ch in enumerate(piece):
                while q and stop[q] != ch:
                    q = fallback[q - 1]
                if stop[q] == ch:
                    q += 1
                if q == len(stop):
                    start = offset + j + 1 - q
                    found = start if found is None else min(found, start)
                    q = fallback[q - 1]
                    break
            self.state[k] = q
        return found


def _prefix_function(s: str) -> list[int]:
    """KMP's table: for each prefix of ``s``, the length of its longest proper end that also begins ``s``."""
    table = [0] * len(s)
    q = 0
    for i in range(1, len(s)):
        while q and s[i] != s[q]:
            q = table[q - 1]
        if s[i] == s[q]:
            q += 1
        table[i] = q
    return table


@dataclass(frozen=True)
class RequestLimits:
    max_seq_len: int
    max_batch: int
    block_size: int
    num_blocks: int
    tokenizer: bool
    where: str  # the engine directory, for messages
    vocab_size: int = 0  # 0: token ids in the parameters are not checked

    def check(self, ids: list[int], params: SamplingParams, pieces: bool, streaming: bool) -> None:
        """A prompt may be as long as max_seq_len - max_new_tokens (prefilled in chunks of at most
        max_input_len tokens); text pieces (a stream or a sink) and stop strings need a tokenizer;
        ``Engine.stream`` carries one sequence; a beam search's beams run in one batch."""
        if len(ids) + params.max_new_tokens > self.max_seq_len:
            room = self.max_seq_len - params.max_new_tokens
            raise RequestError(f"the prompt has {len(ids)} tokens and max_new_tokens is {params.max_new_tokens}: "
                               f"this engine allows at most {max(room, 0)} prompt tokens with that many new ones "
                               f"(max_seq_len {self.max_seq_len}); shorten the prompt or lower max_new_tokens")
        if blocks_needed(len(ids) + params.max_new_tokens, self.block_size) > self.num_blocks:
            raise RequestError(f"this request needs more KV blocks than the whole pool ({self.num_blocks})")
        if (pieces or params.stop) and not self.tokenizer:
            raise RequestError(f"{self.where} has no tokenizer: streaming text and stop strings need one")
        if streaming and (params.n > 1 or params.beam_width > 1):
            raise RequestError("a stream carries one sequence: use n=1 and beam_width=1 to stream, "
                               "or generate without streaming")
        outside = sorted(t for t in [*(params.logit_bias or {}), *params.stop_token_ids]
                         if self.vocab_size and t >= self.vocab_size)
        if outside:
            raise RequestError(f"logit_bias and stop_token_ids name token ids {outside[:5]} outside the vocabulary "
                               f"[0, {self.vocab_size})")
        if params.beam_width > self.max_batch:
            raise RequestError(f"beam_width {params.beam_width} exceeds this engine's max_batch_size "
                               f"{self.max_batch}: a beam search runs its beams in one batch")
