"""Scheduler and block allocator: exact block ids and free-list order after each step (no model)."""

from autoglm_trt.kvcache.block_pool import BlockPool
from autoglm_trt.runtime.kv_cache_manager import KVCacheManager
from autoglm_trt.runtime.sampling import SamplingParams
from autoglm_trt.runtime.scheduler import Scheduler, Sequence, Step


def make(num_blocks=8, block_size=4, max_batch=4, max_input_len=16):
    return Scheduler(KVCacheManager(BlockPool(num_blocks, caching=False), block_size), max_batch, max_input_len)


def seq(n, max_new=8):
    return Sequence(list(range(1, n + 1)), SamplingParams(max_new_tokens=max_new))


def advance(sched: Scheduler, step: Step, token: int = 7) -> None:
    """What the engine does after a step: count computed tokens, append a sampled token."""
    for i, s in enumerate(step.seqs):
        done = step.completes(i)
        s.cache.num_computed_tokens += len(step.new_tokens[i])
        if done:
            s.output_ids.append(token)


def test_prefill_then_decode_block_ids_and_free_list():
    sched = make()
    a, b = seq(6), seq(3)
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    assert step.prefill and step.seqs == [a, b] and step.new_tokens == [[1, 2, 3, 4, 5, 6], [1, 2, 3]]
    assert a.cache.block_table == [0, 1] and b.cache.block_table == [2]
    assert sched.allocator.free_ids() == [3, 4, 5, 6, 7]
    advance(sched, step)
    step = sched.schedule()  # decode: a writes position 6 (block 1 has room), b position 3 (block 2 has room)
    assert not step.prefill and step.new_tokens == [[7], [7]]
    assert a.cache.block_table == [0, 1] and b.cache.block_table == [2]
    advance(sched, step)
    step = sched.schedule()  # b now needs position 4: a new block
    assert b.cache.block_table == [2, 3] and sched.allocator.free_ids() == [4, 5, 6, 7]
    advance(sched, step)
    sched.finish(a, "stop")
    assert sched.allocator.free_ids() == [4, 5, 6, 7, 0, 1]
    assert sched.running == [b]


def test_long_prompt_is_prefilled_in_chunks():
    sched = make(max_input_len=4)
    a = seq(10)
    sched.add(a)
    s1 = sched.schedule()
    assert s1.new_tokens == [[1, 2, 3, 4]] and not s1.completes(0)
    advance(sched, s1)
    s2 = sched.schedule()
    assert s2.prefill and s2.new_tokens == [[5, 6, 7, 8]]
    advance(sched, s2)
    s3 = sched.schedule()
    assert s3.new_tokens == [[9, 10]] and s3.completes(0)
    advance(sched, s3)
    assert a.output_ids == [7] and a.cache.block_table == [0, 1, 2]


def test_admission_waits_for_blocks():
    sched = make(num_blocks=4)
    a, b = seq(8), seq(8)
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    assert step.seqs == [a]  # b needs 2 blocks but only 2 are free and one is kept for a's growth
    assert list(sched.waiting) == [b]


def test_pool_exhaustion_preempts_the_newest_and_recomputes_it():
    sched = make(num_blocks=4, block_size=2)
    a, b = seq(3), seq(2)
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    assert [s.cache.block_table for s in step.seqs] == [[0, 1], [2]]
    advance(sched, step)  # a: 3 computed + 1 sampled; b: 2 computed + 1 sampled
    step = sched.schedule()  # decode: a needs nothing (position 3 in block 1); b needs block 3
    assert step.seqs == [a, b] and b.cache.block_table == [2, 3]
    advance(sched, step)
    step = sched.schedule()  # a needs a block for position 4: none free -> b (newest) is preempted
    assert step.seqs == [a] and a.cache.block_table == [0, 1, 2]  # b's blocks [2, 3] went back; a took 2
    assert list(sched.waiting) == [b] and b.cache.block_table == [] and b.preemptions == 1
    assert sched.allocator.free_ids() == [3]
    advance(sched, step)
    sched.finish(a, "length")
    step = sched.schedule()  # b comes back as a prefill of prompt + its 2 outputs
    assert step.prefill and step.seqs == [b] and step.new_tokens == [[1, 2, 7, 7]]


def test_preemption_ranks_by_the_priority_after_aging():
    """A low-priority request that aging brought in is not the first preempted: under pressure the
    victim is the worst priority after aging (here the newer request of priority 0, not the one of
    priority 5 that waited 60 s, worth six levels at 10 s a level)."""
    import time

    sched = make(num_blocks=4, block_size=2)
    old = Sequence([1, 2, 3], SamplingParams(max_new_tokens=8, priority=5))
    new = Sequence([1, 2], SamplingParams(max_new_tokens=8, priority=0))
    sched.add(old)
    sched.add(new)
    old.arrival = time.monotonic() - 60  # aged: 5 - 6 = -1, ahead of new's 0
    step = sched.schedule()
    assert step.seqs == [old, new]
    advance(sched, step)
    advance(sched, sched.schedule())  # new takes the last free block
    step = sched.schedule()  # old needs a block: new (0) is preempted, not old (-1 after aging; 5 before)
    assert step.seqs == [old] and list(sched.waiting) == [new] and new.preemptions == 1


def test_cancel_frees_blocks():
    sched = make()
    a = seq(5)
    sched.add(a)
    sched.schedule()
    sched.cancel(a)
    assert sched.allocator.num_free == 8 and a.finish_reason == "cancelled" and not sched.has_work()
