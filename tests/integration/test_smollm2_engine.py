"""SmolLM2-135M engines: greedy output equals transformers, solo and batched; the INT8 gate."""

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from conftest import ROOT

from autoglm_trt.builder.config import BuildConfig
from autoglm_trt.builder.pipeline import BuildRequest, build_engine
from autoglm_trt.evaluate.perplexity import evaluate
from autoglm_trt.runtime import Engine, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "Hi! Who are you, and what can you do? Answer in detail.",
    "Tell me a story about a dragon.",
    "Write a poem about the sea and the stars at night.",
    "Explain how photosynthesis works, step by step, for a ten year old.",
    "What are the three most important things to know before adopting a dog, and why does each matter?",
    "Write an essay about why reading books matters, for students who would rather watch videos all day long "
    "instead of reading anything at all.",
    "Describe a typical day in the life of a medieval farmer, from sunrise to sunset, including the work, the food "
    "and the worries.",
    "Give me a recipe for pancakes.",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def fp32_engine(smollm2, tmp_path_factory):
    out = tmp_path_factory.mktemp("smol-eng") / "fp32"
    build_engine(BuildRequest(smollm2, out, precision="fp32", backend="onnxruntime",
                              config=BuildConfig(max_batch_size=8, max_seq_len=512, max_input_len=256),
                              cache_dir=out.parent / ".cache"), log=lambda m: None)
    return out


@pytest.fixture(scope="module")
def reference(smollm2):
    """transformers greedy continuations (64 new tokens or up to EOS) of the chat-formatted prompts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2))
    model = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32)
    out = []
    for p in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                      return_dict=True)["input_ids"]
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=NEW_TOKENS, do_sample=False)
        out.append((list(ids), gen[0, len(ids):].tolist()))
    return model, out


def assert_same_or_near_tie(model, prompt_ids, ours, ref, eos):
    import torch

    ref = [t for t in ref if t not in eos]
    if ours == ref:
        return
    k = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + ref[:k]])).logits[0, -1].numpy()
    top2 = np.sort(logits)[-2:]
    assert top2[1] - top2[0] < 1e-3, f"diverged at token {k} without a near-tie (gap {top2[1] - top2[0]:.4g})"


def test_prompt_ids_match_transformers_chat_template(fp32_engine, reference):
    _, ref = reference
    with Engine.load(fp32_engine) as engine:
        for p, (ids, _) in zip(PROMPTS, ref):
            assert engine.encode([{"role": "user", "content": p}]) == ids
    assert len({len(ids) for ids, _ in ref}) == len(PROMPTS)  # all different lengths


def test_greedy_equals_transformers_solo_and_concurrent(fp32_engine, reference):
    model, ref = reference
    eos = {2}
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    assert sum(len(r) == NEW_TOKENS for _, r in ref) >= 6  # most run the full 64 tokens
    with Engine.load(fp32_engine) as engine:
        solo = [engine.generate([ids], params)[0].token_ids for ids, _ in ref]
        together: list = [None] * len(ref)

        def run(i):
            together[i] = engine.generate([ref[i][0]], params)[0].token_ids

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ref))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        batched = [r.token_ids for r in engine.generate([ids for ids, _ in ref], params)]
    for (ids, r), a, b, c in zip(ref, solo, together, batched):
        for ours in (a, b, c):
            assert_same_or_near_tie(model, ids, ours, r, eos)


INT8_CONFIG = "max_batch_size: 8\nmax_seq_len: 512\nmax_input_len: 256\n"


@pytest.fixture(scope="module")
def int8_engine(smollm2, tmp_path_factory):
    """SmolLM2 int8 with this machine's best native build (its build cache beside it)."""
    out = tmp_path_factory.mktemp("smol-int8") / "int8"
    build_engine(BuildRequest(smollm2, out, precision="int8", backend="onnxruntime",
                              config=BuildConfig(max_batch_size=8, max_seq_len=512, max_input_len=256),
                              cache_dir=out.parent / ".cache"), log=lambda m: None)
    return out


def test_int8_engine_meets_the_accuracy_gate(smollm2, int8_engine):
    manifest = json.loads((int8_engine / "manifest.json").read_text())
    calib = json.loads((int8_engine / "calib.json").read_text())
    assert manifest["precision"] == "int8" and calib["gate"]["result"]["passed"]
    res = evaluate(int8_engine, ROOT / "calibration" / "eval" / "heldout.txt", reference=smollm2, max_chunks=24)
    assert res["ppl_ratio"] <= 1.02 and res["top1_agreement"] >= 0.90, res


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the native library is built for Linux only")
def test_the_demo_answer_is_the_float_models_on_every_native_build_and_the_plain_graph(smollm2, int8_engine):
    """``make engine``'s question, answered by the int8 engine built with each native library this CPU
    runs (each build packs its own weights) and by its plain graph (no native library), is the
    float32 model's answer token for token (``tools/demo_answer.py --check``, what make engine runs)."""
    from autoglm_trt import native

    config = int8_engine.parent / "config.yaml"
    config.write_text(INT8_CONFIG)
    best = native.variant_of(native.library()[0])
    runs = [(best, {}, int8_engine), ("plain graph", {"AUTOGLM_TRT_NATIVE": "0"}, int8_engine)]
    for variant in [v for v in native.installed() if v != best and native.library(v)[0] is not None]:
        env = {**os.environ, "AUTOGLM_TRT_NATIVE_VARIANT": variant}
        out = int8_engine.parent / variant  # the same build cache: the calibration is reused
        r = subprocess.run([sys.executable, "-m", "autoglm_trt", "build", str(smollm2), "--precision", "int8", "-o",
                            str(out), "--config", str(config)], capture_output=True, text=True, cwd=ROOT, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        runs.append((variant, {"AUTOGLM_TRT_NATIVE_VARIANT": variant}, out))
    assert len(runs) >= 3  # x86-64: at least the generic build besides the best
    for name, env, engine in runs:
        r = subprocess.run([sys.executable, str(ROOT / "tools" / "demo_answer.py"), str(engine), "--check"],
                           capture_output=True, text=True, cwd=ROOT, env={**os.environ, **env})
        assert r.returncode == 0, (name, r.stdout, r.stderr[-2000:])
        said = "no native library" if name == "plain graph" else f"native library: the {name} build"
        assert said in r.stdout and "the same answer, token for token" in r.stdout, (name, r.stdout)


@pytest.mark.slow
def test_multi_turn_agent_trace_same_with_and_without_prefix_caching(fp32_engine):
    """An agent loop (a long system prompt, then turns that resend the history plus a new
    observation, 3 agents at once): greedy answers are identical with and without prefix
    caching, and the cached run serves most prompt tokens from the cache."""
    from autoglm_trt.model.tokenizer import TextTokenizer

    tok = TextTokenizer(fp32_engine)
    text = tok.encode((ROOT / "autoglm_trt" / "calib" / "data" / "10_json.txt").read_text())
    system, observations = text[:300], [text[300 + 40 * k: 340 + 40 * k] for k in range(9)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    answers = {}
    for caching in (False, True):
        with Engine.load(fp32_engine, prefix_caching=caching) as engine:
            histories = [list(system) for _ in range(3)]
            answers[caching] = []
            for turn in range(3):
                for a in range(3):
                    histories[a] += observations[3 * a + turn]
                results = engine.generate(histories, params)  # the three agents' turns run together
                for a, r in enumerate(results):
                    histories[a] += r.token_ids
                    answers[caching].append(r.token_ids)
            stats = engine.stats()
    assert answers[True] == answers[False]
    assert stats["prefix_hit_tokens"] > 0.6 * stats["prefix_queried_tokens"]
    assert stats["free_blocks"] == stats["num_blocks"]


@pytest.mark.slow
def test_beam_search_equals_transformers_num_beams(fp32_engine, reference):
    """Every one of the 4 beams (tokens, and scores to float rounding) equals transformers'
    ``generate(num_beams=4, do_sample=False, num_return_sequences=4)``, run concurrently, with
    the default length penalty (1.0) and early stopping (False)."""
    import torch

    model, ref = reference
    eos = [2]
    prompts = [ids for ids, _ in ref[:4]]
    params = SamplingParams(max_new_tokens=32, beam_width=4, n=4)
    with Engine.load(fp32_engine) as engine:
        ours = engine.generate(prompts, params)
        stats = engine.stats()
    assert stats["free_blocks"] == stats["num_blocks"] and sum(engine.allocator.ref_cnt) == 0
    for ids, res in zip(prompts, ours):
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=32, do_sample=False, num_beams=4, num_return_sequences=4,
                                 eos_token_id=eos, pad_token_id=eos[0], output_scores=True,
                                 return_dict_in_generate=True)
        theirs = [row[: row.index(2)] if 2 in row else row for row in out.sequences[:, len(ids):].tolist()]
        assert [c.token_ids for c in res.choices] == theirs
        assert [c.score for c in res.choices] == pytest.approx(out.sequences_scores.tolist(), abs=1e-3)
        assert res.token_ids == theirs[0] and res.finish_reason == ("stop" if len(theirs[0]) < 32 else "length")
