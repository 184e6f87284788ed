import dataclasses

import numpy as np

from autoglm_trt.kvcache.block_pool import BlockPool
from autoglm_trt.kvcache.host_pools import KVPools
from autoglm_trt.kvcache.layout import block_slots, blocks_needed
from autoglm_trt.kvcache.step_inputs import SeqState, step_inputs


def test_allocator_hands_out_lowest_first_and_appends_freed():
    a = BlockPool(6, caching=False)
    assert a.allocate(2) == [0, 1]
    assert a.allocate(3) == [2, 3, 4]
    assert a.allocate(2) is None and a.num_free == 1
    a.release([3, 0])
    assert a.free_ids() == [5, 3, 0]
    assert a.allocate(2) == [5, 3]


def test_step_inputs_padding_positions_and_slots():
    states = [SeqState(0, [4]), SeqState(5, [2, 7])]
    feeds, slots = step_inputs([[11, 12, 13], [21]], states, block_size=4)
    np.testing.assert_array_equal(feeds["input_ids"], [[11, 12, 13], [21, 0, 0]])
    np.testing.assert_array_equal(feeds["position_ids"], [[0, 1, 2], [5, 0, 0]])
    np.testing.assert_array_equal(feeds["context_lens"], [0, 5])
    np.testing.assert_array_equal(feeds["query_lens"], [3, 1])
    np.testing.assert_array_equal(feeds["logits_indices"], [[2], [0]])
    # 5 cached tokens of sequence 1 span two blocks; sequence 0 has none (padded with block 0)
    np.testing.assert_array_equal(feeds["block_tables"], [[0, 0], [2, 7]])
    assert slots.batch.tolist() == [0, 0, 0, 1]
    assert slots.token.tolist() == [0, 1, 2, 0]
    assert slots.block.tolist() == [4, 4, 4, 7]
    assert slots.offset.tolist() == [0, 1, 2, 1]


def test_all_logits_indices_repeat_the_last_valid_token():
    feeds, _ = step_inputs([[1, 2, 3], [4]], [SeqState(0, [0]), SeqState(0, [1])], block_size=4, all_logits=True)
    np.testing.assert_array_equal(feeds["logits_indices"], [[0, 1, 2], [0, 0, 0]])


def test_pool_write_places_each_token_in_its_slot():
    pools = KVPools(num_layers=1, num_blocks=3, block_size=2, kv_heads=1, head_dim=2)
    states = [SeqState(1, [2, 0])]
    _, slots = step_inputs([[5, 6]], states, block_size=2)  # positions 1, 2 -> (block 2, 1), (block 0, 0)
    new = np.arange(4, dtype=np.float32).reshape(1, 2, 1, 2)
    pools.write({"new_key.0": new, "new_value.0": -new}, slots)
    assert pools.keys[0].shape == (1, 3, 2, 2)  # [kv_heads, num_blocks, block_size, head_dim]
    np.testing.assert_array_equal(pools.keys[0][0, 2, 1], [0, 1])
    np.testing.assert_array_equal(pools.keys[0][0, 0, 0], [2, 3])
    np.testing.assert_array_equal(pools.values[0][0, 0, 0], [-2, -3])
    assert np.count_nonzero(pools.keys[0]) == 3  # nothing else written


def test_pool_write_puts_each_kv_head_in_its_own_plane():
    pools = KVPools(num_layers=1, num_blocks=2, block_size=2, kv_heads=2, head_dim=1)
    _, slots = step_inputs([[5, 6, 7]], [SeqState(0, [1, 0])], block_size=2)  # slots (1,0), (1,1), (0,0)
    new = np.array([[[10, 20], [11, 21], [12, 22]]], np.float32)[..., None]  # [batch 1, tokens 3, heads 2, dim 1]
    pools.write({"new_key.0": new, "new_value.0": new}, slots)
    np.testing.assert_array_equal(pools.keys[0][..., 0], [[[12, 0], [10, 11]], [[22, 0], [20, 21]]])


def test_stacked_write_and_block_copy_equal_the_per_layer_ones():
    rng = np.random.default_rng(3)
    states = [SeqState(3, [4, 1]), SeqState(0, [0]), SeqState(6, [2, 5, 3])]
    _, slots = step_inputs([[1, 2], [3], [4, 5, 6]], states, block_size=4)
    new = rng.standard_normal((2, 3, 3, 3, 2, 5)).astype(np.float32)  # [K/V, layers, batch, tokens, heads, dim]
    a = KVPools(num_layers=3, num_blocks=6, block_size=4, kv_heads=2, head_dim=5)
    b = KVPools(num_layers=3, num_blocks=6, block_size=4, kv_heads=2, head_dim=5)
    a.write({f"new_{kind}.{i}": new[k, i] for k, kind in enumerate(("key", "value")) for i in range(3)}, slots)
    b.write_stacked(new, slots)
    assert np.count_nonzero(a.data) == 2 * 3 * 2 * 5 * 6  # six tokens written in every layer, K and V
    np.testing.assert_array_equal(a.data, b.data)
    for i in range(3):  # the per-layer pools are views of the stacked array
        assert np.shares_memory(b.keys[i], b.data) and np.shares_memory(b.values[i], b.data)
    np.testing.assert_array_equal(b.values[2][:, 1, 0], new[1, 2, 0, 1])  # sequence 0, token 1: position 4 = block 1, slot 0
    b.copy_blocks([(1, 0)])
    np.testing.assert_array_equal(b.data[:, :, :, 0], a.data[:, :, :, 1])


def test_a_decode_steps_inputs_equal_the_general_forms():
    """Decode steps take a shorter path (``_decode_inputs``); with ``all_logits`` a decode step goes
    the general way and, one token per sequence, asks for the same logits: every array must match."""
    rng = np.random.default_rng(7)
    for _ in range(50):
        batch, bs = int(rng.integers(1, 9)), int(rng.choice([1, 2, 4, 16]))
        states = []
        for _ in range(batch):
            ctx = int(rng.integers(0, 70))
            blocks = rng.choice(200, blocks_needed(ctx + 1, bs) + int(rng.integers(0, 3)), replace=False)
            states.append(SeqState(ctx, [int(b) for b in blocks]))
        tokens = [[int(t)] for t in rng.integers(0, 1000, batch)]
        fast, fast_slots = step_inputs(tokens, states, bs)
        general, general_slots = step_inputs(tokens, states, bs, all_logits=True)
        assert fast.keys() == general.keys()
        for name in fast:
            assert fast[name].dtype == general[name].dtype and fast[name].shape == general[name].shape, name
            np.testing.assert_array_equal(fast[name], general[name], err_msg=name)
        for a, b in zip(dataclasses.astuple(fast_slots), dataclasses.astuple(general_slots)):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)


def test_block_slots_name_every_slot_of_each_block_in_pair_order():
    src, dst = block_slots([(2, 5), (0, 7)], 4)
    assert src.tolist() == [8, 9, 10, 11, 0, 1, 2, 3]
    assert dst.tolist() == [20, 21, 22, 23, 28, 29, 30, 31]
    empty = block_slots([], 4)
    assert empty[0].dtype == np.int64 and empty[0].size == 0 and empty[1].size == 0


def test_block_slots_copy_a_pool_as_kvpools_copy_blocks_does():
    """The copies the GPU kernel makes from these slots (``pool[:, to] = pool[:, from]`` on the pool
    viewed as [kv_heads, num_blocks * block_size, head_dim]) equal ``KVPools.copy_blocks``."""
    rng = np.random.default_rng(3)
    ref = KVPools(2, 12, 4, 3, 8)
    ref.data[:] = rng.standard_normal(ref.data.shape)
    pools = [p.copy() for p in [*ref.keys, *ref.values]]
    pairs = [(3, 9), (0, 11), (7, 1)]
    ref.copy_blocks(pairs)
    src, dst = block_slots(pairs, 4)
    for pool, want in zip(pools, [*ref.keys, *ref.values]):
        flat = pool.reshape(pool.shape[0], -1, pool.shape[3])
        flat[:, dst] = flat[:, src]
        assert np.array_equal(pool, want)
