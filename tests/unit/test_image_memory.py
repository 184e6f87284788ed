"""The server's bound on the image embeddings its requests in flight hold (``serve --max-image-memory``)."""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi, uvicorn, prometheus-client) is not installed")

from autoglm_trt.kvcache.step_inputs import PromptImages  # noqa: E402
from autoglm_trt.runtime.images import PreparedPrompt  # noqa: E402
from autoglm_trt.runtime.request import Request  # noqa: E402
from autoglm_trt.serve.serving import ApiError, ImageMemory  # noqa: E402


def prepared(*tokens: int) -> PreparedPrompt:
    """A prompt with one image of each number of tokens (hidden size 8, float32: 32 bytes a token)."""
    embeds = tuple(np.zeros((t, 8), np.float32) for t in tokens)
    return PreparedPrompt([1, 2, 3], PromptImages(tuple(range(len(tokens))), embeds) if tokens else None)


def request(children: int = 0) -> Request:
    """An engine request as far as the bound looks at one: whether it and its further samples are done."""
    req = Request.__new__(Request)
    req.done, req.children = threading.Event(), []
    for _ in range(children):
        req.children.append(request())
    return req


def test_requests_past_the_bound_get_429_until_the_holders_end():
    memory = ImageMemory(capacity=1000)
    first, second, third, text = prepared(20), prepared(10), prepared(5), prepared()
    memory.admit(first)  # 640 bytes
    a = request(children=1)
    memory.submitted(first, a)
    assert memory.in_use() == 640
    with pytest.raises(ApiError) as refused:
        memory.admit(prepared(12))  # 384 more: past 1,000
    assert refused.value.status == 429 and refused.value.code == "image_memory"
    assert "hold 640 bytes of image embeddings, and this one's 384 would pass" in refused.value.message
    assert refused.value.headers == {"Retry-After": "1"}
    memory.check_room()  # not full: images may be prepared
    memory.admit(second)  # 320: fits
    memory.admit(text)  # no images: holds nothing, never refused
    assert memory.in_use() == 960
    memory.submitted(second, None)  # not queued (the engine refused it): lets go at once
    text_req = request()
    memory.submitted(text, text_req)
    assert memory.in_use() == 640
    a.done.set()  # its further sample still runs: still held
    assert memory.in_use() == 640
    a.children[0].done.set()
    assert memory.in_use() == 0 and memory.held == {}
    memory.admit(third)
    assert memory.in_use() == 160
    c = request()
    memory.submitted(third, c)
    gone = weakref.ref(c)
    del a, c
    gc.collect()
    assert gone() is None and memory.in_use() == 0  # held weakly: an ended request's embeddings are not kept


def test_one_request_larger_than_the_bound_is_served_alone():
    memory = ImageMemory(capacity=100)
    big = prepared(50)  # 1,600 bytes
    memory.admit(big)
    running = request()
    memory.submitted(big, running)
    with pytest.raises(ApiError):
        memory.admit(prepared(1))
    with pytest.raises(ApiError, match="and more would pass"):  # full: refused before images are prepared
        memory.check_room()
