"""ToDo's settings: :class:`ToDoConfig` (Smith et al. 2024, token downsampling: every query stays, the keys and
values of self-attention come from the tokens downsampled on their grid), and its translation from 0.14's form,
``ToMeConfig(method="todo", downsample_factor=..., downsample_mode=...)``.

ToDo runs on ToMe's per-block machinery (the same hooks, decision, policy and planner, and the one hook slot
``"tome"``: applying one replaces the other); what differs is the plan a block call gets, a
:class:`~ppdiffusers_tome.ops.downsample.DownsamplePlan`. The policy's K/V pooling is that plan at
:data:`DEFAULT_TODO`, ToDo's defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Dict, Optional, Union

from .config import (
    ToMeConfig,
    checked_downsample_factor,
    checked_downsample_mode,
    checked_max_downsample,
    checked_min_tokens,
    checked_policy,
)

__all__ = ["DEFAULT_TODO", "TODO_FIELDS", "ToDoConfig", "technique_config"]


@dataclass(frozen=True)
class ToDoConfig:
    """Settings of ToDo (token downsampling of keys and values).

    Args:
        factor: downsampling per side, an integer in [2, 8] (2 keeps 1/4 of the keys and values, 4 keeps 1/16).
        mode: ``"nearest"`` (the top-left token of each ``factor x factor`` cell) or ``"average"`` (the mean of the
            cell).
        max_downsample: downsample only in blocks whose downsampling factor relative to the latent is at most
            this; one of 1, 2, 4, 8, or ``"auto"`` (the default: the finest level that has transformer blocks), as
            for :class:`~ppdiffusers_tome.tome.config.ToMeConfig`.
        min_tokens: downsample only in blocks whose ``batch * tokens`` is at least this (an integer >= 0).
        policy: ``"auto"`` (the default: on GPU kernels, blocks whose attention work ``batch * tokens**2`` is below
            ``min_work`` run as vanilla) or ``"tomesd"`` (every eligible block downsamples, on any device).
        min_work: the ``"auto"`` policy's threshold; ``None`` (the default) is 2**28 on a UNet's blocks and 2**23
            on SD3's joint blocks on GPU kernels, 0 on CPU kernels. Not allowed with ``policy="tomesd"``.

    Integers may be Python or numpy integers; every value is stored as the plain Python value.

    >>> ToDoConfig(factor=4, mode="average").factor
    4
    >>> ToDoConfig(factor=16)
    Traceback (most recent call last):
    ...
    ValueError: factor must be an integer in [2, 8]; got 16
    """

    factor: int = 2
    mode: str = "nearest"
    max_downsample: Union[int, str] = "auto"
    min_tokens: int = 0
    policy: str = "auto"
    min_work: Optional[int] = None

    def __post_init__(self) -> None:
        store = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 - frozen dataclass
        store("factor", checked_downsample_factor(self.factor, "factor"))
        store("mode", checked_downsample_mode(self.mode, "mode"))
        store("max_downsample", checked_max_downsample(self.max_downsample))
        store("min_tokens", checked_min_tokens(self.min_tokens, "downsample"))
        policy, min_work = checked_policy(self.policy, self.min_work, "downsample")
        store("policy", policy)
        store("min_work", min_work)

    @classmethod
    def from_tome(cls, config: ToMeConfig) -> "ToDoConfig":
        """The ToDo settings that ``config`` (``method="todo"``, 0.14's form) asks for: ``downsample_factor`` and
        ``downsample_mode`` become ``factor`` and ``mode``; ``max_downsample``, ``min_tokens``, ``policy`` and
        ``min_work`` keep their names; ToMe's own options (``ratio``, ``sx``, ...) are not used by ToDo.

        >>> ToDoConfig.from_tome(ToMeConfig(method="todo", downsample_factor=4, min_tokens=8))
        ToDoConfig(factor=4, mode='nearest', max_downsample='auto', min_tokens=8, policy='auto', min_work=None)
        """
        return cls(factor=config.downsample_factor, mode=config.downsample_mode, max_downsample=config.max_downsample,
                   min_tokens=config.min_tokens, policy=config.policy, min_work=config.min_work)

    def to_dict(self) -> Dict[str, Any]:
        """The settings as a dict of field name to value (what ``tome_status`` reports)."""
        return {field.name: getattr(self, field.name) for field in fields(self)}


TODO_FIELDS = tuple(field.name for field in fields(ToDoConfig))
DEFAULT_TODO = ToDoConfig()  # the policy's K/V pooling: ToDo's plan at its defaults (factor 2, nearest)


def technique_config(config: Any) -> Any:
    """The settings the per-block machinery runs: a :class:`ToDoConfig` for ``ToMeConfig(method="todo")`` (the
    translating alias) or a :class:`ToDoConfig` itself, else the :class:`ToMeConfig` as it is.

    >>> technique_config(ToMeConfig(method="todo")) == DEFAULT_TODO, technique_config(ToMeConfig()) == ToMeConfig()
    (True, True)
    """
    if isinstance(config, ToMeConfig) and config.method == "todo":
        return ToDoConfig.from_tome(config)
    return config
