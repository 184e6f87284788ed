"""Random workloads through the scheduler and a fake step, with no model: progress within a
bound, exact block accounting after every step, every block free at the end."""

from __future__ import annotations

import random

import pytest

from autoglm_trt.kvcache.block_pool import BlockPool
from autoglm_trt.kvcache.layout import blocks_needed
from autoglm_trt.runtime.kv_cache_manager import KVCacheManager
from autoglm_trt.runtime.sampling import SamplingParams
from autoglm_trt.runtime.scheduler import Scheduler, Sequence


def check_blocks(sched: Scheduler) -> None:
    """Free blocks and the running sequences' tables partition the pool exactly."""
    tables = [b for s in sched.running for b in s.cache.block_table]
    free = sched.allocator.free_ids()
    assert len(tables) == len(set(tables)), "a block is in two tables"
    assert not set(tables) & set(free), "a block is both free and in use"
    assert sorted(tables + free) == list(range(sched.allocator.num_blocks))
    for s in sched.waiting:
        assert s.cache.block_table == [] and s.cache.num_computed_tokens == 0
    for s in sched.running:
        assert len(s.cache.block_table) * sched.block_size >= s.cache.num_computed_tokens


def run_workload(rng: random.Random) -> int:
    block_size = rng.choice([1, 2, 4, 16])
    max_seq = rng.randrange(4, 130)
    num_blocks = blocks_needed(max_seq, block_size) + rng.randrange(0, 12)
    max_input = rng.randrange(1, 20)
    sched = Scheduler(KVCacheManager(BlockPool(num_blocks, caching=False), block_size), rng.randrange(1, 9), max_input,
                      max_prefill_tokens=rng.choice([1, 8, 64, 4096]))
    jobs = []
    for _ in range(rng.randrange(1, 12)):
        prompt = rng.randrange(1, max_seq)
        new = rng.randrange(1, max_seq - prompt + 1)
        jobs.append(Sequence([3] * prompt, SamplingParams(max_new_tokens=new)))
    upfront = rng.randrange(0, len(jobs) + 1)  # the rest arrive one per step
    for s in jobs[:upfront]:
        sched.add(s)
    pending = jobs[upfront:]
    work = sum(len(s.prompt_ids) + s.params.max_new_tokens for s in jobs)
    bound = 50 * work + 100  # recomputation after preemption included, generously
    steps = 0
    while sched.has_work() or pending:
        if pending:
            sched.add(pending.pop(0))
        step = sched.schedule()
        assert step is not None, "work is waiting but no step was scheduled"
        check_blocks(sched)
        for i, s in enumerate(step.seqs):
            done = step.completes(i)
            s.cache.num_computed_tokens += len(step.new_tokens[i])
            if done:
                s.output_ids.append(7)
                if len(s.output_ids) >= s.params.max_new_tokens:
                    sched.finish(s, "length")
        check_blocks(sched)
        steps += 1
        assert steps <= bound, "no progress"
    assert sched.allocator.num_free == num_blocks
    assert all(s.finish_reason == "length" and len(s.output_ids) == s.params.max_new_tokens for s in jobs)
    return steps


@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_finish_with_every_block_free(seed):
    rng = random.Random(seed)
    for _ in range(150):
        run_workload(rng)


def test_chunked_recompute_after_preemption_does_not_livelock():
    """The shape of the issue's repro: 3-token prompts, chunks of 3, 8 blocks of 16, all queued first."""
    sched = Scheduler(KVCacheManager(BlockPool(8, caching=False), 16), 16, 3)
    seqs = [Sequence([5, 5, 5], SamplingParams(max_new_tokens=90)) for _ in range(4)]
    for s in seqs:
        sched.add(s)
    for _ in range(20_000):
        step = sched.schedule()
        if step is None:
            break
        for i, s in enumerate(step.seqs):
            done = step.completes(i)
            s.cache.num_computed_tokens += len(step.new_tokens[i])
            if done:
                s.output_ids.append(7)
                if len(s.output_ids) == 90:
                    sched.finish(s, "length")
    assert not sched.has_work() and sched.preemptions > 0 and sched.allocator.num_free == 8
