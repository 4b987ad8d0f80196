"""The step cache's settings: :class:`CacheConfig`, frozen and validated by name (the fixed interval, the parts of a
model a cached step runs, the protected steps, the adaptive rule, the forecast and the whole-model cache), and
``CONFIG_FIELDS``, the names :func:`~ppdiffusers_tome.cache.step_cache.apply_cache` takes as options."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, Optional, Tuple, Union

from ..core.validation import as_bool, as_choice, is_int, shown
from .adaptive import check_forecast, check_max_skips, check_threshold
from .layout import AUTO

__all__ = ["CONFIG_FIELDS", "CacheConfig"]


@dataclass(frozen=True)
class CacheConfig:
    """Settings of the step cache.

    Args:
        interval: a full pass every ``interval`` steps (``int >= 1``; 1 = every step, the vanilla forward).
        depth: how much runs on every step: for a UNet or ControlNet, the resolution levels of the shallow branch
            (``down_blocks[:depth]`` and ``up_blocks[-depth:]``; ``int >= 1``, at most the number of down blocks
            minus 1); for a transformer-only model, the blocks that run at each end (``int >= 1``, less than half
            of its blocks).
        layers: UNets and ControlNets at ``depth=1``: how many layers (resnet + attention pairs) of the last up
            block run on a cached step (``int >= 1``, fewer than that block has): DeepCache's finer branches,
            ``layers=1`` is its ``cache_branch_id=0``; ``None`` runs the whole first level (its branch 2 on
            SD-1.5). ``"auto"`` (the default) is ``1`` on a UNet or ControlNet at ``depth=1`` and ``None`` otherwise
            (deeper ``depth``, transformer-only models).
        start: steps before ``start`` are all full (``int >= 0``); cached steps begin at ``start + 1``.
        stop: steps from ``stop`` on are all full (``None``: to the end; else ``int > start``).
        full_steps: the 0-based steps that are full, e.g. ``(0, 1, 2, 4, 7, 11)`` to spend full steps early; when
            given, ``interval`` is not used (``start``/``stop`` still are). Step 0 is always full.
        threshold: ``None`` (the default) keeps the fixed interval; a number ``>= 0`` switches to the adaptive rule
            (:mod:`~ppdiffusers_tome.cache.adaptive`): a step runs in full when the relative change of the deep
            part's input, summed over the steps since the last full one, reaches ``threshold`` (``0``: every step
            full, the vanilla forward; :data:`~ppdiffusers_tome.cache.adaptive.DEFAULT_THRESHOLD` = 0.15 is the
            suggested value). ``interval`` is then not used; ``start``, ``stop`` and ``full_steps`` still protect
            their steps, and so is the last step of a pipeline's loop.
        max_skips: with ``threshold``: at most this many cached steps in a row (``None``: no cap; else ``int >= 1``).
        forecast: ``None`` (reuse the last full step's work as it is) or ``"linear"`` (extrapolate it from the last
            two full steps, first order in the step index). With ``threshold`` the forecast also changes the rule:
            the steps after a full step are cached while the forecast's predicted error, from the error it made at
            that full step, weighed by each step's size (a pipeline's timesteps) and summed over them, stays within
            ``threshold`` (steps 0, 1 and 2 are full; :data:`~ppdiffusers_tome.cache.adaptive.FORECAST_THRESHOLD`
            = 0.3 is the suggested value, 0.15 with 20 steps or fewer).
        whole_model: ``True`` caches whole calls of the model (its output residual), for models whose blocks cannot
            be reached, such as SD3 built with ``INFERENCE_OPTIMIZE=True`` (:mod:`~ppdiffusers_tome.cache.whole_model`);
            ``depth`` and ``layers`` then do not apply.

    Integers may be Python or numpy integers.

    >>> config = CacheConfig(interval=3)
    >>> [step for step in range(10) if config.is_full(step)]
    [0, 3, 6, 9]
    >>> [step for step in range(10) if CacheConfig(interval=2, start=3, stop=8).is_full(step)]
    [0, 1, 2, 3, 5, 7, 8, 9]
    """

    interval: int = 3
    depth: int = 1
    layers: Union[int, str, None] = AUTO
    start: int = 0
    stop: Optional[int] = None
    full_steps: Optional[Tuple[int, ...]] = None
    threshold: Optional[float] = None
    max_skips: Optional[int] = None
    forecast: Optional[str] = None
    whole_model: bool = False

    def __post_init__(self) -> None:
        store = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 - frozen dataclass
        if not is_int(self.interval) or self.interval < 1:
            raise ValueError("interval must be an integer >= 1 (a full pass every interval steps); "
                             f"got {self.interval!r}")
        if not is_int(self.depth) or self.depth < 1:
            raise ValueError("depth must be an integer >= 1 (levels of a UNet, or blocks at each end of a "
                             f"transformer, that run on every step); got {self.depth!r}")
        if as_choice(self.layers, (AUTO,)) is not None:
            store("layers", AUTO)  # (a numpy str as a plain one)
        elif self.layers is not None and (not is_int(self.layers) or self.layers < 1):
            raise ValueError(f"layers must be {AUTO!r}, None or an integer >= 1 (layers of the last up block that run "
                             f"on a cached step); got {shown(self.layers)}")
        if is_int(self.layers) and self.depth != 1:
            raise ValueError(f"layers={self.layers!r} cuts inside the first level, so it needs depth=1; got "
                             f"depth={self.depth!r}")
        if not is_int(self.start) or self.start < 0:
            raise ValueError(f"start must be an integer >= 0 (steps before it are full); got {self.start!r}")
        if self.stop is not None and (not is_int(self.stop) or self.stop <= self.start):
            raise ValueError(f"stop must be None or an integer > start={self.start} (steps from it are full); "
                             f"got {self.stop!r}")
        for name in ("interval", "depth", "layers", "start", "stop"):
            value = getattr(self, name)
            if is_int(value):
                store(name, int(value))
        if self.full_steps is not None:
            steps = self.full_steps
            if isinstance(steps, (str, bytes)) or not isinstance(steps, (list, tuple, range)) or not all(
                    is_int(s) and s >= 0 for s in steps) or len(steps) == 0:
                raise ValueError("full_steps must be None or a non-empty list, tuple or range of integers >= 0 (the "
                                 f"0-based full steps); got {steps!r}")
            store("full_steps", tuple(sorted({int(s) for s in steps} | {0})))
        self._check_rule(store)

    def _check_rule(self, store: Any) -> None:
        """The adaptive rule's and the whole-model cache's options (``threshold``, ``max_skips``, ``forecast``,
        ``whole_model``)."""
        store("threshold", check_threshold(self.threshold))
        store("max_skips", check_max_skips(self.max_skips, self.threshold))
        store("forecast", check_forecast(self.forecast))
        whole = as_bool(self.whole_model)
        if whole is None:
            raise ValueError(f"whole_model must be True (cache whole calls of the model) or False; got "
                             f"{shown(self.whole_model)}")
        store("whole_model", whole)
        if whole and (self.depth != 1 or self.layers not in (AUTO, None)):
            name, value = ("depth", self.depth) if self.depth != 1 else ("layers", self.layers)
            raise ValueError(f"{name}={value!r} chooses the parts of a model a cached step runs; whole_model=True "
                             f"runs none of it: leave {name} at its default")

    def is_full(self, step: int) -> bool:
        """Whether 0-based ``step`` of a generation runs the whole model under the fixed interval (with
        ``threshold`` the rule decides the steps that :meth:`protects` leaves to it)."""
        if step <= self.start or (self.stop is not None and step >= self.stop):
            return True
        if self.full_steps is not None:
            return step in self.full_steps
        return (step - self.start) % self.interval == 0

    def protects(self, step: int, last: Optional[int] = None) -> bool:
        """Whether ``step`` is full whatever the adaptive rule says: up to ``start``, from ``stop`` on, the steps of
        ``full_steps``, and the ``last`` step of the generation (None: not known, outside a pipeline).

        >>> config = CacheConfig(threshold=0.15, start=1)
        >>> [step for step in range(6) if config.protects(step, last=5)]
        [0, 1, 5]
        """
        if step <= self.start or (self.stop is not None and step >= self.stop) or (last is not None and step >= last):
            return True
        return self.full_steps is not None and step in self.full_steps

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


CONFIG_FIELDS = tuple(field.name for field in fields(CacheConfig))
