"""KV blocks with reference counts and a prefix cache of full blocks (vLLM v1's block pool, small).

Every block is in exactly one of three places::

    in use      ref_cnt > 0 (held by one or more running sequences; shared ones are full)
    free        ref_cnt 0, no content worth keeping        deque, taken from the head
    evictable   ref_cnt 0, a full block with its hash       LRU order, evicted from the head
                (still in the hash table: a hit revives it)  only when the free list is empty

A full block is named by a hash chained from its parent block's hash, its own token ids and its
extra key (the digests of the images its tokens stand for; empty for text), so equal hashes mean
equal prefixes, images included::

    tokens   | t0 .. t15 | t16 .. t31 | t32 .. t40 (partial: named once decode fills it)
    hashes   | h0=H(-,b0)| h1=H(h0,b1)|

``allocate`` answers None when it cannot give n blocks (the caller decides what to do);
``release`` drops one reference per block, in reverse order so that a sequence's last blocks
are evicted before its first (the shared prefix outlives the tails). With ``caching`` off it
is a plain free list: lowest ids first, freed blocks back at its end in table order. In the
engine only ``runtime.kv_cache_manager`` calls it; the export's validation uses it uncached.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

ROOT_HASH = b""


def block_hash(parent: bytes, tokens: list[int], extra: bytes = b"") -> bytes:
    """Hash of a full block: its parent's hash, its token ids and its extra key (blake2b, 16 bytes)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"".join(t.to_bytes(8, "little", signed=True) for t in tokens))
    if extra:
        h.update(b"\0extra" + extra)
    return h.digest()


def chained_hashes(tokens: list[int], block_size: int, start: list[bytes] | None = None,
                   extras: list[bytes] | None = None) -> list[bytes]:
    """Hashes of every full block of ``tokens``, continuing the chain ``start`` (already hashed
    blocks); block b's extra key is ``extras[b]`` (none past the list)."""
    out = list(start or [])
    extras = extras or []
    for b in range(len(out), len(tokens) // block_size):
        out.append(block_hash(out[-1] if out else ROOT_HASH, tokens[b * block_size : (b + 1) * block_size],
                              extras[b] if b < len(extras) else b""))
    return out


class BlockPool:
    def __init__(self, num_blocks: int, caching: bool = True):
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks, self.caching = num_blocks, caching
        self.ref_cnt = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block holding that content
        self._free: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()

    # -- the allocator interface -----------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation may take (free and evictable)."""
        return len(self._free) + len(self.evictable)

    def free_ids(self) -> list[int]:
        return list(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n blocks (free ones first, then the least recently used evictable ones), or None."""
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self.evictable.popitem(last=False)
                h = self.hash_of[b]
                if h is not None and self.cached.get(h) == b:
                    del self.cached[h]
                self.hash_of[b] = None
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        """Drop one reference per block; a block nobody holds becomes evictable (if cached) or free."""
        for b in reversed(blocks) if self.caching else blocks:
            self.ref_cnt[b] -= 1
            assert self.ref_cnt[b] >= 0, f"block {b} released more often than taken"
            if self.ref_cnt[b] == 0:
                if self.hash_of[b] is not None:
                    self.evictable[b] = None
                else:
                    self._free.append(b)

    # -- the prefix cache --------------------------------------------------------------
    def lookup(self, hashes: list[bytes]) -> list[int]:
        """Blocks of the longest cached prefix of ``hashes`` (not yet taken)."""
        hits = []
        if self.caching:
            for h in hashes:
                b = self.cached.get(h)
                if b is None:
                    break
                hits.append(b)
        return hits

    def take(self, blocks: list[int]) -> None:
        """One more reference to each (cache hits): an evictable block comes back into use."""
        for b in blocks:
            if self.ref_cnt[b] == 0:
                del self.evictable[b]
            self.ref_cnt[b] += 1

    def cache_block(self, block: int, h: bytes) -> None:
        """Name a full, computed block by its hash (the first block with a content keeps the name)."""
        if self.caching and self.hash_of[block] is None and h not in self.cached:
            self.hash_of[block] = h
            self.cached[h] = block

    def stats(self) -> dict:
        return {"cached_blocks": len(self.cached), "evictable_blocks": len(self.evictable)}
