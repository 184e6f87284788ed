"""Prefix caching with images: a cached block is shared only when its KV is the KV this sequence
would compute itself. Random prompts with images at random offsets go through the real scheduler
and KV-cache manager over a fake model whose KV at a position is a hash of every token up to it
and of every image that starts at or before it; after each admission and each step, every
computed slot of every running sequence must hold that sequence's own KV (preemption,
recompute, forks and copy-on-write included)."""

from __future__ import annotations

import random

import pytest

from autoglm_trt.kvcache.block_pool import BlockPool
from autoglm_trt.kvcache.layout import blocks_needed
from autoglm_trt.model.multimodal import ImageSpan, block_extras
from autoglm_trt.runtime.kv_cache_manager import KVCacheManager
from autoglm_trt.runtime.sampling import SamplingParams
from autoglm_trt.runtime.scheduler import Scheduler, Sequence

IMAGE = 9


class FakeModel:
    """KV slots of a block pool, written as a model would: a position's KV is determined by the
    tokens up to it and the images among them (their content, not their token ids)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool: list[list[object]] = [[None] * block_size for _ in range(num_blocks)]
        self.spans: dict[int, list[ImageSpan]] = {}  # seq_id -> its images
        self.salt: dict[int, int] = {}  # seq_id -> which tokens it generates (forks differ)

    def kv(self, seq: Sequence, p: int) -> object:
        images = tuple(s.digest for s in self.spans[seq.seq_id] if s.start <= p)
        return hash((tuple(seq.token_ids()[: p + 1]), images))

    def write(self, seq: Sequence, start: int, n: int) -> None:
        for p in range(start, start + n):
            self.pool[seq.cache.block_table[p // self.block_size]][p % self.block_size] = self.kv(seq, p)

    def check(self, seq: Sequence) -> None:
        for p in range(seq.cache.num_computed_tokens):
            got = self.pool[seq.cache.block_table[p // self.block_size]][p % self.block_size]
            assert got == self.kv(seq, p), f"sequence {seq.seq_id} reads another sequence's KV at position {p}"

    def next_token(self, seq: Sequence) -> int:
        """The same tokens for every request with the same prompt text, whatever its images (the
        case where a wrong hit goes unnoticed by the tokens alone); forks draw their own."""
        return 20 + (seq.num_tokens * 7 + self.salt[seq.seq_id]) % 3


def prompt_with_images(rng: random.Random, texts: list[list[int]],
                       digests: list[bytes]) -> tuple[list[int], list[ImageSpan]]:
    """One of a few text templates with 0-2 images put in at random offsets (often at its end)."""
    text = list(rng.choice(texts))
    ids: list[int] = []
    spans: list[ImageSpan] = []
    cuts = sorted(rng.choice([len(text), rng.randrange(len(text) + 1)]) for _ in range(rng.randrange(3)))
    at = 0
    for cut in cuts:
        ids += text[at:cut]
        n = rng.choice([1, 2, 3, 4, 6])
        spans.append(ImageSpan(len(ids), len(ids) + n, (1, 2, 2 * n), rng.choice(digests)))
        ids += [IMAGE] * n
        at = cut
    ids += text[at:]
    return ids, spans


def run_workload(rng: random.Random) -> tuple[int, int]:
    block_size = rng.choice([1, 2, 3, 4, 8])
    texts = [[rng.randrange(10, 13) for _ in range(rng.randrange(1, 14))] for _ in range(2)]
    digests = [bytes([k]) * 16 for k in range(2)]
    jobs = []
    for _ in range(rng.randrange(2, 12)):
        ids, spans = prompt_with_images(rng, texts, digests)
        seq = Sequence(ids, SamplingParams(max_new_tokens=rng.randrange(1, 12)),
                       block_extras=block_extras(len(ids), spans, block_size))
        jobs.append((seq, spans, rng.random() < 0.3))  # the last: fork two samples once the prompt is in
    longest = max(len(s.prompt_ids) + s.params.max_new_tokens for s, _, _ in jobs)
    num_blocks = blocks_needed(longest, block_size) + rng.randrange(0, 4)  # small: preemptions are frequent
    model = FakeModel(num_blocks, block_size)
    sched = Scheduler(KVCacheManager(BlockPool(num_blocks), block_size), rng.randrange(1, 6), rng.randrange(1, 10))
    forks: dict[int, bool] = {}
    pending = list(jobs)
    steps = 0
    while sched.has_work() or pending:
        if pending and (rng.random() < 0.5 or not sched.has_work()):
            seq, spans, fork = pending.pop(0)
            sched.add(seq)
            model.spans[seq.seq_id], model.salt[seq.seq_id], forks[seq.seq_id] = spans, 0, fork
        step = sched.schedule()
        if step is None:
            continue
        for src, dst in step.copies:
            model.pool[dst] = list(model.pool[src])
        for seq in sched.running:  # what admission shared must be this sequence's own KV
            model.check(seq)
        for i, seq in enumerate(step.seqs):
            done = step.completes(i)
            model.write(seq, seq.cache.num_computed_tokens, len(step.new_tokens[i]))
            sched.computed(seq, len(step.new_tokens[i]))
            if not done:
                continue
            samples = [seq]
            if forks.pop(seq.seq_id, False) and not seq.output_ids:  # as the engine does: fork, then sample each
                for k in (1, 2):
                    child = sched.fork(seq, stream=k)
                    model.spans[child.seq_id], model.salt[child.seq_id] = model.spans[seq.seq_id], k
                    samples.append(child)
            for s in samples:
                s.output_ids.append(model.next_token(s))
                if len(s.output_ids) >= s.params.max_new_tokens:
                    sched.finish(s, "length")
        for seq in sched.running:
            model.check(seq)
        steps += 1
        assert steps < 20_000, "no progress"
    return sched.kv.hit_tokens, sched.preemptions


@pytest.mark.parametrize("seed", range(6))
def test_every_cached_hit_is_the_sequences_own_kv(seed):
    rng = random.Random(seed)
    hits = preemptions = 0
    for _ in range(120):
        h, p = run_workload(rng)
        hits, preemptions = hits + h, preemptions + p
    assert hits > 0 and preemptions > 0  # the workloads do share blocks and preempt


def test_an_image_in_the_prompts_last_partial_block_keys_it_once_decode_fills_it():
    """Two requests with the same text, the same generated tokens and another screenshot, each image
    ending in its prompt's partial block: the block the first filled during decode is not the second's."""
    block_size = 4
    ids = [11, 12, 13, 14, 15, IMAGE, IMAGE]  # the image is tokens 5-6, in block 1 of 4 slots (partial)
    sched = Scheduler(KVCacheManager(BlockPool(16), block_size), 4, 16)
    model = FakeModel(16, block_size)
    seqs = []
    for digest in (b"a" * 16, b"b" * 16):
        spans = [ImageSpan(5, 7, (1, 2, 4), digest)]
        seq = Sequence(list(ids), SamplingParams(max_new_tokens=4), block_extras=block_extras(len(ids), spans, 4))
        sched.add(seq)
        model.spans[seq.seq_id], model.salt[seq.seq_id] = spans, 0
        seqs.append(seq)
        while seq.finish_reason is None:
            step = sched.schedule()
            for i, s in enumerate(step.seqs):
                model.check(s)
                done = step.completes(i)
                model.write(s, s.cache.num_computed_tokens, len(step.new_tokens[i]))
                sched.computed(s, len(step.new_tokens[i]))
                if done:
                    s.output_ids.append(model.next_token(s))
                    if len(s.output_ids) == 4:
                        sched.finish(s, "length")
    # a third request: the second's tokens so far, as a preempted one is re-admitted with its output
    again = Sequence(seqs[1].token_ids(), SamplingParams(max_new_tokens=1), block_extras=seqs[1].block_extras)
    sched.add(again)
    model.spans[again.seq_id], model.salt[again.seq_id] = model.spans[seqs[1].seq_id], 0
    sched.schedule()
    model.check(again)
    assert again.cache.num_computed_tokens == 8  # its own two full blocks were found: the cache works
