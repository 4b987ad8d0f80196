"""Run float16/bfloat16 tensors through the GPU branch of the merge core on a CPU.

Paddle's CPU build has no half-precision kernels for matmul, max, gather, norm and most elementwise ops, so the GPU
branch cannot run on half tokens here as it is. :func:`half_kernels` patches exactly the Paddle functions that the
branch calls with a wrapper that computes in float32 and rounds every floating result back to the half dtype of its
inputs. That is what a GPU kernel does with half operands (reductions and matmuls accumulate in float32, each output
is stored in half precision), so the code under test really holds every intermediate in float16/bfloat16, and its
decisions show the effect of that precision.
"""

from __future__ import annotations

import contextlib
import functools

import paddle

HALF = ("float16", "bfloat16")
_FUNCTIONS = [
    (paddle, "matmul"), (paddle, "sum"), (paddle, "square"), (paddle, "rsqrt"), (paddle, "where_"),
    (paddle, "gather"), (paddle, "isfinite"), (paddle.linalg, "norm"), (paddle.nn.functional, "pad"),
    (paddle, "reciprocal"), (paddle, "scale"), (paddle, "gather_nd"), (paddle, "take_along_axis"),
    (paddle, "fmax"), (paddle, "mean"),
]
_METHODS = ["__truediv__", "multiply_", "divide_", "max", "argmax", "__mul__", "__sub__"]
_IN_PLACE = {"where_": 1, "multiply_": 0, "divide_": 0}  # which argument an in-place op updates


def _half_of(values):
    for value in values:
        if isinstance(value, paddle.Tensor) and str(value.dtype).replace("paddle.", "") in HALF:
            return str(value.dtype).replace("paddle.", "")
    return None


def _up(value):
    if isinstance(value, paddle.Tensor) and str(value.dtype).replace("paddle.", "") in HALF:
        return value.astype("float32")
    return value


def _down(value, half):
    if isinstance(value, paddle.Tensor) and str(value.dtype).replace("paddle.", "") == "float32":
        return value.astype(half)
    if isinstance(value, (list, tuple)):
        return type(value)(_down(v, half) for v in value)
    return value


def _wrap(original, target=None):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        half = _half_of(list(args) + list(kwargs.values()))
        if half is None:
            return original(*args, **kwargs)
        calls.append(getattr(original, "__name__", "?"))
        out = _down(original(*[_up(a) for a in args], **{k: _up(v) for k, v in kwargs.items()}), half)
        if target is not None:  # in place: write the rounded result into the tensor the op updates
            paddle.assign(out, args[target])
            return args[target]
        return out

    return wrapper


calls: list = []


@contextlib.contextmanager
def half_kernels(monkeypatch):
    """Within this context, half-precision tensors work in the functions the GPU branch uses (see module doc)."""
    calls.clear()
    for owner, name in _FUNCTIONS:
        monkeypatch.setattr(owner, name, _wrap(getattr(owner, name), target=_IN_PLACE.get(name)))
    for name in _METHODS:
        monkeypatch.setattr(paddle.Tensor, name, _wrap(getattr(paddle.Tensor, name), target=_IN_PLACE.get(name)))
    yield calls
