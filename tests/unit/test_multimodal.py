"""GLM-4.1V prompts: image placeholders expanded, M-RoPE positions as transformers computes them, and
prefix-cache keys that include the images a block covers."""

from __future__ import annotations

import numpy as np
import pytest

from autoglm_trt.errors import RequestError
from autoglm_trt.kvcache.block_pool import BlockPool
from autoglm_trt.model.multimodal import ImageSpan, block_extras, expand, image_digest, mrope_positions
from autoglm_trt.runtime.kv_cache_manager import KVCacheManager
from autoglm_trt.runtime.sampling import SamplingParams
from autoglm_trt.runtime.scheduler import Scheduler, Sequence

IMAGE, BEGIN, END = 9, 7, 8  # a tiny vocabulary's <|image|>, <|begin_of_image|>, <|end_of_image|>


def _reference_model(merge: int):
    torch = pytest.importorskip("torch")
    from transformers import Glm4vConfig
    from transformers.models.glm4v.modeling_glm4v import Glm4vModel

    torch.manual_seed(0)
    config = Glm4vConfig(
        text_config={"vocab_size": 32, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                     "num_attention_heads": 4, "num_key_value_heads": 2,
                     "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0,
                                         "partial_rotary_factor": 0.5}},
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 32,
                       "spatial_merge_size": merge, "patch_size": 2, "temporal_patch_size": 2},
        image_token_id=IMAGE, image_start_token_id=BEGIN, image_end_token_id=END, video_start_token_id=30,
        video_end_token_id=31, video_token_id=29)
    return torch, Glm4vModel(config).eval()


@pytest.mark.parametrize("grids", [[(1, 4, 6)], [(1, 6, 4), (1, 2, 2)], [], [(1, 10, 2), (1, 4, 4), (1, 2, 8)]])
def test_positions_equal_transformers_get_rope_index(grids):
    torch, model = _reference_model(merge=2)
    rng = np.random.default_rng(len(grids))
    ids: list[int] = rng.integers(10, 28, 5).tolist()
    for _ in grids:  # text, then <|begin_of_image|><|image|><|end_of_image|>, then text
        ids += [BEGIN, IMAGE, END] + rng.integers(10, 28, int(rng.integers(1, 6))).tolist()
    digests = [bytes([k]) * 16 for k in range(len(grids))]
    expanded, spans = expand(ids, IMAGE, grids, digests, merge=2)
    assert [s.end - s.start for s in spans] == [t * h * w // 4 for t, h, w in grids]
    assert all(expanded[s.start - 1] == BEGIN and expanded[s.end] == END for s in spans)
    types = torch.tensor([[1 if t == IMAGE else 0 for t in expanded]])
    want, delta = model.get_rope_index(torch.tensor([expanded]), types,
                                       image_grid_thw=torch.tensor(grids) if grids else None)
    got, got_delta = mrope_positions(len(expanded), spans, merge=2)
    np.testing.assert_array_equal(got, want[:, 0].numpy())
    assert got_delta == int(delta[0, 0])


def test_placeholders_and_images_must_pair_up():
    with pytest.raises(RequestError, match="2 image placeholder"):
        expand([1, IMAGE, 2, IMAGE], IMAGE, [(1, 2, 2)], [b"x" * 16], merge=2)


def test_a_block_is_keyed_by_the_images_it_covers():
    spans = [ImageSpan(3, 11, (1, 4, 8), b"a" * 16), ImageSpan(13, 15, (1, 2, 4), b"b" * 16)]
    at = lambda digest, offset: digest * 16 + offset.to_bytes(8, "little", signed=True)  # noqa: E731
    assert block_extras(17, spans, 4) == [at(b"a", 3), at(b"a", -1), at(b"a", -5), at(b"b", 1), b""]
    assert block_extras(17, [], 4) == [b""] * 5
    assert block_extras(15, spans, 4)[-1] == at(b"b", 1)  # the partial last block, which decode fills
    pixels = np.ones((4, 24), np.float32)
    assert image_digest(pixels, (1, 2, 2)) != image_digest(pixels + 1e-7, (1, 2, 2))  # one pixel off: another image


def _prefilled(sched: Scheduler, seq: Sequence) -> int:
    """Admit ``seq``, run its prefill, finish it; the prompt tokens its admission found cached."""
    before = sched.kv.hit_tokens
    sched.add(seq)
    step = sched.schedule()
    for i, s in enumerate(step.seqs):
        sched.computed(s, len(step.new_tokens[i]))
    sched.finish(seq, "stop")
    return sched.kv.hit_tokens - before


def test_the_same_tokens_over_another_image_miss_the_prefix_cache():
    sched = Scheduler(KVCacheManager(BlockPool(32), 4), 4, 64)
    tokens = [1, 2, 3] + [IMAGE] * 8 + [4, 5, 6, 7, 8, 9]  # an image of 8 tokens in blocks 0-2
    spans = lambda digest: [ImageSpan(3, 11, (1, 4, 8), digest)]  # noqa: E731

    def seq(digest: bytes) -> Sequence:
        return Sequence(list(tokens), SamplingParams(max_new_tokens=1),
                        block_extras=block_extras(len(tokens), spans(digest), 4))

    assert _prefilled(sched, seq(b"a" * 16)) == 0
    assert _prefilled(sched, seq(b"a" * 16)) == 16  # the same screenshot: every full block is a hit
    assert _prefilled(sched, seq(b"b" * 16)) == 0  # the same token ids over another screenshot: none is
