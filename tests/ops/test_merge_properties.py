"""Property-based tests (hypothesis) of the merge core over batch sizes, grids (1 x N, odd, not divisible by the
stride), strides, ratios from 0 to the maximum, and channel counts."""

import numpy as np
import paddle
from hypothesis import HealthCheck, example, given, settings, strategies as st

from ppdiffusers_tome.ops import bipartite_soft_matching_random2d, max_ratio


@st.composite
def merge_cases(draw):
    sx, sy = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    limit = max_ratio(sx, sy)
    ratio = 0.0 if limit == 0 else draw(st.floats(0.0, limit, exclude_max=True, allow_nan=False))
    return dict(
        batch=draw(st.integers(1, 3)),
        h=draw(st.integers(1, 12)),
        w=draw(st.integers(1, 12)),
        sx=sx,
        sy=sy,
        ratio=ratio,
        channels=draw(st.integers(1, 6)),
        no_rand=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def build(case):
    rng = np.random.default_rng(case["seed"])
    n = case["h"] * case["w"]
    metric = rng.standard_normal((case["batch"], n, 4)).astype(np.float32)
    x = rng.standard_normal((case["batch"], n, case["channels"])).astype(np.float32)
    r = int(n * case["ratio"])
    plan = bipartite_soft_matching_random2d(
        paddle.to_tensor(metric), case["w"], case["h"], case["sx"], case["sy"], r,
        no_rand=case["no_rand"], generator=case["seed"],
    )
    return metric, x, r, plan


def expected_round_trip(x, plan):
    """Unmerged tokens keep their value; a dst and every src merged into it all get the group's mean."""
    out = x.astype(np.float64).copy()
    if plan.is_identity:
        return out
    for b in range(x.shape[0]):
        groups = {}
        for pos, into in zip(plan.merged_pos.numpy()[b], plan.merged_into.numpy()[b]):
            groups.setdefault(int(into), [int(into)]).append(int(pos))
        for members in groups.values():
            out[b, members] = x[b, members].astype(np.float64).mean(axis=0)
    return out


# regression and edge cases, kept explicit: a 1 x N row, a grid with no full cell, strides larger than the grid,
# ratios at the top of the range, a single channel
EDGE_CASES = [
    dict(batch=1, h=1, w=7, sx=2, sy=2, ratio=0.5, channels=3, no_rand=False, seed=0),
    dict(batch=2, h=2, w=1, sx=2, sy=2, ratio=0.7, channels=2, no_rand=True, seed=1),
    dict(batch=1, h=1, w=9, sx=3, sy=1, ratio=0.66, channels=1, no_rand=False, seed=2),
    dict(batch=3, h=11, w=7, sx=3, sy=2, ratio=0.83, channels=4, no_rand=False, seed=3),
    dict(batch=2, h=12, w=12, sx=1, sy=1, ratio=0.0, channels=5, no_rand=False, seed=4),
]


def with_edge_cases(test):
    for case in EDGE_CASES:
        test = example(case)(test)
    return test


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@with_edge_cases
@given(merge_cases())
def test_shapes_round_trip_and_finiteness(case):
    metric, x, r, plan = build(case)
    n = case["h"] * case["w"]
    full_cells = (case["h"] // case["sy"]) * (case["w"] // case["sx"])
    expected_r = min(r, n - full_cells) if full_cells else 0
    assert plan.r == max(expected_r, 0)
    merged = plan.merge(paddle.to_tensor(x))
    assert list(merged.shape) == [case["batch"], n - plan.r, case["channels"]]
    out = plan.unmerge(merged).numpy()
    assert out.shape == x.shape and np.isfinite(out).all()
    np.testing.assert_allclose(out, expected_round_trip(x, plan), rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None)
@with_edge_cases
@given(merge_cases())
def test_identical_tokens_merge_to_themselves_within_rounding(case):
    # the mean is the convex combination dst/(1+k) + sum(src/(1+k)): k+1 roundings at most
    _, x, _, plan = build(case)
    same = np.broadcast_to(x[:, :1, :], x.shape).copy()
    merged = plan.merge(paddle.to_tensor(same))
    bound = (plan.r + 2) * 2.0**-23
    np.testing.assert_allclose(merged.numpy(), same[:, : merged.shape[1]], rtol=bound, atol=0)
    np.testing.assert_allclose(plan.unmerge(merged).numpy(), same, rtol=bound, atol=0)


@settings(max_examples=60, deadline=None)
@with_edge_cases
@given(merge_cases())
def test_nothing_depends_on_the_other_items_of_the_batch(case):
    metric, x, r, plan = build(case)
    order = np.random.default_rng(case["seed"]).permutation(case["batch"])
    permuted = bipartite_soft_matching_random2d(
        paddle.to_tensor(metric[order]), case["w"], case["h"], case["sx"], case["sy"], r,
        no_rand=case["no_rand"], generator=case["seed"],
    )
    round_trip = plan.unmerge(plan.merge(paddle.to_tensor(x))).numpy()
    permuted_trip = permuted.unmerge(permuted.merge(paddle.to_tensor(x[order]))).numpy()
    np.testing.assert_allclose(permuted_trip, round_trip[order], rtol=1e-6, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(merge_cases())
def test_partition_has_one_dst_per_full_cell(case):
    _, _, _, plan = build(case)
    if plan.is_identity:
        return
    h, w, sx, sy = case["h"], case["w"], case["sx"], case["sy"]
    dst = plan.dst_pos.numpy()
    src = plan.src_pos.numpy()
    assert sorted(np.concatenate([dst, src]).tolist()) == list(range(h * w))
    cells = {(int(p) // w // sy, int(p) % w // sx) for p in dst}
    assert len(cells) == len(dst) == (h // sy) * (w // sx)
