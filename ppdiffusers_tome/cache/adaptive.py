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

**The rule with the forecast** (``threshold=`` and ``forecast="linear"``) decides on the forecast's own error instead
of the signal's change. At each full step ``f2`` after two others ``f0 < f1``, the work just computed is compared with
what the forecast from ``f0`` and ``f1`` would have returned there: ``e = mean|w(f2) - forecast| / mean|forecast|`` (one
scalar read per *full* step; cached steps read nothing). A linear forecast misses by the second-order term of the
work's Taylor expansion, so a forecast ``j`` steps past ``f2`` (made from ``f1`` and ``f2``, ``h = f2 - f1`` apart)
errs by about ``e * j * (j + h) / (h * (h + f1 - f0))``, times the size of the step it stands in for relative to the
loop's average step (a sampler moves the latents by its step's size times the prediction; in a pipeline the sizes
come from its scheduler's timesteps, :meth:`~ppdiffusers_tome.core.generation.Generation.step_sizes`; elsewhere
every step weighs 1). The steps after ``f2`` are cached as long as these predicted errors, summed, stay within
``threshold`` (:func:`cached_steps_ahead`); the next step is full. Until a site has three
full steps the next step is full (steps 0, 1 and 2 of a generation), since the error cannot be measured yet. Where the
work changes evenly the gaps grow; where it bends (the first steps, the last ones) they shrink.

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
from typing import Any, Optional, Sequence, Tuple

import numpy as np
import paddle

from ..core.validation import as_choice, is_int, shown

__all__ = ["DEFAULT_THRESHOLD", "FORECAST_THRESHOLD", "FORECASTS", "cached_steps_ahead", "check_forecast",
           "check_max_skips", "check_threshold", "extrapolate", "forecast_error", "full_step_due", "relative_change"]

# The threshold this package suggests: a full step whenever the deep part's input has moved by 15 % of its size
# since the last one. On the shipped shapes model the signal's summed change over a generation is 1.50-1.57 with
# DDIM, Euler and DPM-Solver++ at 20 and at 50 steps, so 0.15 gives 10 full steps of 20 and 11 of 50 with every one
# of them (docs/design.md, "The adaptive rule"; docs/measurements/adaptive_signals_shapes.json).
DEFAULT_THRESHOLD = 0.15
# The threshold this package suggests for the rule with the forecast (the forecast's predicted errors, weighed by the
# steps' sizes, summed over a run of cached steps): with the whole-model cache it ran 12 full steps of 50 on the
# shapes UNet (DDIM, 4.45x, closer to vanilla than interval 3) and 10 of 28 on the SD3 shapes model (flow-matching
# Euler, 2.68x), each closer than fewer steps in the same time (docs/benchmarks.md 7.13, 8.13). With 20 steps or
# fewer, 0.15 (docs/benchmarks.md 7.12).
FORECAST_THRESHOLD = 0.3
FORECASTS = ("linear",)
LONGEST_RUN = 1000  # the rule with the forecast caches at most this many steps in a row (an exact forecast: no end)


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
                         "step, at which a step runs in full, or with forecast='linear' the forecast's predicted "
                         "relative error summed over the cached steps; 0 = every step full; e.g. "
                         f"{DEFAULT_THRESHOLD}, with the forecast {FORECAST_THRESHOLD}); "
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


def forecast_error(current: Any, last: Any, earlier: Any, step: int, last_step: int, earlier_step: int) -> paddle.Tensor:
    """``mean|current - forecast| / mean|forecast|`` as a 0-d float32 tensor (not read), where the forecast is the
    one :func:`extrapolate` makes for ``step`` from the work kept at ``last_step`` (``last``) and ``earlier_step``
    (``earlier``).

    >>> a, b, c = (paddle.to_tensor(v) for v in ([1.0, 2.0], [2.0, 4.0], [4.0, 4.0]))
    >>> round(float(forecast_error(c, b, a, 2, 1, 0)), 4)  # forecast [3, 6]: mean|[1, -2]| / mean|[3, 6]|
    0.3333
    """
    return relative_change(current, extrapolate(last, earlier, last_step, earlier_step, step))


def cached_steps_ahead(error: float, gap: int, previous_gap: int, threshold: float, max_skips: Optional[int],
                       sizes: Optional[Sequence[float]] = None) -> int:
    """How many steps after a full step the rule with the forecast caches: the most ``n`` for which the predicted
    errors of the forecasts ``1 .. n`` steps ahead sum to at most ``threshold`` (and ``n <= max_skips``). ``error``
    is the relative error observed at this full step of the forecast made ``gap`` steps after the last full step
    from it and the one ``previous_gap`` steps before it; a forecast ``j`` steps ahead then errs by about
    ``error * j * (j + gap) / (gap * (gap + previous_gap))``, weighed by ``sizes[j - 1]``, the size of the step it
    stands in for relative to the loop's average step (None: 1; past its end, its last value). A non-finite
    ``error`` caches nothing.

    >>> cached_steps_ahead(0.1, 1, 1, threshold=0.15, max_skips=None)  # 0.05 * (1*2 + 2*3 + ...): 0.1, 0.4
    1
    >>> cached_steps_ahead(0.01, 3, 3, threshold=0.15, max_skips=None)  # (0.01 / 18) * (4 + 10 + 18 + ...)
    7
    >>> cached_steps_ahead(0.01, 3, 3, threshold=0.15, max_skips=None, sizes=(2.0,))  # every step counts twice
    5
    """
    if not math.isfinite(error) or error < 0 or gap < 1 or previous_gap < 1:
        return 0
    scale = error / (gap * (gap + previous_gap))
    cap = LONGEST_RUN if max_skips is None else min(max_skips, LONGEST_RUN)
    count = len(sizes) if sizes else 0
    total, n = 0.0, 0
    while n < cap:
        size = 1.0 if not count else sizes[min(n, count - 1)]
        total += scale * (n + 1) * (n + 1 + gap) * size
        if total > threshold:
            break
        n += 1
    return n
