"""The validated, immutable settings of one ToMe patch (what to merge, where, and how much).

Runtime state (the image size of the current call, the RNG key) lives in :class:`ppdiffusers_tome.patch.ToMeState`,
never here.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Sequence, Tuple, Union

from .merge import DOWNSAMPLE_MODES, max_ratio

__all__ = ["ToMeConfig", "ALLOWED_MAX_DOWNSAMPLE", "METHODS", "RatioSpec", "ratio_at", "tokens_to_merge"]

ALLOWED_MAX_DOWNSAMPLE = (1, 2, 4, 8)
METHODS = ("tome", "todo")
DOWNSAMPLE_FACTORS = range(2, 9)
_SCHEDULE_PROBES = 11  # a ratio callable is checked at progress 0, 0.1, ..., 1 when the config is made

RatioSpec = Union[float, Tuple[float, float], Callable[[float], float]]


def tokens_to_merge(num_tokens: int, ratio: float) -> int:
    """``r = int(num_tokens * ratio)``, the tokens a block with ``num_tokens`` tokens loses.

    >>> tokens_to_merge(4096, 0.5)
    2048
    """
    return int(num_tokens * ratio)


def ratio_at(ratio: RatioSpec, progress: float) -> float:
    """The merge ratio at denoising ``progress`` (0 = pure noise, 1 = clean image) for a constant ratio, a
    ``(start, end)`` pair (linear from ``start`` at 0 to ``end`` at 1) or a callable of the progress.

    >>> ratio_at(0.5, 0.3), ratio_at((0.6, 0.2), 0.5), ratio_at(lambda p: 0.5 if p < 0.5 else 0.0, 0.7)
    (0.5, 0.4, 0.0)
    """
    if isinstance(ratio, tuple):
        start, end = ratio
        return start + (end - start) * min(max(progress, 0.0), 1.0)
    if callable(ratio):
        return ratio(progress)
    return ratio


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class ToMeConfig:
    """Settings of ToMe for Stable Diffusion; defaults are those of the paper and tomesd.

    Args:
        ratio: share of the tokens merged in every patched block, ``0 <= ratio < 1 - 1/(sx*sy)`` (0.75 for the
            default strides). ``r = int(N * ratio)`` tokens are removed from a block with ``N`` tokens.
            A schedule is allowed too: a ``(start, end)`` pair goes linearly from ``start`` to ``end`` as denoising
            progresses, and a callable gets the progress (0 at pure noise, 1 at the clean image, that is
            ``1 - t / num_train_timesteps``) and returns the ratio. Every value must be in the range above.
        max_downsample: merge only in blocks whose downsampling factor relative to the latent is at most this;
            one of 1, 2, 4, 8, or ``"auto"`` (the default): the highest-resolution level that actually has
            transformer blocks (level 1 on SD 1.x/2.x and ControlNet, level 2 on SDXL).
        sx, sy: the dst grid stride: one dst token per ``sy x sx`` cell (integers >= 1).
        use_rand: pick the dst inside each cell at random (reproducibly, see ``seed``) instead of its top-left.
        merge_attn: merge before self-attention (attn1).
        merge_crossattn: merge before cross-attention (attn2).
        merge_mlp: merge before the feed-forward layer (ff).
        seed: base seed of ToMe's own random partition (an integer >= 0). The partition of a block is a pure
            function of (seed, block, timestep, grid size), so identical calls give identical images.
        method: ``"tome"`` (merge, run, unmerge) or ``"todo"`` (ToDo: every query stays; only the keys and values
            of self-attention are downsampled on the token grid, so nothing is matched or unmerged). ToDo ignores
            ``ratio``, ``sx``, ``sy``, ``use_rand`` and ``recompute_every``.
        downsample_factor: ToDo's downsampling per side, an integer in [2, 8] (2 keeps 1/4 of the keys, 4 keeps
            1/16).
        downsample_mode: ToDo's ``"nearest"`` (top-left token of each cell) or ``"average"`` (mean of the cell).
        recompute_every: reuse a block's partition and matching for this many consecutive denoising steps (1 =
            recompute at every step, as the paper does), or a list of the step indices (0-based) at which to
            recompute; other steps reuse the latest plan. Merging always uses the current tokens; a reused plan
            keeps the number of merged tokens of its step (a ratio schedule moves at the recompute steps).

    >>> ToMeConfig(ratio=0.3).tokens_to_merge(4096)
    1228
    >>> ToMeConfig(ratio=0.9)
    Traceback (most recent call last):
    ...
    ValueError: ratio must be in [0, 0.75) for sx=2, sy=2 (the limit is 1 - 1/(sx*sy)); got 0.9
    """

    ratio: RatioSpec = 0.5
    max_downsample: Union[int, str] = "auto"
    sx: int = 2
    sy: int = 2
    use_rand: bool = True
    merge_attn: bool = True
    merge_crossattn: bool = False
    merge_mlp: bool = False
    seed: int = 0
    method: str = "tome"
    downsample_factor: int = 2
    downsample_mode: str = "nearest"
    recompute_every: Union[int, Tuple[int, ...]] = 1

    def __post_init__(self) -> None:
        for name in ("sx", "sy"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
        object.__setattr__(self, "ratio", self._checked_ratio(self.ratio))
        if self.max_downsample != "auto" and (
            not _is_int(self.max_downsample) or self.max_downsample not in ALLOWED_MAX_DOWNSAMPLE
        ):
            raise ValueError(
                f"max_downsample must be 'auto' or one of {ALLOWED_MAX_DOWNSAMPLE}; got {self.max_downsample!r}"
            )
        for name in ("use_rand", "merge_attn", "merge_crossattn", "merge_mlp"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False; got {getattr(self, name)!r}")
        if not _is_int(self.seed) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0; got {self.seed!r}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}; got {self.method!r}")
        if not _is_int(self.downsample_factor) or self.downsample_factor not in DOWNSAMPLE_FACTORS:
            raise ValueError(f"downsample_factor must be an integer in [2, 8]; got {self.downsample_factor!r}")
        if self.downsample_mode not in DOWNSAMPLE_MODES:
            raise ValueError(f"downsample_mode must be one of {DOWNSAMPLE_MODES}; got {self.downsample_mode!r}")
        if self.method == "todo" and (self.merge_crossattn or self.merge_mlp or not self.merge_attn):
            raise ValueError(
                "method='todo' downsamples the keys and values of self-attention only; with it merge_attn must be "
                "True and merge_crossattn and merge_mlp False"
            )
        object.__setattr__(self, "recompute_every", self._checked_recompute(self.recompute_every))

    def _checked_ratio(self, ratio: Any) -> RatioSpec:
        limit = max_ratio(self.sx, self.sy)
        allowed = f"[0, {limit:g}) for sx={self.sx}, sy={self.sy} (the limit is 1 - 1/(sx*sy))"

        def check(value: Any, where: str) -> float:
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
                raise ValueError(f"ratio{where} must be a number in [0, {limit:g}); got {value!r}")
            if value != 0 and not 0 < value < limit:
                raise ValueError(f"ratio{where} must be in {allowed}; got {value!r}")
            return float(value)

        if isinstance(ratio, (tuple, list)):
            if len(ratio) != 2:
                raise ValueError(f"ratio as a schedule must be a (start, end) pair; got {ratio!r}")
            return (check(ratio[0], " start"), check(ratio[1], " end"))
        if callable(ratio):
            for i in range(_SCHEDULE_PROBES):
                progress = i / (_SCHEDULE_PROBES - 1)
                try:
                    value = ratio(progress)
                except Exception as error:
                    raise ValueError(f"ratio(progress) raised {type(error).__name__} at progress={progress:g}: {error}") from error
                check(value, f"(progress={progress:g})")
            return ratio
        return check(ratio, "")

    @staticmethod
    def _checked_recompute(value: Any) -> Union[int, Tuple[int, ...]]:
        if _is_int(value):
            if value < 1:
                raise ValueError(f"recompute_every must be an integer >= 1 or a list of step indices; got {value!r}")
            return int(value)
        if isinstance(value, (list, tuple, range)) and len(value) > 0 and all(_is_int(v) and v >= 0 for v in value):
            return tuple(sorted({int(v) for v in value}))
        raise ValueError(
            f"recompute_every must be an integer >= 1 or a non-empty list of step indices >= 0; got {value!r}"
        )

    @property
    def is_scheduled(self) -> bool:
        """Whether the ratio changes with the denoising progress."""
        return not isinstance(self.ratio, float)

    @property
    def caches_plans(self) -> bool:
        """Whether plans are reused across denoising steps."""
        return self.method == "tome" and self.recompute_every != 1

    def ratio_at(self, progress: float) -> float:
        """The ratio at denoising ``progress`` in [0, 1] (see ``ratio``)."""
        return ratio_at(self.ratio, progress)

    def tokens_to_merge(self, num_tokens: int, progress: float = 0.0) -> int:
        """``r = int(num_tokens * ratio)``, the tokens a block with ``num_tokens`` tokens loses (at ``progress``
        when the ratio is scheduled)."""
        return tokens_to_merge(num_tokens, self.ratio_at(progress))

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)
