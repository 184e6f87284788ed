"""Stop strings on a growing text: the same cuts and held-back ends as a plain search of the whole
text, at a cost per new character that does not grow with the text or the stop strings' length."""

from __future__ import annotations

import random
import sys

import pytest

from autoglm_trt.runtime.request import Request
from autoglm_trt.runtime.sampling import SamplingParams
from autoglm_trt.runtime.sequence import Sequence


def request(stops: tuple[str, ...]) -> Request:
    return Request(Sequence([1], SamplingParams(stop=stops)), None, True, None)


def reference(pieces: list[str], stops: tuple[str, ...]) -> tuple[str, bool, list[str]]:
    """A plain search after each piece: the text (cut at the earliest stop string), whether one was
    found, and what a stream has sent after each piece (everything but an end that may begin one)."""
    text, sent = "", []
    for piece in pieces:
        before = len(text)
        text += piece
        hits = [k for k in (text.find(s, max(0, before - len(s) + 1)) for s in stops) if k >= 0]
        if hits:
            return text[: min(hits)], True, sent
        held = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        sent.append(text[: len(text) - held])
    return text, False, sent


def sent_after_each(req: Request, pieces: list[str]) -> tuple[str, bool, list[str]]:
    got = []
    for piece in pieces:
        if req.add_text(piece) == "stop":
            return req.text, True, got
        got.append(req.text[: req.sent])
    return req.text, False, got


@pytest.mark.parametrize("seed", range(20))
def test_cuts_and_held_ends_equal_a_plain_search(seed):
    rng = random.Random(seed)
    alphabet = "ab" if seed % 2 else "abc"
    stops = tuple("".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 7))) for _ in range(rng.randrange(1, 5)))
    text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 80)))
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 20)))) if len(text) > 1 else []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert sent_after_each(request(stops), pieces) == reference(pieces, stops)


def test_overlapping_and_self_similar_stop_strings():
    assert sent_after_each(request(("aab",)), ["a", "a", "a", "a", "b", "c"]) == ("aa", True, ["", "", "a", "aa"])
    assert sent_after_each(request(("abcd", "c")), ["ab", "cd"]) == ("", True, [""])  # "abcd" starts first
    assert sent_after_each(request(("abcd", "bc")), ["abcd"]) == ("", True, [])  # the earliest start wins
    assert sent_after_each(request(("xyz",)), ["xyxyx", "y", "q"]) == ("xyxyxyq", False, ["xyxy", "xyxy", "xyxyxyq"])


def test_each_token_costs_the_same_however_long_the_stop_strings():
    """16 stop strings of 1,024 characters and a text whose end begins each of them by one character:
    the lines of Python run per generated piece stay within a bound that does not grow with the stop
    strings' length or the text's (trying every prefix of every stop string against the text's end
    ran some 2,000 lines per piece and stop string, each copying a prefix)."""
    stops = tuple("a" * 1023 + chr(ord("b") + k) for k in range(16))
    req = request(stops)
    lines = 0

    def count(frame, event, arg):
        nonlocal lines
        if event == "line":
            lines += 1
        return count

    pieces = ["xa"] * 300
    sys.settrace(count)
    try:
        for piece in pieces:
            assert req.add_text(piece) is None
    finally:
        sys.settrace(None)
    assert req.sent == len(req.text) - 1  # the last "a" may begin a stop string
    per_piece_per_stop = lines / len(pieces) / len(stops)
    assert per_piece_per_stop < 40, per_piece_per_stop
