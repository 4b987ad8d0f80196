"""An independent float64 numpy implementation of ToMe SD's matching, merge and unmerge, written with plain loops
where that makes the math obvious. Tests compare the Paddle core against it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Tuple

import numpy as np


def reference_partition_top_left(h: int, w: int, sx: int, sy: int):
    """dst = top-left token of every full sy x sx cell, in cell order; src = the rest, increasing."""
    dst = []
    for cy in range(h // sy):
        for cx in range(w // sx):
            dst.append(cy * sy * w + cx * sx)
    dst_set = set(dst)
    src = [p for p in range(h * w) if p not in dst_set]
    return np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)


@dataclass
class ReferencePlan:
    src: np.ndarray  # [Ns] grid positions
    dst: np.ndarray  # [Nd]
    r: int
    unmerged: list  # per item: src slots kept, in order
    merged: list  # per item: src slots merged, in order
    target: list  # per item: dst slot of each merged src
    similarity: list  # per item: best cosine similarity of every src slot


def reference_plan(metric: np.ndarray, src: np.ndarray, dst: np.ndarray, r: int) -> ReferencePlan:
    metric = metric.astype(np.float64)
    r = min(r, len(src))
    unmerged, merged, target, sims = [], [], [], []
    for item in metric:
        norms = np.linalg.norm(item, axis=-1, keepdims=True)
        unit = item / np.maximum(norms, 1e-6)
        scores = unit[src] @ unit[dst].T
        best_dst = scores.argmax(axis=-1)
        best = scores.max(axis=-1)
        order = np.argsort(-best, kind="stable")
        unmerged.append(order[r:])
        merged.append(order[:r])
        target.append(best_dst[order[:r]])
        sims.append(best)
    return ReferencePlan(src, dst, r, unmerged, merged, target, sims)


def reference_merge(x: np.ndarray, plan: ReferencePlan) -> np.ndarray:
    x = x.astype(np.float64)
    out = []
    for b, item in enumerate(x):
        dst_sum = item[plan.dst].copy()
        count = np.ones(len(plan.dst))
        for slot, j in zip(plan.merged[b], plan.target[b]):
            dst_sum[j] += item[plan.src[slot]]
            count[j] += 1
        kept = item[plan.src[plan.unmerged[b]]]
        out.append(np.concatenate([kept, dst_sum / count[:, None]], axis=0))
    return np.stack(out)


def reference_round_trip(x: np.ndarray, plan: ReferencePlan) -> np.ndarray:
    """unmerge(merge(x)): unmerged tokens keep their value, dst and merged src get the dst's mean."""
    merged = reference_merge(x, plan)
    n_kept = len(plan.src) - plan.r
    out = np.zeros(x.shape, dtype=np.float64)
    for b in range(x.shape[0]):
        for row, slot in enumerate(plan.unmerged[b]):
            out[b, plan.src[slot]] = merged[b, row]
        for j, pos in enumerate(plan.dst):
            out[b, pos] = merged[b, n_kept + j]
        for slot, j in zip(plan.merged[b], plan.target[b]):
            out[b, plan.src[slot]] = merged[b, n_kept + j]
    return out


def min_margin(metric: np.ndarray, src: np.ndarray, dst: np.ndarray, r: int) -> float:
    """Smallest gap that decides the matching: between the best and second-best dst of every src, and between
    the r-th and (r+1)-th most similar src. Inputs with a large margin are tie-free for float32 arithmetic."""
    plan = reference_plan(metric, src, dst, r)
    margins = [math.inf]
    for b, item in enumerate(metric.astype(np.float64)):
        unit = item / np.maximum(np.linalg.norm(item, axis=-1, keepdims=True), 1e-6)
        scores = np.sort(unit[src] @ unit[dst].T, axis=-1)
        if scores.shape[1] > 1:
            margins.append(float((scores[:, -1] - scores[:, -2]).min()))
        best = np.sort(plan.similarity[b])[::-1]
        if 0 < plan.r < len(best):
            margins.append(float(best[plan.r - 1] - best[plan.r]))
    return min(margins)


def sort_rows(a: np.ndarray) -> np.ndarray:
    """Rows of each batch item in lexicographic order, to compare merged outputs up to row order."""
    return np.stack([item[np.lexsort(item.T[::-1])] for item in a])


def reference_downsample(x: np.ndarray, h: int, w: int, factor: int, mode: str) -> np.ndarray:
    """ToDo's downsampling of ``[B, h*w, C]`` tokens with plain loops: per ``factor x factor`` cell (cut at the
    grid's edge), its top-left token ("nearest") or the mean of the tokens it holds ("average")."""
    x = np.asarray(x, dtype=np.float64)
    batch, _, channels = x.shape
    out_h, out_w = math.ceil(h / factor), math.ceil(w / factor)
    out = np.zeros((batch, out_h * out_w, channels))
    for b in range(batch):
        for i in range(out_h):
            for j in range(out_w):
                rows = range(i * factor, min((i + 1) * factor, h))
                cols = range(j * factor, min((j + 1) * factor, w))
                if mode == "nearest":
                    out[b, i * out_w + j] = x[b, rows[0] * w + cols[0]]
                else:
                    out[b, i * out_w + j] = np.mean([x[b, y * w + z] for y in rows for z in cols], axis=0)
    return out


def reference_windows(h: int, w: int, wy: int, wx: int):
    """Grid positions of the tokens of every ``wy x wx`` window, row-major inside a window, windows row-major."""
    return [
        [(y0 + ty) * w + (x0 + tx) for ty in range(wy) for tx in range(wx)]
        for y0 in range(0, h, wy)
        for x0 in range(0, w, wx)
    ]


def reference_local(metric: np.ndarray, x: np.ndarray, h: int, w: int, wy: int, wx: int, partition: np.ndarray,
                    num_src: int, r_w: int):
    """Local matching in float64 with plain loops: in every window, src (the first ``num_src`` tokens of the
    window's row of ``partition``, window-local indices) are matched to the window's dst by cosine similarity,
    the ``r_w`` most similar (stable on ties) merge into their dst by mean. Returns ``(merged, round_trip,
    margin)``: the merged tokens window by window (kept src in descending similarity, then the dst), ``x`` after
    merge and unmerge, and the smallest gap deciding a choice (for tie-free inputs)."""
    metric, x = metric.astype(np.float64), x.astype(np.float64)
    windows = reference_windows(h, w, wy, wx)
    merged, round_trip, margins = [], np.zeros_like(x), [math.inf]
    for b in range(x.shape[0]):
        rows = []
        for k, cells in enumerate(windows):
            order = [cells[i] for i in partition[k]]
            src, dst = order[:num_src], order[num_src:]
            unit = metric[b] / np.maximum(np.linalg.norm(metric[b], axis=-1, keepdims=True), 1e-300)
            kept, means = _merge_window(unit, x[b], src, dst, r_w, round_trip[b], margins)
            rows.extend(x[b, src[i]] for i in kept)
            rows.extend(means)
        merged.append(np.stack(rows))
    return np.stack(merged), round_trip, min(margins)


def reference_clusters(metric: np.ndarray, h: int, w: int, wy: int, wx: int) -> Tuple[np.ndarray, float]:
    """Feature order's cluster keys of one item, float64: the centroids are the mean tokens of tiles (the windows,
    halved on both sides while both are even and there are at most 64 tiles), every token joins the centroid with the largest dot product over the
    centroid's length, and its key is the place of that centroid when they are sorted by their cosine with the mean
    token. Returns the keys ``[N]`` and the smallest gap deciding a choice (for tie-free inputs)."""
    ty, tx = wy, wx
    while ty % 2 == 0 and tx % 2 == 0 and (h // (ty // 2)) * (w // (tx // 2)) <= 64:
        ty, tx = ty // 2, tx // 2
    means = np.array([metric[cells].mean(axis=0) for cells in reference_windows(h, w, ty, tx)])
    centroids = means / np.linalg.norm(means, axis=-1, keepdims=True)
    along = centroids @ means.mean(axis=0)
    place = np.argsort(np.argsort(along, kind="stable"), kind="stable")
    scores = metric @ centroids.T
    top = np.sort(scores, axis=-1)
    gaps = [float((top[:, -1] - top[:, -2]).min()) if scores.shape[1] > 1 else math.inf]
    gaps.append(float(np.diff(np.sort(along)).min()) if len(along) > 1 else math.inf)
    return place[scores.argmax(axis=-1)], min(gaps)


def reference_local_feature(metric: np.ndarray, x: np.ndarray, h: int, w: int, wy: int, wx: int, partition: np.ndarray,
                            num_src: int, r_w: int):
    """Local matching in feature order, float64 and plain loops: the src of all windows of ``partition`` (window by
    window, in partition order) are sorted by their cluster key (:func:`reference_clusters`), stably, and cut into
    equal runs, and so are the dst; run ``k`` of the src is matched with run ``k`` of the dst as
    :func:`reference_local` matches a window. Returns ``(round_trip, margin)``; the margin also covers the cluster
    choices and their order."""
    metric, x = metric.astype(np.float64), x.astype(np.float64)
    windows = reference_windows(h, w, wy, wx)
    count = len(windows)
    src_all = [windows[k][i] for k in range(count) for i in partition[k][:num_src]]
    dst_all = [windows[k][i] for k in range(count) for i in partition[k][num_src:]]
    ns_w, nd_w = num_src, len(partition[0]) - num_src
    round_trip, margins = np.zeros_like(x), [math.inf]
    for b in range(x.shape[0]):
        unit = metric[b] / np.maximum(np.linalg.norm(metric[b], axis=-1, keepdims=True), 1e-300)
        clusters, gap = reference_clusters(metric[b], h, w, wy, wx)
        margins.append(gap)
        runs = []
        for tokens, size in ((src_all, ns_w), (dst_all, nd_w)):
            ordered = [tokens[i] for i in np.argsort(clusters[tokens], kind="stable")]
            runs.append([ordered[k * size:(k + 1) * size] for k in range(count)])
        for src, dst in zip(*runs):
            _merge_window(unit, x[b], src, dst, r_w, round_trip[b], margins)
    return round_trip, min(margins)


def _merge_window(unit: np.ndarray, x: np.ndarray, src, dst, r_w: int, round_trip: np.ndarray, margins: list):
    """One window of one item: match ``src`` to ``dst`` (grid positions) by the cosine of their ``unit`` rows,
    merge the ``r_w`` most similar src into their dst by mean, write the round trip of ``x`` into ``round_trip``
    and the deciding gaps into ``margins``. Returns the kept src (indices into ``src``, in descending similarity)
    and the means of the dst groups."""
    scores = unit[src] @ unit[dst].T
    best_dst, best = scores.argmax(axis=-1), scores.max(axis=-1)
    ranked = np.argsort(-best, kind="stable")
    top = np.sort(scores, axis=-1)
    if top.shape[1] > 1:
        margins.append(float((top[:, -1] - top[:, -2]).min()))
    if 0 < r_w < len(best):
        margins.append(float(-np.diff(np.sort(best)[::-1])[r_w - 1]))
    sums, sizes = x[dst].copy(), np.ones(len(dst))
    for i in ranked[:r_w]:
        sums[best_dst[i]] += x[src[i]]
        sizes[best_dst[i]] += 1
    means = sums / sizes[:, None]
    for i in ranked[r_w:]:
        round_trip[src[i]] = x[src[i]]
    for j, pos in enumerate(dst):
        round_trip[pos] = means[j]
    for i in ranked[:r_w]:
        round_trip[src[i]] = means[best_dst[i]]
    return ranked[r_w:], means
