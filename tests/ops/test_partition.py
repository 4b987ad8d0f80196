"""The random 2D-stride partition: one dst per full cell, leftovers src, uniform and independent slots in the variants
drawn per grid and seed (every bit of it used), picked per block and step on the device in a few ops, and the level
of a token count."""

import math

import numpy as np
import paddle

import ppdiffusers_tome.ops as merge_module
from ppdiffusers_tome.ops import (
    bipartite_soft_matching_random2d,
    find_downsample,
    grid_partition,
    max_ratio,
)


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


def slots_of(table, h=32, w=32):
    """Every row's dst slot per cell (rows of a partition table on an h x w grid with 2 x 2 cells)."""
    cells = (h // 2) * (w // 2)
    found = []
    for row in table:
        dst = np.sort(row[-cells:])
        cell = (dst // w // 2) * (w // 2) + (dst % w) // 2
        order = np.argsort(cell)
        assert np.array_equal(cell[order], np.arange(cells))  # one dst per cell
        found.append(((dst // w % 2) * 2 + dst % 2)[order])
    return np.array(found)


def test_the_variants_draw_each_slot_uniformly_and_independently():
    # 61 variants x 256 cells = 15616 draws: chi-square with 3 dof, and the transitions between neighbouring cells
    # (15 dof) must look independent too
    from ppdiffusers_tome.ops.partition import VARIANTS, grid

    slots = slots_of(grid(32, 32, 2, 2).variants(0).numpy())
    assert slots.shape == (VARIANTS, 256) and len({tuple(row) for row in slots}) == VARIANTS
    counts = np.bincount(slots.reshape(-1), minlength=4)
    expected = counts.sum() / 4
    assert ((counts - expected) ** 2 / expected).sum() < 16.3  # p = 0.001 for 3 dof
    pairs = np.zeros((4, 4))
    for row in slots:
        np.add.at(pairs, (row[:-1], row[1:]), 1)
    expected_pairs = pairs.sum() / 16
    assert ((pairs - expected_pairs) ** 2 / expected_pairs).sum() < 37.7  # p = 0.001 for 15 dof


def test_steps_and_blocks_spread_over_the_variants():
    from ppdiffusers_tome.ops.partition import VARIANTS, variant_index

    key = merge_module.step_key
    picks = np.array([variant_index(key(paddle.to_tensor([t])), 0, 16).numpy() for t in range(0, 1000, 50)])
    assert all(len(set(row)) == 16 for row in picks)  # the 16 blocks of one step: 16 different variants
    assert len({tuple(column) for column in picks.T}) == 16 and all(len(set(c)) == 20 for c in picks.T)  # 20 steps
    counts = np.bincount(np.array([variant_index(key(t), 3, 2).numpy() for t in range(1000)]).reshape(-1),
                         minlength=VARIANTS)
    assert counts.min() > 0.5 * counts.mean() and counts.max() < 1.5 * counts.mean()  # 1000 steps: all of them


def test_partition_table_rows_differ_by_block_timestep_seed_and_grid():
    key = merge_module.step_key
    a = merge_module.partition_table(16, 16, 2, 2, key(paddle.to_tensor(999)), 0, 3).numpy()
    assert len({tuple(row) for row in a}) == 3  # blocks
    assert not np.array_equal(a, merge_module.partition_table(16, 16, 2, 2, key(paddle.to_tensor(981)), 0, 3).numpy())
    assert not np.array_equal(a, merge_module.partition_table(16, 16, 2, 2, key(paddle.to_tensor(999)), 1, 3).numpy())
    np.testing.assert_array_equal(a, merge_module.partition_table(16, 16, 2, 2, key(999), 0, 3).numpy())


def test_every_bit_of_the_seed_changes_the_variants():
    from ppdiffusers_tome.ops.partition import grid

    seeds = [0, 1, 2**29, 2**30, 2**31, 2**32, 2**62, 2**64 - 1, 2**64, 2**64 + 1]
    tables = [grid(8, 8, 2, 2).variants(s).numpy().tobytes() for s in seeds]
    assert len(set(tables)) == len(seeds)


def test_a_partition_costs_at_most_eight_ops_per_call():
    from ppdiffusers_tome.tools.measure import count_ops

    timestep = paddle.to_tensor([999, 999])
    merge_module.partition_table(64, 64, 2, 2, merge_module.step_key(timestep), 0, 16)  # tables built once
    counted = count_ops(lambda: merge_module.partition_table(64, 64, 2, 2, merge_module.step_key(timestep), 0, 16))
    assert counted.total <= 8, counted.by_name


def test_step_key_is_the_same_for_a_batch_of_one_timestep_in_any_form():
    key = lambda t: int(merge_module.step_key(t))  # noqa: E731
    assert key(paddle.to_tensor(999)) == key(paddle.to_tensor([999, 999])) == key(999) == key(999.0)
    assert key(paddle.to_tensor([999.0], dtype="float32")) == key(paddle.to_tensor([999]))
    assert key(paddle.to_tensor([999, 500])) == key(999)  # the noisiest item decides
    assert key(paddle.to_tensor(999.5)) != key(999)
