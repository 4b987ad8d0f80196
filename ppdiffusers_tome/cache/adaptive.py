"""The step cache's adaptive rule (``threshold=``) and its forecast (``forecast="linear"``).

**The rule.** At every step of a call site the shallow part runs up to the first deep part, whose input is the
*signal* (a UNet: the input of its first deep part; a transformer: the input of its cached segment, the image
stream; the whole-model cache: the model's input). Its relative change since the site's previous step,
``mean|s_t - s_{t-1}| / mean|s_{t-1}|``, is added to what has accumulated since the last full step; the step runs in
full when the sum reaches ``threshold`` (and the sum starts again from 0), or when ``max_skips`` cached steps came in
a row; otherwise it is cached. The change is one device scalar, read to the host once per call (the one
device-to-host read the rule costs); the sum is a Python float. Protected steps (the first, the last, ``start``,
``stop``, ``full_steps``) are full whatever the sum. No per-model polynomial and no offline calibration: the sum is a
relative change of the model's own features, whose total over a generation depends little on the sampler or the
number of steps, so one threshold gives about the same number of full steps with DDIM, Euler and DPM-Solver++, at 20
steps as at 50 (``docs/design.md``, "The adaptive rule").

**The forecast.** On a cached step, the deep part's work (a UNet's last deep output, a transformer segment's
contribution, the whole model's residual) is extrapolated to first order in the step index from the last two full
steps ``f0 < f1``: ``w(t) = w(f1) + (w(f1) - w(f0)) * (t - f1) / (f1 - f0)``; with one full step only, ``w(f1)``.

>>> full_step_due(0.25, 0.125, 1, threshold=0.5, max_skips=None)  # 0.375 < 0.5: cached, one more skip
(False, 0.375, 2)
>>> full_step_due(0.25, 0.375, 1, threshold=0.5, max_skips=None)  # 0.625 >= 0.5: full, the sum starts again
(True, 0.0, 0)
>>> full_step_due(0.0, 0.125, 3, threshold=0.5, max_skips=3)  # 3 cached steps in a row already
(True, 0.0, 0)
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Tuple

import numpy as np
import paddle

from ..core.validation import as_choice, is_int, shown

__all__ = ["DEFAULT_THRESHOLD", "FORECASTS", "check_forecast", "check_max_skips", "check_threshold", "full_step_due",
           "extrapolate", "relative_change"]

# The threshold this package suggests: a full step whenever the deep part's input has moved by 15 % of its size
# since the last one. On the shipped shapes model the signal's summed change over a generation is 1.50-1.57 with
# DDIM, Euler and DPM-Solver++ at 20 and at 50 steps, so 0.15 gives 10 full steps of 20 and 11 of 50 with every one
# of them (docs/design.md, "The adaptive rule"; docs/measurements/adaptive_signals_shapes.json).
DEFAULT_THRESHOLD = 0.15
FORECASTS = ("linear",)


def check_threshold(value: Any) -> Optional[float]:
    """``value`` as a float (or None), or ``ValueError`` naming ``threshold`` and its range.

    >>> check_threshold(0.2), check_threshold(None), check_threshold(0)
    (0.2, None, 0.0)
    """
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or value < 0:
        raise ValueError("threshold must be None (a full step every interval steps) or a finite number >= 0 (the "
                         "adaptive rule: the relative change of the deep part's input, summed since the last full "
                         f"step, at which a step runs in full; 0 = every step full; e.g. {DEFAULT_THRESHOLD}); "
                         f"got {shown(value)}")
    return float(value)


def check_max_skips(value: Any, threshold: Optional[float]) -> Optional[int]:
    """``value`` as an int (or None), or ``ValueError`` naming ``max_skips``; it needs ``threshold``."""
    if value is None:
        return None
    if not is_int(value) or value < 1:
        raise ValueError(f"max_skips must be None (no cap) or an integer >= 1 (cached steps in a row at most); got "
                         f"{shown(value)}")
    if threshold is None:
        raise ValueError(f"max_skips={int(value)} caps the adaptive rule's cached steps in a row; it needs threshold= "
                         "(with threshold=None the interval already fixes them)")
    return int(value)


def check_forecast(value: Any) -> Optional[str]:
    """``value`` as ``"linear"`` (or None), or ``ValueError`` naming ``forecast``."""
    if value is None:
        return None
    choice = as_choice(value, FORECASTS)
    if choice is None:
        raise ValueError(f"forecast must be None (reuse the last full step's work as it is) or {FORECASTS[0]!r} "
                         f"(extrapolate it from the last two full steps); got {shown(value)}")
    return choice


def full_step_due(accumulated: float, change: float, skips: int, threshold: float,
           max_skips: Optional[int]) -> Tuple[bool, float, int]:
    """One step of the adaptive rule: ``(full, accumulated, skips)`` after a step whose signal changed by
    ``change`` (relative), given what had ``accumulated`` since the last full step and the ``skips`` (cached steps
    in a row) before it. A change that is not a finite number makes the step full."""
    total = accumulated + change
    if not total < threshold or (max_skips is not None and skips >= max_skips):  # (NaN: not < threshold)
        return True, 0.0, 0
    return False, total, skips + 1


def relative_change(current: paddle.Tensor, previous: paddle.Tensor) -> paddle.Tensor:
    """``mean|current - previous| / mean|previous|`` as a 0-d float32 tensor on their device (not read)."""
    change = paddle.abs(current - previous).mean() / paddle.abs(previous).mean()
    return change.astype("float32") if change.dtype != paddle.float32 else change


def extrapolate(last: Any, earlier: Any, last_step: int, earlier_step: int, step: int) -> Any:
    """The forecast of the work kept at ``last_step`` (``last``) for ``step``, from it and the work kept at
    ``earlier_step`` (``earlier``, or None: ``last`` as it is). Tensors, and tuples or lists of tensors (a ``None``
    item stays None), are extrapolated item by item.

    >>> a, b = paddle.to_tensor([1.0, 2.0]), paddle.to_tensor([2.0, 4.0])
    >>> extrapolate(b, a, 3, 1, 4).tolist()  # b + (b - a) * (4 - 3) / (3 - 1)
    [2.5, 5.0]
    """
    if earlier is None or last_step <= earlier_step:
        return last
    scale = (step - last_step) / (last_step - earlier_step)
    if isinstance(last, (tuple, list)):
        return type(last)(extrapolate(x, y, last_step, earlier_step, step) if x is not None and y is not None else x
                          for x, y in zip(last, earlier))
    if not isinstance(last, paddle.Tensor) or not isinstance(earlier, paddle.Tensor) or last.shape != earlier.shape:
        return last
    return last + (last - earlier) * scale
