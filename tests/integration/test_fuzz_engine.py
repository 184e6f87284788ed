"""Fuzz the engine from 16 threads: a few hundred random requests, 40% of them invalid.

Valid requests include beam searches and seeded parallel samples. Every call returns or raises
an ``AutoGLMError`` subclass within a bound; every valid output (greedy, beams, seeded
samples) equals its solo run; at the end the loop is alive and every block is free.
"""

from __future__ import annotations

import random
import threading

from autoglm_trt.errors import AutoGLMError
from autoglm_trt.runtime import Engine, SamplingParams

REQUESTS = 240
THREADS = 16
BOUND_S = 240


def valid_request(rng: random.Random) -> tuple[object, dict]:
    kind = rng.randrange(3)
    if kind == 0:
        prompt: object = "".join(rng.choice("abcdefgh .,!\n") for _ in range(rng.randrange(1, 30)))
    elif kind == 1:
        prompt = [rng.randrange(3, 256) for _ in range(rng.randrange(1, 30))]
    else:
        prompt = [rng.randrange(3, 256)]
    kw: dict = {"max_new_tokens": rng.randrange(1, 24), "ignore_eos": True}
    shape = rng.random()
    if shape < 0.15:  # a beam search (its beams share blocks, fork and are pruned)
        kw |= {"beam_width": rng.randrange(2, 5)}
        kw["n"] = rng.randrange(1, kw["beam_width"] + 1)
    elif shape < 0.3:  # parallel samples with a seed
        kw |= {"n": rng.randrange(2, 4), "temperature": 1.0, "seed": rng.randrange(100)}
    return prompt, kw


def invalid_request(rng: random.Random) -> tuple[object, dict]:
    choice = rng.randrange(10)
    bad_prompts = [None, 5, 3.5, {"role": "user"}, [None], [1.5, 2], "x\ud800y", [{"role": 1, "content": "a"}],
                   [], [-1], [10**9], "z" * 5000, b"bytes", [[1, 2], "mixed"]]
    if choice < 5:
        return rng.choice(bad_prompts), {"max_new_tokens": 4}
    bad_params = [{"max_new_tokens": 0}, {"max_new_tokens": "3"}, {"temperature": -1.0}, {"temperature": 1e-300},
                  {"top_p": 0.0}, {"top_k": -3}, {"stop": [None]}, {"stop": [""]}, {"seed": -5},
                  {"max_new_tokens": 500}, {"timeout": -1}, {"ignore_eos": None}, {"n": 0}, {"beam_width": 99},
                  {"beam_width": 2, "temperature": 1.0}, {"beam_width": 9}]
    return "valid prompt", rng.choice(bad_params)


def test_fuzz_sixteen_threads(tiny_engine):
    rng = random.Random(1234)
    jobs = [invalid_request(rng) if rng.random() < 0.4 else valid_request(rng) for _ in range(REQUESTS)]
    outcomes: dict[int, object] = {}
    unexpected: list[str] = []
    with Engine.load(tiny_engine, num_blocks=24) as engine:

        def worker(k: int) -> None:
            for i in range(k, REQUESTS, THREADS):
                prompt, kw = jobs[i]
                try:
                    params = SamplingParams(**kw)
                    [res] = engine.generate([prompt], params)
                    outcomes[i] = [c.token_ids for c in res.choices]
                except AutoGLMError as exc:
                    outcomes[i] = exc
                except BaseException as exc:  # noqa: BLE001 - any other type is a finding
                    unexpected.append(f"request {i} {jobs[i]!r:.80}: {type(exc).__name__}: {exc}")
                    outcomes[i] = exc

        threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(BOUND_S)
        assert not any(t.is_alive() for t in threads), "a call did not return within the bound"
        assert not unexpected, unexpected
        assert len(outcomes) == REQUESTS
        valid = [i for i, (p, kw) in enumerate(jobs) if isinstance(outcomes[i], list)]
        assert len(valid) > REQUESTS // 3
        for i in valid:
            prompt, kw = jobs[i]
            [solo] = engine.generate([prompt], SamplingParams(**kw))
            assert [c.token_ids for c in solo.choices] == outcomes[i], f"request {i} differs from its solo run"
        stats = engine.stats()
        assert engine.alive and stats["free_blocks"] == stats["num_blocks"] and stats["running"] == stats["waiting"] == 0
