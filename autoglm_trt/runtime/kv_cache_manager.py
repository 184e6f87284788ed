"""The KV-cache manager: every sequence's blocks, between the scheduler and the block pool
(vLLM v1's ``KVCacheManager``, small).

The scheduler decides who runs; it asks this manager for blocks and the manager asks the pool
(``kvcache.block_pool``). Nobody else touches block ids. Allocation that cannot be met answers
False and changes nothing; the caller decides (wait, preempt)::

    admit(seq, keep_free)    a waiting sequence: share its longest cached prefix, blocks for the rest
    allocate_slots(seq, n)   blocks for n more tokens (and a private copy of a shared block they write)
    fork(parent, child)      the child shares every block of the parent (one more reference each)
    free(seq)                drop the sequence's references; cached blocks stay evictable
    cache_full_blocks(seq)   name the blocks its computed tokens filled by their chained hashes
    take_copies()            the copy-on-write pairs the next step must make before it runs

Prefix caching (a pool whose ``caching`` is on): blocks shared this way are full and wholly
computed, so no sequence writes to one; at least a prompt's last token is computed, so that
there are logits to sample. A forked sequence's last block may be partly filled: the first
sequence to write into it while it is shared gets a fresh block and a copy (copy-on-write).
"""

from __future__ import annotations

from ..kvcache.block_pool import BlockPool, chained_hashes
from ..kvcache.layout import blocks_needed
from ..kvcache.step_inputs import SeqState
from .sequence import Sequence


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int):
        self.pool, self.block_size = pool, block_size
        self.queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0  # of those, found there
        self._copies: list[tuple[int, int]] = []

    @property
    def caching(self) -> bool:
        return self.pool.caching

    def admit(self, seq: Sequence, keep_free: int) -> bool:
        """Blocks for a waiting sequence's every token, sharing its longest cached prefix; False
        (nothing taken) if that would leave fewer than ``keep_free`` blocks free."""
        hits: list[int] = []
        hashes: list[bytes] = []
        revived = 0
        if self.caching:
            tokens = seq.token_ids()
            # its tokens only grow, so the chain computed while it waited is extended, not redone
            hashes = seq.token_hashes = chained_hashes(tokens, self.block_size, seq.token_hashes, seq.block_extras)
            hits = self.pool.lookup(hashes)
            if len(hits) * self.block_size >= len(tokens):  # keep the last token to compute
                hits = hits[:-1]
            revived = sum(1 for b in hits if self.pool.ref_cnt[b] == 0)
        need = blocks_needed(seq.num_tokens, self.block_size) - len(hits)
        if need + revived > self.pool.num_free - keep_free:
            return False
        if self.caching:
            self.pool.take(hits)
            self.queried_tokens += seq.num_tokens
            self.hit_tokens += len(hits) * self.block_size
            seq.cache = SeqState(len(hits) * self.block_size, list(hits))
            seq.block_hashes = hashes[: len(hits)]
        if not self.allocate_slots(seq, seq.num_pending):  # cannot happen: the blocks were counted free above
            raise RuntimeError("the block pool refused blocks it reported free")
        return True

    def allocate_slots(self, seq: Sequence, num_new: int) -> bool:
        """Blocks for ``num_new`` more tokens of ``seq``, and a private copy of a shared block they
        would write to; False (nothing taken) if the pool has too few."""
        table = seq.cache.block_table
        first = seq.cache.num_computed_tokens // self.block_size  # the block the next token goes into
        shared = first < len(table) and self.pool.ref_cnt[table[first]] > 1
        need = blocks_needed(seq.cache.num_computed_tokens + num_new, self.block_size) - len(table) + shared
        if need <= 0:
            return True
        got = self.pool.allocate(need)
        if got is None:
            return False
        if shared:
            fresh = got.pop(0)
            self._copies.append((table[first], fresh))
            self.pool.release([table[first]])
            table[first] = fresh
        table += got
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` (with the parent's tokens) shares every block of ``parent``."""
        self.pool.take(parent.cache.block_table)
        child.cache = SeqState(parent.cache.num_computed_tokens, list(parent.cache.block_table))
        child.block_hashes = list(parent.block_hashes)

    def free(self, seq: Sequence) -> None:
        self.pool.release(seq.cache.block_table)
        seq.cache = SeqState()
        seq.block_hashes = []

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Name the full blocks of ``seq``'s computed tokens not yet named (prefix caching)."""
        full = seq.cache.num_computed_tokens // self.block_size
        if not self.caching or full <= len(seq.block_hashes):
            return
        start = len(seq.block_hashes)
        seq.block_hashes = chained_hashes(seq.token_ids()[: full * self.block_size], self.block_size,
                                          seq.block_hashes, seq.block_extras)
        for b in range(start, full):
            self.pool.cache_block(seq.cache.block_table[b], seq.block_hashes[b])

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies

    def stats(self) -> dict:
        return {**self.pool.stats(), "prefix_queried_tokens": self.queried_tokens,
                "prefix_hit_tokens": self.hit_tokens}
