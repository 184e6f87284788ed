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

Admission takes the blocks of a sequence's whole prompt at once (its chunks then need no
more), so only decode growth can run out of blocks. Progress: whenever a running sequence
needs a block that is not free, the newest running sequence is preempted (which may be
itself) until the block is found. The oldest running
sequence therefore always gets its blocks (a request larger than the whole pool is refused
before it is queued), so while there is work, ``schedule`` returns a step.

Priorities: a request's ``priority`` (lower runs first, 0 by default) orders admission, then
arrival; a waiting request gains one level per ``aging_s`` seconds so that low priorities
do not starve under a steady high-priority load.

Prefix caching (with a ``BlockPool`` whose ``caching`` is on): a waiting sequence shares the
longest run of cached full blocks that starts its tokens and computes only the rest (at least
its last token, so that there are logits to sample); as its blocks fill they are named by
their chained hashes, and blocks it frees stay cached (evictable) until the pool needs them.
Blocks shared by prefix caching are full and wholly computed, so no sequence writes to one.

Forks (parallel samples, beams): ``fork`` gives a new sequence the parent's tokens and one
more reference to each of its blocks. The last block may be partly filled; the first of them
to write into it while it is shared gets a fresh block and a copy of it (copy-on-write: the
step carries the ``copies`` the runner makes before it runs). A sequence whose tokens are all
computed and which waits for something else (a beam waiting for its siblings' logits) is
"idle": it is never scheduled, and when nothing else can run an idle one is preempted
("parked": admitted again only after the other waiting sequences, and parked ones in the
order they were parked, so that it cannot keep out the one it waits for).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from ..graph.paged_kv import BlockAllocator, SeqState, blocks_needed
from .block_pool import BlockPool, chained_hashes
from .sampling import SamplingParams

AGING_S = 10.0  # a waiting request gains one priority level per this many seconds


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

    def __post_init__(self) -> None:
        seed = self.params.seed
        self.rng = np.random.default_rng(seed if seed is None or self.stream == 0 else [seed, self.stream])

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.cache.num_computed_tokens

    @property
    def priority(self) -> int:
        return self.params.priority

    def pending_ids(self, limit: int) -> list[int]:
        start = self.cache.num_computed_tokens
        ids = self.prompt_ids + self.output_ids
        return ids[start : start + min(limit, self.num_pending)]


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


class Scheduler:
    def __init__(self, allocator: BlockAllocator | BlockPool, block_size: int, max_batch: int, max_input_len: int,
                 max_prefill_tokens: int = 4096, aging_s: float = AGING_S):
        self.allocator, self.block_size = allocator, block_size
        self.caching = isinstance(allocator, BlockPool) and allocator.caching
        self.aging_s = aging_s
        self.max_batch, self.max_input_len = max_batch, max_input_len
        self.max_prefill_tokens = max(max_prefill_tokens, max_input_len)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.preemptions = 0
        self._ids = itertools.count()
        self._parks = itertools.count(1)
        self._copies: list[tuple[int, int]] = []

    def add(self, seq: Sequence) -> None:
        seq.seq_id = next(self._ids)
        seq.arrival = time.monotonic()
        self.waiting.append(seq)

    def _next_waiting(self) -> Sequence:
        """The waiting sequence to admit next: best priority after aging, then the oldest."""
        now = time.monotonic()
        return min(self.waiting,
                   key=lambda s: (s.parked, s.priority - int((now - s.arrival) / self.aging_s), s.seq_id))

    @staticmethod
    def _rank(seq: Sequence) -> tuple[int, int]:
        """Who keeps blocks under pressure: smaller ranks first (a victim is the largest)."""
        return seq.priority, seq.seq_id

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- blocks ----------------------------------------------------------------
    def _grow(self, seq: Sequence, num_new: int) -> bool:
        """Blocks for ``num_new`` more tokens, and a private copy of a shared block they would write to."""
        table = seq.cache.block_table
        first = seq.cache.num_computed_tokens // self.block_size  # the block the next token goes into
        shared = isinstance(self.allocator, BlockPool) and first < len(table) and self.allocator.ref_cnt[table[first]] > 1
        need = blocks_needed(seq.cache.num_computed_tokens + num_new, self.block_size) - len(table) + shared
        if need <= 0:
            return True
        got = self.allocator.allocate(need)
        if got is None:
            return False
        if shared:
            fresh = got.pop(0)
            self._copies.append((table[first], fresh))
            self.allocator.release([table[first]])
            table[first] = fresh
        table += got
        return True

    def fork(self, parent: Sequence, stream: int = 0) -> Sequence:
        """A new sequence with the parent's tokens, parameters and arrival, sharing its blocks, drawing from
        random stream ``stream``; without a free running slot it waits with no blocks (and recomputes its
        tokens when admitted)."""
        child = Sequence(list(parent.prompt_ids), parent.params, output_ids=list(parent.output_ids),
                         arrival=parent.arrival, stream=stream)
        child.seq_id = next(self._ids)
        if parent in self.running and len(self.running) < self.max_batch and isinstance(self.allocator, BlockPool):
            self.allocator.take(parent.cache.block_table)
            child.cache = SeqState(parent.cache.num_computed_tokens, list(parent.cache.block_table))
            child.block_hashes = list(parent.block_hashes)
            self.running.append(child)
        else:
            self.waiting.append(child)
        return child

    def _reserve(self, seq: Sequence, num_new: int, planned: dict[int, tuple[Sequence, list[int]]]) -> bool:
        """Blocks for ``num_new`` more tokens of a running sequence, preempting the newest running
        sequences (perhaps ``seq`` itself) until they are found; False if ``seq`` was preempted.
        A preempted sequence leaves this step's plan too."""
        while not self._grow(seq, num_new):
            victim = max(self.running, key=self._rank)
            self._preempt(victim)
            planned.pop(victim.seq_id, None)
            if victim is seq:
                return False
        return True

    def free(self, seq: Sequence) -> None:
        self.allocator.release(seq.cache.block_table)
        seq.cache = SeqState()
        seq.block_hashes = []

    def _preempt(self, seq: Sequence) -> None:
        self.free(seq)
        self.running.remove(seq)
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.append(seq)  # its old arrival and id put it ahead of newer requests of its priority

    def computed(self, seq: Sequence, n: int) -> None:
        """The step computed ``n`` more tokens of ``seq``: count them and cache the blocks they filled."""
        seq.cache.num_computed_tokens += n
        full = seq.cache.num_computed_tokens // self.block_size
        if self.caching and full > len(seq.block_hashes):
            tokens = (seq.prompt_ids + seq.output_ids)[: full * self.block_size]
            start = len(seq.block_hashes)
            seq.block_hashes = chained_hashes(tokens, self.block_size, seq.block_hashes)
            assert isinstance(self.allocator, BlockPool)
            for b in range(start, full):
                self.allocator.cache_block(seq.cache.block_table[b], seq.block_hashes[b])

    def _admit(self, seq: Sequence) -> bool:
        """Blocks for a waiting sequence's whole prompt, sharing its longest cached prefix; False if
        they would not leave one free block per running sequence."""
        hits: list[int] = []
        hashes: list[bytes] = []
        revived = 0
        if self.caching:
            assert isinstance(self.allocator, BlockPool)
            tokens = seq.prompt_ids + seq.output_ids
            # its tokens only grow, so the chain computed while it waited is extended, not redone
            hashes = seq.token_hashes = chained_hashes(tokens, self.block_size, seq.token_hashes)
            hits = self.allocator.lookup(hashes)
            if len(hits) * self.block_size >= len(tokens):  # keep the last token to compute
                hits = hits[:-1]
            revived = sum(1 for b in hits if self.allocator.ref_cnt[b] == 0)
        need = blocks_needed(seq.num_tokens, self.block_size) - len(hits)
        if need + revived > self.allocator.num_free - len(self.running):
            return False
        if self.caching:
            assert isinstance(self.allocator, BlockPool)
            self.allocator.take(hits)
            self.allocator.queried_tokens += seq.num_tokens
            self.allocator.hit_tokens += len(hits) * self.block_size
            seq.cache = SeqState(len(hits) * self.block_size, list(hits))
            seq.block_hashes = hashes[: len(hits)]
        if not self._grow(seq, seq.num_pending):  # cannot happen: the blocks were counted free above
            raise RuntimeError("block allocator refused blocks it reported free")
        return True

    # -- steps -----------------------------------------------------------------
    def schedule(self) -> Step | None:
        """The next step, or None when nothing can run."""
        step = self._schedule_prefill() or self._schedule_decode()
        while step is None and self.waiting and (idle := [s for s in self.running if s.num_pending == 0]):
            victim = max(idle, key=self._rank)  # idle sequences must not keep the waiting out
            self._preempt(victim)
            victim.parked = next(self._parks)
            step = self._schedule_prefill() or self._schedule_decode()
        copies, self._copies = self._copies, []
        if step is not None:
            step.copies = copies
        return step

    def _schedule_prefill(self) -> Step | None:
        planned: dict[int, tuple[Sequence, list[int]]] = {}

        def fits(n: int) -> bool:
            longest = max((len(c) for _, c in planned.values()), default=0)
            return len(planned) < self.max_batch and max(longest, n) * (len(planned) + 1) <= self.max_prefill_tokens

        continuing = sorted((s for s in self.running if s.num_pending > 1), key=self._rank)
        for seq in continuing:  # chunked prefills under way, oldest first
            if seq not in self.running:  # preempted for an older one in this loop
                continue
            n = min(seq.num_pending, self.max_input_len)
            if not fits(n):
                break
            if self._reserve(seq, n, planned):
                planned[seq.seq_id] = (seq, seq.pending_ids(n))
        while self.waiting and len(self.running) < self.max_batch:
            seq = self._next_waiting()
            if not fits(min(seq.num_pending, self.max_input_len)) or not self._admit(seq):
                break
            self.waiting.remove(seq)
            self.running.append(seq)
            seq.parked = 0
            n = min(seq.num_pending, self.max_input_len)
            planned[seq.seq_id] = (seq, seq.pending_ids(n))
        if not planned:
            return None
        return Step([s for s, _ in planned.values()], [c for _, c in planned.values()], prefill=True)

    def _schedule_decode(self) -> Step | None:
        planned: dict[int, tuple[Sequence, list[int]]] = {}
        for seq in sorted((s for s in self.running if s.num_pending == 1), key=self._rank):
            if seq in self.running and self._reserve(seq, 1, planned):  # the first-ranked keep their blocks
                planned[seq.seq_id] = (seq, seq.pending_ids(1))
        if not planned:
            return None
        return Step([s for s, _ in planned.values()], [c for _, c in planned.values()], prefill=False)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (waiting or running) and free its blocks; a second call does nothing."""
        if seq.finish_reason is not None and seq not in self.running and seq not in self.waiting:
            return
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.free(seq)

    def cancel(self, seq: Sequence) -> None:
        self.finish(seq, "cancelled")
