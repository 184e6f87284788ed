"""The runtime on a tiny model engine: load test, streaming, stop strings, bad input, corruption."""

import json
import random
import threading

import numpy as np
import pytest
from conftest import run_cli

from autoglm_trt.artifacts import EngineError
from autoglm_trt.backends.onnxrt.offline import GraphRunner
from autoglm_trt.errors import AutoGLMError
from autoglm_trt.runtime import Engine, RequestError, SamplingError, SamplingParams


def test_load_test_small_pool_many_threads(tiny_engine):
    """200 requests of random lengths from 8 threads through a pool far smaller than the demand."""
    rng = random.Random(0)
    jobs = [([rng.randrange(3, 250) for _ in range(rng.randrange(1, 40))], rng.randrange(1, 40)) for _ in range(200)]
    demand = sum(-(-(len(p) + n) // 8) for p, n in jobs)
    with Engine.load(tiny_engine) as solo:
        expected = [solo.generate([p], SamplingParams(max_new_tokens=n, ignore_eos=True))[0].token_ids for p, n in jobs]
    with Engine.load(tiny_engine, num_blocks=16) as engine:
        assert demand > 10 * engine.allocator.num_blocks
        got: dict[int, list[int]] = {}
        errors = []

        def worker(k: int) -> None:
            try:
                for i in range(k, len(jobs), 8):
                    p, n = jobs[i]
                    [res] = engine.generate([p], SamplingParams(max_new_tokens=n, ignore_eos=True))
                    assert res.finish_reason == "length"
                    got[i] = res.token_ids
            except Exception as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not errors and len(got) == len(jobs)
        for i, tokens in got.items():
            assert tokens == expected[i], f"request {i} differs from its solo run"
        stats = engine.stats()
        assert stats["free_blocks"] == stats["num_blocks"] == 16
        assert stats["running"] == stats["waiting"] == 0
        assert stats["preemptions"] > 0  # the pool really was too small


def test_stream_pieces_join_to_the_generated_text(tiny_engine):
    with Engine.load(tiny_engine) as engine:
        params = SamplingParams(max_new_tokens=20, temperature=0.9, seed=3, ignore_eos=True)
        [full] = engine.generate(["Hello there"], params)
        pieces = list(engine.stream("Hello there", params))
        assert "".join(pieces) == full.text and len(pieces) > 1


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_engine):
    with Engine.load(tiny_engine) as engine:
        params = SamplingParams(max_new_tokens=16, temperature=1.0, top_k=50, top_p=0.9, seed=11, ignore_eos=True)
        alone = engine.generate(["abc"], params)[0].token_ids
        batch = engine.generate(["abc", "a different prompt", "xyz"], params)
        assert batch[0].token_ids == alone


def test_stop_string_truncates(tiny_engine):
    with Engine.load(tiny_engine) as engine:
        [ref] = engine.generate(["stop test"], SamplingParams(max_new_tokens=30, ignore_eos=True))
        stop = ref.text[5:8]
        assert len(stop) == 3
        [res] = engine.generate(["stop test"], SamplingParams(max_new_tokens=30, ignore_eos=True, stop=(stop,)))
        assert res.finish_reason == "stop" and res.text == ref.text[: ref.text.find(stop)]


def test_bad_requests(tiny_engine):
    with Engine.load(tiny_engine) as engine:
        with pytest.raises(RequestError, match="at most 32 prompt tokens"):  # 96 - 64 new tokens
            engine.generate([list(range(3, 60))])
        with pytest.raises(RequestError, match="max_seq_len 96"):
            engine.generate(["hi"], SamplingParams(max_new_tokens=95))
        with pytest.raises(RequestError, match="outside the vocabulary"):
            engine.generate([[1, 2, 9999]])
        with pytest.raises(AutoGLMError, match="no chat template"):
            engine.generate([[{"role": "user", "content": "hi"}]])
    with pytest.raises(SamplingError, match="top_p"):
        SamplingParams(top_p=1.5)


def test_a_batch_is_checked_whole_and_prefilled_in_one_step(tiny_engine):
    """``generate``'s prompts: one bad prompt queues none of them (nothing is left running for a
    call that raised), and the good ones are queued together, so their first step prefills them
    all (not the first alone because the loop woke before the others were queued)."""
    with Engine.load(tiny_engine) as engine:
        with pytest.raises(RequestError, match="outside the vocabulary"):
            engine.generate([[5, 6, 7], [1, 2, 9999]], SamplingParams(max_new_tokens=50, ignore_eos=True))
        stats = engine.stats()
        assert stats["waiting"] == stats["running"] == 0
        batches = []
        step = engine.backend.step

        def counting(feeds, slots):
            batches.append(feeds["input_ids"].shape)
            return step(feeds, slots)

        engine.backend.step = counting
        for _ in range(5):  # the loop thread races each call's submissions: give it chances to win
            batches.clear()
            engine.generate([[5 + i, 6, 7, 8] for i in range(6)], SamplingParams(max_new_tokens=2, ignore_eos=True))
            assert batches[0] == (6, 4), batches


def test_missing_and_corrupt_engine(tiny_engine, tmp_path):
    with pytest.raises(EngineError, match="does not exist"):
        Engine.load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EngineError, match="no manifest.json"):
        Engine.load(tmp_path / "empty")
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_engine, broken)
    data = broken / "model.opt.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(EngineError, match="corrupt"):
        Engine.load(broken)
    r = run_cli("doctor", str(broken))
    assert r.returncode == 1 and "PROBLEM" in r.stdout and "model.opt.onnx.data is corrupt" in r.stdout
    ok = run_cli("doctor", str(tiny_engine))
    assert ok.returncode == 0 and "ready to run here" in ok.stdout and "vision encoder" not in ok.stdout


def test_generate_cli(tiny_engine):
    r = run_cli("generate", str(tiny_engine), "Once upon", "--max-new-tokens", "5", "--stream")
    assert r.returncode == 0, r.stderr
    r = run_cli("generate", str(tiny_engine), "x" * 200)
    assert r.returncode == 1 and "at most 32 prompt tokens" in r.stderr


def test_bench_cli_json_and_plot(tiny_engine, tmp_path):
    r = run_cli("bench", str(tiny_engine), "--concurrency", "1,2", "--prompt-len", "8", "--gen-len", "8", "--json",
                "--plot", str(tmp_path / "b.png"))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["concurrency"] for x in rows] == [1, 2]
    assert all(x["tokens_per_s"] > 0 and x["token_ms_p50"] <= x["token_ms_p99"] for x in rows)
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prompts_longer_than_one_prefill_chunk(tiny_engine):
    """max_input_len (48 here) bounds a prefill chunk, not a prompt: 80 tokens go in two chunks,
    and the first token sampled is the argmax of a one-shot prefill of all 80 on the same graph."""
    prompt = [(7 * i) % 250 + 3 for i in range(80)]
    with Engine.load(tiny_engine, prefix_caching=False) as engine:
        [res] = engine.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))
        assert len(res.token_ids) == 8 and res.prompt_tokens == 80
        one_shot = GraphRunner(tiny_engine).logits(np.asarray([prompt], np.int64))[0, -1]
        assert res.token_ids[0] == int(np.argmax(one_shot))
        with pytest.raises(RequestError, match="at most 88 prompt tokens"):
            engine.generate([prompt + [5] * 9], SamplingParams(max_new_tokens=8))
