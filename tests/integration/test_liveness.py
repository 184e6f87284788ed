"""Runtime liveness: no request stops the engine, no livelock, close() and deadlines
release every caller, and no request does unbounded work before a limit applies.

Every wait here has a timeout, so a regression fails instead of hanging the suite.
"""

from __future__ import annotations

import shutil
import threading
from types import SimpleNamespace

import pytest
from conftest import build_tiny_engine, run_cli

from autoglm_trt.errors import AutoGLMError
from autoglm_trt.model.tokenizer import TextTokenizer
from autoglm_trt.runtime import Engine, RequestError, SamplingError, SamplingParams
from autoglm_trt.runtime import engine as engine_module
from autoglm_trt.runtime.request import PromptEncoder

WAIT = 60  # seconds a call may take before the test calls it hung


def call_with_timeout(fn, timeout: float = WAIT):
    """(value, exception) of fn() run in a thread; fails the test if it does not return in time."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"call did not return within {timeout} s"
    return box.get("value"), box.get("error")


# -- 1. one request must not kill the loop -------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"stop": [1]}, "stop strings must be strings"),
    ({"stop": [b"x"]}, "stop strings must be strings"),
    ({"temperature": 1e-310}, "temperature must be >= 0: 0"),
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"seed": -1}, "seed must be an integer >= 0"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"max_new_tokens": True}, "max_new_tokens must be an integer"),
    ({"top_k": "5"}, "top_k must be an integer"),
    ({"top_p": "0.5"}, "top_p must be a finite number"),
    ({"stop": "x" * 2000}, "1 to 1024 characters"),
    ({"timeout": 0}, "timeout must be a positive"),
    ({"ignore_eos": "yes"}, "ignore_eos must be true or false"),
])
def test_sampling_params_check_every_field(kwargs, message):
    with pytest.raises(SamplingError, match=message):
        SamplingParams(**kwargs)


def test_a_failure_while_sampling_fails_that_request_alone(tiny_engine, monkeypatch):
    real = engine_module.sample

    def flaky(logits, params, rng):
        if params.seed == 13:
            raise ValueError("boom")
        return real(logits, params, rng)

    monkeypatch.setattr(engine_module, "sample", flaky)
    with Engine.load(tiny_engine) as engine:
        bad = SamplingParams(max_new_tokens=4, temperature=1.0, seed=13)
        good = SamplingParams(max_new_tokens=4, ignore_eos=True)
        _, err = call_with_timeout(lambda: engine.generate(["The capital of France is"], bad))
        assert isinstance(err, RequestError) and "boom" in str(err)
        [res], err = call_with_timeout(lambda: engine.generate(["The capital of France is"], good))
        assert err is None and len(res.token_ids) == 4
        assert engine.alive and engine.stats()["free_blocks"] == engine.stats()["num_blocks"]


def test_cli_rejects_an_unusable_temperature(tiny_engine):
    r = run_cli("generate", str(tiny_engine), "hello", "--temperature", "1e-310")
    assert r.returncode == 1 and r.stderr.startswith("Error: temperature must be >= 0") and "Traceback" not in r.stderr


# -- 2. no livelock --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cramped_engine(tiny_dir, tmp_path_factory):
    """Prompts prefilled 3 tokens at a time, 8 blocks of 16 for sequences of up to 128 tokens."""
    return build_tiny_engine(tiny_dir, tmp_path_factory.mktemp("cramped") / "e", max_input_len=3, max_seq_len=128,
                             kv_num_blocks=8, kv_block_size=16)


@pytest.mark.parametrize("prompts, new_tokens", [([[5, 5, 5]] * 4, 90), ([[5, 5]] * 6, 100), ([[5, 5, 5]] * 5, 110)])
def test_preempted_sequences_recomputed_in_chunks_finish(cramped_engine, prompts, new_tokens):
    with Engine.load(cramped_engine) as engine:
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        results, err = call_with_timeout(lambda: engine.generate(prompts, params))
        assert err is None and [len(r.token_ids) for r in results] == [new_tokens] * len(prompts)
        solo = engine.generate([prompts[0]], params)[0].token_ids
        assert all(r.token_ids == solo for r in results)
        stats = engine.stats()
        assert stats["preemptions"] > 0 and stats["free_blocks"] == stats["num_blocks"] == 8


# -- 3. close() and deadlines ------------------------------------------------------------------
def test_close_fails_every_waiting_and_running_caller(tiny_engine):
    """Every caller still waiting or running when the engine closes gets the engine's error, and
    none hangs; one may have finished first, and returned its answer. Each decode step is held
    10 ms, so the five requests outlast the check below by a second at least, even on a machine
    whose main thread waits long for a core."""
    engine = Engine.load(tiny_engine, num_blocks=16)
    step = engine.backend.step

    def held_step(feeds, slots):
        threading.Event().wait(0.01)
        return step(feeds, slots)

    engine.backend.step = held_step
    params = SamplingParams(max_new_tokens=70, ignore_eos=True)
    outcomes: list[object] = []
    lock = threading.Lock()
    started = threading.Barrier(6)

    def finish(call) -> None:
        started.wait()
        try:
            call()
            out: object = "returned"
        except AutoGLMError as exc:
            out = exc
        with lock:
            outcomes.append(out)

    calls = [lambda: engine.generate(["long"], params)] * 3 + [lambda: list(engine.stream("streamed", params))] * 2
    threads = [threading.Thread(target=finish, args=(c,), daemon=True) for c in calls]
    for t in threads:
        t.start()
    started.wait()
    for _ in range(WAIT * 100):
        if engine.stats()["running"] > 0 or len(outcomes) == 5:
            break
        threading.Event().wait(0.01)
    assert engine.stats()["running"] > 0, outcomes
    call_with_timeout(engine.close, 30)
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert len(outcomes) == 5
    failed = [o for o in outcomes if isinstance(o, RequestError) and "closed" in str(o)]
    assert failed and len(failed) + outcomes.count("returned") == 5, outcomes
    with pytest.raises(RequestError, match="closed"):
        engine.generate(["after close"])


def test_a_deadline_ends_a_request_with_its_text_so_far(slow_engine):
    # the slow engine: 1,000 tokens take well over a second, the deadline is 50 ms
    with Engine.load(slow_engine) as engine:
        [res], err = call_with_timeout(lambda: engine.generate(
            ["slow"], SamplingParams(max_new_tokens=1000, ignore_eos=True), timeout=0.05))
        assert err is None and res.finish_reason == "timeout" and len(res.token_ids) < 1000
        [res] = engine.generate(["fast"], SamplingParams(max_new_tokens=3, ignore_eos=True, timeout=60))
        assert res.finish_reason == "length"
        assert engine.stats()["free_blocks"] == engine.stats()["num_blocks"]


# -- 4. bounded work per request -----------------------------------------------------------------
def test_a_huge_prompt_is_refused_before_it_is_tokenized(tiny_engine, monkeypatch):
    with Engine.load(tiny_engine) as engine:
        calls = []
        real = engine.tokenizer.encode
        monkeypatch.setattr(engine.tokenizer, "encode", lambda text: calls.append(len(text)) or real(text))
        with pytest.raises(RequestError, match="characters"):
            engine.generate("x" * 20_000_000)
        with pytest.raises(RequestError, match="characters"):
            engine.generate([[{"role": "user", "content": "y" * 20_000_000}]])
        assert calls == []


def _tokenizer_with_template(tmp_path, tiny_engine, template: str) -> TextTokenizer:
    d = tmp_path / "tok"
    d.mkdir()
    shutil.copy(tiny_engine / "tokenizer.json", d / "tokenizer.json")
    (d / "chat_template.jinja").write_text(template)
    return TextTokenizer(d)


@pytest.mark.parametrize("template, message", [
    ("{{ 'ab' * 10**8 }}", "repeated sequence"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "loops more than"),
    ("{{ 'a'.ljust(10**9) }}", "called a function"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deeply"),
    ("{{ messages[0]['content'] + 1 }}", "failed on these messages"),
    ("{{ raise_exception('no system role') }}", "no system role"),
])
def test_hostile_chat_templates_fail_the_request(tmp_path, tiny_engine, template, message):
    tok = _tokenizer_with_template(tmp_path, tiny_engine, template)
    _, err = call_with_timeout(lambda: tok.apply_chat_template([{"role": "user", "content": "hi"}]), 30)
    assert isinstance(err, RequestError) and message in str(err), err


def test_list_form_chat_template_uses_the_default(tmp_path, tiny_engine):
    d = tmp_path / "tok"
    d.mkdir()
    shutil.copy(tiny_engine / "tokenizer.json", d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text('{"chat_template": [{"name": "tool_use", "template": "T"}, '
                                             '{"name": "default", "template": "D{{ messages[0].content }}"}]}')
    tok = TextTokenizer(d)
    assert tok.tok.decode(tok.apply_chat_template([{"role": "user", "content": "hi"}])) == "Dhi"


# -- 5. smaller holes ------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt, message", [
    ({"role": "user", "content": "hi"}, "single chat message"),
    (None, "a prompt is a string"),
    (5, "a prompt is a string"),
    ("bad \ud800 surrogate", "not valid Unicode"),
    ([{"role": "user", "content": None}], "needs a 'content' string"),
    ([{"role": "user", "content": 7}], "needs a 'content' string"),
    ([{"content": "no role"}], "needs a 'role' string"),
    ([True, 1], "a prompt is a string"),
    ([], None),
])
def test_malformed_prompts_are_request_errors(tiny_engine, prompt, message):
    with Engine.load(tiny_engine) as engine:
        if message is None:
            assert engine.generate(prompt) == []
            return
        with pytest.raises(RequestError, match=message):
            engine.generate(prompt)
        assert engine.alive


def test_stream_holds_back_a_possible_stop_string(tiny_engine):
    with Engine.load(tiny_engine) as engine:
        [ref] = engine.generate(["stop test"], SamplingParams(max_new_tokens=30, ignore_eos=True))
        stop = ref.text[6:8]
        params = SamplingParams(max_new_tokens=30, ignore_eos=True, stop=(stop, "\x00never"))
        [res] = engine.generate(["stop test"], params)
        pieces = list(engine.stream("stop test", params))
        assert res.finish_reason == "stop" and "".join(pieces) == res.text == ref.text[: ref.text.find(stop)]


def test_threads_are_bounded(tiny_engine):
    with pytest.raises(AutoGLMError, match="threads must be an integer from 0"):
        Engine.load(tiny_engine, threads=10**6)
    with pytest.raises(AutoGLMError, match="spinning must be True or False"):
        Engine.load(tiny_engine, spinning="no")


def test_prompt_encoder_bound_follows_the_longest_token(tiny_engine):
    tok = TextTokenizer(tiny_engine)
    enc = PromptEncoder(tok, 256, max_prompt_tokens=10)
    assert tok.max_token_chars == 1 and enc.max_chars == 2 * 10 + 1024
    with pytest.raises(RequestError, match="1045 characters"):
        enc.encode("z" * 1045)


def test_a_rendered_chat_past_the_bound_is_refused_before_tokenizing(tiny_engine, tmp_path, monkeypatch):
    """Text outside the messages' content (here a tool's description) counts too: the template's
    output is measured before the tokenizer reads it."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tiny_engine / name).is_file():
            shutil.copy(tiny_engine / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for t in tools or [] %}{{ t.function.description }}{% endfor %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}")
    tok = TextTokenizer(tmp_path)
    enc = PromptEncoder(tok, 256, max_prompt_tokens=10)
    tools = [{"type": "function", "function": {"name": "f", "description": "d" * (enc.max_chars + 1)}}]
    read: list[str] = []
    encode = tok.tok.encode
    monkeypatch.setattr(tok, "tok", SimpleNamespace(encode=lambda text, **kw: read.append(text) or encode(text, **kw)))
    with pytest.raises(RequestError, match=f"made {enc.max_chars + 2} characters of these messages and tools"):
        enc.encode_with_images([{"role": "user", "content": "z"}], tools=tools)
    assert read == []
    assert enc.encode_with_images([{"role": "user", "content": "z"}], tools=tools[:0])[0] == encode("z").ids


@pytest.mark.parametrize("moment", ["after_scheduling", "model"])
def test_a_request_cancelled_mid_step_fails_no_other(tiny_engine, monkeypatch, moment):
    """A client that leaves while its request is in a step (its blocks freed from another thread)
    must not fail the step's other requests. Before, the step's inputs were read from its sequences
    after the loop let go of its lock: a cancel waiting for the lock got in first, emptied the leaving
    request's block table, the inputs failed ("block table does not cover the new tokens") and every
    request of the step with them (the load test's attackers leaving requests did it every few seconds)."""
    pending: list[threading.Thread] = []

    class Handoff(threading.Condition):
        """The engine loop's lock; a cancel started while the loop held it runs as soon as it is let go."""

        def __exit__(self, *exc):
            out = super().__exit__(*exc)
            if pending and threading.current_thread().name == "autoglm-scheduler":
                pending.pop().join(30)
            return out

    monkeypatch.setattr(engine_module.threading, "Condition", Handoff)
    with Engine.load(tiny_engine) as engine:
        reqs: list = []
        fired = threading.Event()

        def cancel_first() -> threading.Thread:
            fired.set()
            leaving = threading.Thread(target=engine.cancel, args=(reqs[0],))
            leaving.start()
            return leaving

        real_schedule, real_step = engine.scheduler.schedule, engine.backend.step

        def schedule():
            step = real_schedule()
            if moment == "after_scheduling" and step is not None and len(step.seqs) == 2 and not fired.is_set():
                pending.append(cancel_first())  # it waits for the lock, which the loop holds now
            return step

        def step(feeds, slots):
            if moment == "model" and feeds["input_ids"].shape[0] == 2 and not fired.is_set():
                cancel_first().join(30)  # nothing holds the lock while the model runs
            return real_step(feeds, slots)

        monkeypatch.setattr(engine.scheduler, "schedule", schedule)
        monkeypatch.setattr(engine.backend, "step", step)
        params = SamplingParams(max_new_tokens=12, ignore_eos=True)
        reqs += engine._queue([engine._prepare([5, 6, 7], params, False, None),
                               engine._prepare([8, 9, 10, 11], params, False, None)])
        kept, error = call_with_timeout(lambda: engine.outcome(reqs[1]))
        assert fired.is_set() and error is None and len(kept.token_ids) == 12
        left, _ = call_with_timeout(lambda: engine.outcome(reqs[0]))
        assert left.finish_reason == "cancelled" and engine.stats()["free_blocks"] == engine.stats()["num_blocks"]
