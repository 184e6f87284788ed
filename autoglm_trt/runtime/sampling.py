"""Sampling parameters and the token sampler (pure numpy).

Order of operations on one sequence's logits: temperature 0 -> argmax. Otherwise divide by
the temperature, keep the ``top_k`` largest (0: all), then the smallest set of the most
likely tokens whose probability reaches ``top_p`` (always at least one), renormalise, and
draw with the request's own generator (seeded: the same seed gives the same tokens whatever
else is in the batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import AutoGLMError


class SamplingError(AutoGLMError):
    """Invalid sampling parameters."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False  # for benchmarks: always generate max_new_tokens

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise SamplingError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:
            raise SamplingError(f"temperature must be >= 0 (0 is greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError(f"top_k must be an integer >= 0 (0 keeps all tokens), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if any(not s for s in self.stop):
            raise SamplingError("stop strings must not be empty")


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token id from one row of logits."""
    if params.temperature == 0.0:
        return int(np.argmax(logits))
    x = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < x.size:
        cut = np.partition(x, -params.top_k)[-params.top_k]
        x = np.where(x >= cut, x, -np.inf)
    order = np.argsort(-x, kind="stable")
    p = np.exp(x[order] - x[order[0]])
    p /= p.sum()
    if params.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), params.top_p, side="left")) + 1
        p = p[:keep] / p[:keep].sum()
        order = order[:keep]
    return int(order[rng.choice(p.size, p=p)])
