"""Threads with a stack of their own size: llguidance, called on the engine's loop and its grammar
workers, recurses as deep as a client's grammar (a JSON schema's chain of 1,000 ``$ref``s overflowed
a thread's default 8 MiB and killed the process); a large stack is address space, not memory, until
it is used."""

from __future__ import annotations

import threading
from collections.abc import Callable

DEEP_STACK_BYTES = 256 << 20
_creating = threading.Lock()


def start_thread(target: Callable[[], None], name: str, stack_bytes: int = DEEP_STACK_BYTES) -> threading.Thread:
    """A daemon thread running ``target`` on a stack of ``stack_bytes``, started."""
    with _creating:  # the size applies to the threads created while it is set
        previous = threading.stack_size(stack_bytes)
        try:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    return thread
