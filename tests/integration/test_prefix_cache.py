"""Prefix caching and priorities: exact block ids, reference counts, the hash table and
the evictable list after each step (no model), then greedy equality on a real engine."""

from __future__ import annotations

import itertools

import pytest

from autoglm_trt.kvcache.block_pool import ROOT_HASH, BlockPool, block_hash, chained_hashes
from autoglm_trt.runtime import Engine, SamplingParams
from autoglm_trt.runtime import scheduler as scheduler_module
from autoglm_trt.runtime.kv_cache_manager import KVCacheManager
from autoglm_trt.runtime.scheduler import Scheduler, Sequence

BS = 4


def seq(tokens, max_new=4, priority=0):
    return Sequence(list(tokens), SamplingParams(max_new_tokens=max_new, priority=priority))


def run_step(sched: Scheduler, token: int = 99) -> list[Sequence]:
    """Schedule a step and do what the engine does after it; return the sequences that finished."""
    step = sched.schedule()
    assert step is not None
    done = []
    for i, s in enumerate(step.seqs):
        complete = step.completes(i)
        sched.computed(s, len(step.new_tokens[i]))
        if complete:
            s.output_ids.append(token)
            if len(s.output_ids) >= s.params.max_new_tokens:
                sched.finish(s, "length")
                done.append(s)
    return done


def test_hashes_chain_and_only_full_blocks_count():
    toks = list(range(10))
    hs = chained_hashes(toks, BS)
    assert len(hs) == 2 and hs[0] == block_hash(ROOT_HASH, [0, 1, 2, 3]) and hs[1] == block_hash(hs[0], [4, 5, 6, 7])
    assert chained_hashes([9, 1, 2, 3, 4, 5, 6, 7], BS)[1] != hs[1]  # same block, other parent
    assert chained_hashes(toks, BS, hs[:1]) == hs


def test_block_pool_evicts_only_when_the_free_list_is_dry():
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert a == [0, 1] and pool.ref_cnt == [1, 1, 0, 0]
    pool.cache_block(0, b"h0")
    pool.release(a)  # block 1 had no hash: free; block 0: evictable
    assert pool.free_ids() == [2, 3, 1] and list(pool.evictable) == [0] and pool.cached == {b"h0": 0}
    assert pool.num_free == 4
    assert pool.lookup([b"h0", b"h1"]) == [0]
    pool.take([0])  # a hit revives it
    assert pool.ref_cnt[0] == 1 and not pool.evictable
    pool.release([0])
    assert pool.allocate(3) == [2, 3, 1] and pool.cached == {b"h0": 0}  # free ones first
    assert pool.allocate(1) == [0] and pool.cached == {} and pool.hash_of[0] is None  # then eviction
    assert pool.allocate(1) is None


def test_admission_shares_the_cached_prefix_and_computes_the_rest():
    sched = Scheduler(KVCacheManager(BlockPool(10), BS), 4, 16)
    a = seq(range(1, 11), max_new=1)  # 10 tokens: blocks 0, 1 full, block 2 partial
    sched.add(a)
    run_step(sched)  # a prefilled, sampled its one token, finished: blocks go back
    pool = sched.allocator
    assert len(pool.cached) == 2 and list(pool.evictable) == [1, 0]  # the tail is evicted first
    assert pool.free_ids() == [3, 4, 5, 6, 7, 8, 9, 2]
    b = seq([*range(1, 9), 50, 51, 52], max_new=2)  # shares a's first 8 tokens (2 blocks)
    sched.add(b)
    step = sched.schedule()
    assert b.cache.block_table[:2] == [0, 1] and pool.ref_cnt[0] == pool.ref_cnt[1] == 1
    assert step.new_tokens == [[50, 51, 52]] and b.cache.num_computed_tokens == 8
    assert sched.kv.hit_tokens == 8 and sched.kv.queried_tokens == 10 + 11  # the manager keeps hit statistics
    c = seq(range(1, 9), max_new=2)  # the whole prompt is cached: its last block is recomputed
    sched.add(c)
    step = sched.schedule()
    assert c.cache.block_table[0] == 0 and c.cache.block_table[1] not in (0, 1)
    assert step.new_tokens[-1] == [5, 6, 7, 8] and pool.ref_cnt[0] == 2 and pool.ref_cnt[1] == 1


def test_preempting_a_sharer_keeps_the_shared_blocks():
    sched = Scheduler(KVCacheManager(BlockPool(6), BS), 4, 16)
    a, b = seq(range(1, 9), max_new=12), seq([*range(1, 9), 7], max_new=9)
    sched.add(a)
    run_step(sched)
    sched.add(b)
    run_step(sched)  # b admitted, sharing a's two full blocks
    pool = sched.allocator
    assert b.cache.block_table[:2] == a.cache.block_table[:2] and pool.ref_cnt[a.cache.block_table[0]] == 2
    for _ in range(40):
        if sched.preemptions:
            break
        run_step(sched)
    assert sched.preemptions >= 1 and b in sched.waiting and b.cache.block_table == []
    assert pool.ref_cnt[a.cache.block_table[0]] == 1  # the shared block is released once, still a's
    while sched.has_work():
        run_step(sched)
    assert pool.num_free == 6 and sum(pool.ref_cnt) == 0
    assert a.output_ids == [99] * 12 and b.output_ids == [99] * 9


def test_high_priority_request_submitted_last_starts_first():
    sched = Scheduler(KVCacheManager(BlockPool(64), BS), 1, 16)
    running = seq(range(1, 5), max_new=3)
    sched.add(running)
    run_step(sched)
    low = [seq([10 + i], max_new=1, priority=5) for i in range(3)]
    for s in low:
        sched.add(s)
    urgent = seq([42], max_new=1, priority=-1)
    sched.add(urgent)
    order = []
    while sched.has_work():
        order += run_step(sched)
    assert order == [running, urgent, *low]


def test_lowest_priority_running_sequence_is_preempted():
    sched = Scheduler(KVCacheManager(BlockPool(4), BS), 4, 16)
    high, low = seq(range(1, 5), max_new=8, priority=0), seq(range(1, 4), max_new=8, priority=9)
    sched.add(low)
    sched.add(high)
    while not sched.preemptions:
        run_step(sched)
    assert low in sched.waiting and high in sched.running


def test_aging_lets_low_priority_finish_under_steady_high_priority_load(monkeypatch):
    clock = itertools.count()
    monkeypatch.setattr(scheduler_module.time, "monotonic", lambda: float(next(clock)))
    sched = Scheduler(KVCacheManager(BlockPool(64), BS), 1, 16, aging_s=20.0)
    low = seq([5], max_new=1, priority=3)
    sched.add(low)
    sched.add(seq([6], max_new=2, priority=0))
    finished = []
    for _ in range(400):
        sched.add(seq([7], max_new=2, priority=0))  # a new urgent request every step
        finished += run_step(sched)
        if low in finished:
            break
    assert low in finished and low.finish_reason == "length"


@pytest.fixture(scope="module")
def trace():
    system = [(11 * i) % 200 + 30 for i in range(40)]
    turns, history = [], list(system)
    for t in range(4):
        history = history + [(5 * t + j) % 100 + 3 for j in range(6)]
        turns.append(list(history))
    return turns


def test_greedy_outputs_equal_with_and_without_caching(tiny_engine, trace):
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    outs = {}
    for caching in (False, True):
        with Engine.load(tiny_engine, prefix_caching=caching) as engine:
            outs[caching] = [engine.generate([p], params)[0].token_ids for p in trace]
            outs[caching] += [r.token_ids for r in engine.generate(trace, params)]  # concurrently too
            stats = engine.stats()
            assert stats["free_blocks"] == stats["num_blocks"]
            if caching:
                assert stats["prefix_hit_tokens"] >= 40 * 3 // 8 * 8 and stats["cached_blocks"] > 0
    assert outs[True] == outs[False]
