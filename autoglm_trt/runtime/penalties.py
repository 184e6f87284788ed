"""Logit adjustments before sampling, and the log-probabilities of what was sampled (pure numpy).

Adjustments, in vLLM's order: ``logit_bias``, then
``min_tokens`` (the end tokens masked until that many are generated), then the penalties:

- ``repetition_penalty`` r (transformers' and vLLM's definition, over the prompt's and the
  generated tokens): a seen token's logit l becomes l / r if l > 0, else l * r;
- ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI's definition, over the generated
  tokens): l - f * count - p * (count > 0).

``TokenCounts`` keeps one sequence's generated-token counts, updated per token (never
recounted), and the distinct tokens of its prompt and text, found once when a repetition penalty
first needs them and then grown by each new one; ``adjust`` touches only the rows of those tokens.
"""

from __future__ import annotations

import numpy as np


class TokenCounts:
    def __init__(self, prompt_ids: list[int]):
        self.prompt_ids = prompt_ids
        self.counts: dict[int, int] = {}
        self.generated = 0
        self._prompt: set[int] | None = None  # the prompt's distinct tokens, once a repetition penalty asks
        self._prompt_ids: np.ndarray | None = None  # the same, as an array
        self._new: list[int] = []  # generated tokens the prompt does not hold, each once
        self._seen: np.ndarray | None = None  # the two together, until a new one comes

    def add(self, token: int) -> None:
        first = token not in self.counts
        self.counts[token] = self.counts.get(token, 0) + 1
        self.generated += 1
        if first and self._prompt is not None and token not in self._prompt:
            self._new.append(token)
            self._seen = None

    def copy(self) -> TokenCounts:
        out = TokenCounts(self.prompt_ids)
        out.counts, out.generated = dict(self.counts), self.generated
        out._prompt, out._prompt_ids, out._new, out._seen = self._prompt, self._prompt_ids, list(self._new), self._seen
        return out

    def seen(self) -> np.ndarray:
        """Every distinct token of the prompt and of the generated text (in no particular order)."""
        if self._prompt is None:
            self._prompt = set(self.prompt_ids)
            self._prompt_ids = np.fromiter(self._prompt, np.int64, len(self._prompt))
            self._new = [t for t in self.counts if t not in self._prompt]
        if self._seen is None:
            assert self._prompt_ids is not None  # set with _prompt
            self._seen = np.concatenate((self._prompt_ids, np.asarray(self._new, np.int64)))
        return self._seen


def adjust(logits: np.ndarray, params, counts: TokenCounts, end_ids: frozenset[int] | set[int]) -> np.ndarray:
    """A float32 copy of one sequence's ``logits`` with ``params``' bias, ``min_tokens`` mask and
    penalties applied (``end_ids``: the tokens that would end it, masked while fewer than
    ``min_tokens`` are generated)."""
    x = np.array(logits, np.float32)
    if params.logit_bias:
        ids = np.fromiter(params.logit_bias.keys(), np.int64, len(params.logit_bias))
        x[ids] += np.fromiter(params.logit_bias.values(), np.float32, len(params.logit_bias))
    if params.min_tokens and counts.generated < params.min_tokens and end_ids:
        x[np.fromiter(end_ids, np.int64, len(end_ids))] = -np.inf
    if params.repetition_penalty != 1.0:
        seen = counts.seen()
        r = np.float32(params.repetition_penalty)
        v = x[seen]
        x[seen] = np.where(v > 0, v / r, v * r)
    if (params.frequency_penalty or params.presence_penalty) and counts.counts:
        ids = np.fromiter(counts.counts.keys(), np.int64, len(counts.counts))
        n = np.fromiter(counts.counts.values(), np.float32, len(counts.counts))
        x[ids] -= np.float32(params.frequency_penalty) * n + np.float32(params.presence_penalty)
    return x


MIN_LOGPROB = -9999.0  # a log-probability is never below this (vLLM's floor): JSON has no -Infinity


def token_logprobs(logits: np.ndarray, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """``token``'s log-probability under ``log_softmax(logits)`` and the ``top`` most likely tokens'
    (descending; ties by lower id), in float64. Tokens masked out (-inf: a grammar's, ``min_tokens``')
    could not have been sampled and are left out of the alternatives, so there may be fewer than
    ``top``; every value is at least ``MIN_LOGPROB``."""
    x = np.asarray(logits, np.float64)
    m = float(x.max())
    lse = m + float(np.log(np.exp(x - m).sum()))
    best: list[tuple[int, float]] = []
    if top:
        k = min(top, x.size)
        ids = np.argpartition(-x, k - 1)[:k]
        ids = ids[np.lexsort((ids, -x[ids]))]
        best = [(int(i), max(float(x[i] - lse), MIN_LOGPROB)) for i in ids if np.isfinite(x[i])]
    return max(float(x[token] - lse), MIN_LOGPROB), best
