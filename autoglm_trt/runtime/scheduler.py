"""Continuous batching over a paged KV cache (one scheduler; the engine's loop thread calls it).

Policy only: who is admitted, who runs in a step, who is preempted. The scheduler asks the
``KVCacheManager`` for blocks; when it says no, the scheduler decides: a waiting sequence
stays waiting, a running one may be preempted (its blocks freed, its tokens recomputed later
by a prefill of prompt + output so far).

Each step is one of:
* prefill: sequences with more than one token to compute (new, or recomputing after
  preemption), chunks of at most ``max_input_len`` tokens, as many as the batch and the
  padded-token budget allow;
* decode: every running sequence with exactly its last sampled token to compute.
Prefill goes first, so a new request waits at most one step to start.

Admission takes the blocks of a sequence's whole prompt at once (its chunks then need no
more), so only decode growth can run out of blocks. Progress: whenever a running sequence
needs a block that is not free, the running sequence of the worst priority after aging, the
newest among equals, is preempted (which may be itself) until the block is found. The best-ranked
running sequence therefore always gets its blocks (a request larger than the whole pool is refused
before it is queued), so while there is work, ``schedule`` returns a step.

Priorities: a request's ``priority`` (lower runs first, 0 by default) orders admission, then
arrival; a waiting request gains one level per ``aging_s`` seconds so that low priorities
do not starve under a steady high-priority load.

Prefix caching and copy-on-write are the manager's (``kv_cache_manager.py``): a waiting
sequence shares the longest cached prefix of its tokens; a step carries the block ``copies``
the runner makes before it runs.

Forks (parallel samples, beams): ``fork`` gives a new sequence the parent's tokens and one
more reference to each of its blocks. A sequence whose tokens are all
computed and which waits for something else (a beam waiting for its siblings' logits) is
"idle": it is never scheduled, and when nothing else can run an idle one is preempted
("parked": admitted again only after the other waiting sequences, and parked ones in the
order they were parked, so that it cannot keep out the one it waits for).
"""

from __future__ import annotations

import itertools
import time

from .kv_cache_manager import KVCacheManager
from .sequence import Sequence, Step

AGING_S = 10.0  # a waiting request gains one priority level per this many seconds
__all__ = ["Scheduler", "Sequence", "Step"]


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_batch: int, max_input_len: int, max_prefill_tokens: int = 4096,
                 aging_s: float = AGING_S):
        self.kv, self.block_size = kv, kv.block_size
        self.allocator = kv.pool  # for inspection (tests, stats); only the manager changes it
        self.aging_s = aging_s
        self.max_batch, self.max_input_len = max_batch, max_input_len
        self.max_prefill_tokens = max(max_prefill_tokens, max_input_len)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.preemptions = 0
        self._ids = itertools.count()
        self._parks = itertools.count(1)

    def add(self, seq: Sequence) -> None:
        seq.seq_id = next(self._ids)
        seq.arrival = time.monotonic()
        self.waiting.append(seq)

    def _aged(self, seq: Sequence, now: float) -> int:
        """A sequence's priority after aging: one level better per ``aging_s`` since it arrived."""
        return seq.priority - int((now - seq.arrival) / self.aging_s)

    def _next_waiting(self) -> Sequence:
        """The waiting sequence to admit next: best priority after aging, then the oldest."""
        now = time.monotonic()
        return min(self.waiting, key=lambda s: (s.parked, self._aged(s, now), s.seq_id))

    def _rank(self, seq: Sequence) -> tuple[int, int]:
        """Who keeps blocks under pressure: smaller ranks first (a victim is the largest), by the
        priority after aging, as admission orders them (else a request admitted by aging would be the
        first preempted again)."""
        return self._aged(seq, time.monotonic()), seq.seq_id

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- blocks ----------------------------------------------------------------
    def fork(self, parent: Sequence, stream: int = 0) -> Sequence:
        """A new sequence with the parent's tokens, parameters and arrival, sharing its blocks, drawing from
        random stream ``stream``; without a free running slot it waits with no blocks (and recomputes its
        tokens when admitted)."""
        child = Sequence(list(parent.prompt_ids), parent.params, output_ids=list(parent.output_ids),
                         arrival=parent.arrival, stream=stream, block_extras=parent.block_extras,
                         mrope=parent.mrope, images=parent.images)
        child.seq_id = next(self._ids)
        if parent.guided is not None:  # its own place in the request's grammar, copied
            child.guided = parent.guided.fork()
        if parent in self.running and len(self.running) < self.max_batch:
            self.kv.fork(parent, child)
            self.running.append(child)
        else:
            self.waiting.append(child)
        return child

    def _reserve(self, seq: Sequence, num_new: int, planned: dict[int, tuple[Sequence, list[int]]]) -> bool:
        """Blocks for ``num_new`` more tokens of a running sequence, preempting the newest running
        sequences (perhaps ``seq`` itself) until they are found; False if ``seq`` was preempted.
        A preempted sequence leaves this step's plan too."""
        while not self.kv.allocate_slots(seq, num_new):
            victim = max(self.running, key=self._rank)
            self._preempt(victim)
            planned.pop(victim.seq_id, None)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        self.running.remove(seq)
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.append(seq)  # its old arrival and id put it ahead of newer requests of its priority

    def computed(self, seq: Sequence, n: int) -> None:
        """The step computed ``n`` more tokens of ``seq``: count them and cache the blocks they filled."""
        seq.cache.num_computed_tokens += n
        self.kv.cache_full_blocks(seq)

    # -- steps -----------------------------------------------------------------
    def schedule(self) -> Step | None:
        """The next step, or None when nothing can run."""
        step = self._schedule_prefill() or self._schedule_decode()
        while step is None and self.waiting and (idle := [s for s in self.running if s.num_pending == 0]):
            victim = max(idle, key=self._rank)  # idle sequences must not keep the waiting out
            self._preempt(victim)
            victim.parked = next(self._parks)
            step = self._schedule_prefill() or self._schedule_decode()
        copies = self.kv.take_copies()
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
            if not fits(min(seq.num_pending, self.max_input_len)) or not self.kv.admit(seq, len(self.running)):
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
        self.kv.free(seq)

    def cancel(self, seq: Sequence) -> None:
        self.finish(seq, "cancelled")
