"""The server's bound on the image embeddings its requests in flight hold (``serve --max-image-memory``)."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi, uvicorn, prometheus-client) is not installed")

from autoglm_trt.runtime.request import Request  # noqa: E402
from autoglm_trt.serve.image_memory import ImageMemory, Reservation  # noqa: E402
from autoglm_trt.serve.protocol import ApiError  # noqa: E402


def request(children: int = 0) -> Request:
    """An engine request as far as the bound looks at one: whether it and its further samples are done."""
    req = Request.__new__(Request)
    req.done, req.children = threading.Event(), []
    for _ in range(children):
        req.children.append(request())
    return req


def reserved(memory: ImageMemory, n: int) -> Reservation:
    memory.reserve(r := Reservation(), n)
    return r


def test_requests_past_the_bound_get_429_until_the_holders_end():
    memory = ImageMemory(capacity=1000)
    first = reserved(memory, 640)
    a = request(children=1)
    memory.submitted(first, a)  # the request holds them now
    first.ended = True
    assert memory.in_use() == 640
    with pytest.raises(ApiError) as refused:
        reserved(memory, 384)  # past 1,000
    assert refused.value.status == 429 and refused.value.code == "image_memory"
    assert "hold 640 bytes of image embeddings, and this one's 384 would pass" in refused.value.message
    assert refused.value.headers == {"Retry-After": "1"}
    memory.check_room()  # not full: images may be read
    second = reserved(memory, 320)  # fits
    assert memory.in_use() == 960
    memory.submitted(second, None)  # not queued (the engine refused it): lets go at once
    assert memory.in_use() == 640
    failed = reserved(memory, 100)  # its handler failed before submitting: ending it lets go
    assert memory.in_use() == 740
    failed.ended = True
    assert memory.in_use() == 640
    late = Reservation()
    late.ended = True  # the client left; its images' worker reserves after that: nothing stays held
    memory.reserve(late, 200)
    assert memory.in_use() == 640
    a.done.set()  # its further sample still runs: still held
    assert memory.in_use() == 640
    a.children[0].done.set()
    assert memory.in_use() == 0 and memory.held == {}
    third = reserved(memory, 160)
    c = request()
    memory.submitted(third, c)
    gone = weakref.ref(c)
    del a, c
    gc.collect()
    assert gone() is None and memory.in_use() == 0  # held weakly: an ended request's embeddings are not kept


def test_one_request_larger_than_the_bound_is_served_alone():
    memory = ImageMemory(capacity=100)
    big, running = reserved(memory, 1600), request()
    memory.submitted(big, running)
    with pytest.raises(ApiError):
        reserved(memory, 1)
    with pytest.raises(ApiError, match="and more would pass"):  # full: refused before its images are read
        memory.check_room()


def test_image_workers_reserving_at_once_never_pass_the_bound():
    """Reservations come from the image workers' threads: of 16 at once, exactly as many as fit are held."""
    memory = ImageMemory(capacity=450)
    keep = reserved(memory, 50)
    held: list[Reservation] = []
    start = threading.Barrier(16)

    def worker() -> None:
        start.wait()
        try:
            held.append(reserved(memory, 100))
        except ApiError:
            pass

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(held) == 4 and memory.in_use() == 450 and keep is not None


def test_a_failed_reservations_bytes_never_pass_to_the_next_request():
    """A request that reserved and failed before it was queued, then a text request whose reservation
    (holding nothing) may take the freed one's address: the text request is charged nothing. Before,
    entries were kept by ``id`` and the next request at that address took the bytes over."""
    memory = ImageMemory(capacity=10_000)
    requests = []
    for _ in range(20):
        failed = reserved(memory, 5000)
        failed.ended = True  # its handler's finally
        del failed
        text, req = Reservation(), request()
        memory.submitted(text, req)
        requests.append(req)
        assert memory.in_use() == 0


def test_a_reservation_outlived_by_its_preparation_ends_when_that_stops():
    """The client left while its images were prepared: what was reserved stays held until the
    preparation stops (it may still be encoding), then goes."""
    import asyncio

    from autoglm_trt.serve.serving import _stopped

    memory = ImageMemory(capacity=1000)
    r = reserved(memory, 300)
    r.outlived = True
    r.ended = not r.outlived  # the handler returned (a 499)
    assert memory.in_use() == 300

    async def scenario() -> None:
        job = asyncio.get_running_loop().create_future()
        job.add_done_callback(lambda j: _stopped(r, j))
        job.set_exception(RuntimeError("cancelled while its images were prepared"))
        await asyncio.sleep(0)

    asyncio.run(scenario())
    assert r.ended and memory.in_use() == 0
