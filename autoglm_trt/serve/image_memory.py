"""The server's bound on the image embeddings its requests in flight hold (``serve --max-image-memory``).

A request's images are encoded before it queues, and its sequence keeps their embeddings (for a
recompute after a preemption) until it ends. Their bytes are reserved from the images' headers,
before any is decoded (``Engine.prepare``'s ``reserve``, on an image worker's thread): a request
past the bound is a 429 before its images cost any work, unless nothing else holds any (one
request always fits). Requests are held weakly, so an ended one's embeddings are not kept alive.
"""

from __future__ import annotations

import os
import threading
import weakref

from ..runtime.request import Request as EngineRequest
from .protocol import ApiError


def default_image_memory() -> int:
    """A quarter of the host's memory (``serve --max-image-memory``'s default)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


class Reservation:
    """One request's image bytes until it is queued: ``ended`` lets go of whatever its request did not
    take over (``ImageMemory.submitted``). Its handler sets it however it ended, unless its images
    are still being prepared (``outlived``: the client left), which then set it when they stop."""

    __slots__ = ("__weakref__", "ended", "outlived")

    def __init__(self) -> None:
        self.ended = self.outlived = False


class ImageMemory:
    """At most ``capacity`` bytes of image embeddings held by reservations and the requests they
    became; thread-safe (an image worker reserves, the event loop hands over)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        # a weak reference to a reservation or a request -> bytes (a reference to an object that is gone
        # equals no other, though a new object may take the old one's id)
        self.held: dict[weakref.ref, int] = {}
        self._lock = threading.Lock()

    def in_use(self) -> int:
        """Bytes held by the reservations and requests not yet ended (those that ended are let go here)."""
        with self._lock:
            return self._used()

    def _used(self) -> int:
        self.held = {owner: n for owner, n in self.held.items() if not _ended(owner)}
        return sum(self.held.values())

    def check_room(self) -> None:
        """Refuse a request with images before they are read when the bound is reached already."""
        used = self.in_use()
        if used and used >= self.capacity:
            self._refuse(used, "more")

    def reserve(self, reservation: Reservation, n: int) -> None:
        """Hold ``n`` bytes for ``reservation``'s images (what the encoder will make of them), or refuse
        them with a 429."""
        with self._lock:
            used = self._used()
            if used and used + n > self.capacity:
                self._refuse(used, f"this one's {n:,}")
            self.held[weakref.ref(reservation)] = n

    def submitted(self, reservation: Reservation, req: EngineRequest | None) -> None:
        """``reservation`` became ``req``, which holds its bytes until it ends (None: it was not
        queued, and lets go of them)."""
        with self._lock:
            n = self.held.pop(weakref.ref(reservation), None)
            if n is not None and req is not None:
                self.held[weakref.ref(req)] = n

    def _refuse(self, used: int, more: str) -> None:
        raise ApiError(429, f"the requests in flight hold {used:,} bytes of image embeddings, and {more} would pass "
                            f"the {self.capacity:,} this server holds (serve --max-image-memory); retry shortly",
                       "rate_limit_error", "image_memory", headers={"Retry-After": "1"})


def _ended(owner: weakref.ref) -> bool:
    """Whether an entry's reservation or request has ended (a request, with its further samples)."""
    held = owner()
    if held is None:
        return True
    if isinstance(held, Reservation):
        return held.ended
    return all(r.done.is_set() for r in [held, *held.children])
