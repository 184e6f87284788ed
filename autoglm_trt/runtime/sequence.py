"""A sequence's plain state, and one step of the engine (which sequences, which new tokens).

Vocabulary as in vLLM: a sequence has ``num_computed_tokens`` in the pool and a
``block_table`` (its ``cache``); a step gives some sequences ``num_new_tokens`` each. Only
the KV-cache manager changes ``cache`` and the block hashes; the scheduler changes the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..kvcache.step_inputs import MRope, PromptImages, SeqState
from .guided import GuidedState
from .penalties import TokenCounts
from .sampling import SamplingParams


@dataclass
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    seq_id: int = -1  # given by the scheduler that admits it (its arrival order)
    output_ids: list[int] = field(default_factory=list)
    cache: SeqState = field(default_factory=SeqState)
    finish_reason: str | None = None
    preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # of its full, computed, cached blocks
    token_hashes: list[bytes] = field(default_factory=list)  # of every full block of its tokens (kept while waiting)
    arrival: float = 0.0
    stream: int = 0  # which random stream of the request's seed (fork k draws from stream k)
    parked: int = 0  # n > 0: the n-th sequence preempted while idle (admitted after the unparked, in that order)
    block_extras: list[bytes] = field(default_factory=list)  # per prompt block (the partial one too): the images it covers
    mrope: MRope | None = None  # a prompt with images: its 3-D positions (M-RoPE models)
    images: PromptImages | None = None  # and its image tokens' embeddings (kept for a recompute)

    def __post_init__(self) -> None:
        seed = self.params.seed
        self.rng = np.random.default_rng(seed if seed is None or self.stream == 0 else [seed, self.stream])
        self.counts = TokenCounts(self.prompt_ids)  # its generated tokens, for the penalties
        self.guided: GuidedState | None = None  # its place in its grammar (SamplingParams.guide), made with its request
        for token in self.output_ids:
            self.counts.add(token)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.cache.num_computed_tokens

    @property
    def priority(self) -> int:
        return self.params.priority

    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def pending_ids(self, limit: int) -> list[int]:
        start = self.cache.num_computed_tokens
        return self.token_ids()[start : start + min(limit, self.num_pending)]


@dataclass
class Step:
    seqs: list[Sequence]
    new_tokens: list[list[int]]
    prefill: bool
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination) blocks, made first

    def completes(self, i: int) -> bool:
        """Whether sequence i's tokens are all computed after this step (then it samples)."""
        s = self.seqs[i]
        return s.cache.num_computed_tokens + len(self.new_tokens[i]) == s.num_tokens
