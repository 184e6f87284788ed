"""What one request may ask of an engine, checked when it is submitted (``RequestError`` otherwise)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import RequestError
from ..graph.paged_kv import blocks_needed
from .sampling import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    max_seq_len: int
    max_batch: int
    block_size: int
    num_blocks: int
    tokenizer: bool
    where: str  # the engine directory, for messages

    def check(self, ids: list[int], params: SamplingParams, pieces: bool, streaming: bool) -> None:
        """A prompt may be as long as max_seq_len - max_new_tokens (prefilled in chunks of at most
        max_input_len tokens); text pieces (a stream or a sink) and stop strings need a tokenizer;
        ``Engine.stream`` carries one sequence; a beam search's beams run in one batch."""
        if len(ids) + params.max_new_tokens > self.max_seq_len:
            room = self.max_seq_len - params.max_new_tokens
            raise RequestError(f"the prompt has {len(ids)} tokens and max_new_tokens is {params.max_new_tokens}: "
                               f"this engine allows at most {max(room, 0)} prompt tokens with that many new ones "
                               f"(max_seq_len {self.max_seq_len}); shorten the prompt or lower max_new_tokens")
        if blocks_needed(len(ids) + params.max_new_tokens, self.block_size) > self.num_blocks:
            raise RequestError(f"this request needs more KV blocks than the whole pool ({self.num_blocks})")
        if (pieces or params.stop) and not self.tokenizer:
            raise RequestError(f"{self.where} has no tokenizer: streaming text and stop strings need one")
        if streaming and (params.n > 1 or params.beam_width > 1):
            raise RequestError("a stream carries one sequence: use n=1 and beam_width=1 to stream, "
                               "or generate without streaming")
        if params.beam_width > self.max_batch:
            raise RequestError(f"beam_width {params.beam_width} exceeds this engine's max_batch_size "
                               f"{self.max_batch}: a beam search runs its beams in one batch")
