"""Cosine similarity between src and dst tokens, and each src's best dst.

Tokens are normalised scale-free (no square leaves the dtype, whatever their magnitude); tokens that are all zero or
not finite count as zero vectors, similarity 0 to everything, never NaN. The GPU family spends few kernels and keeps
half-precision tokens in half precision; the CPU family makes fewer passes over the tokens.
"""

from __future__ import annotations

import functools
from typing import Any, Tuple

import paddle

from .cache import batch_tables, constant
from .runtime import KERNELS, LOW_PRECISION, dtype_name, tracing

__all__ = ["best_dst", "clear_non_finite", "normalize_rows", "similarity_dtype", "unit_rows"]

_TINY = 1.1754944e-38  # smallest normal float32


@functools.lru_cache(maxsize=64)  # (a hit runs no Python frame)
def similarity_dtype(dtype: Any, kind: Any) -> str:
    """The dtype in which tokens are normalised and compared (the ``[B, Ns, Nd]`` similarity) for tokens of
    ``dtype`` on ``kind`` kernels (a :class:`~ppdiffusers_tome.ops.runtime.Kernels` or its name): with
    ``half_math`` (a GPU) float16/bfloat16 stay (tensor cores, half the bytes of the largest temporary, as tomesd
    does); a CPU has no half-precision matmul and uses float32. float32 and float64 stay.

    >>> import paddle
    >>> similarity_dtype(paddle.float16, "gpu"), similarity_dtype(paddle.float16, "cpu")
    ('float16', 'float32')
    """
    name = dtype_name(dtype)
    if name in LOW_PRECISION:
        return name if KERNELS[kind].half_math else "float32"
    return name if name in ("float32", "float64") else "float32"


def clear_non_finite(x: paddle.Tensor, value: float = 0.0) -> paddle.Tensor:
    """``x`` (this code's own buffer) with NaN and inf replaced by ``value``, in place. (``where_`` rather than
    ``masked_fill_``: Paddle 3.3's ``masked_fill_`` adds a cast of its bool mask, one more operator.)"""
    return paddle.where_(paddle.isfinite(x), x, constant(value, dtype_name(x.dtype)))


def normalize_rows(x: paddle.Tensor, kind: Any, in_place: bool = False) -> paddle.Tensor:
    """The rows of ``x`` as unit vectors, computed scale-free: each row is first divided by its largest absolute
    value, so neither the square of 1e30 (nor, in float16, of 300) nor that of 1e-30 leaves the dtype. Rows that
    are all zero or hold NaN or inf become NaN (0/0, x/inf): callers clear them. One new buffer at most (none with
    ``in_place``, for a tensor this code owns). A GPU takes the 2-norm in one kernel; Paddle's CPU build runs that
    kernel slowly, so a CPU squares and sums with a matmul."""
    largest = paddle.linalg.norm(x, p=float("inf"), axis=-1, keepdim=True)
    x = x.divide_(largest) if in_place else x / largest
    if KERNELS[kind].few_launches:
        return x.divide_(paddle.linalg.norm(x, p=2, axis=-1, keepdim=True))
    ones = constant(1.0, dtype_name(x.dtype), (x.shape[-1], 1))
    return x.multiply_(paddle.rsqrt(paddle.matmul(paddle.square(x), ones)))


def unit_rows(metric: paddle.Tensor, kind: Any = "gpu") -> paddle.Tensor:
    """``metric`` as unit vectors along the last axis in a new tensor of its dtype (see :func:`normalize_rows`);
    tokens that are all zero or hold NaN or inf come out as zero vectors (similarity 0 to every token)."""
    return clear_non_finite(normalize_rows(metric, kind))


def best_dst(metric: paddle.Tensor, partition: paddle.Tensor, num_src: int, kind: Any
             ) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """For every src of ``partition`` (``[N]`` grid positions, ``num_src`` src first), the cosine similarity to its
    most similar dst and that dst's slot: ``[B, Ns]`` each, the GPU way or the CPU way (``kind``'s
    ``few_launches``)."""
    if KERNELS[kind].few_launches:
        return _best_dst_gpu(metric, partition, num_src)
    return _best_dst_cpu(metric, partition, num_src)


def _best_dst_gpu(metric: paddle.Tensor, partition: paddle.Tensor, num_src: int
                  ) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """The GPU way: few kernels (each one a launch), the unit rows and the similarity in the tokens' own dtype (see
    :func:`similarity_dtype`). Next to the similarity only one ``[B, N, C]`` temporary is alive, and the similarity
    is read once: its row maxima are gathered at the argmax, not found by a second pass."""
    work = similarity_dtype(metric.dtype, "gpu")
    unit = unit_rows(metric if dtype_name(metric.dtype) == work else metric.astype(work))
    src, dst = paddle.split(paddle.gather(unit, partition, axis=1), [num_src, metric.shape[1] - num_src], axis=1)
    del unit
    scores = paddle.matmul(src, dst, transpose_y=True)  # [B, Ns, Nd]
    del src, dst
    best = scores.argmax(axis=-1, keepdim=True)  # [B, Ns, 1]
    score = paddle.take_along_axis(scores, best, axis=-1, broadcast=False)
    return score.reshape([-1, num_src]), best.reshape([-1, num_src])


def _best_dst_cpu(metric: paddle.Tensor, partition: paddle.Tensor, num_src: int
                  ) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """The CPU way: fewer passes over the tokens, more (cheap) operators, since on a CPU a pass costs milliseconds
    and an operator microseconds.

    * One scale for all tokens, the reciprocal of the largest finite dst magnitude, keeps every square inside
      float32, so scaling all tokens by the same factor changes no decision (a token ~1e18 times smaller or larger
      than the dst counts as similarity 0, as do tokens holding NaN or inf).
    * Only the dst become unit rows; the src enter the similarity as they are (a positive factor per row does not
      move a row's argmax) and each src's best score is divided by its norm afterwards.
    * Row sums run as a matmul with a ones column (several times faster than a reduction on Paddle's CPU build),
      and each row's best score is read with one gather instead of a second pass over the similarity.
    """
    work = similarity_dtype(metric.dtype, "cpu")
    if dtype_name(metric.dtype) != work:
        metric = metric.astype(work)
    batch, num_dst, channels = int(metric.shape[0]), metric.shape[1] - num_src, metric.shape[2]
    ones = constant(1.0, work, (channels, 1))
    src = paddle.gather(metric, partition[:num_src], axis=1)
    dst = paddle.gather(metric, partition[num_src:], axis=1)
    dst_max = paddle.linalg.norm(dst, p=float("inf"), axis=-1, keepdim=True)  # [B, Nd, 1]
    scale = paddle.reciprocal(paddle.scale(paddle.max(clear_non_finite(dst_max)), 1.0, _TINY))
    # in place wherever the tensor is this function's own: a fresh buffer costs about as much as the pass itself
    # (always rebinding the result: a static program's in-place op only takes effect through its output)
    dst = dst.scale_(scale)
    dst = dst.multiply_(paddle.rsqrt(paddle.matmul(paddle.square(dst), ones)))  # 0/0, inf/inf give NaN: cleared next
    dst = clear_non_finite(dst)
    scaled = paddle.scale(src, scale)
    src_norm2 = paddle.matmul(paddle.square_(scaled), ones)  # [B, Ns, 1]
    del scaled
    scores = paddle.matmul(src, dst, transpose_y=True)  # [B, Ns, Nd]: cosine similarity times |src|
    best = scores.argmax(axis=-1)
    # each score row's offset in the flattened [B, Ns, Nd] similarity, to read every row's best score with one gather
    offsets = batch_tables("score_rows", -1 if tracing() else batch, metric, _build_score_offsets, num_src, num_dst)
    rows = (best + offsets).reshape([-1])
    score = paddle.gather(scores.reshape([-1]), rows).reshape([-1, num_src])
    cosine = score * scale * paddle.rsqrt(src_norm2.reshape([-1, num_src]))
    return clear_non_finite(cosine), best


def _build_score_offsets(count: Any, num_src: int, num_dst: int) -> paddle.Tensor:
    return (paddle.arange(count * num_src, dtype="int64") * num_dst).reshape([-1, num_src])
