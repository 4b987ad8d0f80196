"""The random 2D-stride partition: one dst per full cell, leftovers src, uniform and independent slots drawn on\nthe device from (seed, block, grid, step, cell), every bit of the seed used, and the level of a token count."""

import math

import numpy as np
import paddle

import ppdiffusers_tome.merge as merge_module
from ppdiffusers_tome.merge import (
    bipartite_soft_matching_random2d,
    find_downsample,
    grid_partition,
    max_ratio,
)
from ppdiffusers_tome.ops import partition as partition_module


def test_random_partition_has_one_dst_per_cell_and_leftovers_are_src():
    h, w, sx, sy = 7, 9, 2, 3
    seen_slots = set()
    for seed in range(30):
        src, dst = grid_partition(h, w, sx, sy, no_rand=False, generator=seed)
        assert sorted(np.concatenate([src, dst]).tolist()) == list(range(h * w))
        rows, cols = dst // w, dst % w
        cells = list(zip((rows // sy).tolist(), (cols // sx).tolist()))
        assert len(set(cells)) == len(cells) == (h // sy) * (w // sx)
        assert rows.max() < (h // sy) * sy and cols.max() < (w // sx) * sx  # leftover rows/columns hold no dst
        seen_slots.update(zip((rows % sy).tolist(), (cols % sx).tolist()))
    assert seen_slots == {(dy, dx) for dy in range(sy) for dx in range(sx)}


def test_random_partition_is_reproducible_from_its_generator():
    a = grid_partition(8, 8, 2, 2, no_rand=False, generator=np.random.default_rng(5))
    b = grid_partition(8, 8, 2, 2, no_rand=False, generator=5)
    c = grid_partition(8, 8, 2, 2, no_rand=False, generator=6)
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[1], c[1])


def test_random_plan_does_not_touch_paddles_global_rng():
    x = paddle.randn([2, 64, 8])
    paddle.seed(123)
    expected = paddle.randn([4]).numpy()
    paddle.seed(123)
    bipartite_soft_matching_random2d(x, 8, 8, 2, 2, 32, no_rand=False)
    bipartite_soft_matching_random2d(x, 8, 8, 2, 2, 32, no_rand=False, generator=3)
    np.testing.assert_array_equal(paddle.randn([4]).numpy(), expected)


def test_max_ratio():
    assert max_ratio(2, 2) == 0.75 and max_ratio(1, 1) == 0.0 and math.isclose(max_ratio(3, 2), 5 / 6)


def _tomesd_downsample(h, w, n):
    return int(math.ceil(math.sqrt(h * w // n)))


def test_find_downsample_is_right_for_every_sd_size_and_level():
    tomesd_wrong = 0
    for px_h in range(256, 1025, 8):
        for px_w in range(256, 1025, 8):
            h, w = px_h // 8, px_w // 8
            for d in (1, 2, 4, 8):
                n = math.ceil(h / d) * math.ceil(w / d)
                assert find_downsample(h, w, n) == d, (h, w, d)
                if d == 8 and _tomesd_downsample(h, w, n) != d:
                    tomesd_wrong += 1
    assert tomesd_wrong > 0  # the reason this function exists


def test_find_downsample_for_odd_latent_and_unknown_counts():
    assert find_downsample(9, 11, 4) == 8
    assert _tomesd_downsample(9, 11, 4) == 5  # tomesd picks a 2 x 3 grid for 4 tokens and crashes
    assert find_downsample(9, 11, 99) == 1
    assert find_downsample(9, 11, 30) == 2
    assert find_downsample(64, 64, 77) is None


def test_partition_table_draws_each_slot_uniformly_and_independently():
    # 4 slots per cell; 40 timesteps x 4 blocks x 256 cells = 40960 draws: chi-square with 3 dof, and the
    # transitions between neighbouring cells (15 dof) must look independent too
    slots, pairs = np.zeros(4), np.zeros((4, 4))
    for t in range(0, 1000, 25):
        table = merge_module.partition_table(32, 32, 2, 2, merge_module.step_key(paddle.to_tensor([t])), 0, 4).numpy()
        for row in table:
            dst = np.sort(row[-256:])
            cell = (dst // 32 // 2) * 16 + (dst % 32) // 2
            slot = (dst // 32 % 2) * 2 + dst % 2
            order = np.argsort(cell)
            assert np.array_equal(cell[order], np.arange(256))  # one dst per cell
            s = slot[order]
            slots += np.bincount(s, minlength=4)
            np.add.at(pairs, (s[:-1], s[1:]), 1)
    expected = slots.sum() / 4
    assert ((slots - expected) ** 2 / expected).sum() < 16.3  # p = 0.001 for 3 dof
    expected_pairs = pairs.sum() / 16
    assert ((pairs - expected_pairs) ** 2 / expected_pairs).sum() < 37.7  # p = 0.001 for 15 dof


def test_partition_table_rows_differ_by_block_timestep_seed_and_grid():
    key = merge_module.step_key
    a = merge_module.partition_table(16, 16, 2, 2, key(paddle.to_tensor(999)), 0, 3).numpy()
    assert len({tuple(row) for row in a}) == 3  # blocks
    assert not np.array_equal(a, merge_module.partition_table(16, 16, 2, 2, key(paddle.to_tensor(981)), 0, 3).numpy())
    assert not np.array_equal(a, merge_module.partition_table(16, 16, 2, 2, key(paddle.to_tensor(999)), 1, 3).numpy())
    np.testing.assert_array_equal(a, merge_module.partition_table(16, 16, 2, 2, key(999), 0, 3).numpy())


def test_seed_salts_use_every_bit_and_keep_the_old_salts_below_2_to_the_29():
    salt = partition_module._seed_salt
    assert salt(0) == 0 and salt(5) == (5 * partition_module._W_SEED) & partition_module.MASK31  # partitions of 0.4.0 kept
    seeds = [0, 2**29, 2**30, 3 * 2**29, 2**31, 2**32, 2**62, 2**64 - 1]
    assert len({salt(s) for s in seeds}) == len(seeds)
    low = np.random.default_rng(0).choice(2**31, 20000, replace=False)
    assert len({salt(int(s)) for s in low}) == len(low)  # one-to-one on [0, 2**31)
    step = merge_module.step_key(999)
    tables = [merge_module.partition_table(16, 16, 2, 2, step, s, 2).numpy() for s in (0, 2**29, 2**31)]
    assert not np.array_equal(tables[0], tables[1]) and not np.array_equal(tables[0], tables[2])


def test_step_key_is_the_same_for_a_batch_of_one_timestep_in_any_form():
    key = lambda t: int(merge_module.step_key(t))  # noqa: E731
    assert key(paddle.to_tensor(999)) == key(paddle.to_tensor([999, 999])) == key(999) == key(999.0)
    assert key(paddle.to_tensor([999.0], dtype="float32")) == key(paddle.to_tensor([999]))
    assert key(paddle.to_tensor([999, 500])) == key(999)  # the noisiest item decides
    assert key(paddle.to_tensor(999.5)) != key(999)
