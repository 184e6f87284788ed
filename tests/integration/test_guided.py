"""Structured output on a tiny random model, whose free output is noise: every constrained answer
parses and validates — a JSON schema (nested object, enum, array, required fields), JSON mode, a
regex, a choice list and Open-AutoGLM's action grammar; malformed guides are refused before any work."""

from __future__ import annotations

import json
import re

import pytest

from autoglm_trt.errors import AutoGLMError
from autoglm_trt.runtime import Engine, Guide, SamplingParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "kind", "point", "meta"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "kind": {"enum": ["tap", "swipe", "type"]},
                         "point": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
                                   "minItems": 2, "maxItems": 2},
                         "meta": {"type": "object", "additionalProperties": False, "required": ["ok"],
                                  "properties": {"ok": {"type": "boolean"}}}}}
# Open-AutoGLM's answer, as its client parses it (phone_agent/model/client.py, actions/handler.py)
ACTION = re.compile(r'<think>[^<]*</think>\n?<answer>\n?'
                    r'(do\(action="(Tap|Double Tap|Long Press)", element=\[\d{1,3}, ?\d{1,3}\]\)'
                    r'|do\(action="[A-Za-z_ ]+"[^)]*\)|finish\(message="([^"\\\n]|\\.)*"\))\n?</answer>')


def valid(answer: dict) -> bool:
    return (set(answer) == {"name", "kind", "point", "meta"} and isinstance(answer["name"], str)
            and len(answer["name"]) <= 6 and answer["kind"] in ("tap", "swipe", "type")
            and len(answer["point"]) == 2 and all(isinstance(v, int) and 0 <= v <= 999 for v in answer["point"])
            and answer["meta"].keys() == {"ok"} and isinstance(answer["meta"]["ok"], bool))


def samples(engine: Engine, guide: Guide, n: int = 50, **extra) -> list[str]:
    params = SamplingParams(max_new_tokens=200, temperature=1.0, seed=7, n=n, guide=guide, **extra)
    [res] = engine.generate([[{"role": "user", "content": "Answer."}]], params)
    assert all(c.finish_reason == "stop" for c in res.choices), [c.finish_reason for c in res.choices]
    return [c.text for c in res.choices]


def test_fifty_answers_under_each_guide_parse_and_validate(glm4v_engine):
    with Engine.load(glm4v_engine) as engine:
        answers = [json.loads(t) for t in samples(engine, Guide.json_schema(SCHEMA))]
        assert all(valid(a) for a in answers) and len({json.dumps(a) for a in answers}) > 10
        # JSON mode allows any object: a push toward '}' ends the random model's ones within the budget
        close = engine.tokenizer.encode("}")[0]
        assert all(isinstance(json.loads(t), dict)
                   for t in samples(engine, Guide.json_object(), n=20, logit_bias={close: 3.0}))
        assert all(re.fullmatch(r"[a-c]{2,5}-[0-9]{3}", t) for t in samples(engine, Guide.regex(r"[a-c]{2,5}-[0-9]{3}")))
        picked = samples(engine, Guide.choice(["Tap", "Swipe", "Long Press"]))
        assert set(picked) <= {"Tap", "Swipe", "Long Press"} and len(set(picked)) > 1
        # thoughts and strings close sooner with a push toward '<' and '"' (the grammar still decides)
        lt, quote = (engine.tokenizer.encode(c)[0] for c in ("<", '"'))
        actions = samples(engine, Guide.shipped("autoglm_action"), logit_bias={lt: 4.0, quote: 3.0})
        assert all(ACTION.fullmatch(t) for t in actions), [t for t in actions if not ACTION.fullmatch(t)][:3]


def test_free_output_of_the_tiny_model_is_not_json(glm4v_engine):
    """What the guides fix: without one the same requests give no valid answer."""
    with Engine.load(glm4v_engine) as engine:
        params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=7, n=10)
        [res] = engine.generate([[{"role": "user", "content": "Answer."}]], params)

    def parses(text: str) -> bool:
        try:
            return valid(json.loads(text))
        except (ValueError, AttributeError, TypeError):
            return False

    assert not any(parses(c.text) for c in res.choices)


@pytest.mark.parametrize("guide, message", [
    (Guide.json_schema("{not json"), "not valid JSON"),
    (Guide.regex("(unclosed"), "regex guide is not usable"),
    (Guide.lark("start: undefined_rule"), "lark guide is not usable"),
    (Guide("yaml", "a: 1"), "kind must be one of"),
])
def test_malformed_guides_are_refused_before_any_work(glm4v_engine, guide, message):
    with Engine.load(glm4v_engine) as engine:
        with pytest.raises(AutoGLMError, match=message):  # RequestError, or SamplingError when the params are made
            engine.generate(["hi"], SamplingParams(max_new_tokens=4, guide=guide))
        assert engine.stats()["waiting"] == engine.stats()["running"] == 0


def _grammars(engine_dir, budget_s: float):
    from autoglm_trt.artifacts import Manifest
    from autoglm_trt.runtime.guided import Grammars

    spec = Manifest.read(engine_dir).spec
    return Grammars(engine_dir / "tokenizer.json", spec.vocab_size, list(spec.eos_token_ids), budget_s)


def _busy_until(release, limit_s: float = 30) -> bool:
    """Work (the CPU time a compilation's budget counts) until ``release`` is set."""
    import time

    end = time.monotonic() + limit_s
    while not release.is_set() and time.monotonic() < end:
        sum(range(1000))
    return True


def _slow_grammars(monkeypatch, release, busy: bool = True):
    """Every guide's grammar is made only once ``release`` is set (inside the budgeted compilation),
    working until then (``busy``) or waiting."""
    real = Guide.grammar
    monkeypatch.setattr(Guide, "grammar",
                        lambda self: (_busy_until(release) if busy else release.wait(30)) and real(self))


def test_a_compilation_past_its_budget_is_refused_and_not_kept(glm4v_engine, monkeypatch):
    import threading
    import time

    release = threading.Event()
    _slow_grammars(monkeypatch, release)
    grammars = _grammars(glm4v_engine, budget_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(AutoGLMError, match="took more than 0.3 s of CPU time to compile"):
        grammars.state(Guide.regex("[ab]+"))
    assert time.monotonic() - t0 < 10
    release.set()
    time.sleep(0.5)  # the worker finishes it in the background
    assert not grammars._compiled  # too slow to be kept for the next request
    grammars.close()


def test_the_budgets_count_cpu_time_not_waiting(glm4v_engine, monkeypatch):
    """A compilation that waits (a loaded machine's cores taken by others) past its budget, but works
    little, is kept (past WAIT_FACTOR times the budget its caller gets a BusyError to retry, and it is
    kept still); so is a mask that waits past MASK_BUDGET_S. One that works past it is refused.
    Before, both counted wall time: under load a valid guide was refused, and remembered as refused."""
    import threading
    import time

    from autoglm_trt.errors import BusyError
    from autoglm_trt.runtime import guided

    release = threading.Event()
    _slow_grammars(monkeypatch, release, busy=False)
    threading.Timer(0.8, release.set).start()
    grammars = _grammars(glm4v_engine, budget_s=0.3)
    state = grammars.state(Guide.regex("[ef]+"))
    assert Guide.regex("[ef]+") in grammars._compiled
    # a wait past WAIT_FACTOR times the budget is a BusyError (retry), not the guide's fault: it is kept
    release.clear()
    threading.Timer(10 * 0.3 + 1.0, release.set).start()
    with pytest.raises(BusyError, match="s for the busy grammar workers; retry"):
        grammars.state(Guide.regex("[gh]+"))
    release.wait(30)
    deadline = time.monotonic() + 30
    while grammars._jobs and time.monotonic() < deadline:
        time.sleep(0.02)
    grammars.state(Guide.regex("[gh]+"))
    assert Guide.regex("[gh]+") in grammars._compiled and not grammars._refused
    grammars.close()

    from llguidance.numpy import fill_next_token_bitmask

    def fills(work) -> type:  # llguidance.numpy as GuidedState uses it, the mask's fill doing ``work`` first
        return type("lln", (), {"fill_next_token_bitmask": staticmethod(lambda *a: (work(), fill_next_token_bitmask(*a)))})

    state._filled, state.lln = False, fills(lambda: time.sleep(2 * guided.MASK_BUDGET_S))
    state.fill()  # waited 0.2 s, worked a few ms: no GuideError
    state._filled, state.lln = False, fills(lambda: _busy_until(threading.Event(), 2 * guided.MASK_BUDGET_S))
    with pytest.raises(guided.GuideError, match="ms of CPU time to decide the next token"):
        state.fill()


def test_compilations_queue_within_a_bound_and_the_rest_are_busy(glm4v_engine, monkeypatch):
    """Two workers and a queue of eight: a flood of distinct guides gets ``BusyError`` (the server's
    429) past ten at once, instead of holding every thread that waits for one."""
    import threading
    import time

    from autoglm_trt.errors import BusyError
    from autoglm_trt.runtime.guided import GRAMMAR_CACHE, GRAMMAR_WORKERS, MAX_QUEUED_GRAMMARS

    release = threading.Event()
    _slow_grammars(monkeypatch, release, busy=False)  # waiting, they use no budget
    grammars = _grammars(glm4v_engine, budget_s=60)
    bound = GRAMMAR_WORKERS + MAX_QUEUED_GRAMMARS
    done: list = []
    threads = [threading.Thread(target=lambda k=k: done.append(grammars.state(Guide.regex(f"a{{{k + 1}}}"))))
               for k in range(bound)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while len(grammars._jobs) < bound and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(BusyError, match="retry"):
        grammars.state(Guide.regex("b+"))
    release.set()
    for t in threads:
        t.join(60)
    assert len(done) == bound and len(grammars._compiled) == min(bound, GRAMMAR_CACHE)
    grammars.state(Guide.regex("b+"))  # the queue has room again
    grammars.close()


def test_a_guide_past_its_budget_is_refused_at_once_the_next_time(glm4v_engine, monkeypatch):
    import threading
    import time

    release, calls = threading.Event(), []
    real = Guide.grammar
    monkeypatch.setattr(Guide, "grammar", lambda self: calls.append(1) or (_busy_until(release) and real(self)))
    grammars = _grammars(glm4v_engine, budget_s=0.3)
    with pytest.raises(AutoGLMError, match="took more than"):
        grammars.state(Guide.regex("[cd]+"))
    release.set()
    deadline = time.monotonic() + 10
    while grammars._jobs and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(AutoGLMError, match="took more than"):  # remembered: not compiled again
        grammars.state(Guide.regex("[cd]+"))
    assert len(calls) == 1
    grammars.close()


@pytest.mark.parametrize("guide", [
    # a chain of 1,000 $refs: three levels of JSON, a thousand of llguidance's recursion
    Guide.json_schema({"$ref": "#/$defs/d0", "$defs": {
        **{f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(1000)},
        "d1000": {"type": "integer"}}}),
    Guide.lark("start: r0\n" + "".join(f'r{i}: "x" r{i + 1} | "y"\n' for i in range(3000)) + 'r3000: "z"\n'),
])
def test_deep_grammars_do_not_overflow_a_stack(glm4v_engine, guide):
    """Before, llguidance overflowed a worker thread's 8 MiB stack on these and killed the process (a
    75 KB request): the grammar workers and the engine's loop now run on deep stacks, and the guide is
    compiled and followed, or refused as the client's mistake."""
    with Engine.load(glm4v_engine) as engine:
        try:
            [res] = engine.generate("x", SamplingParams(max_new_tokens=8, guide=guide))
            assert res.finish_reason in ("stop", "length")
        except AutoGLMError as exc:  # a RequestError (a 400), not a crash
            assert "guide" in str(exc)


def test_an_ambiguous_grammar_fails_fast_instead_of_stalling_the_loop(smollm2):
    """``e: e "+" e | e e | ...`` over SmolLM2's 49,152 tokens took 150-660 ms a mask with llguidance's
    default 50,000 Earley items a step (n = 14 held the engine's loop 2.5 s a step); at 5,000 the
    parser gives up within a few tokens, a ``GuideError`` (the server's 400)."""
    import numpy as np

    from autoglm_trt.runtime.guided import Grammars, GuideError

    grammars = Grammars(smollm2 / "tokenizer.json", 49152, [2])
    state = grammars.state(Guide.lark('start: e\ne: e "+" e | e "*" e | e e | "(" e ")" | /[a-z]/\n'))
    rng = np.random.default_rng(0)
    with pytest.raises(GuideError, match="Too many items"):
        for _ in range(200):
            logits = state.masked(np.zeros(49152, np.float32))
            state.accept(int(rng.choice(np.flatnonzero(np.isfinite(logits)))))
    grammars.close()


def test_a_choice_of_thousands_of_options_generates(glm4v_engine):
    """A choice guide is one terminal of the lexer: as a rule of as many alternatives it passed
    llguidance's 2,000 items a row and failed at the first token."""
    import random

    rng = random.Random(3)
    options = sorted({"".join(rng.choice("abcdef") for _ in range(8)) for _ in range(3_000)})
    with Engine.load(glm4v_engine) as engine:
        [res] = engine.generate([[{"role": "user", "content": "Pick."}]], SamplingParams(
            max_new_tokens=16, temperature=1.0, seed=4, n=4, guide=Guide.choice(options)))
    assert len(options) > 2_000 and all(c.text in options and c.finish_reason == "stop" for c in res.choices)


@pytest.mark.parametrize("regex", ["^$", "(|)"])
def test_min_tokens_yields_to_a_grammar_that_allows_only_its_end(glm4v_engine, regex):
    """``min_tokens`` masks the end tokens; a regex that matches only the empty string allows nothing
    else, so every logit would be -inf. The grammar wins: the answer is empty and ends with "stop"
    (the server's fuzzing found this as a 500, "logits that are not finite")."""
    with Engine.load(glm4v_engine) as engine:
        params = SamplingParams(max_new_tokens=1, min_tokens=1, seed=0, guide=Guide.regex(regex))
        [res] = engine.generate(["0"], params)
        assert res.finish_reason == "stop" and res.token_ids == [] and res.text == ""
        # the mask still holds where the grammar allows more than its end
        [held] = engine.generate(["0"], SamplingParams(max_new_tokens=3, min_tokens=3, seed=0,
                                                       guide=Guide.regex("a*")))
        assert held.token_ids and held.text == "a" * len(held.text) and len(held.token_ids) == 3
