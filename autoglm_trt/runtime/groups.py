"""Requests that run several sequences over one prompt: parallel samples and beam search.

Both start as one sequence whose prompt is prefilled once.

Parallel samples (``SamplingParams(n=...)``): when the prompt's logits arrive, the sequence
forks n - 1 children (``Scheduler.fork``: every block shared, the partly filled last one
copied by the first sample that writes to it). Each child is a request of its own (its
decoder, stop strings, random stream k of the seed) and samples its first token from the same
logits; the first request's result gathers the others'.

Beam search (``SamplingParams(beam_width=...)``): the group keeps its running beams as
sequences, in the order of ``BeamSearch.beams``. Each beam's logits are held until every beam
has reported (a beam that is done waits idle, and the scheduler does not run it); then
``BeamSearch.step`` picks the continuations. A beam picked once continues in place; picked
again, it is forked first (its blocks shared); a beam not picked is freed. Beams therefore
share the blocks of their common past and their KV is never copied except the one partly
filled block a fork writes into.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .beam import BeamSearch, Hypothesis
from .scheduler import Scheduler
from .sequence import Sequence

PRUNED = "pruned"  # the finish reason of a beam the search dropped (never reported)


class BeamGroup:
    def __init__(self, root: Sequence, eos_ids: list[int]):
        p = root.params
        self.search = BeamSearch(p.beam_width, eos_ids, p.max_new_tokens, p.length_penalty, p.early_stopping)
        self.seqs = [root]
        self.logits: dict[int, np.ndarray] = {}
        self.reason: str | None = None  # why the search ended early ("timeout", "cancelled", "error")

    def report(self, seq: Sequence, logits: np.ndarray) -> bool:
        """Hold a copy of a beam's logits (the runner's next step may overwrite them); True when
        every running beam has reported."""
        self.logits[seq.seq_id] = logits.copy()
        return all(s.seq_id in self.logits for s in self.seqs)

    def advance(self, scheduler: Scheduler, on_fork: Callable[[Sequence], None]) -> list[Sequence]:
        """Run one search step over the held logits; return the beams that left the group."""
        picks = self.search.step([self.logits[s.seq_id] for s in self.seqs])
        self.logits.clear()
        kept = {b for b, _ in picks}
        dropped = [s for i, s in enumerate(self.seqs) if i not in kept]
        for seq in dropped:  # first, so that their running slots are free for the forks
            scheduler.finish(seq, PRUNED)
        plan: list[tuple[Sequence, int]] = []
        seen: set[int] = set()
        for b, token in picks:
            parent = self.seqs[b]
            if b in seen:
                child = scheduler.fork(parent)  # before any token is appended to the parent
                on_fork(child)
                plan.append((child, token))
            else:
                seen.add(b)
                plan.append((parent, token))
        for seq, token in plan:
            seq.output_ids.append(token)
        self.seqs = [seq for seq, _ in plan]
        return dropped

    @property
    def done(self) -> bool:
        return self.search.done

    def results(self, n: int) -> list[Hypothesis]:
        return self.search.best(n)


def fork_samples(scheduler: Scheduler, seq: Sequence, n: int) -> list[Sequence]:
    """The n - 1 further samples of a request, forked from its sequence, random streams 1..n-1."""
    return [scheduler.fork(seq, stream=k) for k in range(1, n)]
