"""The validated, immutable settings of one ToMe patch (what to merge, where, and how much).

Runtime state (the image size of the current call, the RNG key) lives in :mod:`ppdiffusers_tome.tome.state`,
never here.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, Optional, Tuple, Union

from ..core.validation import as_bool, as_choice, is_int, shown
from ..ops.downsample import DOWNSAMPLE_MODES
from ..ops.partition import max_ratio

__all__ = [
    "ToMeConfig",
    "check_ratio",
    "checked_downsample_factor",
    "checked_downsample_mode",
    "checked_max_downsample",
    "checked_min_tokens",
    "checked_policy",
    "is_int",
    "ALLOWED_MAX_DOWNSAMPLE",
    "METHODS",
    "MAX_STRIDE",
    "MAX_WINDOW",
    "MATCH_ORDERS",
    "POLICIES",
    "SHARE_PLAN",
    "RatioSpec",
    "ratio_at",
    "tokens_to_merge",
]

ALLOWED_MAX_DOWNSAMPLE = (1, 2, 4, 8)
METHODS = ("tome", "todo")
DOWNSAMPLE_FACTORS = range(2, 9)
# Largest sx/sy. A 64 x 64 cell already covers the whole 1x latent grid of a 512 px image (one dst token, a ratio up
# to 0.9997); larger strides change nothing useful and only make the partition's index arrays huge.
MAX_STRIDE = 64
# Largest match_window: 128 tokens per side is the whole 1x grid of a 1024 px image (local matching then equals
# global matching, with a dense [N - r, N] plan per image: beyond that a dense plan stops being small).
MAX_WINDOW = 128
SHARE_PLAN = ("auto", "block", "level")
POLICIES = ("auto", "tomesd")
MATCH_ORDERS = ("grid", "feature")
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


def check_ratio(value: Any, sx: int, sy: int, where: str = "") -> float:
    """``value`` as a float if it is an admissible merge ratio for strides ``sx``, ``sy`` (0, or strictly between 0
    and ``1 - 1/(sx*sy)``), else a ``ValueError`` naming ``ratio<where>`` and the range. The one ratio rule, used
    when a config is made and when a ratio schedule is evaluated during a call.

    >>> check_ratio(0.5, 2, 2)
    0.5
    >>> check_ratio(0.9, 2, 2, "(progress=0.550)")
    Traceback (most recent call last):
    ...
    ValueError: ratio(progress=0.550) must be in [0, 0.75) for sx=2, sy=2 (the limit is 1 - 1/(sx*sy)); got 0.9
    """
    limit = max_ratio(sx, sy)
    # strides of 1 make every token a dst token: the range [0, limit) is empty, only 0 (no merging) is left
    only_zero = (f"strides sx={sx}, sy={sy} allow only ratio 0 (every token is a dst token, so none can be merged; "
                 "the limit 1 - 1/(sx*sy) is 0). Use sx=2 or sy=2 or more to merge") if limit <= 0 else ""
    # (value != value) is NaN without math.isnan, which overflows on huge ints
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != value:
        forms = ", a (start, end) pair or a callable of the progress" if not where else ""
        if only_zero:
            raise ValueError(f"ratio{where} must be the number 0{forms}: {only_zero}; got {shown(value)}")
        raise ValueError(f"ratio{where} must be a number in [0, {limit:g}){forms}; got {shown(value)}")
    if value != 0 and not 0 < value < limit:
        if only_zero:
            raise ValueError(f"ratio{where} must be 0: {only_zero}; got {shown(value)}")
        allowed = f"[0, {limit:g}) for sx={sx}, sy={sy} (the limit is 1 - 1/(sx*sy))"
        raise ValueError(f"ratio{where} must be in {allowed}; got {shown(value)}")
    return float(value)


def _checked_unused_ratio(value: Any, where: str) -> float:
    """``value`` as a float if it is a number in [0, 1), the check of a ratio that ``method="todo"`` does not use
    (a ratio of some stride, so no stride limit), else a ``ValueError`` naming ``ratio<where>``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != value or not 0 <= value < 1:
        raise ValueError(
            f"ratio{where} must be a number in [0, 1) (method='todo' does not use it, but it must still be a ratio); "
            f"got {shown(value)}"
        )
    return float(value)


def checked_max_downsample(value: Any) -> Union[int, str]:
    """``value`` as ``"auto"`` or a plain int of :data:`ALLOWED_MAX_DOWNSAMPLE`, else a ``ValueError`` naming
    ``max_downsample`` (ToMe's and ToDo's check)."""
    if as_choice(value, ("auto",)) is not None:
        return "auto"
    if is_int(value) and value in ALLOWED_MAX_DOWNSAMPLE:
        return int(value)
    raise ValueError(f"max_downsample must be 'auto' or one of {ALLOWED_MAX_DOWNSAMPLE}; got {shown(value)}")


def checked_min_tokens(value: Any, verb: str = "merge") -> int:
    """``value`` as a plain int >= 0, else a ``ValueError`` naming ``min_tokens`` (``verb``: what the blocks at or
    above it do)."""
    if not is_int(value) or value < 0:
        raise ValueError(f"min_tokens must be an integer >= 0 ({verb} only where batch * tokens reaches it); "
                         f"got {shown(value)}")
    return int(value)


def checked_policy(policy: Any, min_work: Any, verb: str = "merge") -> Tuple[str, Optional[int]]:
    """``(policy, min_work)`` as plain values if ``policy`` is one of :data:`POLICIES` and ``min_work`` None or an
    integer >= 0 (and None with ``policy="tomesd"``), else a ``ValueError`` naming the argument."""
    checked = as_choice(policy, POLICIES)
    if checked is None:
        raise ValueError(f"policy must be one of {POLICIES}; got {shown(policy)}")
    if min_work is not None and (not is_int(min_work) or min_work < 0):
        raise ValueError(
            "min_work must be None (the policy's default: 2**26 or 2**28 on GPU kernels, 2**23 or 2**25 on SD3's "
            "joint blocks, 0 on CPU kernels) or an integer "
            f">= 0 ({verb} only in blocks where batch * tokens**2 reaches it); got {shown(min_work)}"
        )
    if min_work is not None and checked == "tomesd":
        raise ValueError(
            f"min_work={shown(min_work)} is a threshold of policy='auto'; policy='tomesd' {verb}s every eligible "
            f"block. Leave min_work=None with policy='tomesd', or use policy='auto'"
        )
    return checked, None if min_work is None else int(min_work)


def checked_downsample_factor(value: Any, name: str) -> int:
    """ToDo's downsampling per side as a plain int in [2, 8], else a ``ValueError`` naming ``name``."""
    if not is_int(value) or value not in DOWNSAMPLE_FACTORS:
        raise ValueError(f"{name} must be an integer in [2, 8]; got {shown(value)}")
    return int(value)


def checked_downsample_mode(value: Any, name: str) -> str:
    """ToDo's downsampling mode as a plain str of :data:`DOWNSAMPLE_MODES`, else a ``ValueError`` naming ``name``."""
    mode = as_choice(value, DOWNSAMPLE_MODES)
    if mode is None:
        raise ValueError(f"{name} must be one of {DOWNSAMPLE_MODES}; got {shown(value)}")
    return mode


@dataclass(frozen=True)
class ToMeConfig:
    """Settings of ToMe for Stable Diffusion. The defaults are tomesd's (the paper's settings) except
    ``max_downsample``: ``"auto"`` here, 1 in tomesd (the same level on SD 1.x/2.x, level 2 instead of nothing on
    SDXL), and ``policy="auto"``, which on GPU kernels skips blocks too small to pay and pools keys and values where
    it pays (on CPU kernels it merges as tomesd); every other option that tomesd lacks is off by default.

    Args:
        ratio: share of the tokens merged in every patched block, ``0 <= ratio < 1 - 1/(sx*sy)`` (0.75 for the
            default strides). ``r = int(N * ratio)`` tokens are removed from a block with ``N`` tokens.
            A schedule is allowed too: a ``(start, end)`` pair goes linearly from ``start`` to ``end`` as denoising
            progresses, and a callable gets the progress (0 at pure noise, 1 at the clean image, that is
            ``1 - t / num_train_timesteps``) and returns the ratio. Every value must be in the range above.
        max_downsample: merge only in blocks whose downsampling factor relative to the latent is at most this;
            one of 1, 2, 4, 8, or ``"auto"`` (the default): the highest-resolution level that actually has
            transformer blocks (level 1 on SD 1.x/2.x and ControlNet, level 2 on SDXL).
        sx, sy: the dst grid stride: one dst token per ``sy x sx`` cell (integers in [1, 64]; 64 x 64 already
            covers the whole token grid of a 512 px image).
        use_rand: pick the dst inside each cell at random (reproducibly, see ``seed``) instead of its top-left.
        merge_attn: merge before self-attention (attn1).
        merge_crossattn: merge before cross-attention (attn2).
        merge_mlp: merge before the feed-forward layer (ff).
        seed: base seed of ToMe's own random partition (an integer >= 0 of any size; every bit of it counts). The
            partition of a block is a pure function of (seed, block, timestep, grid size), so identical calls give
            identical images.
        method: ``"tome"`` (merge, run, unmerge) or ``"todo"`` (ToDo: every query stays; only the keys and values
            of self-attention are downsampled on the token grid, so nothing is matched or unmerged). ``"todo"`` is
            0.14's way to ToDo, kept as a translating alias: the patch runs
            ``ToDoConfig(factor=downsample_factor, mode=downsample_mode, max_downsample, min_tokens, policy,
            min_work)`` (:class:`~ppdiffusers_tome.tome.todo.ToDoConfig`, what ``apply_todo`` takes). ToDo does not
            use ``ratio``, ``sx``, ``sy``, ``use_rand`` or ``recompute_every``; they are only checked for their
            type: ``ratio`` is a number in [0, 1) (no stride limit), a pair of such numbers or a callable (not
            called), ``sx``/``sy`` integers in [1, 64], ``use_rand`` a bool, ``recompute_every`` as for ToMe.
        downsample_factor: ToDo's downsampling per side, an integer in [2, 8] (2 keeps 1/4 of the keys, 4 keeps
            1/16).
        downsample_mode: ToDo's ``"nearest"`` (top-left token of each cell) or ``"average"`` (mean of the cell).
        recompute_every: reuse a block's partition and matching for this many consecutive denoising steps (1 =
            recompute at every step, as the paper does), or a list of the step indices (0-based) at which to
            recompute; other steps reuse the latest plan. Merging always uses the current tokens; a reused plan
            keeps the number of merged tokens of its step (a ratio schedule moves at the recompute steps).
        match_window: ``None`` (the default: every src may merge into any dst, as in tomesd) or the side, in
            tokens, of the windows that matching stays inside (an integer in [2, 128], at least ``max(sx, sy)``).
            Each window merges ``int(ratio * window tokens)`` of its src; the side actually used on a grid is the
            divisor of the grid side nearest to it, so equal windows tile the grid. On a GPU the plan is then held
            as two small matrices per window, and merge and unmerge are one batched matmul each (few kernel
            launches, a fixed summation order, memory that grows as ``N * window**2``).
        match_order: how ``match_window``'s windows are cut: ``"grid"`` (the default: tiles of the token grid) or
            ``"feature"``: along the tokens' directions. One step of spherical k-means from tiles of the grid
            groups the tokens (at most 64 clusters), the clusters are ordered by their centroid's cosine with the
            mean token, and the src and the dst are each sorted by cluster and cut into equal runs: a window holds
            tokens that point the same way wherever they are on the grid, with the sizes and the matching work of
            grid windows. A plan costs about 20 more operators than in grid order (56-58 against 35 at 16
            windows, GPU kernels), and on a GPU merge and unmerge use one ``gather_nd`` each instead of a
            ``gather`` and a reshape. Needs ``match_window``.
        share_plan: ``"block"``: every block matches its own input, as in tomesd; ``"level"``: the first merging
            block at each token count plans, and the others at that count reuse its plan in the same call (and,
            with ``recompute_every``, across steps); ``"auto"`` (the default): ``"level"`` for SD3's joint blocks
            on GPU kernels (one plan per call for every joint block: all of them run at the same token count),
            ``"block"`` everywhere else (UNets, DiT, and SD3 on CPU kernels).
        min_tokens: merge only in blocks whose ``batch * tokens`` is at least this (an integer >= 0; 0, the
            default, merges everywhere). Below some size the plan costs more than the attention it saves (on a GPU
            with FlashAttention, at 512 px and one image); skipped blocks are counted by ``tome_stats``.
        deterministic: on a GPU, merge without float atomics so that the same seed gives bit-identical outputs
            run to run (default False: the merge is one ``index_add``, whose float atomics may change the last
            bits). Costs about 30 more kernel launches per merging block (73 instead of 42, measured; a shared
            plan, ``share_plan="level"``, brings it back to 42) and a float64 ``[B, 3N/4, C]`` buffer during the
            merge. No effect on a CPU (deterministic either way) or with ``match_window`` (the dense
            local plan has no atomics).
        policy: ``"auto"`` (the default) or ``"tomesd"``. ``"tomesd"`` merges every eligible block as tomesd
            does, on any device. ``"auto"`` does the same on CPU kernels; on GPU kernels it skips the blocks whose
            attention work is below ``min_work`` and, where merging pays and the plan settings are the defaults,
            pools the keys and values instead of matching (on SD3's joint blocks: the image keys and values,
            ToDo's 2 x 2 downsampling; see :mod:`ppdiffusers_tome.tome.policy`). Settings you give always keep their
            plan; ``tome_status`` says what was chosen per level and why.
        min_work: the ``"auto"`` policy's threshold on a block's attention work, ``batch * tokens**2``: blocks
            below it are skipped. ``None`` (the default) means, on GPU kernels, 2**26 where the policy pools (512 px
            with one image is skipped, 768 px with one image pools) and 2**28 where the settings keep their plan
            (512 px with eight images merges); on SD3's joint blocks (image tokens) 2**23 where the policy
            downsamples the image keys and values or ToDo runs (512 px with four images, 768 px with one) and
            2**25 where ToMe's plan runs (1024 px with one image); 0 on CPU kernels. ``0`` merges everywhere.
            ``bench --calibrate`` measures the break-even on your GPU. Not allowed with ``policy="tomesd"``.

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
    match_window: Optional[int] = None
    match_order: str = "grid"
    share_plan: str = "auto"
    min_tokens: int = 0
    deterministic: bool = False
    policy: str = "auto"
    min_work: Optional[int] = None

    def __post_init__(self) -> None:
        # every value is checked by type before any comparison (an array or a tensor compared with a str or an int
        # raises from inside numpy/paddle), and stored as the plain Python value (np.int64(2) -> 2)
        store = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 - frozen dataclass
        # the method first: with ToDo the ratio is not used, so it is not held to the stride limit
        method = as_choice(self.method, METHODS)
        if method is None:
            raise ValueError(f"method must be one of {METHODS}; got {shown(self.method)}")
        store("method", method)
        for name in ("sx", "sy"):
            value = getattr(self, name)
            if not is_int(value) or not 1 <= value <= MAX_STRIDE:
                raise ValueError(
                    f"{name} must be an integer >= 1 and <= {MAX_STRIDE} (one dst token per sy x sx cell of the "
                    f"token grid); got {shown(value)}"
                )
            store(name, int(value))
        store("ratio", self._checked_ratio(self.ratio))
        store("max_downsample", checked_max_downsample(self.max_downsample))
        for name in ("use_rand", "merge_attn", "merge_crossattn", "merge_mlp", "deterministic"):
            flag = as_bool(getattr(self, name))
            if flag is None:
                raise ValueError(f"{name} must be True or False; got {shown(getattr(self, name))}")
            store(name, flag)
        if not is_int(self.seed) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0; got {shown(self.seed)}")
        store("seed", int(self.seed))
        self._check_todo_options(store)
        object.__setattr__(self, "recompute_every", self._checked_recompute(self.recompute_every))
        self._check_local_options(store)
        self._check_policy_options(store)

    def _check_todo_options(self, store: Callable[[str, Any], None]) -> None:
        store("downsample_mode", checked_downsample_mode(self.downsample_mode, "downsample_mode"))
        store("downsample_factor", checked_downsample_factor(self.downsample_factor, "downsample_factor"))
        if self.method == "todo" and (self.merge_crossattn or self.merge_mlp or not self.merge_attn):
            raise ValueError(
                "method='todo' downsamples the keys and values of self-attention only; with it merge_attn must be "
                "True and merge_crossattn and merge_mlp False"
            )

    def _check_local_options(self, store: Callable[[str, Any], None]) -> None:
        window, smallest = self.match_window, max(self.sx, self.sy)
        if window is not None:
            if not is_int(window) or not max(2, smallest) <= window <= MAX_WINDOW:
                raise ValueError(
                    f"match_window must be None (match across the whole grid, as tomesd) or an integer in "
                    f"[{max(2, smallest)}, {MAX_WINDOW}] (tokens per side of a matching window, at least "
                    f"max(sx, sy)={smallest} so that a window holds a cell); got {shown(window)}"
                )
            store("match_window", int(window))
        order = as_choice(self.match_order, MATCH_ORDERS)
        if order is None:
            raise ValueError(f"match_order must be one of {MATCH_ORDERS}; got {shown(self.match_order)}")
        if order == "feature" and window is None:
            raise ValueError(
                "match_order='feature' cuts match_window's windows along the features; set match_window (an integer "
                f"in [{max(2, smallest)}, {MAX_WINDOW}]) with it, or leave match_order='grid'"
            )
        store("match_order", order)
        share = as_choice(self.share_plan, SHARE_PLAN)
        if share is None:
            raise ValueError(f"share_plan must be one of {SHARE_PLAN}; got {shown(self.share_plan)}")
        store("share_plan", share)
        store("min_tokens", checked_min_tokens(self.min_tokens))

    def _check_policy_options(self, store: Callable[[str, Any], None]) -> None:
        policy, min_work = checked_policy(self.policy, self.min_work)
        store("policy", policy)
        store("min_work", min_work)

    def _checked_ratio(self, ratio: Any) -> RatioSpec:
        todo = self.method == "todo"

        def check(value: Any, where: str) -> float:
            if todo:
                return _checked_unused_ratio(value, where)
            return check_ratio(value, self.sx, self.sy, where)

        if isinstance(ratio, (tuple, list)):
            if len(ratio) != 2:
                raise ValueError(f"ratio as a schedule must be a (start, end) pair; got {shown(ratio)}")
            return (check(ratio[0], " start"), check(ratio[1], " end"))
        if callable(ratio) and todo:  # never called by ToDo, so not probed either
            return ratio
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
        if is_int(value):
            if value < 1:
                raise ValueError(
                    f"recompute_every must be an integer >= 1 or a list of step indices; got {shown(value)}"
                )
            return int(value)
        if isinstance(value, (list, tuple, range)) and len(value) > 0 and all(is_int(v) and v >= 0 for v in value):
            return tuple(sorted({int(v) for v in value}))
        raise ValueError(
            f"recompute_every must be an integer >= 1 or a non-empty list of step indices >= 0; got {shown(value)}"
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
        """The settings as a dict of field name to value. The values are the config's own objects, not copies: a
        ratio schedule (a callable) comes back as the very object given to ``apply_tome``, which may hold anything
        (a lock, a model) that cannot be copied.

        >>> ToMeConfig(ratio=0.4).to_dict()["ratio"]
        0.4
        """
        return {field.name: getattr(self, field.name) for field in fields(self)}
