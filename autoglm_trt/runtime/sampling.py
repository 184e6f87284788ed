"""Sampling parameters and the token sampler (pure numpy).

Order of operations on one sequence's logits: temperature 0 -> argmax. Otherwise divide by
the temperature, keep the ``top_k`` largest (0: all), then the smallest set of the most
likely tokens whose probability reaches ``top_p`` (always at least one), renormalise, and
draw with the request's own generator (seeded: the same seed gives the same tokens whatever
else is in the batch).

``SamplingParams`` checks the type and range of every field when it is made, so a request
that reaches the engine's loop cannot fail there for its parameters; ``sample`` still refuses
logits that are not finite (a broken engine) with a ``SamplingError`` for that request alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from numbers import Integral, Real

import numpy as np

from ..errors import AutoGLMError
from .guided import Guide

MIN_TEMPERATURE = 1e-3  # below this, logits / temperature overflow float64 for ordinary logits
MAX_TEMPERATURE = 1e3
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_SEQUENCES = 64  # n and beam_width
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20  # top log-probabilities per token (OpenAI's limit)
MIN_REPETITION_PENALTY = 0.01  # and 1 / this at most: a logit divided by it stays finite


_NOT_FINITE = "the engine produced logits that are not finite (NaN or infinity); cannot sample"


class SamplingError(AutoGLMError):
    """Invalid sampling parameters, or logits that cannot be sampled."""


def _int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < low:
        raise SamplingError(f"{name} must be an integer >= {low}, got {_show(value)}")
    return int(value)


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
        raise SamplingError(f"{name} must be a finite number, got {_show(value)}")
    return float(value)


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:59] + "…"


@dataclass(frozen=True)
class SamplingParams:
    """How to generate for one request.

    Args:
        max_new_tokens: tokens to generate at most (>= 1).
        temperature: 0 for greedy, else in [1e-3, 1e3].
        top_k: keep the k most likely tokens (0: all).
        top_p: nucleus mass in (0, 1].
        seed: a non-negative integer for reproducible sampling, or None.
        stop: strings that end generation (not included in the text); at most 16.
        ignore_eos: keep generating past the end-of-sequence token (benchmarks).
        timeout: seconds from submission after which the request ends with finish reason
            ``"timeout"`` and the text generated so far (None: no deadline).
        priority: lower runs first (0 by default; negative for real-time, positive for batch
            and background work); waiting requests age up one level per 10 s.
        n: samples to draw from the one prompt (its blocks shared); with ``beam_width``, the
            number of best beams returned (at most ``beam_width``).
        beam_width: beams of a beam search (1: none); beam search is deterministic, so it needs
            temperature 0, and it ends at EOS or max_new_tokens (no stop strings).
        length_penalty: beam search scores a hypothesis by its sum of log-probabilities over
            its length ** length_penalty (transformers' definition; 1.0 by default).
        early_stopping: beam search ends as soon as ``beam_width`` hypotheses are finished
            (True), by transformers' heuristic (False, the default), or only when no beam can
            improve ("never").
        frequency_penalty, presence_penalty: OpenAI's, in [-2, 2]: a generated token's logit is
            lowered by ``frequency_penalty`` per time it was generated and by ``presence_penalty``
            once it was (``penalties``).
        repetition_penalty: transformers' (in [0.01, 100]; 1: none): the logit l of a token of the
            prompt or the output becomes l / r if positive, l * r otherwise.
        min_tokens: the end-of-sequence and ``stop_token_ids`` tokens are masked until this many
            tokens are generated (but where a guide allows nothing but the end: its grammar wins).
        logit_bias: token id -> a value in [-100, 100] added to its logit.
        stop_token_ids: further tokens that end generation like end-of-sequence (not in the output).
        guide: hold the output to a JSON schema, regex, choice list or Lark grammar (``guided.Guide``);
            the end-of-sequence token is allowed exactly where the grammar may end.
        logprobs: report each generated token's log-probability and the ``logprobs`` most likely
            alternatives' (0 to 20; None: none): ``log_softmax`` of the logits the sampler used
            (after logit_bias, the min_tokens mask and the penalties; before temperature, top-k
            and top-p).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False  # for benchmarks: always generate max_new_tokens
    timeout: float | None = None
    priority: int = 0
    n: int = 1
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    logprobs: int | None = None
    guide: Guide | None = None

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        set_("max_new_tokens", _int("max_new_tokens", self.max_new_tokens, 1))
        t = _real("temperature", self.temperature)
        if t != 0.0 and not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE:
            raise SamplingError(f"temperature must be >= 0: 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
                                f"got {t!r}")
        set_("temperature", t)
        set_("top_k", _int("top_k", self.top_k, 0))
        p = _real("top_p", self.top_p)
        if not 0.0 < p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {p!r}")
        set_("top_p", p)
        if self.seed is not None:
            set_("seed", _int("seed", self.seed, 0))
        set_("stop", self._stop_strings(self.stop))
        if isinstance(self.priority, bool) or not isinstance(self.priority, Integral) or abs(self.priority) > 2**31:
            raise SamplingError(f"priority must be an integer (lower runs first), got {_show(self.priority)}")
        if not isinstance(self.ignore_eos, bool):
            raise SamplingError(f"ignore_eos must be true or false, got {_show(self.ignore_eos)}")
        if self.timeout is not None:
            timeout = _real("timeout", self.timeout)
            if timeout <= 0:
                raise SamplingError(f"timeout must be a positive number of seconds, got {timeout!r}")
            set_("timeout", timeout)
        self._check_adjustments()
        self._check_sequences()

    def _check_adjustments(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        for name in ("frequency_penalty", "presence_penalty"):
            value = _real(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise SamplingError(f"{name} must be in [-2, 2], got {value!r}")
            set_(name, value)
        r = _real("repetition_penalty", self.repetition_penalty)
        if not MIN_REPETITION_PENALTY <= r <= 1 / MIN_REPETITION_PENALTY:  # l / r stays finite
            raise SamplingError(f"repetition_penalty must be in [0.01, 100] (1: none), got {r!r}")
        set_("repetition_penalty", r)
        set_("min_tokens", _int("min_tokens", self.min_tokens, 0))
        if self.min_tokens > self.max_new_tokens:
            raise SamplingError(f"min_tokens ({self.min_tokens}) exceeds max_new_tokens ({self.max_new_tokens})")
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
                raise SamplingError(f"logit_bias must be a mapping of at most {MAX_LOGIT_BIAS} token ids to numbers, "
                                    f"got {_show(bias)}")
            checked = {}
            for k, v in bias.items():
                value = _real("a logit_bias value", v)
                if not -100.0 <= value <= 100.0:
                    raise SamplingError(f"logit_bias values must be in [-100, 100], got {value!r} for token {k!r}")
                checked[_int("a logit_bias token id", k, 0)] = value
            set_("logit_bias", checked or None)
        ids = self.stop_token_ids
        if not isinstance(ids, list | tuple) or len(ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingError(f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids, got {_show(ids)}")
        set_("stop_token_ids", tuple(_int("a stop token id", t, 0) for t in ids))
        if self.guide is not None:
            if not isinstance(self.guide, Guide):
                raise SamplingError(f"guide must be a Guide (autoglm_trt.runtime.Guide), got {_show(self.guide)}")
            try:
                self.guide.check()
            except AutoGLMError as exc:
                raise SamplingError(str(exc)) from exc
            if self.ignore_eos:
                raise SamplingError("a guided generation ends where its grammar does: ignore_eos cannot be set with it")
        if self.logprobs is not None:
            set_("logprobs", _int("logprobs", self.logprobs, 0))
            if self.logprobs > MAX_LOGPROBS:
                raise SamplingError(f"logprobs must be at most {MAX_LOGPROBS}, got {self.logprobs}")

    @property
    def adjusts_logits(self) -> bool:
        """Whether logits are changed before sampling (``penalties.adjust``)."""
        return bool(self.logit_bias or self.min_tokens or self.repetition_penalty != 1.0
                    or self.frequency_penalty or self.presence_penalty)

    def _check_sequences(self) -> None:
        for name in ("n", "beam_width"):
            value = _int(name, getattr(self, name), 1)
            if value > MAX_SEQUENCES:
                raise SamplingError(f"{name} must be at most {MAX_SEQUENCES}, got {value}")
            object.__setattr__(self, name, value)
        object.__setattr__(self, "length_penalty", _real("length_penalty", self.length_penalty))
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise SamplingError(f"early_stopping must be true, false or \"never\", got {_show(self.early_stopping)}")
        if self.beam_width > 1:
            if self.temperature != 0.0:
                raise SamplingError("beam search is deterministic: leave temperature at 0 with beam_width > 1")
            if self.n > self.beam_width:
                raise SamplingError(f"n ({self.n}) beams cannot be returned from a beam search of width "
                                    f"{self.beam_width}")
            if self.stop or self.stop_token_ids:
                raise SamplingError("beam search ends at EOS or max_new_tokens; stop strings and stop_token_ids are not "
                                    "supported with it")
            if self.adjusts_logits or self.logprobs is not None or self.guide is not None:
                raise SamplingError("beam search scores the model's own log-probabilities: penalties, logit_bias, "
                                    "min_tokens, logprobs and guides are not supported with it")

    @staticmethod
    def _stop_strings(stop: object) -> tuple[str, ...]:
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, list | tuple):
            raise SamplingError(f"stop must be a string or a list of strings, got {_show(stop)}")
        if len(stop) > MAX_STOP_STRINGS:
            raise SamplingError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        for s in stop:
            if not isinstance(s, str):
                raise SamplingError(f"stop strings must be strings, got {_show(s)}")
            if not s or len(s) > MAX_STOP_CHARS:
                raise SamplingError(f"stop strings must have 1 to {MAX_STOP_CHARS} characters, got {len(s)}")
        return tuple(stop)


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token id from one row of logits."""
    if params.temperature == 0.0:
        best = int(np.argmax(logits))  # the first NaN, if there is one
        if not math.isfinite(float(logits[best])):
            raise SamplingError(_NOT_FINITE)
        return best
    ids, weights = _weights(logits, params)
    i = draw(weights, rng.random())
    return i if ids is None else int(ids[i])


def distribution(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The tokens a draw at ``params.temperature`` > 0 can give and their probabilities (summing to 1)."""
    ids, weights = _weights(logits, params)
    return (np.arange(weights.size) if ids is None else ids), weights / weights.sum(dtype=np.float64)


def _weights(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray | None, np.ndarray]:
    """The tokens left after ``top_k`` and ``top_p`` (None: all, in order) and their unnormalized
    probabilities, without sorting the vocabulary: both look only at the tokens within e^4, e^8,
    ... of the most likely (``_near``): the ``top_k`` largest come from a partition of the first
    such set that holds k, the nucleus from sorting the first whose mass reaches ``top_p`` (ties
    rank the lower id first). A full sort of SmolLM2's 49,152 logits took about as long as a
    batch-1 decode step (docs/benchmarks.md, "Sampling without sorting the vocabulary"). In
    float32: the log-ratio d of a token to the most likely one is off by ~1e-7 of d, so a token
    at least e^-20 as likely is drawn with its probability to ~3e-6 of itself."""
    x = np.asarray(logits, np.float32)
    top = float(x.max())  # NaN if any is NaN
    if not math.isfinite(top):
        raise SamplingError(_NOT_FINITE)
    d = x - np.float32(top)
    d /= np.float32(params.temperature)  # <= 0; 0 for the most likely
    ids = None
    if 0 < params.top_k < d.size:
        near = _near(d, lambda near: near.size >= params.top_k)
        cut = np.partition(d[near], -params.top_k)[-params.top_k]
        ids = near[d[near] >= cut]  # ties with the k-th largest stay
        d = d[ids]
    p = np.exp(d) if params.top_p < 1.0 else np.exp(d, out=d)  # d is needed only for the nucleus
    if params.top_p < 1.0:
        order = _nucleus(d, p, params.top_p)
        ids, p = (order if ids is None else ids[order]), p[order]
    return ids, p


def _nucleus(d: np.ndarray, p: np.ndarray, top_p: float) -> np.ndarray:
    """Positions of the smallest set of the largest ``d`` (descending, ties by position) whose
    probabilities ``p = exp(d)`` reach ``top_p`` of their sum; at least one."""
    need = top_p * float(p.sum(dtype=np.float64))
    head = _near(d, lambda near: float(p[near].sum(dtype=np.float64)) >= need)
    order = head[np.argsort(-d[head], kind="stable")]
    mass = np.cumsum(p[order], dtype=np.float64)
    return order[:min(int(np.searchsorted(mass, need, side="left")) + 1, order.size)]


def _near(d: np.ndarray, enough: Callable[[np.ndarray], bool]) -> np.ndarray:
    """The positions of ``d`` (<= 0) within 4, 8, 16 or 32 of its largest (0), the first set that
    is ``enough``; else all. Every position of a larger ``d`` than one in the set is in it."""
    for t in (4.0, 8.0, 16.0, 32.0):
        near = np.flatnonzero(d >= -t)
        if enough(near):
            return near
    return np.arange(d.size)


DRAW_BLOCK = 256


def draw(weights: np.ndarray, u: float) -> int:
    """The index i at which the running sum of ``weights`` (not all zero) first passes
    ``u * sum`` (u in [0, 1)): i with probability weights[i] / sum. Through sums of blocks of
    ``DRAW_BLOCK``, then within one block (a running sum of the whole vocabulary measured slower)."""
    block = DRAW_BLOCK if weights.size > 4 * DRAW_BLOCK else weights.size
    full = weights.size // block * block
    sums = weights[:full].reshape(-1, block).sum(axis=1, dtype=np.float64)
    if full < weights.size:
        sums = np.append(sums, weights[full:].sum(dtype=np.float64))
    ends = np.cumsum(sums)
    target = u * ends[-1]
    b = min(int(np.searchsorted(ends, target, side="right")), ends.size - 1)
    while sums[b] == 0:  # rounding put the target past the last block with weight
        b -= 1
    inside = weights[b * block:(b + 1) * block]
    run = np.cumsum(inside, dtype=np.float64)
    j = int(np.searchsorted(run, target - (ends[b - 1] if b else 0.0), side="right"))
    return b * block + min(j, int(np.flatnonzero(inside)[-1]))
