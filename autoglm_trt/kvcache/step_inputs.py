"""The graph inputs of one step: from each sequence's new tokens and cache state (``SeqState``)
to ``input_ids``, ``position_ids``, ``context_lens``, ``query_lens``, ``block_tables``,
``logits_indices``, and the slots (``SlotMap``) where the new tokens' K/V go.

For a graph with M-RoPE (GLM-4.1V) ``position_ids`` is ``[3, batch, new_tokens]``: each sequence's
3-D positions (``MRope``: the prompt's, from ``model.multimodal.mrope_positions``; past the prompt,
position + delta in every row), or for a sequence without images its 1-D positions in all three rows.
With a vision tower (``StepImages``) the step also carries ``image_embeds`` ``[rows, hidden]`` and
``image_index`` ``[batch, new_tokens]``: the encoder's rows of the image tokens among the new tokens
(row 0 is zeros and never taken), and for each new token the row it takes (0: a text token)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .host_pools import SlotMap
from .layout import blocks_needed


@dataclass(frozen=True)
class MRope:
    """A prompt's 3-D positions ``[3, prompt tokens]`` and the delta that carries them past it."""

    positions: np.ndarray
    delta: int = 0

    def at(self, start: int, n: int) -> np.ndarray:
        """int64 ``[3, n]``: the positions of tokens ``start .. start + n - 1``."""
        p = np.arange(start, start + n)
        out = np.empty((3, n), np.int64)
        inside = p < self.positions.shape[1]
        out[:, inside] = self.positions[:, p[inside]]
        out[:, ~inside] = p[~inside] + self.delta
        return out


@dataclass(frozen=True)
class PromptImages:
    """A prompt's image tokens: image k covers prompt tokens ``starts[k]`` to
    ``starts[k] + len(embeds[k]) - 1`` and gives them the rows of ``embeds[k]`` ``[tokens, hidden]``."""

    starts: tuple[int, ...]
    embeds: tuple[np.ndarray, ...]


@dataclass(frozen=True)
class StepImages:
    """The image feeds of a step: the decoder's hidden size and each sequence's images (None: text only)."""

    hidden: int
    seqs: Sequence[PromptImages | None]

    @classmethod
    def text(cls, hidden: int, batch: int) -> StepImages:
        return cls(hidden, [None] * batch)


@dataclass
class SeqState:
    """One sequence's cache state: tokens already in the pool and its block table."""

    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)


def step_inputs(new_tokens: list[list[int]], states: list[SeqState], block_size: int,
                all_logits: bool = False, mrope: list[MRope | None] | None = None,
                images: StepImages | None = None) -> tuple[dict[str, np.ndarray], SlotMap]:
    """Graph inputs (without the pools) for one step, and the slots of the new tokens.

    Every sequence must have at least one new token and a block table that already covers
    ``num_computed_tokens + len(new_tokens)`` positions. Logits are asked for the last new
    token of each sequence, or with ``all_logits`` for every new token (padding repeats the
    last one).
    """
    batch = len(new_tokens)
    assert batch == len(states) and batch > 0
    if not all_logits and all(len(t) == 1 for t in new_tokens):
        feeds, slots = _decode_inputs(new_tokens, states, block_size)
        return _with_images(_with_mrope(feeds, new_tokens, states, mrope), new_tokens, states, images), slots
    t_max = max(len(t) for t in new_tokens)
    max_ctx = max(s.num_computed_tokens for s in states)
    max_blocks = max(1, blocks_needed(max_ctx, block_size))
    input_ids = np.zeros((batch, t_max), np.int64)
    position_ids = np.zeros((batch, t_max), np.int64)
    block_tables = np.zeros((batch, max_blocks), np.int64)
    context_lens = np.zeros(batch, np.int64)
    query_lens = np.zeros(batch, np.int64)
    logits_indices = np.zeros((batch, t_max if all_logits else 1), np.int64)
    sb, st, sk, so = [], [], [], []
    for b, (toks, state) in enumerate(zip(new_tokens, states)):
        n, ctx = len(toks), state.num_computed_tokens
        assert n >= 1, "every sequence in a step needs at least one new token"
        table = state.block_table
        assert len(table) * block_size >= ctx + n, "block table does not cover the new tokens"
        input_ids[b, :n] = toks
        positions = np.arange(ctx, ctx + n)
        position_ids[b, :n] = positions
        used = blocks_needed(ctx, block_size)
        block_tables[b, :used] = table[:used]
        context_lens[b], query_lens[b] = ctx, n
        logits_indices[b] = np.minimum(np.arange(logits_indices.shape[1]), n - 1) if all_logits else n - 1
        sb.append(np.full(n, b))
        st.append(np.arange(n))
        sk.append(np.asarray(table, np.int64)[positions // block_size])
        so.append(positions % block_size)
    feeds = {"input_ids": input_ids, "position_ids": position_ids, "context_lens": context_lens,
             "query_lens": query_lens, "block_tables": block_tables, "logits_indices": logits_indices}
    slots = SlotMap(*(np.concatenate(a).astype(np.int64) for a in (sb, st, sk, so)))
    return _with_images(_with_mrope(feeds, new_tokens, states, mrope), new_tokens, states, images), slots


def _with_mrope(feeds: dict[str, np.ndarray], new_tokens: list[list[int]], states: list[SeqState],
                mrope: list[MRope | None] | None) -> dict[str, np.ndarray]:
    """``feeds`` with ``position_ids`` as ``[3, batch, new_tokens]`` when ``mrope`` is given (one entry
    per sequence; None: its 1-D positions in every row)."""
    if mrope is None:
        return feeds
    positions = np.repeat(feeds["position_ids"][None], 3, axis=0)
    for b, (toks, state, m) in enumerate(zip(new_tokens, states, mrope)):
        if m is not None:
            positions[:, b, :len(toks)] = m.at(state.num_computed_tokens, len(toks))
    return {**feeds, "position_ids": positions}


def _with_images(feeds: dict[str, np.ndarray], new_tokens: list[list[int]], states: list[SeqState],
                 images: StepImages | None) -> dict[str, np.ndarray]:
    """``feeds`` with ``image_embeds`` and ``image_index`` when ``images`` is given."""
    if images is None:
        return feeds
    assert len(images.seqs) == len(new_tokens)
    rows = [np.zeros((1, images.hidden), np.float32)]
    index = np.zeros(feeds["input_ids"].shape, np.int64)
    taken = 1
    for b, (toks, state, seq) in enumerate(zip(new_tokens, states, images.seqs)):
        if seq is None:
            continue
        lo = state.num_computed_tokens
        hi = lo + len(toks)
        for start, embeds in zip(seq.starts, seq.embeds):
            a, z = max(lo, start), min(hi, start + len(embeds))
            if a < z:
                rows.append(embeds[a - start : z - start])
                index[b, a - lo : z - lo] = np.arange(taken, taken + z - a)
                taken += z - a
    table = rows[0] if len(rows) == 1 else np.concatenate(rows).astype(np.float32, copy=False)
    return {**feeds, "image_embeds": table, "image_index": index}


def _decode_inputs(new_tokens: list[list[int]], states: list[SeqState],
                   block_size: int) -> tuple[dict[str, np.ndarray], SlotMap]:
    """``step_inputs`` of a decode step (one new token per sequence, the last token's logits):
    the same arrays, built from lists in a few numpy calls rather than a dozen per sequence
    (the general form's calls were a measurable share of a batch-1 step)."""
    batch = len(new_tokens)
    ctx = [s.num_computed_tokens for s in states]
    tables = np.zeros((batch, max(1, blocks_needed(max(ctx), block_size))), np.int64)
    slot_blocks = []
    for b, (state, c) in enumerate(zip(states, ctx)):
        table = state.block_table
        assert len(table) * block_size >= c + 1, "block table does not cover the new tokens"
        used = blocks_needed(c, block_size)
        if used:
            tables[b, :used] = table[:used]
        slot_blocks.append(table[c // block_size])
    positions = np.array(ctx, np.int64)
    feeds = {"input_ids": np.array(new_tokens, np.int64), "position_ids": positions[:, None].copy(),
             "context_lens": positions, "query_lens": np.ones(batch, np.int64), "block_tables": tables,
             "logits_indices": np.zeros((batch, 1), np.int64)}
    slots = SlotMap(np.arange(batch, dtype=np.int64), np.zeros(batch, np.int64), np.array(slot_blocks, np.int64),
                    positions % block_size)
    return feeds, slots
