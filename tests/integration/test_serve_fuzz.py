"""A bounded HTTP fuzz of ``serve``'s API with hypothesis: one real server per engine (the tiny chat
Llama, and the tiny GLM-4.1V with images), some 4,500 generated requests in all.

Most bodies are structurally plausible OpenAI requests (the right field names, values at and past
their edges: huge, negative, fractional and NaN-like numbers, long and exotic Unicode, deep JSON
nesting, guides, tools), the rest raw bytes (truncated JSON, wrong top-level types, wrong media
types) and every method on every route. Every answer is checked:

- no status of 500 or more, no dropped connection (a 413 cut short while the body is still being
  sent is fine), an answer within ``CLIENT_TIMEOUT_S``;
- a refusal (any status but 2xx) is OpenAI's error JSON with ``Content-Type: application/json``;
- a 2xx answer to a completion is strict JSON (no NaN/Infinity) with ``choices``; a stream's events
  are strict JSON and it ends with ``data: [DONE]`` (or an error event).

Meanwhile a thread GETs ``/health`` every 0.2 s: it must answer 200 within ``HEALTH_BOUND_S``, and
the engine's loop may not hold its lock that long in one go (``/metrics``).
Afterwards no request may be running or waiting and no KV block used. Violations are collected
(one example per distinct cause, the shortest body; a 5xx's cause read from the server's log) and
reported together. Runs are reproducible (``derandomize``) and bounded in time: examples, a small
``max_tokens``, a per-request timeout and a time budget per server (examples past it are skipped
and counted).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import io
import json
import os
import re
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest
from conftest import ROOT, free_port, random_image

pytest.importorskip("fastapi", reason="the serve extra (fastapi, uvicorn, prometheus-client) is not installed")
pytest.importorskip("hypothesis", reason="hypothesis is part of the test extra")

from hypothesis import HealthCheck, Phase, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

TEXT_MODEL, IMAGE_MODEL = "tiny-chat", "tiny-glm4v"  # the engine directories' names (conftest)
TEXT_BODY_LIMIT = 1 << 20  # the text server's --max-body-bytes (the image server keeps the default, 8 MiB)
START_S = 90
CLIENT_TIMEOUT_S = 20  # one request (a stream: between two reads)
HEALTH_EVERY_S, HEALTH_BOUND_S = 0.2, 1.0
DRAIN_S = 30  # after the fuzz: until nothing runs, waits or holds KV blocks
TEXT_BUDGET_S, IMAGE_BUDGET_S = 55, 35  # sending stops past these (the examples left are counted as skipped)
EXAMPLES = {"completions": 1400, "chat": 1400, "raw": 200, "paths": 80, "images": 800}
SUPPRESSED = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
              HealthCheck.large_base_example]
ROUTES = ["/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"]
METHODS = ["GET", "PUT", "DELETE", "POST", "PATCH", "OPTIONS"]  # (HEAD's answers carry no body to check)
GENERATING = ("/v1/completions", "/v1/chat/completions")


# -- JSON with raw fragments ----------------------------------------------------------------------
@dataclass(frozen=True)
class Raw:
    """JSON text put into a body as it is: what ``json.dumps`` cannot write (``1e999``, 5,000-digit
    integers, a lone surrogate escape) or would recurse too deep to write (nesting 1,000 deep)."""

    text: str


def encode(body: object, ascii_only: bool = True) -> bytes:
    """The body as JSON bytes (NaN and infinities written as Python writes them: NaN, Infinity)."""
    raws: list[str] = []

    def hold(value: object) -> str:
        if isinstance(value, Raw):
            raws.append(value.text)
            return f"\x00raw{len(raws) - 1}\x00"
        raise TypeError(f"cannot encode {type(value).__name__}")

    text = json.dumps(body, default=hold, ensure_ascii=ascii_only)
    for i, fragment in enumerate(raws):
        text = text.replace(json.dumps(f"\x00raw{i}\x00"), fragment, 1)
    return text.encode("utf-8", "surrogatepass")


def nested(depth: int, kind: str) -> Raw:
    """JSON nested ``depth`` deep (arrays and objects counted alike)."""
    shapes = {"list": ("[", "0", "]"), "object": ('{"a":', "1", "}"),
              "schema": ('{"type":"object","properties":{"a":', '{"type":"integer"}', "}}"),
              "anyof": ('{"anyOf":[', '{"type":"string"}', "]}"),
              "items": ('{"type":"array","items":', "{}", "}"),
              "arguments": ('{"k":[', '"v"', "]}")}
    head, middle, tail = shapes[kind]
    units = max(1, depth // (head.count("{") + head.count("[")))
    return Raw(head * units + middle + tail * units)


# -- values at and past the edges ----------------------------------------------------------------
EDGE_NUMBERS = [0, -0.0, 1, -1, 2, 7, 8, 9, 2**31 - 1, 2**31, -(2**31) - 1, 2**53 + 1, 2**63 - 1, 2**63, 2**64,
                10**30, -(10**30), 1e308, -1e308, 5e-324, -5e-324, 0.5, 1.5, 1.0000001, 99.99, 100.0, 100.5,
                float("nan"), float("inf"), float("-inf"), Raw("1e999"), Raw("-1e999"), Raw("1E+2"), Raw("-0"),
                Raw("0.1e-400"), Raw("9" * 5000), Raw("-" + "9" * 5000), Raw("0." + "0" * 5000 + "1"),
                Raw("1" + "0" * 400)]
JUNK = [None, True, False, "", "1", "NaN", "true", [], {}, [1], {"a": 1}, Raw('"\\ud800"'), Raw('"\\udfff x"')]
numbers = st.one_of(st.sampled_from(EDGE_NUMBERS), st.integers(), st.floats())
junk = st.one_of(st.sampled_from(JUNK), numbers, st.text(max_size=8))

WEIRD_TEXT = ["", " ", "\n", "\t\r\n", "\x00", "\x7f\x1b[31m", "\ufeff", "\u2028\u2029", "\u200b\u200d",
              "\u202ehello\u202c", "\u200f\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd",
              "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645", "e\u0301\u0302\u0303\u0304",
              "Z\u0334\u0321\u0327\u034e\u0344a\u0337\u0322\u0359l\u0338g\u0335o", "\U0001d518\U0001d52b\U0001d526",
              "\U0001f600\U0001f469\u200d\U0001f469\u200d\U0001f467", "\U0010ffff", "\U000e0001\U000e0041",
              "\uffff\ufffe", "\ud7ff\ue000", "\u00b2\u00b3\u00b9", "\u0661\u0662\u0663", "\u0966\u0967",
              "\uff10\uff11", "\U0001d7d9", "\u2167", "\u00bd", "<|user|>", "<|assistant|>", "<|endoftext|>",
              "<|begin_of_image|><|image|><|end_of_image|>", "[gMASK]<sop>", "<tool_call>", "</s><s>",
              "{{ 7 * 7 }}", "{% for x in range(10) %}x{% endfor %}", "%s%n%x", "' OR 1=1 --", "\\u0000",
              "\\", '"', "data: [DONE]\n\n", "\r\n\r\nHTTP/1.1 200 OK"]
short_text = st.one_of(st.text(max_size=24), st.sampled_from(WEIRD_TEXT),
                       st.lists(st.sampled_from(WEIRD_TEXT), min_size=2, max_size=6).map("".join))
long_text = st.builds(lambda unit, k: unit * k,
                      st.sampled_from(["a", "ab ", "\u00e9", "\U0001f600", "\u0661", "e\u0301", "\u05e9", "\x00",
                                       "<|user|>", "\U0010ffff"]),
                      st.one_of(st.integers(40, 400), st.sampled_from([1025, 4096, 20000, 200000])))
texts = st.one_of(short_text, short_text, short_text, long_text)


def mostly(good, bad, bad_percent: int = 20):
    """``good`` most of the time, ``bad`` in about ``bad_percent`` percent of the draws (``good`` is
    hypothesis' simplest choice, so the first examples are plausible ones)."""
    return st.integers(0, 99).flatmap(lambda k: bad if k >= 100 - bad_percent else good)


def weighted(*options):
    """One of the strategies, each drawn in proportion to its weight: ``weighted((5, a), (1, b))``
    (the first is hypothesis' simplest choice)."""
    total = sum(w for w, _ in options)

    def pick(k: int):
        for w, strategy in options:
            if k < w:
                return strategy
            k -= w
        raise AssertionError(k)

    return st.integers(0, total - 1).flatmap(pick)


def now_and_then(draw, percent: int) -> bool:
    """True in about ``percent`` percent of the draws (False is the simplest choice)."""
    return draw(st.integers(0, 99)) >= 100 - percent


def deep(kinds=("list", "object", "schema", "anyof", "items", "arguments")):
    """JSON nested 100 to 1,000 deep, most often near Python's recursion limit (1,000 frames), where the
    request's parse has just room and code that recurses further in may not."""
    depths = weighted((1, st.sampled_from([100, 500, 1000])), (2, st.integers(100, 1000)), (5, st.integers(900, 1000)))
    return st.builds(nested, depths, st.sampled_from(kinds))


json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), short_text),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(short_text, inner, max_size=4),
                           max_leaves=12)

# -- structured output ------------------------------------------------------------------------------
SCHEMAS = [{"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["x"], "additionalProperties": False},
           {"type": "string", "maxLength": 5}, {"enum": ["a", "b"]}, {"type": "array", "items": {"type": "boolean"},
                                                                       "maxItems": 3},
           {}, {"type": "null"}, {"const": "\U0001f600"}, {"type": "string", "pattern": "^[0-9]{2}$"},
           {"type": "string", "pattern": "(unclosed"}, {"type": "integer", "minimum": 10, "maximum": 1},
           {"$ref": "#/definitions/nope"}, {"$ref": "#"}, {"type": "object", "properties": {"a": {"$ref": "#"}}},
           {"type": "wat"}, {"type": "number", "minimum": float("nan")}, {"type": "string", "format": "date-time"},
           {"allOf": [{"type": "string"}, {"type": "integer"}]}, {"not": {}}, {"type": ["string", "null"]},
           {"type": "string", "minLength": 1000000}, {"type": "array", "minItems": 100000},
           {"type": "integer", "multipleOf": 0}, {"type": "object", "required": ["a"], "properties": {}},
           {"type": "object", "patternProperties": {"^\u00b2$": {}}}, {"properties": {"\x00": {"type": "string"}}},
           {"type": "number", "minimum": 1e308, "maximum": float("inf")}, {"enum": []}, {"type": "integer",
                                                                                    "minimum": 2**70}]
schemas = st.one_of(st.sampled_from(SCHEMAS), st.dictionaries(
    st.sampled_from(["type", "properties", "items", "enum", "const", "minimum", "maximum", "pattern", "required",
                     "anyOf", "$ref", "additionalProperties", "maxLength", "format"]), json_values, max_size=4),
    deep(("schema", "anyof", "items", "object")))
REGEXES = ["[a-z]{1,5}", "(yes|no)", "\\d+", "[0-9]{3}", "(", ")", "[z-a]", "a{1000000}", "a{2,1}", "\\", "(?=a)b",
           "(?P<x>a)(?P=x)", "\\p{L}+", ".*", "", "\U0001f600+", "(a*)*b", "\\b\\B", "^$", "a|" * 300 + "b",
           "(" * 300 + "a" + ")" * 300, "[\u0661-\u0669]+", "x{0}", "\\1", "[[:alpha:]]", "(?i)abc", "\\x{110000}",
           "[^\\x00-\\x{10FFFF}]", "\\d{2}\u00b2"]
regexes = st.one_of(st.sampled_from(REGEXES), st.text(alphabet="()[]{}*+?|.\\^$-,0123456789azAZ\u00b2", max_size=20))
LARK = ['start: "yes" | "no"', "start: /[0-9]+/", 'start: a\na: "x" a | "y"', "start: ", 'start: "a"*', "start: b",
        "%import common.NUMBER\nstart: NUMBER", "start: /(?=x)/", "start: " + '"a" ' * 2000,
        '?start: ("a" | "b")~3', 'start: "a"~1000000', "start: " + "(" * 400 + '"a"' + ")" * 400,
        'start: %json {"type": "integer"}', "start: %json {", 'start: "\U0001f600" | "\u0661"', "start: /\\p{Nd}+/",
        'start: "x"\nstart: "y"', "a: b\nb: a\nstart: a", "start: //", "start: /[/"]
grammars = st.one_of(st.sampled_from(["autoglm_action", "no_such_grammar", "AUTOGLM_ACTION", "autoglm_action ",
                                      "__init__", "_", "\u00b2", "\u0661\u0662", "..", "../grammars/autoglm_action"]),
                     st.sampled_from(LARK), short_text)
choices = st.one_of(st.lists(short_text, min_size=1, max_size=5), st.just([]), st.just([""]),
                    st.lists(st.sampled_from(["yes", "no", "\U0001f600", "\u0661"]), min_size=60, max_size=120))
response_formats = weighted(
    (3, st.sampled_from([{"type": "text"}, {"type": "json_object"}])),
    (4, st.builds(lambda name, schema: {"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
                  short_text, schemas)),
    (1, st.sampled_from([{}, {"type": "yaml"}, {"type": None}, {"type": ["json_object"]}, {"type": {"a": 1}},
                         {"type": "json_schema"}, {"type": "json_schema", "json_schema": None},
                         {"type": "json_schema", "json_schema": {}}])),
    (1, st.sampled_from([{"type": "text"}, {"type": "json_object"}])))
structured = st.one_of(st.fixed_dictionaries({}, optional={"json": schemas, "regex": regexes, "choice": choices,
                                                           "grammar": grammars}),
                       st.dictionaries(short_text, json_values, max_size=2))

# -- sampling fields: (plausible values, edges included; values past the edges, or of the wrong type) ----
small_tokens = st.integers(1, 8)
bad_tokens = st.one_of(st.sampled_from([0, -1, 1.5, "4", 95, 96, 500]), numbers, junk)
# keys str.isdigit() takes: ASCII, other scripts' digits (int() reads them), superscripts (int() does not)
LOGIT_KEYS = ["\u00b2", "\u00b3", "\u00b9", "\u2075", "\u0661\u0662", "\u0966", "\uff10", "\U0001d7d9", "\u2460",
              "0" * 20 + "1", "9" * 30, "9" * 5000, "99999", "255", "256", "0", "00"]
logit_keys = st.one_of(st.integers(0, 270).map(str), st.sampled_from(LOGIT_KEYS),
                       st.text(alphabet=st.characters(categories=["Nd", "No"]), min_size=1, max_size=4))
logit_values = st.one_of(st.floats(-100, 100), st.sampled_from([-100, 100, 0, -0.0, 100.0000001, 5e-324, 1e308,
                                                                float("nan"), float("inf"), float("-inf")]))
BAD_LOGIT_KEYS = ["-1", "+1", " 1", "1 ", "1.0", "0x10", "", "\u00bd", "\u2167", "\U0001f600", "1\x00", "a"]
bad_logit_biases = st.one_of(
    st.dictionaries(st.sampled_from(BAD_LOGIT_KEYS), logit_values, min_size=1, max_size=3),
    st.dictionaries(logit_keys, st.one_of(junk, deep(("list", "object"))), min_size=1, max_size=3),
    st.builds(lambda n, v: {str(i): v for i in range(n)}, st.sampled_from([300, 5000]), st.floats(-100, 100)),
    deep(("object",)), junk)
bad_stops = st.one_of(st.lists(short_text, min_size=17, max_size=20), st.just([[]]), st.just(["x" * 1025]),
                      st.lists(junk, min_size=1, max_size=2), junk)
FIELDS = {
    "temperature": (st.one_of(st.floats(0, 2), st.sampled_from([0, 2, 5e-324, 1e-310, 1e-7])), numbers),
    "top_p": (st.one_of(st.floats(0, 1, exclude_min=True), st.sampled_from([5e-324, 1e-300, 1])), numbers),
    "seed": (st.one_of(st.integers(0, 2**63 - 1), st.sampled_from([0, 2**63 - 1])), numbers),
    "stop": (st.one_of(short_text, st.lists(short_text, max_size=16), long_text), bad_stops),
    "stream": (st.booleans(), junk),
    "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}),
                       st.one_of(st.dictionaries(short_text, junk, max_size=2), junk)),
    "n": (st.one_of(st.integers(1, 4), st.sampled_from([8, 16, 64])),
          st.one_of(st.sampled_from([65, 0, -1, 2.5, "2"]), numbers)),
    "presence_penalty": (st.floats(-2, 2), numbers),
    "frequency_penalty": (st.floats(-2, 2), numbers),
    "logit_bias": (st.dictionaries(logit_keys, logit_values, max_size=6), bad_logit_biases),
    "user": (short_text, st.one_of(long_text, junk)),
    "top_k": (st.one_of(st.integers(0, 300), st.sampled_from([2**31, 2**63, 10**30])), numbers),
    "repetition_penalty": (st.one_of(st.floats(0, 100, exclude_min=True), st.sampled_from([5e-324, 100])), numbers),
    "min_tokens": (st.one_of(st.integers(0, 8), st.sampled_from([2**31, 10**30])), numbers),
    "stop_token_ids": (st.one_of(st.lists(st.integers(0, 300), max_size=8), st.just(list(range(64))),
                                 st.just(list(range(65))), st.lists(st.integers(), max_size=3)),
                       st.one_of(st.lists(numbers, max_size=100), deep(("list",)), junk)),
    "beam_width": (st.one_of(st.integers(1, 4), st.sampled_from([8, 9, 64])), st.one_of(st.just(65), numbers)),
    "length_penalty": (st.floats(-10, 10), numbers),
    "ignore_eos": (st.booleans(), junk),
    "priority": (st.one_of(st.integers(0, 2**31), st.sampled_from([0, 2**31])), numbers),
    "response_format": (response_formats, st.one_of(deep(), junk)),
    "guided_json": (st.one_of(schemas, schemas.map(lambda s: json.dumps(s) if not isinstance(s, Raw) else s)),
                    st.one_of(short_text, junk)),
    "guided_regex": (regexes, junk),
    "guided_choice": (choices, st.one_of(st.lists(junk, min_size=1, max_size=3), junk)),
    "guided_grammar": (grammars, junk),
    "structured_outputs": (structured, junk),
}
REFUSED_FIELDS = {  # what the server does not do: a 400 unless the value is neutral
    "echo": st.one_of(st.booleans(), junk), "best_of": st.one_of(st.sampled_from([1, 2]), junk),
    "suffix": st.one_of(short_text, junk), "functions": st.one_of(st.just([]), junk),
    "function_call": st.one_of(st.just("none"), junk), "logit_bias_type": junk,
    "skip_special_tokens": st.booleans(), "include_stop_str_in_output": st.booleans(),
}
UNKNOWN_KEYS = ["frobnicate", "", " model", "MODEL", "\u00b2", "\U0001f600", "\x00", "__proto__", "constructor",
                "max_tokens\u200b", "prompt_logprobs", "guided_decoding_backend"]
model_names = st.sampled_from(["", "TINY-CHAT", "tiny-chat ", "\u202etiny-chat", "x" * 10000, "../tiny-chat",
                               "tiny-glm4v", 1, None, ["tiny-chat"], Raw('"\\ud800"')])


@st.composite
def sampling(draw, model: str, extra: dict, fields: int = 5, wrong_percent: int = 40) -> dict:
    """``model``, ``max_tokens`` and up to ``fields`` of the sampling fields and ``extra``, plausible
    (edges included) but for at most one of them, past its edges or of the wrong type (so that the
    others' values reach the code behind validation; in about ``wrong_percent`` percent of the bodies);
    now and then a refused or unknown field, or a required one missing."""
    table = {"model": (st.just(model), model_names), "max_tokens": (small_tokens, bad_tokens), **FIELDS, **extra}
    names = ["model", "max_tokens", *draw(st.lists(st.sampled_from(sorted(set(table) - {"model", "max_tokens"})),
                                                   max_size=fields, unique=True))]
    wrong = draw(weighted((100 - wrong_percent, st.none()), (wrong_percent, st.sampled_from(names))))
    body = {}
    for name in names:
        good, bad = table[name]
        body[name] = draw(bad if name == wrong else good)
    if body.get("n") not in (None, 1) or body.get("beam_width") not in (None, 1):
        body.setdefault("temperature", draw(st.sampled_from([0, 1.0])))
    if now_and_then(draw, 4):
        name = draw(st.sampled_from(sorted(REFUSED_FIELDS)))
        body[name] = draw(REFUSED_FIELDS[name])
    if now_and_then(draw, 3):
        body[draw(st.one_of(st.sampled_from(UNKNOWN_KEYS), short_text))] = draw(junk)
    if now_and_then(draw, 3):
        body.pop(draw(st.sampled_from(["model", "max_tokens"])))
    return body


token_ids = st.lists(mostly(st.integers(0, 255), st.one_of(st.integers(256, 300), numbers, junk), 5), min_size=1,
                     max_size=30)
prompt_texts = st.one_of(st.text(min_size=1, max_size=16), st.sampled_from([w for w in WEIRD_TEXT if w]),
                         st.lists(st.sampled_from(WEIRD_TEXT), min_size=2, max_size=4).map("".join).filter(bool),
                         long_text)
prompts = mostly(st.one_of(prompt_texts, prompt_texts, token_ids),
                 st.one_of(st.sampled_from(["", [], [[1, 2]], ["hi", "there"], [""]]),
                           st.lists(texts, min_size=1, max_size=3), deep(("list",)), junk), 15)
COMPLETION_EXTRA = {"logprobs": (st.integers(0, 20), st.one_of(st.sampled_from([21, -1, True]), numbers))}


@st.composite
def completion_bodies(draw) -> dict:
    body = draw(sampling(TEXT_MODEL, COMPLETION_EXTRA))
    if not now_and_then(draw, 3) or "max_tokens" not in body:  # (sometimes no prompt: a 400)
        body["prompt"] = draw(prompts)
    return body


# -- chat: messages, tools ----------------------------------------------------------------------------
roles = mostly(st.sampled_from(["user", "system", "assistant", "developer", "tool"]),
               st.one_of(st.sampled_from(["wizard", "USER", "function", "ipython", ""]), junk), 5)
tool_names = st.one_of(st.sampled_from(["tap", "back", "f", "a.b-c_d", "x" * 64, "x" * 65, "", "tap tap",
                                        "\u0442\u0430\u043f", "\U0001f600", "tap\n", "\u00b2"]),
                       st.from_regex(r"[A-Za-z0-9_.-]{1,64}", fullmatch=True))
arguments = st.one_of(json_values.map(json.dumps), st.dictionaries(short_text, json_values, max_size=3),
                      deep(("object", "arguments", "list")), st.sampled_from(["{", "", "null", "[]"]), junk)
message_calls = st.one_of(
    st.lists(st.fixed_dictionaries({"id": short_text, "type": st.just("function"),
                                    "function": st.fixed_dictionaries({"name": tool_names, "arguments": arguments})}),
             max_size=3),
    st.lists(json_values, max_size=2), deep(("list", "object")), junk)
text_parts = st.fixed_dictionaries({"type": st.just("text"), "text": texts})
odd_parts = st.one_of(st.sampled_from([{"type": "text"}, {"type": "image_url"}, {"type": "image"},
                                       {"type": "input_image", "image_url": "x"}, {"type": "audio"}, {},
                                       {"type": "text", "text": "a", "extra": 1},
                                       {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]),
                      junk)
text_contents = mostly(st.one_of(texts, st.lists(mostly(text_parts, odd_parts, 10), min_size=1, max_size=4)),
                       st.one_of(st.none(), st.just([]), junk), 10)


@st.composite
def messages(draw, contents) -> list:
    out = []
    for _ in range(draw(st.integers(1, 4))):
        m = {"role": draw(roles), "content": draw(contents)}
        for key, strategy, percent in (("name", mostly(short_text, junk), 8), ("tool_calls", message_calls, 8),
                                       ("tool_call_id", mostly(short_text, junk), 8), ("audio", junk, 2)):
            if now_and_then(draw, percent):
                m[key] = draw(strategy)
        out.append(m)
    return out


tool_defs = st.fixed_dictionaries(
    {"type": mostly(st.just("function"), junk, 5),
     "function": mostly(st.fixed_dictionaries({"name": tool_names},
                                              optional={"description": texts, "parameters": schemas,
                                                        "strict": st.booleans()}), junk, 5)})
tool_choices = st.one_of(st.sampled_from(["required", "none", "auto"]),
                         st.builds(lambda name: {"type": "function", "function": {"name": name}}, tool_names))
CHAT_EXTRA = {
    "max_completion_tokens": (small_tokens, bad_tokens),
    "logprobs": (st.booleans(), junk),
    "top_logprobs": (st.integers(0, 20), st.one_of(st.just(21), numbers)),
    "tools": (st.lists(tool_defs, min_size=1, max_size=4), st.one_of(st.just([]), deep(("list",)), junk)),
    "tool_choice": (tool_choices, st.one_of(st.sampled_from(["any", ""]), junk)),
    "parallel_tool_calls": (st.booleans(), junk),
}


@st.composite
def chat_bodies(draw, contents=text_contents, model: str = TEXT_MODEL) -> dict:
    body = draw(sampling(model, CHAT_EXTRA))
    if "tools" in body and "tool_choice" not in body and draw(st.booleans()):
        body["tool_choice"] = "required"
    if body.get("logprobs") is True and draw(st.booleans()):  # under a guide: logprobs of tokens it forbids
        body.setdefault("guided_choice", ["yes", "no"])
    if not now_and_then(draw, 3):  # (sometimes no messages: a 400)
        body["messages"] = draw(mostly(messages(contents), st.one_of(st.just([]), deep(("list",)), junk), 5))
    return body


# -- raw bodies, paths -------------------------------------------------------------------------------
RAW_BODIES = [b"", b" ", b"{", b"{}", b"[]", b"null", b"1", b'"x"', b"true", b"\x00" * 8, b"\xef\xbb\xbf{}",
              b'[{"model": "tiny-chat", "prompt": "hi"}]', b"{'model': 'tiny-chat'}", b'{"model": "tiny-chat",}',
              b'{"model": "tiny-chat", "prompt": "hi", "max_tokens": 1, "max_tokens": 2}',
              b'{"model": "tiny-chat", "prompt": "hi", "max_tokens": 1} {"trailing": 1}',
              b'{"model": "tiny-chat", "prompt": "\xff\xfe", "max_tokens": 1}',
              b'{"model": "tiny-chat", "prompt": "\xed\xa0\x80", "max_tokens": 1}',
              b'\xef\xbb\xbf{"model": "tiny-chat", "prompt": "hi", "max_tokens": 1}',
              b'\xff\xfe{\x00"\x00m\x00',
              b'{"model": "tiny-chat", "prompt": "hi", "max_tokens": NaN}',
              b'{"model": "tiny-chat", "prompt": "hi", "max_tokens": 1, "temperature": Infinity}',
              b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, '
              b'"seed": ' + b"9" * 5000 + b"}",
              b'{"model": "tiny-chat", "prompt": "hi", "max_tokens": 1e999}',
              b'{"model": "tiny-chat", "prompt": [' + b"1," * 20000 + b"1]}",
              b"[" * 5000 + b"]" * 5000, b'{"a":' * 5000 + b"1" + b"}" * 5000]
CONTENT_TYPES = ["application/json", "application/json; charset=utf-8", "application/json; charset=latin-1",
                 "APPLICATION/JSON", "application/vnd.openai+json", "text/plain", "text/plain; charset=utf-8",
                 "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "", None,
                 "application/json, text/plain", "*/*", "application/jsonx", "json", "text/json",
                 "application/json;;;", "application/json; boundary=\u00e9".encode().decode("latin-1")]


@st.composite
def raw_cases(draw) -> tuple[str, str, bytes, str | None, bool]:
    """(method, path, body, Content-Type or None for none, chunked)."""
    kind = draw(st.sampled_from(["fixed", "truncated", "bytes", "valid"]))
    if kind == "fixed":
        data = draw(st.sampled_from(RAW_BODIES))
    elif kind == "bytes":
        data = draw(st.binary(max_size=200))
    else:
        body = draw(st.one_of(completion_bodies(), chat_bodies()))
        data = encode(body, draw(st.booleans()))
        if kind == "truncated":
            data = data[: draw(st.integers(0, max(0, len(data) - 1)))]
    method = draw(mostly(st.just("POST"), st.sampled_from(["PUT", "PATCH"]), 10))
    path = draw(st.sampled_from(list(GENERATING)))
    return method, path, data, draw(mostly(st.just("application/json"), st.sampled_from(CONTENT_TYPES), 50)), \
        draw(mostly(st.just(False), st.just(True), 10))


ODD_PATHS = ["/", "/v1", "/v1/", "/v1/models/", "/v1/models/tiny-chat", "/v1/completions/", "/v1/chat/completions/",
             "//v1/models", "/v1/../health", "/v1/%2e%2e/health", "/health?x=1", "/v1/models?limit=-1", "/%00",
             "/v1/%ff", "/v1/embeddings", "/v1/responses", "/docs", "/openapi.json", "/metrics/", "/HEALTH",
             "/v1/chat//completions", "/v1/models%00", "/" + "a" * 2000, "/v1/completions;x=1", "/v1/com%70letions"]
paths = st.one_of(st.sampled_from(ODD_PATHS),
                  st.lists(st.text(max_size=12), min_size=1, max_size=4).map(
                      lambda parts: "/" + "/".join(quote(p, safe="") for p in parts)))


# -- images ----------------------------------------------------------------------------------------------
FORMATS = ["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "ICO", "BLP", "DDS", "TGA", "PPM", "QOI", "JPEG2000", "PCX"]
MODES = ["RGB", "RGB", "RGBA", "L", "LA", "P", "1", "CMYK", "I;16", "I", "F"]
FAKE_HEADERS = {"tiff": [b"II*\x00", b"MM\x00*", b"II*\x00\x08\x00\x00\x00\xff\xff"],
                "blp": [b"BLP1", b"BLP2", b"BLP2\x01\x01\x00\x00", b"BLP1\x00\x00\x00\x00\x08\x00\x00\x00"],
                "dds": [b"DDS |\x00\x00\x00", b"DDS |\x00\x00\x00\x07\x10\x00\x00\xff\xff\x00\x00\xff\xff\x00\x00"],
                "ico": [b"\x00\x00\x01\x00\x01\x00", b"\x00\x00\x02\x00\x01\x00\x00\x00"],
                "psd": [b"8BPS\x00\x01", b"8BPS\x00\x01\x00\x00\x00\x00\x00\x00\x00\x03"],
                "eps": [b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", b"\xc5\xd0\xd3\xc6"],
                "other": [b"\x89PNG\r\n\x1a\n", b"GIF89a", b"\xff\xd8\xff", b"RIFF\x00\x00\x00\x00WEBPVP8 ", b"BM",
                          b"<svg xmlns='http://www.w3.org/2000/svg'/>", b"%PDF-1.4\n", b"\n\x05\x01\x08", b"icns",
                          b"\x00\x00\x00\x0cjP  \r\n\x87\n", b"qoif", b"P6\n65535 65535\n255\n", b"#define x 1\n",
                          b"/* XPM */\n", b"SIMPLE  =                    T", b"\x59\xa6\x6a\x95", b"FORM"]}


def png_bomb(width: int, height: int) -> bytes:
    """A PNG's signature and IHDR declaring ``width`` x ``height``, without pixel data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk + struct.pack(">I", zlib.crc32(chunk))


def image_bytes(fmt: str, width: int, height: int, mode: str, seed: int, frames: int) -> bytes:
    """A seeded random image in ``fmt`` (in ``mode`` where the format takes it; PNG if ``fmt`` cannot be written here)."""
    for form, conv in ((fmt, mode), (fmt, "RGB"), ("PNG", "RGB")):
        image = random_image(width, height, seed)
        buf = io.BytesIO()
        try:
            image = image.convert(conv)
            if frames > 1 and form in ("GIF", "PNG", "WEBP", "TIFF"):
                more = [random_image(width, height, seed + k).convert(conv) for k in range(1, frames)]
                image.save(buf, format=form, save_all=True, append_images=more)
            else:
                image.save(buf, format=form)
            return buf.getvalue()
        except (OSError, ValueError, KeyError, TypeError):
            continue
    raise AssertionError("PNG could not be written")


def data_url_of(data: bytes, mime: str = "image/png", b64: str = "standard") -> str:
    payload = {"standard": base64.b64encode(data), "urlsafe": base64.urlsafe_b64encode(data),
               "unpadded": base64.b64encode(data).rstrip(b"="),
               "wrapped": base64.encodebytes(data)}[b64].decode()
    return f"data:{mime};base64,{payload}"


sides = st.one_of(st.integers(1, 300), st.sampled_from([1, 2, 27, 28, 29, 56, 224, 300]))
good_images = st.builds(image_bytes, st.sampled_from(FORMATS), sides, sides, st.sampled_from(MODES),
                        st.integers(0, 10**6), mostly(st.just(1), st.integers(2, 3), 10))


@st.composite
def corrupt_images(draw) -> bytes:
    data = draw(good_images)
    how = draw(st.sampled_from(["truncate", "flip", "both"]))
    if how in ("flip", "both"):
        data = bytearray(data)
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= draw(st.integers(1, 255))
        data = bytes(data)
    if how in ("truncate", "both"):
        data = data[: draw(st.integers(0, len(data) - 1))]
    return data


header_values = st.one_of(st.integers(0, 8), st.sampled_from([16, 24, 28, 32, 124, 255, 256, 2**31 - 1, 2**32 - 1]),
                          st.integers(0, 2**32 - 1))


@st.composite
def sparse_bytes(draw, base: bytes = b"", span: int = 300) -> bytes:
    """``base`` (or up to ``span`` zero bytes) with a few header-like fields (small integers, either
    byte order) written over it, now and then cut short."""
    data = bytearray(base or bytes(draw(st.integers(0, span))))
    for _ in range(draw(st.integers(0, 6))):
        form = draw(st.sampled_from(["<I", ">I", "<H", ">H", "B"]))
        size = struct.calcsize(form)
        if len(data) < size:
            break
        at = draw(st.integers(0, min(len(data), span) - size))
        data[at:at + size] = struct.pack(form, draw(header_values) % (1 << (8 * size)))
    if now_and_then(draw, 10):
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data)


def tiff_template(order: str) -> bytes:
    """A 4 x 4 8-bit grey TIFF, uncompressed, in one strip."""
    tags = [(256, 3, 4), (257, 3, 4), (258, 3, 8), (259, 3, 1), (262, 3, 1), (273, 4, 8 + 2 + 12 * 9 + 4),
            (277, 3, 1), (278, 3, 4), (279, 4, 16)]
    entries = b"".join(struct.pack(order + "HHI", tag, kind, 1) + (struct.pack(order + "HH", value, 0) if kind == 3
                                                                   else struct.pack(order + "I", value))
                       for tag, kind, value in tags)
    magic = b"II*\x00" if order == "<" else b"MM\x00*"
    return magic + struct.pack(order + "IH", 8, len(tags)) + entries + struct.pack(order + "I", 0) + bytes(range(16))


# small valid (or nearly valid) files of formats Pillow reads, whose header fields a fuzz then overwrites
TEMPLATES = [
    b"BLP1" + struct.pack("<iIIIii", 1, 0, 4, 4, 5, 0) + struct.pack("<16I", 156 + 1024, *[0] * 15)
    + struct.pack("<16I", 16, *[0] * 15) + bytes(1024 + 16),
    b"BLP2" + struct.pack("<i4bII", 1, 1, 0, 0, 0, 4, 4) + struct.pack("<16I", 148 + 1024, *[0] * 15)
    + struct.pack("<16I", 16, *[0] * 15) + bytes(1024 + 16),
    b"DDS " + struct.pack("<7I", 124, 0x1007, 4, 4, 16, 0, 0) + bytes(44)
    + struct.pack("<8I", 32, 0x41, 0, 32, 0xFF0000, 0xFF00, 0xFF, 0xFF000000) + struct.pack("<5I", 0x1000, 0, 0, 0, 0)
    + bytes(64),
    tiff_template("<"), tiff_template(">"),
    struct.pack("<HHH", 0, 1, 1) + struct.pack("<BBBBHHII", 4, 4, 0, 0, 1, 32, 40 + 64 + 16, 22)
    + struct.pack("<IiiHHIIiiII", 40, 4, 8, 1, 32, 0, 0, 0, 0, 0, 0) + bytes(64 + 16),
    b"8BPS" + struct.pack(">H6xHIIHH", 1, 3, 4, 4, 8, 3) + struct.pack(">IIIH", 0, 0, 0, 0) + bytes(48),
    b"BM" + struct.pack("<IHHI", 14 + 40 + 48, 0, 0, 54) + struct.pack("<IiiHHIIiiII", 40, 4, 4, 1, 24, 0, 48, 0, 0, 0, 0)
    + bytes(48),
    struct.pack("<BBBBHHHHHH", 10, 5, 1, 8, 0, 0, 3, 3, 72, 72) + bytes(48) + struct.pack("<BBHH", 0, 3, 4, 1)
    + bytes(58 + 48),
    struct.pack("<BBBHHBHHHHBB", 0, 0, 2, 0, 0, 0, 0, 0, 4, 4, 24, 0) + bytes(48),
    b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 4 4\n%%EndComments\nshowpage\n",
]
fake_images = st.builds(lambda head, tail: head + tail,
                        st.sampled_from([h for heads in FAKE_HEADERS.values() for h in heads]),
                        st.one_of(sparse_bytes(), st.binary(max_size=300)))
mutated_images = st.sampled_from(TEMPLATES).flatmap(lambda base: sparse_bytes(base, 160))
bombs = st.builds(png_bomb, st.sampled_from([100000, 65535, 2**31 - 1, 0, 1]), st.sampled_from([100000, 1, 0, 2**31 - 1]))
mimes = mostly(st.just("image/png"), st.sampled_from(["image/jpeg", "image/webp", "application/octet-stream", "",
                                                        "text/plain", "image/svg+xml", "image/png;charset=utf-8"]), 30)
b64_forms = mostly(st.just("standard"), st.sampled_from(["urlsafe", "unpadded", "wrapped"]), 10)


def file_urls(media: Path) -> list[str]:
    inside = str(media)
    return [f"file://{inside}/ok.png", f"file://{inside}/missing.png", f"file://{inside}/", f"file://{inside}",
            f"file://{inside}/ok.png%00.txt", f"file://{inside}/%00", f"file://{inside}/corrupt.bmp",
            f"file://{inside}/zero", f"file://{inside}/sub/../ok.png", f"file://{inside}/../",
            f"file://localhost{inside}/ok.png", "file:///etc/passwd", "file:///etc/passwd%00", "file:///dev/zero",
            "file://evil.example/x.png", f"file:{inside}/ok.png", f"FILE://{inside}/ok.png", "file://", "file:",
            f"file://{inside}/ok%2Epng", f"file://{inside}/%2e%2e/%2e%2e/etc/passwd", f"file://{inside}/\u00e9.png",
            f"file://{inside}/" + "a" * 5000]


OTHER_URLS = ["http://example.com/x.png", "https://127.0.0.1:1/x.png", "HTTP://x/y", "ftp://x/y.png",
              "javascript:alert(1)", "x.png", "//host/x.png", "", " data:image/png;base64,", "data:",
              "data:,", "data:image/png;base64,", "data:;base64,", "data:image/png,rawbytes",
              "data:image/svg+xml;utf8,<svg/>", "data:image/png;base64,!!!not base64!!!", "data:image/png;base64,aGVsbG8",
              "data:image/png;base64,=", "data:image/png;base64,\u0661\u0662", "data:image/png;base64,aGVsbG8=\x00",
              "data:image/png;BASE64,aGVsbG8=", "data:image/png;base64" + "A" * 100]


def image_urls(media: Path):
    return weighted((35, st.builds(data_url_of, good_images, mimes, b64_forms)),
                    (12, st.builds(data_url_of, corrupt_images(), mimes, b64_forms)),
                    (20, st.builds(data_url_of, mutated_images, mimes)),
                    (8, st.builds(data_url_of, fake_images, mimes)),
                    (2, st.builds(data_url_of, bombs)),
                    (10, st.sampled_from(file_urls(media))),
                    (2, junk),
                    (11, st.sampled_from(OTHER_URLS)))


def image_parts(media: Path):
    url = image_urls(media)
    plain = st.builds(lambda u: {"type": "image_url", "image_url": {"url": u}}, url)
    detailed = st.builds(lambda u, d: {"type": "image_url", "image_url": {"url": u, "detail": d}}, url,
                         st.sampled_from(["auto", "high", "low", "", None, 1]))
    odd = st.one_of(st.builds(lambda u: {"type": "image_url", "image_url": u}, url),
                    st.builds(lambda u: {"type": "image", "image": u}, url), odd_parts)
    return weighted((80, plain), (10, detailed), (5, odd), (5, plain))  # (the last is drawn more often than its share)


@st.composite
def image_contents(draw, media: Path) -> list:
    count = draw(st.one_of(st.integers(0, 3), st.integers(0, 3), st.integers(0, 12)))
    parts = [draw(image_parts(media)) for _ in range(count)]
    for _ in range(draw(st.integers(0, 2))):
        parts.insert(draw(st.integers(0, len(parts))), draw(text_parts))
    return parts or [{"type": "text", "text": draw(short_text)}]


@st.composite
def image_bodies(draw, media: Path) -> dict:
    body = draw(sampling(IMAGE_MODEL, CHAT_EXTRA, fields=2, wrong_percent=10))
    system = [{"role": "system", "content": draw(short_text)}] if draw(st.booleans()) else []
    body["messages"] = [*system, {"role": "user", "content": draw(image_contents(media))}]
    return body


# -- the client, the checks ----------------------------------------------------------------------------
def strict_json(data: bytes) -> object:
    """JSON as RFC 8259 has it: UTF-8, no NaN or Infinity (ValueError otherwise)."""
    def refuse(name: str) -> object:
        raise ValueError(f"{name} is not JSON")

    return json.loads(data.decode("utf-8"), parse_constant=refuse)


def show(data: bytes | None, limit: int = 600) -> str:
    if data is None:
        return "(no body)"
    text = data.decode("utf-8", "backslashreplace")
    if len(text) <= limit:
        return text
    return f"{text[: limit - 150]} ...[{len(data):,} bytes in all]... {text[-100:]}"


def cause_in_log(text: str) -> tuple[str, str]:
    """("type: message" of the first exception in a traceback in ``text``, for a chain the root cause;
    the innermost autoglm_trt frame it passed through, else its last frame), or ("", "")."""
    lines = [re.sub(r"^[\s|+\-]*", "", line) for line in text.splitlines()]
    frame, last_frame = "", ""
    for line in lines:
        if line.startswith('File "'):
            last_frame = line
            if "autoglm_trt" in line and "site-packages" not in line:
                frame = line
        m = re.match(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|\.error))(?::\s*(.*))?$", line)
        if m and "ExceptionGroup" not in m[1] and last_frame:
            where = frame or last_frame
            where = re.sub(r'File ".*?([^/]+/[^/]+\.py)"', r"\1", where)
            return f"{m[1]}: {(m[2] or '')[:200]}", where
    return "", ""


def same_cause(text: str) -> str:
    """``text`` without the values in it (digits, quoted text), so that one cause is one violation."""
    return re.sub(r"\d+", "#", re.sub(r"'[^']*'", "'...'", text))


@dataclass
class Violation:
    kind: str
    status: object
    answer: str
    request: str
    size: int
    cause: str = ""
    where: str = ""
    count: int = 1


class Target:
    """A server under fuzz: sends requests, checks each answer, keeps the tally and the violations."""

    def __init__(self, port: int, proc: subprocess.Popen, log: Path, model: str, body_limit: int):
        self.port, self.proc, self.log, self.model, self.body_limit = port, proc, log, model, body_limit
        self.statuses: Counter = Counter()
        self.violations: dict[tuple, Violation] = {}
        self.stream_errors: dict[str, Violation] = {}
        self.sent = self.skipped = 0
        self.deadline = float("inf")
        self.current = self.request = ""
        self.down = ""
        self.media: Path | None = None  # the image server's --allowed-local-media-path
        self._log_seen = 0

    def budget(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def post(self, path: str, body: object, ascii_only: bool = True) -> None:
        self.send("POST", path, encode(body, ascii_only), "application/json")

    def send(self, method: str, path: str, data: bytes | None, content_type: str | None = "application/json",
             chunked: bool = False) -> None:
        if self.down or time.monotonic() > self.deadline:
            self.skipped += 1
            return
        self.sent += 1
        where = f"{method} {path}"
        self.current, self.request = f"{where} {show(data, 160)}", f"{where} {show(data)}"
        self._log_seen = self.log.stat().st_size  # what the server logs from now on is this request's
        headers = {} if content_type is None else {"Content-Type": content_type}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=CLIENT_TIMEOUT_S)
        try:
            try:
                if chunked and data is not None:
                    pieces = [data[i:i + 4096] for i in range(0, len(data), 4096)] or [b""]
                    conn.request(method, path, iter(pieces), headers, encode_chunked=True)
                else:
                    conn.request(method, path, data, headers)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server answered before the whole body was sent (a 413): read its answer
            r = conn.getresponse()
            status, ctype, answer = r.status, r.getheader("Content-Type", ""), r.read()
        except TimeoutError:
            self._violate("no answer in time", "timeout", f"nothing for {CLIENT_TIMEOUT_S} s", where, data)
            return
        except ConnectionRefusedError as exc:
            self.down = f"{where}: {exc!r}"
            self._violate("server down", "refused", repr(exc), where, data)
            return
        except (http.client.HTTPException, OSError) as exc:
            if data is not None and len(data) > self.body_limit:
                self.statuses["413 (reset while sending)"] += 1
                return
            self._violate("connection dropped or answer cut short", type(exc).__name__, repr(exc)[:300], where, data)
            return
        finally:
            conn.close()
            self.current = ""
        self.statuses[status] += 1
        broken = self.check(method, path, status, ctype, answer)
        if broken:
            self._violate("; ".join(broken), status, f"Content-Type: {ctype}; {show(answer, 400)}", where, data)

    def check(self, method: str, path: str, status: int, ctype: str, answer: bytes) -> list[str]:
        """The properties an answer breaks (none: [])."""
        found = []
        if status >= 500:
            found.append(f"status {status}")
        if not 200 <= status < 300:
            if not ctype.lower().startswith("application/json"):
                found.append(f"a {status} without Content-Type application/json")
            try:
                err = strict_json(answer)
                ok = isinstance(err, dict) and set(err) == {"error"} and isinstance(err["error"], dict) \
                    and {"message", "type", "param", "code"} <= set(err["error"]) \
                    and isinstance(err["error"]["message"], str) and isinstance(err["error"]["type"], str)
            except ValueError:
                ok = False
            if not ok:
                found.append(f"a {status} whose body is not OpenAI's error JSON")
            return found
        if method != "POST" or path.split("?")[0] not in GENERATING:
            if "json" in ctype.lower():
                try:
                    strict_json(answer)
                except ValueError:
                    found.append("a 2xx JSON answer that is not strict JSON")
            return found
        if ctype.lower().startswith("text/event-stream"):
            return found + list(dict.fromkeys(self.check_stream(answer)))
        try:
            value = strict_json(answer)
        except ValueError as exc:
            return found + [f"a 2xx completion that is not strict JSON ({str(exc)[:60]})"]
        if not ctype.lower().startswith("application/json"):
            found.append("a 2xx completion without Content-Type application/json")
        if not isinstance(value, dict) or not isinstance(value.get("choices"), list) or not value["choices"]:
            found.append("a 2xx completion without choices")
        return found

    def check_stream(self, answer: bytes) -> list[str]:
        try:
            text = answer.decode("utf-8")
        except UnicodeDecodeError:
            return ["a stream that is not UTF-8"]
        events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
        found = []
        for event in events:
            if event == "[DONE]":
                continue
            try:
                value = strict_json(event.encode())
            except ValueError as exc:
                found.append(f"a stream event that is not strict JSON ({str(exc)[:60]})")
                continue
            if isinstance(value, dict) and "error" in value:
                key = str(value["error"].get("message", ""))[:120] if isinstance(value["error"], dict) else ""
                self.stream_errors.setdefault(key, Violation("stream error event", 200, event[:400], self.request, 0))
        if not events or events[-1] != "[DONE]":
            last = events[-1] if events else ""
            is_error = last.startswith('{"error"')
            if not is_error:
                found.append("a stream that does not end with data: [DONE]")
        return found

    def _violate(self, kind: str, status: object, answer: str, where: str, data: bytes | None) -> None:
        cause, frame = ("", "")
        if str(status).startswith("5") or kind in ("connection dropped or answer cut short", "server down"):
            # an unhandled exception is logged, maybe just after its plain 500 went out; a 5xx in error JSON
            # was answered by a handler, which logs before it answers (if it logs at all)
            cause, frame = self._log_cause(1.5 if "OpenAI's error JSON" in kind or not kind.startswith("status") else 0.3)
        key = (kind, status, same_cause(cause or answer[:80]), frame)
        request = f"{where} {show(data)}"
        size = len(data or b"")
        old = self.violations.get(key)
        if old is None:
            self.violations[key] = Violation(kind, status, answer, request, size, cause, frame)
        else:
            old.count += 1
            if size < old.size:
                old.answer, old.request, old.size = answer, request, size

    def _log_cause(self, wait: float) -> tuple[str, str]:
        """The cause of the last 5xx, from what the server logged since (waiting up to ``wait`` s for it)."""
        deadline = time.monotonic() + wait
        while True:
            with open(self.log, "rb") as f:
                f.seek(self._log_seen)
                cause = cause_in_log(f.read().decode("utf-8", "replace"))
            if cause[0] or time.monotonic() > deadline:
                return cause
            time.sleep(0.05)


def logged_causes(log: Path) -> Counter:
    """(cause, where) of every traceback in the server's log, counted."""
    marker = "Traceback (most recent call last):"
    pieces = log.read_text(errors="replace").split(marker)[1:]
    return Counter(cause_in_log(marker + "\n" + piece) for piece in pieces)


def get(port: int, path: str, timeout: float = 5) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def engine_gauges(port: int) -> dict[str, float]:
    _, text = get(port, "/metrics")
    out = {}
    for line in text.decode().splitlines():
        if line.startswith(("autoglm_kv_blocks_used", "autoglm_requests_running", "autoglm_requests_waiting",
                            "autoglm_requests_preparing")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def loop_hold(port: int) -> float | None:
    """The longest the engine's loop has held its lock in one go (scheduling or sampling a step)."""
    _, text = get(port, "/metrics")
    for line in text.decode().splitlines():
        if line.startswith("autoglm_loop_longest_hold_seconds "):
            return float(line.split()[-1])
    return None


class HealthWatch:
    """GETs /health every ``HEALTH_EVERY_S`` on a thread: the slowest answer, and what was in flight then."""

    def __init__(self, target: Target):
        self.target, self.worst, self.during, self.failures = target, 0.0, "", []
        self.probes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(HEALTH_EVERY_S):
            during = self.target.current
            t0 = time.monotonic()
            try:
                status = get(self.target.port, "/health", timeout=5)[0]
            except (OSError, http.client.HTTPException) as exc:
                status = repr(exc)
            took = time.monotonic() - t0
            self.probes += 1
            if took > self.worst:
                self.worst, self.during = took, during
            if status != 200:
                self.failures.append(f"{status} after {took:.2f} s during {during[:200]}")

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)


@contextlib.contextmanager
def fuzz_server(engine_dir: Path, log: Path, *args: str):
    """``autoglm-trt serve`` on a free port, its output into ``log`` (a pipe nobody reads would fill
    with 5xx tracebacks and stall the server); no API key; always stopped."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "AUTOGLM_API_KEY"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "autoglm_trt", "serve", str(engine_dir), "--port", str(port),
                                 *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + START_S
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"server exited: {log.read_text()[-3000:]}")
            try:
                if get(port, "/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"server did not become ready: {log.read_text()[-3000:]}")
            time.sleep(0.1)
        yield port, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def run_examples(strategy, action, max_examples: int, explicit=()) -> None:
    """``action`` on ``max_examples`` reproducible draws of ``strategy`` (and the ``explicit`` cases first)."""
    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=SUPPRESSED, phases=[Phase.explicit, Phase.generate])
    @given(strategy)
    def fuzz(case) -> None:
        action(case)

    for case in explicit:
        fuzz = example(case)(fuzz)
    fuzz()


def every_method_on_every_route(target: Target) -> None:
    for path in ROUTES + ["/v1/nothing", "/"]:
        for method in METHODS:
            data = b"{}" if method in ("PUT", "POST", "PATCH") else None
            target.send(method, path, data, "application/json" if data is not None else None)


def deep_sweep(target: Target, depths=range(880, 1001, 2)) -> None:
    """JSON nested ``depths`` deep in each place a body may carry it: the window where the request
    still parses but code behind it runs out of stack is a few levels wide, and where it lies moves
    with the server's code."""
    base = {"model": TEXT_MODEL, "max_tokens": 1}
    hi = [{"role": "user", "content": "hi"}]
    places = [
        ("/v1/completions", lambda v: {**base, "prompt": "hi", "frobnicate": v}),
        ("/v1/completions", lambda v: {**base, "prompt": "hi", "guided_json": v}),
        ("/v1/completions", lambda v: {**base, "prompt": "hi", "logit_bias": {"1": v}}),
        ("/v1/completions", lambda v: {**base, "prompt": "hi", "response_format": {
            "type": "json_schema", "json_schema": {"name": "a", "schema": v}}}),
        ("/v1/chat/completions", lambda v: {**base, "messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": v}}]}, *hi]}),
        ("/v1/chat/completions", lambda v: {**base, "messages": hi, "tool_choice": "required",
                                            "tools": [{"type": "function", "function": {"name": "f", "parameters": v}}]}),
    ]
    for path, body in places:
        for depth in depths:
            target.post(path, body(nested(depth, "object")))


def finish(target: Target, watch: HealthWatch, name: str, started: float, capsys) -> None:
    """Wait for the server to settle, print the tally and every violation, then assert."""
    gauges: dict[str, float] = {}
    deadline = time.monotonic() + DRAIN_S
    while time.monotonic() < deadline and target.proc.poll() is None:
        try:
            gauges = engine_gauges(target.port)
        except (OSError, http.client.HTTPException, ValueError):
            gauges = {}
        if gauges and not any(gauges.values()):
            break
        time.sleep(0.2)
    took = time.monotonic() - started
    hold = loop_hold(target.port) if target.proc.poll() is None else None
    statuses = dict(sorted(target.statuses.items(), key=lambda kv: str(kv[0])))
    lines = [f"fuzz ({name}): {target.sent} requests in {took:.0f} s, {statuses}"
             + (f", {target.skipped} skipped past the time budget" if target.skipped else "")
             + f"; /health worst {watch.worst * 1000:.0f} ms over {watch.probes} probes"
             + (f"; the engine loop held its lock {hold * 1000:.0f} ms at most" if hold is not None else "")]
    for v in target.violations.values():
        lines.append(f"  VIOLATION x{v.count}: {v.kind} [{v.status}]"
                     + (f"\n    cause: {v.cause}\n    at:    {v.where}" if v.cause else "")
                     + f"\n    answer:  {v.answer[:400]}\n    request: {v.request[:700]}")
    known = {same_cause(v.cause) for v in target.violations.values()}
    for (cause, frame), n in logged_causes(target.log).items():
        if same_cause(cause) not in known:
            lines.append(f"  note: the server logged x{n}: {cause} at {frame}")
    for message, v in target.stream_errors.items():
        lines.append(f"  note: a stream ended with an error event ({message!r})\n    request: {v.request[:400]}")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    problems = [f"{v.kind} [{v.status}] x{v.count}: {v.cause or v.answer[:200]} <- {v.request[:300]}"
                for v in target.violations.values()]
    if hold is not None and hold >= HEALTH_BOUND_S:
        problems.append(f"the engine's loop held its lock for {hold:.2f} s in one go (bound {HEALTH_BOUND_S} s)")
    if watch.worst >= HEALTH_BOUND_S:
        problems.append(f"/health took {watch.worst:.2f} s (bound {HEALTH_BOUND_S} s) during {watch.during[:300]}")
    problems += [f"/health: {f}" for f in watch.failures[:5]]
    if target.proc.poll() is not None:
        problems.append(f"the server exited with {target.proc.returncode}")
    elif not gauges or any(gauges.values()):
        problems.append(f"after {DRAIN_S} s the server still has work or KV blocks: {gauges}")
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems)


# -- the tests ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def text_target(chat_engine, tmp_path_factory):
    log = tmp_path_factory.mktemp("fuzz-text") / "serve.log"
    with fuzz_server(chat_engine, log, "--max-body-bytes", str(TEXT_BODY_LIMIT)) as (port, proc):
        yield Target(port, proc, log, TEXT_MODEL, TEXT_BODY_LIMIT)


@pytest.fixture(scope="module")
def image_target(glm4v_engine, tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz-images")
    media = base / "media"
    (media / "sub").mkdir(parents=True)
    random_image(40, 30, 1).save(media / "ok.png")
    (media / "corrupt.bmp").write_bytes(image_bytes("BMP", 20, 20, "RGB", 2, 1)[:60])
    (media / "zero").symlink_to("/dev/zero")
    log = base / "serve.log"
    with fuzz_server(glm4v_engine, log, "--allowed-local-media-path", str(media)) as (port, proc):
        target = Target(port, proc, log, IMAGE_MODEL, 8 << 20)
        target.media = media
        yield target


TEXT_COMPLETIONS = [
    {"model": TEXT_MODEL, "prompt": "hi", "max_tokens": 2, "logit_bias": {"\u00b2": 5}},
    {"model": TEXT_MODEL, "prompt": "hi", "max_tokens": 2, "logit_bias": {"9" * 5000: 1}},
    {"model": TEXT_MODEL, "prompt": "hi", "max_tokens": 2, "logprobs": 5, "guided_choice": ["yes", "no"]},
    {"model": TEXT_MODEL, "prompt": "hi", "max_tokens": 2, "stream": True, "logprobs": 5, "guided_regex": "(yes|no)"},
    {"model": TEXT_MODEL, "prompt": "hi", "max_tokens": 2, "guided_json": nested(1000, "schema")},
    {"model": TEXT_MODEL, "prompt": "hi", "max_tokens": 2, "n": 64, "temperature": 1.0},
]
TEXT_CHATS = [
    {"model": TEXT_MODEL, "max_tokens": 2, "logprobs": True, "top_logprobs": 5, "guided_choice": ["yes", "no"],
     "messages": [{"role": "user", "content": "hi"}]},
    {"model": TEXT_MODEL, "max_tokens": 2, "messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": nested(1000, "arguments")}}]}]},
    {"model": TEXT_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
     "tools": [{"type": "function", "function": {"name": "f", "parameters": nested(999, "schema")}}],
     "tool_choice": "required"},
    {"model": TEXT_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
     "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": nested(500, "anyof")}}},
]


def test_text_server_fuzz(text_target, capsys):
    """/v1/completions and /v1/chat/completions bodies, raw bodies and media types, odd paths, and
    every method on every route against the tiny chat Llama."""
    t = text_target
    started = time.monotonic()
    with HealthWatch(t) as watch:
        t.budget(TEXT_BUDGET_S)
        every_method_on_every_route(t)
        deep_sweep(t)
        run_examples(st.tuples(completion_bodies(), st.booleans()),
                     lambda case: t.post("/v1/completions", *case), EXAMPLES["completions"],
                     [(b, True) for b in TEXT_COMPLETIONS])
        run_examples(st.tuples(chat_bodies(), st.booleans()),
                     lambda case: t.post("/v1/chat/completions", *case), EXAMPLES["chat"],
                     [(b, False) for b in TEXT_CHATS])
        oversized = b'{"model": "tiny-chat", "prompt": "' + b"x" * (TEXT_BODY_LIMIT + 10) + b'", "max_tokens": 1}'
        run_examples(raw_cases(), lambda case: t.send(*case), EXAMPLES["raw"],
                     [("POST", "/v1/completions", oversized, "application/json", False),
                      ("POST", "/v1/completions", oversized, "application/json", True),
                      ("POST", "/v1/completions", b"prompt=hi", "text/plain", False),
                      ("POST", "/v1/chat/completions", b"{}", "text/plain; charset=utf-8", False)])
        run_examples(st.tuples(st.sampled_from(METHODS), paths),
                     lambda case: t.send(case[0], case[1], b"{}" if case[0] in ("PUT", "POST", "PATCH") else None),
                     EXAMPLES["paths"])
    finish(t, watch, "text", started, capsys)


def test_image_server_fuzz(image_target, capsys):
    """Chat requests with image parts (PNG, JPEG, WebP, GIF, BMP and more of random sizes and modes,
    corrupt and truncated ones, other formats' headers, bad data: URLs, file:// and http URLs, up to
    12 images) against the tiny GLM-4.1V, and every method on every route."""
    t = image_target
    media = t.media
    assert media is not None
    started = time.monotonic()
    shot = {"type": "image_url", "image_url": {"url": data_url_of(image_bytes("PNG", 60, 90, "RGB", 3, 1))}}

    def chat(*parts) -> dict:
        return {"model": IMAGE_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [*parts]}]}

    def url(u: str) -> dict:
        return {"type": "image_url", "image_url": {"url": u}}

    explicit = [chat(url(f"file://{media}/ok.png%00.txt")), chat(url(f"file://{media}/ok.png")),
                chat(url(data_url_of(b"BLP1" + struct.pack("<i", 5) + TEMPLATES[0][8:]))),
                chat(url(data_url_of(b"DDS |" + bytes(124)))),
                chat(url(data_url_of(b"II*\x00\x08\x00\x00\x00" + bytes(32)))),
                chat(url(data_url_of(image_bytes("TIFF", 30, 30, "RGB", 1, 1)[:-40]))),
                chat({"type": "text", "text": "look "}, *[shot] * 12)]
    with HealthWatch(t) as watch:
        t.budget(IMAGE_BUDGET_S)
        every_method_on_every_route(t)
        run_examples(image_bodies(media), lambda body: t.post("/v1/chat/completions", body), EXAMPLES["images"],
                     explicit)
    finish(t, watch, "images", started, capsys)
