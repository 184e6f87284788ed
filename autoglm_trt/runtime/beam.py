"""Beam search, step by step, as transformers' ``generate(num_beams=W, do_sample=False)`` does it (pure numpy).

The engine runs the beams as sequences that share KV blocks; this module only decides, from
the logits of each running beam, which (beam, token) continuations run next and which
hypotheses are finished. One step, with W beams and E end-of-sequence ids::

    scores[b, t] = beam_score[b] + log_softmax(logits[b])[t]        (sum of log-probabilities)
    the K = max(2, 1 + E) * W best (b, t) over all beams, best first  (ties: lower b, then t)
    a candidate "ends" if t is an EOS id or it is the max_new_tokens-th token
    finished   <- the candidates of rank < W that end, scored  scores / generated_len ** length_penalty
                  (generated_len counts the new token, EOS included), merged and cut to the best W
    running    <- the first W candidates that do not end

The search stops when every candidate ends (the length limit), when W hypotheses are
finished and ``early_stopping`` is True, or when no running beam can beat the worst finished
one: with ``early_stopping`` False (the default) transformers' heuristic divides the best
running score by the current generated length ** length_penalty; with ``"never"`` and a
positive length penalty, by max_new_tokens ** length_penalty. These are the definitions of
transformers 5 (``GenerationMixin._beam_search``); the engine's test compares the best beam
with it on SmolLM2. Differences: a search has one prompt (no batch of prompts), and
ties between equal scores are broken by the lower beam, then the lower token id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Stopping = bool | str  # True, False or "never"


@dataclass(frozen=True)
class Hypothesis:
    tokens: tuple[int, ...]  # generated tokens, without the EOS that ended it
    score: float  # sum of log-probabilities / generated_len ** length_penalty
    eos: bool  # ended by an EOS id (else by the length limit, or cut short)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


class BeamSearch:
    def __init__(self, width: int, eos_ids: Sequence[int], max_new_tokens: int, length_penalty: float = 1.0,
                 early_stopping: Stopping = False):
        if early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
        self.width, self.eos, self.max_new_tokens = width, frozenset(eos_ids), max_new_tokens
        self.length_penalty, self.early_stopping = length_penalty, early_stopping
        self.keep = max(2, 1 + len(self.eos)) * width
        self.beams: list[tuple[tuple[int, ...], float]] = [((), 0.0)]  # running: tokens, sum of log-probs
        self.finished: list[Hypothesis] = []
        self.improvable = True
        self.done = False

    def step(self, logits: Sequence[np.ndarray]) -> list[tuple[int, int]]:
        """Advance every running beam by one token, given their logits in ``beams`` order.

        Returns the new running beams as (index of the parent beam, token), best first; empty
        when the search is done.
        """
        if self.done:
            raise RuntimeError("the beam search is done")
        if len(logits) != len(self.beams):
            raise ValueError(f"{len(self.beams)} running beams but {len(logits)} rows of logits")
        scores = np.stack([log_softmax(row) for row in logits]) + np.array([s for _, s in self.beams])[:, None]
        vocab = scores.shape[1]
        flat = scores.reshape(-1)
        k = min(self.keep, flat.size)
        top = np.argpartition(-flat, k - 1)[:k]
        top = top[np.lexsort((top, -flat[top]))]  # best first; equal scores: lower index first
        gen = len(self.beams[0][0]) + 1  # generated tokens once this one is added
        cands = [(int(i) // vocab, int(i) % vocab, float(flat[i])) for i in top]
        ends = [t in self.eos or gen >= self.max_new_tokens for _, t, _ in cands]
        self._finish([c for c, e in zip(cands[: self.width], ends) if e], gen)
        running = [c for c, e in zip(cands, ends) if not e][: self.width]
        self.beams = [(self.beams[b][0] + (t,), s) for b, t, s in running]
        self._check_stop(running[0][2] if running else -1e9, gen, all(ends))
        return [] if self.done else [(b, t) for b, t, _ in running]

    def _finish(self, ended: list[tuple[int, int, float]], gen: int) -> None:
        full = len(self.finished) == self.width
        if not ended or not self.improvable or (full and self.early_stopping is True):
            return
        new = [Hypothesis(self.beams[b][0] + (() if t in self.eos else (t,)), s / gen**self.length_penalty,
                          t in self.eos) for b, t, s in ended]
        merged = sorted(self.finished + new, key=lambda h: -h.score)  # stable: earlier hypotheses win ties
        self.finished = merged[: self.width]

    def _check_stop(self, best_running: float, gen: int, all_end: bool) -> None:
        full = len(self.finished) == self.width
        if full:
            length = self.max_new_tokens if self.early_stopping == "never" and self.length_penalty > 0 else gen
            best_possible = best_running / length**self.length_penalty
            self.improvable = self.improvable and best_possible > min(h.score for h in self.finished)
        self.done = not self.improvable or (full and self.early_stopping is True) or all_end

    def best(self, n: int) -> list[Hypothesis]:
        """The n best hypotheses: finished ones, then (if the search was cut short) running beams."""
        out = list(self.finished)
        if len(out) < n:
            extra = [Hypothesis(toks, s / max(len(toks), 1) ** self.length_penalty, False) for toks, s in self.beams]
            out = sorted(out + extra, key=lambda h: -h.score)
        return out[:n]
