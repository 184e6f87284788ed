"""The engine's table of unfinished requests, and how a request ends (under the engine's lock).

A request is registered under the id of each sequence it runs (one, or each of its beams),
so a step's sequences lead back to their requests. Ending a request frees its sequences'
blocks in the scheduler, drops its ids, ends its stream and wakes its caller, exactly once.
"""

from __future__ import annotations

from .request import Request
from .scheduler import Scheduler
from .sequence import Sequence


class Registry:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self._by_seq: dict[int, Request] = {}

    def add(self, seq: Sequence, req: Request) -> None:
        self._by_seq[seq.seq_id] = req

    def get(self, seq: Sequence) -> Request | None:
        return self._by_seq.get(seq.seq_id)

    def drop(self, seq: Sequence) -> None:
        self._by_seq.pop(seq.seq_id, None)

    def live(self) -> list[Request]:
        """Every unfinished request once."""
        return list({id(r): r for r in self._by_seq.values()}.values())

    def end(self, req: Request, reason: str) -> None:
        """End a request for ``reason`` (its decoder flushed, held-back text sent)."""
        reason = req.finish_text(reason)
        self._close(req, reason)

    def cancel(self, req: Request) -> None:
        """End a request and its further samples with finish reason "cancelled" (no more text)."""
        for r in [req, *req.children]:
            if not r.done.is_set():
                self._close(r, "cancelled")

    def fail(self, req: Request, exc: BaseException) -> None:
        req.error = exc
        self._close(req, "error")

    def fail_seq(self, seq: Sequence, exc: BaseException) -> None:
        """A sequence's step failed: end it, and fail its request."""
        self.scheduler.finish(seq, "error")
        req = self.get(seq)
        if req is not None:
            self.fail(req, exc)

    def _close(self, req: Request, reason: str) -> None:
        if req.beam is not None:
            req.beam.reason = reason
        for seq in req.sequences():
            self.scheduler.finish(seq, reason)
        for seq in [req.seq, *req.sequences()]:
            self.drop(seq)
        if req.pieces is not None:
            req.pieces.put(None)
        req.done.set()
