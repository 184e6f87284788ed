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


def _slow_grammars(monkeypatch, release):
    """Every guide's grammar is made only once ``release`` is set (inside the budgeted compilation)."""
    real = Guide.grammar
    monkeypatch.setattr(Guide, "grammar", lambda self: release.wait(30) and real(self))


def test_a_compilation_past_its_budget_is_refused_and_not_kept(glm4v_engine, monkeypatch):
    import threading
    import time

    release = threading.Event()
    _slow_grammars(monkeypatch, release)
    grammars = _grammars(glm4v_engine, budget_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(AutoGLMError, match="took more than 0.3 s to compile"):
        grammars.state(Guide.regex("[ab]+"))
    assert time.monotonic() - t0 < 10
    release.set()
    time.sleep(0.5)  # the worker finishes it in the background
    assert not grammars._compiled  # too slow to be kept for the next request
    grammars.close()


def test_compilations_queue_within_a_bound_and_the_rest_are_busy(glm4v_engine, monkeypatch):
    """Two workers and a queue of eight: a flood of distinct guides gets ``BusyError`` (the server's
    429) past ten at once, instead of holding every thread that waits for one."""
    import threading
    import time

    from autoglm_trt.errors import BusyError
    from autoglm_trt.runtime.guided import GRAMMAR_WORKERS, MAX_QUEUED_GRAMMARS

    release = threading.Event()
    _slow_grammars(monkeypatch, release)
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
    assert len(done) == bound and len(grammars._compiled) == bound
    grammars.state(Guide.regex("b+"))  # the queue has room again
    grammars.close()
