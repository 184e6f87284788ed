"""Continuous batching over a paged KV cache (one scheduler; the engine's loop thread calls it).

Vocabulary as in vLLM: a sequence has ``num_computed_tokens`` in the pool and a
``block_table``; a step gives some sequences ``num_new_tokens`` each. The scheduler asks the
``BlockAllocator`` for blocks; when it says no, the scheduler decides: a waiting sequence
stays waiting, a running one may be preempted (its blocks freed, its tokens recomputed later
by a prefill of prompt + output so far). Nobody else touches block ids.

Each step is one of:
* prefill: sequences with more than one token to compute (new, or recomputing after
  preemption), chunks of at most ``max_input_len`` tokens, as many as the batch and the
  padded-token budget allow;
* decode: every running sequence with exactly its last sampled token to compute.
Prefill goes first, so a new request waits at most one step to start.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..paged_kv import BlockAllocator, SeqState, blocks_needed
from .sampling import SamplingParams

_ids = itertools.count()


@dataclass
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    cache: SeqState = field(default_factory=SeqState)
    finish_reason: str | None = None
    preemptions: int = 0

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.cache.num_computed_tokens

    def pending_ids(self, limit: int) -> list[int]:
        start = self.cache.num_computed_tokens
        ids = self.prompt_ids + self.output_ids
        return ids[start : start + min(limit, self.num_pending)]


@dataclass
class Step:
    seqs: list[Sequence]
    new_tokens: list[list[int]]
    prefill: bool

    def completes(self, i: int) -> bool:
        """Whether sequence i's tokens are all computed after this step (then it samples)."""
        s = self.seqs[i]
        return s.cache.num_computed_tokens + len(self.new_tokens[i]) == s.num_tokens


class Scheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_batch: int, max_input_len: int,
                 max_prefill_tokens: int = 4096):
        self.allocator, self.block_size = allocator, block_size
        self.max_batch, self.max_input_len = max_batch, max_input_len
        self.max_prefill_tokens = max(max_prefill_tokens, max_input_len)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- blocks ----------------------------------------------------------------
    def _grow(self, seq: Sequence, num_new: int) -> bool:
        need = blocks_needed(seq.cache.num_computed_tokens + num_new, self.block_size) - len(seq.cache.block_table)
        if need <= 0:
            return True
        got = self.allocator.allocate(need)
        if got is None:
            return False
        seq.cache.block_table += got
        return True

    def free(self, seq: Sequence) -> None:
        self.allocator.release(seq.cache.block_table)
        seq.cache = SeqState()

    def _preempt(self, seq: Sequence) -> None:
        self.free(seq)
        self.running.remove(seq)
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    # -- steps -----------------------------------------------------------------
    def schedule(self) -> Step | None:
        return self._schedule_prefill() or self._schedule_decode()

    def _schedule_prefill(self) -> Step | None:
        seqs: list[Sequence] = []
        chunks: list[list[int]] = []
        longest = 0

        def fits(n: int) -> bool:
            return len(seqs) < self.max_batch and max(longest, n) * (len(seqs) + 1) <= self.max_prefill_tokens

        for seq in [s for s in self.running if s.num_pending > 1]:  # continuing chunked prefills
            n = min(seq.num_pending, self.max_input_len)
            if not fits(n) or not self._grow(seq, n):
                break
            seqs.append(seq)
            chunks.append(seq.pending_ids(n))
            longest = max(longest, n)
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            n = min(seq.num_pending, self.max_input_len)
            need = blocks_needed(n, self.block_size)
            # keep one free block per running sequence so that admitting does not force a preemption
            if not fits(n) or need > self.allocator.num_free - len(self.running):
                break
            self.waiting.popleft()
            assert self._grow(seq, n)
            self.running.append(seq)
            seqs.append(seq)
            chunks.append(seq.pending_ids(n))
            longest = max(longest, n)
        return Step(seqs, chunks, prefill=True) if seqs else None

    def _schedule_decode(self) -> Step | None:
        batch = [s for s in self.running if s.num_pending == 1]
        ready: list[Sequence] = []
        for seq in sorted(batch, key=lambda s: s.seq_id):  # the oldest keep their blocks
            while seq in self.running and not self._grow(seq, 1):
                victim = max(self.running, key=lambda s: s.seq_id)  # the newest gives way (maybe seq itself)
                self._preempt(victim)
                if victim in ready:
                    ready.remove(victim)
            if seq in self.running:
                ready.append(seq)
        if not ready:
            return None
        return Step(ready, [s.pending_ids(1) for s in ready], prefill=False)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        self.free(seq)

    def cancel(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.finish(seq, "cancelled")
