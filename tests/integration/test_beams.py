"""Parallel sampling and beam search over shared blocks: the beam search's decisions to
exact values, fork and copy-on-write block states without a model, then real engines."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from autoglm_trt.errors import RequestError
from autoglm_trt.kvcache.block_pool import BlockPool
from autoglm_trt.runtime import Engine, SamplingParams
from autoglm_trt.runtime.beam import BeamSearch, Hypothesis
from autoglm_trt.runtime.kv_cache_manager import KVCacheManager
from autoglm_trt.runtime.scheduler import Scheduler, Sequence

BS = 4


def logits(*p: float) -> np.ndarray:
    """Logits whose log-softmax is log(p) (p sums to 1)."""
    return np.log(np.array(p, np.float64))


def test_beam_search_steps_to_exact_hypotheses():
    search = BeamSearch(width=2, eos_ids=[0], max_new_tokens=3)
    assert search.keep == 4
    # step 1: candidates 1 (.5), 2 (.3), then the tie 0 / 3 (.1) by token id; EOS 0 is ranked 3rd: not finished
    assert search.step([logits(0.1, 0.5, 0.3, 0.1)]) == [(0, 1), (0, 2)]
    assert search.finished == [] and [b for b, _ in search.beams] == [(1,), (2,)]
    # step 2: beam (1,) then EOS has .5 x .6 = .30, the best: it finishes with score log(.30) / 2
    picks = search.step([logits(0.6, 0.2, 0.1, 0.1), logits(0.05, 0.05, 0.8, 0.1)])
    assert picks == [(1, 2), (0, 1)]  # (2, 2) at .24, (1, 1) at .10
    assert search.finished == [Hypothesis((1,), pytest.approx(math.log(0.30) / 2), True)]
    assert search.beams[0] == ((2, 2), pytest.approx(math.log(0.24)))
    # step 3 is the last token: every candidate ends; the two best of rank < 2 are scored by length 3
    assert search.step([logits(0.1, 0.7, 0.1, 0.1), logits(0.25, 0.25, 0.25, 0.25)]) == []
    assert search.done
    assert search.best(2) == [Hypothesis((2, 2, 1), pytest.approx(math.log(0.168) / 3), False),
                              Hypothesis((1,), pytest.approx(math.log(0.30) / 2), True)]


@pytest.mark.parametrize("early_stopping, done", [(False, True), (True, True), ("never", False)])
def test_early_stopping_as_transformers_defines_it(early_stopping, done):
    # width 1: EOS at .6 finishes (score log .6); the running beam has log .4: by the current length it
    # cannot win (stop), but divided by max_new_tokens ** 1 ("never") it might (go on)
    search = BeamSearch(width=1, eos_ids=[0], max_new_tokens=10, early_stopping=early_stopping)
    picks = search.step([logits(0.6, 0.4)])
    assert search.done is done and picks == ([] if done else [(0, 1)])
    assert search.finished == [Hypothesis((), pytest.approx(math.log(0.6)), True)]


def test_length_penalty_scales_finished_scores():
    search = BeamSearch(width=1, eos_ids=[0], max_new_tokens=2, length_penalty=2.0, early_stopping="never")
    assert search.step([logits(0.2, 0.8)]) == [(0, 1)]  # EOS ranks 2nd: not finished at width 1
    assert search.step([logits(0.5, 0.5)]) == []  # the last token: EOS wins the tie by its lower id
    assert search.best(1) == [Hypothesis((1,), pytest.approx(math.log(0.4) / 2**2), True)]


def prefilled(sched: Scheduler, tokens: list[int]) -> Sequence:
    s = Sequence(tokens, SamplingParams(max_new_tokens=8))
    sched.add(s)
    step = sched.schedule()
    assert step is not None and step.seqs == [s]
    sched.computed(s, len(step.new_tokens[0]))
    return s


def test_a_beam_group_holds_a_copy_of_the_logits_it_waits_with():
    """The runner's next step may overwrite the logits it returned (``StepRunner.step``); a beam
    that reported waits for the others with its own copy."""
    from autoglm_trt.runtime.groups import BeamGroup

    root = Sequence([5, 6, 7], SamplingParams(beam_width=2, max_new_tokens=4))
    group = BeamGroup(root, [0])
    buffer = logits(0.1, 0.5, 0.3, 0.1).astype(np.float32)
    expected = buffer.copy()
    assert group.report(root, buffer)
    buffer[:] = 0  # the runner's next step
    np.testing.assert_array_equal(group.logits[root.seq_id], expected)


def test_fork_shares_blocks_and_copies_the_partial_block_on_write():
    pool = BlockPool(8)
    sched = Scheduler(KVCacheManager(pool, BS), 4, 16)
    a = prefilled(sched, [1, 2, 3, 4, 5, 6])  # block 0 full, block 1 holds 2 tokens
    b = sched.fork(a)
    assert b.cache.block_table == [0, 1] and b.cache.num_computed_tokens == 6 and sched.running == [a, b]
    assert pool.ref_cnt[:3] == [2, 2, 0]
    assert pool.num_blocks - pool.num_free == 2  # shared blocks are counted once
    a.output_ids.append(7)
    b.output_ids.append(8)
    step = sched.schedule()
    assert step is not None and not step.prefill and step.seqs == [a, b]
    # a writes first into the shared partial block 1: it gets block 2, a copy of 1; b then owns 1 alone
    assert step.copies == [(1, 2)]
    assert a.cache.block_table == [0, 2] and b.cache.block_table == [0, 1] and pool.ref_cnt[:3] == [2, 1, 1]
    for s in (a, b):
        sched.computed(s, 1)
    sched.finish(a, "length")
    sched.finish(b, "length")
    assert pool.num_free == 8 and sum(pool.ref_cnt) == 0


def test_full_blocks_are_never_copied():
    pool = BlockPool(8)
    sched = Scheduler(KVCacheManager(pool, BS), 4, 16)
    a = prefilled(sched, [1, 2, 3, 4, 5, 6, 7, 8])  # two full blocks: the next token opens block 3
    b = sched.fork(a)
    a.output_ids.append(9)
    b.output_ids.append(9)
    step = sched.schedule()
    assert step is not None and step.copies == []
    assert a.cache.block_table == [0, 1, 2] and b.cache.block_table == [0, 1, 3] and pool.ref_cnt[:4] == [2, 2, 1, 1]


def test_a_fork_without_a_running_slot_waits_to_recompute():
    sched = Scheduler(KVCacheManager(BlockPool(8), BS), 1, 16)
    a = prefilled(sched, [1, 2, 3])
    b = sched.fork(a)
    assert b in sched.waiting and b.cache.block_table == [] and b.prompt_ids == a.prompt_ids


def test_an_idle_sequence_is_preempted_when_nothing_else_can_run():
    sched = Scheduler(KVCacheManager(BlockPool(8), BS), 1, 16)
    a = prefilled(sched, [1, 2, 3])  # computed, nothing sampled yet: idle (a beam waiting for its siblings)
    b = Sequence([4, 5], SamplingParams())
    sched.add(b)
    step = sched.schedule()
    assert step is not None and step.seqs == [b] and a in sched.waiting and a.preemptions == 1


# -- engines -------------------------------------------------------------------------


def test_parallel_samples_share_the_prompt_and_follow_their_seeds(tiny_engine):
    ids = list(range(5, 30))
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    with Engine.load(tiny_engine) as engine:
        [one] = engine.generate([ids], params)
        [many] = engine.generate([ids], dataclasses.replace(params, n=4))
        stats = engine.stats()
        pool = engine.allocator
    assert len(many.choices) == 4 and many.token_ids == one.token_ids == many.choices[0].token_ids
    assert len({tuple(c.token_ids) for c in many.choices}) >= 3  # their own random streams
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in many.choices)
    assert stats["free_blocks"] == stats["num_blocks"] and sum(pool.ref_cnt) == 0


def test_beam_search_is_the_same_with_a_pool_too_small_for_its_beams(tiny_engine):
    ids = list(range(3, 40))
    params = SamplingParams(max_new_tokens=24, beam_width=4, n=4, ignore_eos=True)
    with Engine.load(tiny_engine) as engine:
        [roomy] = engine.generate([ids], params)
    with Engine.load(tiny_engine, num_blocks=10) as engine:  # 4 beams of 61 tokens need up to 32 blocks
        [tight] = engine.generate([ids], params)
        preempted, free = engine.stats()["preemptions"], engine.stats()["free_blocks"]
    assert preempted > 0 and free == 10
    assert [c.token_ids for c in tight.choices] == [c.token_ids for c in roomy.choices]
    assert [c.score for c in tight.choices] == pytest.approx([c.score for c in roomy.choices], abs=1e-4)
    scores = [c.score for c in roomy.choices]
    assert scores == sorted(scores, reverse=True) and len(roomy.token_ids) == 24


def test_beam_and_sample_requests_that_cannot_run_are_refused(tiny_engine):
    with Engine.load(tiny_engine) as engine:
        with pytest.raises(RequestError, match="max_batch_size 8"):
            engine.generate([[1, 2, 3]], SamplingParams(beam_width=9))
        with pytest.raises(RequestError, match="a stream carries one sequence"):
            list(engine.stream([1, 2, 3], SamplingParams(n=2)))
        [timed_out] = engine.generate([[1, 2, 3]], SamplingParams(beam_width=2, max_new_tokens=40), timeout=1e-9)
        assert timed_out.finish_reason == "timeout" and engine.stats()["free_blocks"] == engine.stats()["num_blocks"]
