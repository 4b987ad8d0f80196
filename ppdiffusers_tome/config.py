"""The validated, immutable settings of one ToMe patch (what to merge, where, and how much).

Runtime state (the image size of the current call, the RNG key) lives in :class:`ppdiffusers_tome.patch.ToMeState`,
never here.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass
from typing import Any, Dict

from .merge import max_ratio

__all__ = ["ToMeConfig", "ALLOWED_MAX_DOWNSAMPLE", "tokens_to_merge"]

ALLOWED_MAX_DOWNSAMPLE = (1, 2, 4, 8)


def tokens_to_merge(num_tokens: int, ratio: float) -> int:
    """``r = int(num_tokens * ratio)``, the tokens a block with ``num_tokens`` tokens loses.

    >>> tokens_to_merge(4096, 0.5)
    2048
    """
    return int(num_tokens * ratio)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class ToMeConfig:
    """Settings of ToMe for Stable Diffusion; defaults are those of the paper and tomesd.

    Args:
        ratio: share of the tokens merged in every patched block, ``0 <= ratio < 1 - 1/(sx*sy)`` (0.75 for the
            default strides). ``r = int(N * ratio)`` tokens are removed from a block with ``N`` tokens.
        max_downsample: merge only in blocks whose downsampling factor relative to the latent is at most this;
            one of 1, 2, 4, 8. 1 means the highest-resolution transformer blocks only.
        sx, sy: the dst grid stride: one dst token per ``sy x sx`` cell (integers >= 1).
        use_rand: pick the dst inside each cell at random (reproducibly, see ``seed``) instead of its top-left.
        merge_attn: merge before self-attention (attn1).
        merge_crossattn: merge before cross-attention (attn2).
        merge_mlp: merge before the feed-forward layer (ff).
        seed: base seed of ToMe's own random partition (an integer >= 0). The partition of a block is a pure
            function of (seed, block, timestep, grid size), so identical calls give identical images.

    >>> ToMeConfig(ratio=0.3).tokens_to_merge(4096)
    1228
    >>> ToMeConfig(ratio=0.9)
    Traceback (most recent call last):
    ...
    ValueError: ratio must be in [0, 0.75) for sx=2, sy=2 (the limit is 1 - 1/(sx*sy)); got 0.9
    """

    ratio: float = 0.5
    max_downsample: int = 1
    sx: int = 2
    sy: int = 2
    use_rand: bool = True
    merge_attn: bool = True
    merge_crossattn: bool = False
    merge_mlp: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("sx", "sy"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
        limit = max_ratio(self.sx, self.sy)
        ratio = self.ratio
        if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or math.isnan(ratio):
            raise ValueError(f"ratio must be a number in [0, {limit:g}); got {ratio!r}")
        if ratio != 0 and not 0 < ratio < limit:
            raise ValueError(
                f"ratio must be in [0, {limit:g}) for sx={self.sx}, sy={self.sy} "
                f"(the limit is 1 - 1/(sx*sy)); got {ratio!r}"
            )
        object.__setattr__(self, "ratio", float(ratio))
        if not _is_int(self.max_downsample) or self.max_downsample not in ALLOWED_MAX_DOWNSAMPLE:
            raise ValueError(f"max_downsample must be one of {ALLOWED_MAX_DOWNSAMPLE}; got {self.max_downsample!r}")
        for name in ("use_rand", "merge_attn", "merge_crossattn", "merge_mlp"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False; got {getattr(self, name)!r}")
        if not _is_int(self.seed) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0; got {self.seed!r}")

    def tokens_to_merge(self, num_tokens: int) -> int:
        """``r = int(num_tokens * ratio)``, the tokens a block with ``num_tokens`` tokens loses."""
        return tokens_to_merge(num_tokens, self.ratio)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)
