"""What a transformer block call does, decided in one place (tomesd's ``compute_merge``): a pure function of the
block's input shape, the call (latent size, kernel family, ratio now, finest level so far) and the settings (a
:class:`~ppdiffusers_tome.tome.config.ToMeConfig` or a :class:`~ppdiffusers_tome.tome.todo.ToDoConfig`).

:func:`decide_block` answers, in this order: does anything merge at all; which token grid and level the block is at, and
whether that level merges; is the block below ``min_tokens``; what the policy says for its size and kernels (skip,
K/V pooling, or the settings' plan, see :mod:`~ppdiffusers_tome.tome.policy`); ToDo's downsampling; whether the grid
holds a cell and the ratio leaves a token to merge. It returns a :class:`BlockDecision` (its ``action`` one of
:class:`~ppdiffusers_tome.tome.actions.Action`) with the reason in words, and
writes nothing: counting, planning and reporting are the hooks' (:mod:`~ppdiffusers_tome.tome.hooks`). Its answers are
memoised by the hooks, so a block call that does not merge costs one dictionary lookup.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import paddle

from ..ops.partition import find_downsample
from ..ops.windows import window_sides
from .actions import Action
from .config import ToMeConfig, tokens_to_merge
from .joint_attention import attention_core
from .policy import Policy
from .state import ToMeStaticGraphError
from .todo import DEFAULT_TODO, ToDoConfig, technique_config

__all__ = ["Action", "BlockDecision", "POOLING", "Settings", "decide_block", "finest_block_level", "patch_size_of"]

# the policy's K/V pooling: ToDo's plan at its defaults, as the (factor, mode) a decision carries (plain values: a
# decision is made inside a traced forward, where Paddle's SOT tracer cannot rebuild a frozen dataclass held in it)
POOLING = (DEFAULT_TODO.factor, DEFAULT_TODO.mode)

# the rules that decide, in the order they are asked
REASONS = ("nothing", "no_grid", "level", "min_tokens", "policy", "todo", "no_cell", "ratio0", "rounds", "merge")


def finest_block_level(model: Any, blocks: list[tuple[str, Any]]) -> int | None:
    """The smallest downsampling factor at which any of ``blocks`` runs, read from the model's structure (a UNet's
    or ControlNet's ``down_blocks``/``mid_block``/``up_blocks`` and their down/upsamplers), over the whole model:
    for a UNet whose 1x transformer blocks are only in the up path it is 1 although the down path reaches its
    first transformer block at 2x. None when the structure is not of that kind (then the finest level seen so far
    in the call decides).

    >>> from ppdiffusers_tome.testing import tiny_unet
    >>> from ppdiffusers_tome.tome.patch import find_blocks
    >>> unet = tiny_unet()
    >>> finest_block_level(unet, find_blocks(unet))
    1
    """
    levels = block_levels(model, blocks)
    return None if levels is None else min(levels, default=None)


def block_levels(model: Any, blocks: list[tuple[str, Any]]) -> list[int] | None:
    """The downsampling factor of every block of ``blocks`` from the model's structure, or None when it is not a
    UNet's (see :func:`finest_block_level`)."""
    downs = getattr(model, "down_blocks", None)
    if not isinstance(downs, paddle.nn.LayerList):
        return None
    level, levels = 1, {}
    for i, block in enumerate(downs):
        levels[f"down_blocks.{i}."] = level
        if getattr(block, "downsamplers", None):
            level *= 2
    levels["mid_block."] = level
    ups = getattr(model, "up_blocks", None)
    for i, block in enumerate(ups if isinstance(ups, paddle.nn.LayerList) else []):
        levels[f"up_blocks.{i}."] = level
        if getattr(block, "upsamplers", None):
            level = max(level // 2, 1)
    found = []
    for name, _ in blocks:
        matches = [value for prefix, value in levels.items() if name.startswith(prefix)]
        if not matches:
            return None  # a transformer block outside the known structure: decide at run time
        found.append(matches[0])
    return found


def patch_size_of(model: Any) -> int | None:
    """The patch size of a transformer-only model whose blocks all run on the patch grid (DiT, PixArt-alpha, SD3's
    MMDiT), else None."""
    if getattr(model, "is_input_patches", False):
        return int(model.patch_size)
    embed = getattr(model, "pos_embed", None)
    if type(embed).__name__ == "PatchEmbed" and getattr(model, "transformer_blocks", None) is not None:
        return int(model.config.patch_size)
    return None


class Settings:
    """What :func:`decide_block` reads about one patched model, fixed when ToMe or ToDo is applied: the config's
    choices and, from the model, the finest block level (``max_downsample="auto"``) and the patch size of a
    transformer-only model (DiT, PixArt-alpha: every block runs on the patch grid). ``todo`` is the
    :class:`~ppdiffusers_tome.tome.todo.ToDoConfig` ToDo runs (None for ToMe)."""

    def __init__(self, config: Any, model: Any, blocks: list[tuple[str, Any]]):
        config = technique_config(config)  # (0.14's ToMeConfig(method="todo") is ToDo's config)
        self.todo: ToDoConfig | None = config if isinstance(config, ToDoConfig) else None
        tome = config if self.todo is None else ToMeConfig()  # (ToMe's plan options, not used by ToDo)
        # with every sub-layer switched off nothing runs on merged tokens: then nothing is planned either
        self.merges_something = self.todo is not None or tome.merge_attn or tome.merge_crossattn or tome.merge_mlp
        self.auto_level = config.max_downsample == "auto"
        self.max_downsample = None if self.auto_level else int(config.max_downsample)
        self.patch_size: int | None = patch_size_of(model)
        # SD3's joint attention: the policy's thresholds and plan for it (see policy.py); its downsampling of the
        # image keys and values needs the attention core of every joint layer's processor
        joint_blocks = [block for _, block in blocks if type(block).__name__ == "JointTransformerBlock"]
        self.joint = bool(joint_blocks)
        joint_pools = all(attention_core(block.attn.processor) is not None for block in joint_blocks)
        self.auto_finest: int | None = None
        if self.auto_level and self.patch_size is None:
            self.auto_finest = finest_block_level(model, blocks)
        self.min_tokens = config.min_tokens
        self.downsample = None if self.todo is None else (self.todo.factor, self.todo.mode)  # ToDo's (factor, mode)
        self.sx, self.sy = tome.sx, tome.sy
        self.match_window = tome.match_window
        self.policy = Policy(config, joint=self.joint, joint_pools=joint_pools)


class BlockDecision:
    """What one block call does: ``action`` (an :class:`~ppdiffusers_tome.tome.actions.Action`: ``"off"``: not a
    merging block in this call, ``"skip"``: it would merge but ``min_tokens`` or the policy said no, ``"pool"``: the
    policy's K/V pooling, ``"todo"``: ToDo's downsampling, ``"merge"``: a merge plan at ``ratio``), the block's
    ``level`` and ``grid`` (when known), the policy's choice (when asked); ``reason`` names the rule that decided
    (one of :data:`REASONS`) and ``why`` says it in words; ``shared``: a merge whose plan is made once per call and
    token count (the policy's choice, from ``share_plan``); ``downsample``: for ``"pool"`` and ``"todo"``, the
    ``(factor, mode)`` of the :class:`~ppdiffusers_tome.tome.todo.ToDoConfig` whose plan runs (:data:`POOLING`,
    ToDo's defaults, for the pooling)."""

    __slots__ = ("action", "reason", "level", "grid_h", "grid_w", "ratio", "policy", "why", "tokens", "shared",
                 "downsample")

    def __init__(self, action: str, reason: str, why: str, grid: Optional[Tuple[int, int, int]] = None,
                 ratio: float = 0.0, policy: Any = None, tokens: int = 0,
                 downsample: Optional[Tuple[int, str]] = None):
        self.action, self.reason, self.why, self.ratio, self.policy = action, reason, why, ratio, policy
        self.level, self.grid_h, self.grid_w = grid if grid is not None else (None, 0, 0)
        self.tokens = tokens  # with reason "rounds": the tokens the ratio is applied to (a block's or a window's)
        self.shared = action == Action.MERGE and policy is not None and policy.shared
        self.downsample = downsample

    def __repr__(self) -> str:
        return f"BlockDecision({self.action!r}, level={self.level}, grid={self.grid_h}x{self.grid_w}: {self.why})"


def grid_of(settings: Settings, latent_hw: Tuple[int, int], tokens: int) -> Optional[Tuple[int, int, int]]:
    """``(level, grid_h, grid_w)`` of a block with ``tokens`` tokens in a call with latent ``latent_hw``, or None
    when the tokens form no grid of it."""
    latent_h, latent_w = latent_hw
    if settings.patch_size is not None:  # every block of a patch transformer runs on the patch grid
        grid_h, grid_w = latent_h // settings.patch_size, latent_w // settings.patch_size
        return (1, grid_h, grid_w) if grid_h * grid_w == tokens else None
    level = find_downsample(latent_h, latent_w, tokens)
    if level is None:
        return None
    return level, math.ceil(latent_h / level), math.ceil(latent_w / level)


def decide_block(settings: Settings, tokens: int, batch: int, grid: Optional[Tuple[int, int, int]],
                 finest: Optional[int], kernels: str, ratio: float) -> BlockDecision:
    """What a block call does: the decision for a block call with ``tokens`` tokens and ``batch`` items (``-1``: a dynamic batch while
    tracing) on ``grid`` (from :func:`grid_of`), ``finest`` the finest level seen so far in the call, on
    ``kernels`` (``"cpu"``/``"gpu"``), at merge ``ratio``.

    >>> from ppdiffusers_tome.testing import tiny_unet
    >>> from ppdiffusers_tome.tome.patch import find_blocks
    >>> unet = tiny_unet()
    >>> settings = Settings(ToMeConfig(), unet, find_blocks(unet))
    >>> decide_block(settings, 256, 2, grid_of(settings, (16, 16), 256), 1, "cpu", 0.5).action
    'merge'
    >>> decide_block(settings, 64, 2, grid_of(settings, (16, 16), 64), 1, "cpu", 0.5).why
    'level 2 is above the finest level with transformer blocks (1, max_downsample="auto")'
    """
    where = _where(settings, tokens, batch, grid, finest)
    if where is not None:
        return where
    policy = settings.policy.choose_plan_for(kernels, batch, tokens)
    if policy.action == Action.SKIP:
        return BlockDecision(Action.SKIP, "policy", policy.why(), grid, policy=policy)
    if policy.action == Action.POOL:  # ToDo's plan at its defaults
        return BlockDecision(Action.POOL, "policy", policy.why(), grid, policy=policy, downsample=POOLING)
    todo = settings.downsample
    if todo is not None:
        return BlockDecision(Action.TODO, "todo", f"ToDo: keys and values downsampled by {todo[0]}", grid,
                             policy=policy, downsample=todo)
    nothing = _nothing_to_merge(settings, tokens, grid, ratio, policy)
    if nothing is not None:
        return nothing
    shared = " with one plan per call" if policy.shared else ""
    return BlockDecision(Action.MERGE, "merge", f"merge at ratio {ratio:g}{shared}", grid, ratio, policy)


def _where(settings: Settings, tokens: int, batch: int, grid: Optional[Tuple[int, int, int]],
           finest: Optional[int]) -> Optional[BlockDecision]:
    """The decision when the block cannot merge for where it is (no settings that merge, no grid, a level above the
    limit, fewer than ``min_tokens``), else None."""
    if not settings.merges_something:
        return BlockDecision(Action.OFF, "nothing", "merge_attn, merge_crossattn and merge_mlp are all False")
    if grid is None:
        return BlockDecision(Action.OFF, "no_grid", "the tokens form no grid of the latent")
    level = grid[0]
    if settings.auto_level:
        limit = settings.auto_finest if settings.auto_finest is not None else finest
        if level > limit:
            return BlockDecision(Action.OFF, "level", f"level {level} is above the finest level with transformer blocks ({limit}, "
                                 'max_downsample="auto")', grid)
    elif level > settings.max_downsample:
        return BlockDecision(Action.OFF, "level", f"level {level} is above max_downsample={settings.max_downsample}", grid)
    if settings.min_tokens:
        if batch < 0:
            raise ToMeStaticGraphError(
                f"ToMe with min_tokens={settings.min_tokens} compares batch * tokens with it, but this program's "
                "batch is dynamic; give the InputSpec a fixed batch or set min_tokens=0 before converting"
            )
        if batch * tokens < settings.min_tokens:
            return BlockDecision(Action.SKIP, "min_tokens", f"batch * tokens = {batch * tokens} < min_tokens = {settings.min_tokens}",
                                 grid)
    return None


def _nothing_to_merge(settings: Settings, tokens: int, grid: Tuple[int, int, int], ratio: float,
                      policy: Any) -> Optional[BlockDecision]:
    """The decision when a merge would move no token (no cell on the grid or in a window, a ratio of 0, a ratio
    that rounds to 0 tokens), else None."""
    grid_h, grid_w = grid[1], grid[2]
    sx, sy = settings.sx, settings.sy
    if (grid_h // sy) * (grid_w // sx) == 0:
        return BlockDecision(Action.OFF, "no_cell", f"the {grid_h}x{grid_w} grid holds no {sy}x{sx} cell", grid, policy=policy)
    if ratio <= 0:
        return BlockDecision(Action.OFF, "ratio0", "the ratio is 0", grid, policy=policy)
    if settings.match_window is None:
        if tokens_to_merge(tokens, ratio) <= 0:
            return BlockDecision(Action.OFF, "rounds", f"int({tokens} * {ratio:g}) = 0 tokens to merge", grid, policy=policy,
                                 tokens=tokens)
    else:
        wy, wx = window_sides(grid_h, grid_w, settings.match_window, sx, sy)
        cells = (wy // sy) * (wx // sx)
        if cells == 0:
            return BlockDecision(Action.OFF, "no_cell", f"no {wy}x{wx} window holds a {sy}x{sx} cell", grid, policy=policy)
        if min(tokens_to_merge(wy * wx, ratio), wy * wx - cells) <= 0:
            return BlockDecision(Action.OFF, "rounds", f"int({wy * wx} * {ratio:g}) = 0 tokens to merge in each "
                                 f"{wy * wx}-token match_window", grid, policy=policy, tokens=wy * wx)
    return None


def __getattr__(name: str) -> Any:  # the names of 0.15.0 and before (decide, OFF, SKIPPED, ...): compat.RENAMED
    from ..compat import renamed

    return renamed(__name__, name)
