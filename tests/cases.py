"""Test cases shared by the plan tests: shapes and partitions, and inputs whose decisions are clear of float32 rounding
(so a float32 plan and the float64 numpy reference must agree exactly on which tokens merge)."""

import numpy as np

from ppdiffusers_tome.ops import step_key, window_partition_table, window_sides
from tests.numpy_reference import min_margin, reference_local

F32_TOL = dict(rtol=1e-5, atol=1e-5)


def tie_free_metric(seed, batch, h, w, channels, src, dst, r):
    """Random metric whose matching decisions are separated by more than float32 noise (redrawn otherwise)."""
    rng = np.random.default_rng(seed)
    for _ in range(50):
        metric = rng.standard_normal((batch, h * w, channels)).astype(np.float32)
        if min_margin(metric, src, dst, r) > 2e-6:  # float32 cosine error is ~1e-7
            return metric
    raise AssertionError("could not draw a tie-free metric")


def partition_of(plan):
    return plan.src_pos.numpy(), plan.dst_pos.numpy()


GLOBAL_CASES = [
    # batch, h, w, sx, sy, r, no_rand
    (2, 8, 8, 2, 2, 32, True),
    (1, 9, 11, 2, 2, 40, True),
    (3, 7, 5, 2, 2, 10, False),
    (2, 6, 9, 3, 2, 25, False),
    (2, 16, 12, 2, 2, 96, False),
    (2, 5, 13, 1, 2, 20, True),
    (1, 4, 4, 2, 2, 1, False),
]


def tie_free_local(seed, batch, h, w, wy, wx, channels, partition, num_src, r_w, reference=reference_local, shift=0.0):
    """Tokens ``x`` and a metric whose decisions under ``reference`` (the last of its results is the smallest
    deciding margin) are all clear of float32 rounding; ``shift`` moves the metric's mean off zero."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, h * w, 5)).astype(np.float32)
    for _ in range(50):
        metric = (rng.standard_normal((batch, h * w, channels)) + shift).astype(np.float32)
        margin = reference(metric, x, h, w, wy, wx, partition, num_src, r_w)[-1]
        if margin > 2e-6:
            return metric, x
    raise AssertionError("could not draw a tie-free metric")


LOCAL_CASES = [
    # batch, h, w, window, r_w, random
    (2, 8, 8, 4, 6, True),
    (1, 12, 16, 8, 20, True),
    (2, 13, 10, 4, 9, False),  # 13 is prime: one window per column of height 13, odd sides leave src-only rows
    (3, 6, 9, 3, 2, True),
    (2, 16, 16, 16, 96, True),  # one window: the global plan written densely
    (2, 16, 16, 4, 5, True),  # 16 windows: feature order cuts along four keys (2 x 2 x 2 x 2)
    (1, 24, 24, 4, 5, False),  # 36 windows: 2 x 2 x 3 x 3
]


def case_partition(h, w, window, random):
    """The window sides, partition table (as a tensor and its first row in numpy) and src per window of a case."""
    wy, wx = window_sides(h, w, window)
    table = window_partition_table(h, w, wy, wx, 2, 2, step_key(321) if random else None, seed=3, blocks=1)
    return wy, wx, table, table[0].numpy(), wy * wx - (wy // 2) * (wx // 2)
