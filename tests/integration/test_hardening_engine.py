"""What a crafted request can make the engine do, in process: images are budgeted from their headers
before a pixel is decoded, a caller that gives up stops its images' preparation, a client's grammar
is compiled once per request on the grammar workers (never on the loop thread), and log-probabilities
under a grammar are finite."""

from __future__ import annotations

import io
import json
import math
import random
import threading
import time

import pytest
from conftest import hold_encoder, image_message, random_image

from autoglm_trt.errors import RequestError
from autoglm_trt.runtime import Engine, Guide, SamplingParams
from autoglm_trt.runtime.guided import Grammars, GuideError
from autoglm_trt.runtime.images import Cancelled


def one_bit_png(width: int, height: int) -> bytes:
    """A black one-bit PNG: a few KB that decode to width x height pixels (x 3 bytes as RGB)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (width, height)).save(buf, "PNG")
    return buf.getvalue()


def chat_with_images(*images: bytes) -> list[dict]:
    import base64

    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(i).decode()}}
             for i in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "Where do I tap?"}]}]


@pytest.fixture
def decodes(monkeypatch):
    """How many times Pillow decoded an image's pixels."""
    from PIL import ImageFile

    count = [0]
    real = ImageFile.ImageFile.load

    def load(self):
        count[0] += 1
        return real(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    return count


def test_images_too_many_tokens_are_refused_before_a_pixel_is_decoded(glm4v_engine, decodes):
    """Ten 8000 x 8000 one-bit PNGs, some 100 KB: each becomes as many image tokens as its header's
    size gives, which overflows the prompt, so nothing is decoded (before: all ten were, 9.6 s and
    2 GB of RSS, and then the request was refused for its length)."""
    bomb = one_bit_png(8000, 8000)
    with Engine.load(glm4v_engine) as engine:
        t0 = time.perf_counter()
        with pytest.raises(RequestError, match="prompt has .* tokens"):
            engine.prepare(chat_with_images(*[bomb] * 10))
        print(f"refused in {time.perf_counter() - t0:.3f} s")
    assert decodes[0] == 0


def test_a_requests_pixels_are_bounded_in_all_before_decoding(glm4v_engine, decodes):
    bomb = one_bit_png(7000, 7000)  # 49 Mpx each, under the per-image 64 Mpx; three are 147 Mpx
    with Engine.load(glm4v_engine) as engine:
        with pytest.raises(RequestError, match="147,000,000 pixels in all; at most 128,000,000"):
            engine.prepare(chat_with_images(bomb, bomb, bomb))
    assert decodes[0] == 0


def test_a_caller_that_gives_up_stops_its_images_preparation(glm4v_engine):
    """One request holds the encoder; a second waits for it. Its caller gives up: the second stops
    waiting at once with ``Cancelled`` (before: it waited and was encoded for nobody)."""
    release, cancel = threading.Event(), threading.Event()
    with Engine.load(glm4v_engine) as engine:
        hold_encoder(engine, release)
        first = threading.Thread(target=engine.prepare, args=(image_message("a ", random_image(64, 96, 1)),))
        first.start()
        deadline = time.monotonic() + 30
        while not engine.images._encoding.locked() and time.monotonic() < deadline:  # the first is in the encoder
            time.sleep(0.01)
        outcome: list = []

        def second() -> None:
            try:
                engine.prepare(image_message("b ", random_image(64, 96, 2)), cancel=cancel)
                outcome.append("prepared")
            except Cancelled as exc:
                outcome.append(exc)

        waiting = threading.Thread(target=second)
        try:
            waiting.start()
            deadline = time.monotonic() + 30
            while engine.stats()["images_preparing"] < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            cancel.set()
            waiting.join(10)
            assert not waiting.is_alive() and isinstance(outcome[0], Cancelled)
            assert engine.stats()["images_preparing"] == 1  # the first still waits for the encoder
        finally:
            release.set()
            first.join(60)
        assert engine.stats()["images_preparing"] == 0


def test_a_huge_grammar_is_compiled_once_and_never_on_the_loop(glm4v_engine, monkeypatch):
    """An 18,000-word enum (a 240 KB JSON schema, near the longest guide taken) with n = 32 samples beside a
    plain stream: the
    grammar is compiled once, on a grammar worker, and each sample copies the request's matcher; the
    loop thread never holds its lock for long, so the stream's tokens keep coming (before: 32
    matchers were built on the loop thread, some 0.15 s each, and the stream stalled for seconds)."""
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghij") for _ in range(rng.randrange(5, 15))) for _ in range(18_000)]
    guide = Guide.json_schema({"type": "object", "properties": {"w": {"enum": words}}, "required": ["w"]})
    compiled = []
    real = Grammars._compile
    monkeypatch.setattr(Grammars, "_compile", lambda self, g: compiled.append(threading.current_thread().name)
                        or real(self, g))
    with Engine.load(glm4v_engine) as engine:
        gaps: list[float] = []

        def stream() -> None:
            last = time.perf_counter()
            for _ in engine.stream("count", SamplingParams(max_new_tokens=150, ignore_eos=True)):
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        plain = threading.Thread(target=stream)
        plain.start()
        try:
            engine.generate([[{"role": "user", "content": "Pick."}]],
                            SamplingParams(max_new_tokens=40, temperature=1.0, seed=1, n=32, guide=guide))
        except GuideError as exc:  # the lexer may hit llguidance's limits inside the string: the client's grammar
            assert "<state>" not in str(exc)
        plain.join(120)
        hold = engine.stats()["longest_hold_s"]
    print(f"longest hold {hold * 1000:.1f} ms, longest gap {max(gaps[1:]) * 1000:.1f} ms")
    assert compiled and all(name.startswith("autoglm-grammar") for name in compiled) and len(compiled) == 1
    assert hold < 1.0 and max(gaps[1:]) < 1.0


def test_grammars_over_llguidance_limits_fail_as_the_clients_guide(glm4v_engine):
    """A guide llguidance cannot compile is refused before the queue; one that compiles but passes one
    of its limits while generating (2,500 alternatives in a row) ends its request with a ``GuideError``
    (the server's 400), its message without the parser's state (before: a 500 with the state)."""
    alternatives = Guide.lark("start: " + " | ".join(f'"w{k}"' for k in range(2_500)))
    with Engine.load(glm4v_engine) as engine:
        with pytest.raises(GuideError) as failed:
            engine.generate("x", SamplingParams(max_new_tokens=8, guide=alternatives))
        assert "max is 2000" in str(failed.value) and "<state>" not in str(failed.value)
        with pytest.raises(RequestError, match="guide is not usable"):
            engine.submit("x", SamplingParams(max_new_tokens=4, guide=Guide.lark("start: nothing_defined")))
        assert engine.stats()["waiting"] == engine.stats()["running"] == 0


def test_logprobs_under_a_grammar_are_finite(glm4v_engine):
    """The alternatives a grammar masks out were -inf: a 500 for a JSON body, -Infinity in a stream.
    They could not have been sampled, so they are left out; every value is finite."""
    with Engine.load(glm4v_engine) as engine:
        [res] = engine.generate([[{"role": "user", "content": "Pick."}]], SamplingParams(
            max_new_tokens=8, guide=Guide.choice(["Tap", "Swipe"]), logprobs=10, n=3, temperature=1.0, seed=2))
    entries = [e for c in res.choices for e in c.logprobs]
    assert entries and all(math.isfinite(e.logprob) and all(math.isfinite(v) for _, v in e.top) for e in entries)
    assert any(len(e.top) < 10 for e in entries)  # the grammar allowed fewer than ten tokens somewhere
    json.dumps([[e.logprob, e.top] for e in entries], allow_nan=False)
