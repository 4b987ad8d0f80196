"""Which plan a block call gets: the one place that decides (tomesd's ``compute_merge``).

For every transformer block call, :meth:`Planner.plan_for` answers in this order: does anything merge at all; which
token grid and level is this block at, and is that level merged; is the block below ``min_tokens``; what the
policy says for its size and kernels (skip, K/V pooling, or the settings' plan, see
:mod:`~ppdiffusers_tome.policy`); ToDo's downsampling; a plan shared by an earlier block of the call (``share_plan="level"``); a plan kept from an earlier
step (``recompute_every``); else a new plan, from matching inside windows (``match_window``) or over the whole grid.
What one call needs (its size, timestep, the partition tables drawn for it) is read from and written to
:class:`~ppdiffusers_tome.state.ToMeState`.
"""

from __future__ import annotations

import math
from typing import Any

import paddle

from .config import ToMeConfig, check_ratio, ratio_at, tokens_to_merge
from .hooks import TENSOR_TYPES
from .ops.downsample import DownsamplePlan
from .ops.feature_order import feature_partition_table
from .ops.global_plan import MergePlan, bipartite_soft_matching_random2d
from .ops.local_plan import LocalMergePlan
from .ops.partition import find_downsample, partition_table, step_key
from .ops.runtime import converting
from .ops.windows import window_partition_table, window_sides
from .policy import POOL, SKIP, Policy
from .state import ToMeState, ToMeStaticGraphError

__all__ = ["Planner", "finest_block_level"]


def finest_block_level(model: Any, blocks: list[tuple[str, Any]]) -> int | None:
    """The smallest downsampling factor at which any of ``blocks`` runs, read from the model's structure (a UNet's
    or ControlNet's ``down_blocks``/``mid_block``/``up_blocks`` and their down/upsamplers), over the whole model:
    for a UNet whose 1x transformer blocks are only in the up path it is 1 although the down path reaches its
    first transformer block at 2x. None when the structure is not of that kind (then the finest level seen so far
    in the call decides)."""
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
    return min(found) if found else None


class Planner:
    """Decides and builds the plan of every block call of one patched model.

    ``model`` and ``blocks`` (``(name, block)`` pairs) are read once, when the patch is installed: the finest level
    with transformer blocks (``max_downsample="auto"``) and, for a transformer-only model (DiT, PixArt-alpha), the
    patch size whose grid every block runs on. A subclass may replace :meth:`global_plan` (the benchmark's
    zero-overhead bound does).

    >>> from ppdiffusers_tome.testing import tiny_unet
    >>> from ppdiffusers_tome.patch import find_blocks
    >>> unet = tiny_unet()
    >>> planner = Planner(ToMeConfig(), ToMeState(ToMeConfig()), unet, find_blocks(unet))
    >>> planner.auto_finest, planner.patch_size  # transformer blocks at 1x; not a patch transformer
    (1, None)
    """

    def __init__(self, config: ToMeConfig, state: ToMeState, model: Any, blocks: list[tuple[str, Any]]):
        self.config = config
        self.state = state
        self.num_blocks = len(blocks)
        # plain attributes read on the traced path (Paddle's SOT tracer cannot call dataclass properties)
        self.todo = config.method == "todo"
        self.auto_level = config.max_downsample == "auto"
        self.fixed_ratio = None if config.is_scheduled else config.ratio
        self.caches = config.caches_plans
        self.share_level = config.share_plan == "level"
        # with every sub-layer switched off nothing would run on merged tokens: then nothing is planned either
        self.merges_something = self.todo or config.merge_attn or config.merge_crossattn or config.merge_mlp
        # transformer-only models (DiT, PixArt-alpha): the token grid is the patch grid
        patch_size = getattr(model, "patch_size", None) if getattr(model, "is_input_patches", False) else None
        self.patch_size: int | None = int(patch_size) if patch_size else None
        self.auto_finest: int | None = None  # with "auto": the finest block level of the model, when known
        if self.auto_level and self.patch_size is None:
            self.auto_finest = finest_block_level(model, blocks)
        self.policy = Policy(config)  # skip, pool or the settings' plan, by the size of the work (see policy.py)
        self.model_name = type(model).__name__
        self.grid_without_cells: tuple[int, int] | None = None  # a grid too small for one sy x sx cell
        self.rounded_to_nothing: tuple[int, float] | None = None  # (tokens, ratio) where int(tokens*ratio) = 0

    # the decision -----------------------------------------------------------------------------------------------
    def plan_for(self, block_index: int, hidden: Any) -> Any:
        """The plan of one block call (a merge plan, or ToDo's :class:`DownsamplePlan`), or None when this block
        does not merge in this call."""
        if not self.merges_something:
            return None
        grid = self._grid_if_merging(hidden)
        if grid is None:
            return None
        state = self.state
        if state.reads_timestep and converting():
            state.refuse_conversion()
        _, grid_h, grid_w = grid
        if self.config.min_tokens and self._below_min_tokens(hidden):
            state.blocks_skipped += 1
            return None
        decision = self.policy.decide(hidden)
        state.record_decision(decision)
        if decision.action == SKIP:
            state.blocks_skipped += 1
            self.policy.log_first_skip(decision, self.model_name)
            return None
        if decision.action == POOL:
            state.blocks_pooled += 1
            return DownsamplePlan(hidden.shape[1], hidden.shape[0], grid_h, grid_w, 2, "nearest")
        if not self.todo and grid_h // self.config.sy * (grid_w // self.config.sx) == 0:
            self.grid_without_cells = (grid_h, grid_w)  # no dst at all: an identity, not worth planning
            return None
        if self.todo:
            config = self.config
            return DownsamplePlan(hidden.shape[1], hidden.shape[0], grid_h, grid_w, config.downsample_factor,
                                  config.downsample_mode)
        tokens = hidden.shape[1]
        if self.share_level:  # an earlier block of this call planned at this token count
            plan = state.shared_plan(tokens)
            if plan is not None and plan.batch_size == hidden.shape[0]:
                state.plans_shared += 1
                return plan
        plan = self._cached_or_new(block_index, hidden, grid_h, grid_w, self._ratio_now())
        if plan is not None and self.share_level:
            state.share_plan(tokens, plan)
        return plan

    def grid_of(self, num_tokens: int) -> tuple[int, int, int] | None:
        """``(level, grid_h, grid_w)`` of a block with ``num_tokens`` tokens in the call in flight, or None."""
        latent_h, latent_w = self.state.latent_hw
        if self.patch_size is not None:  # every block of a patch transformer runs on the patch grid
            grid_h, grid_w = latent_h // self.patch_size, latent_w // self.patch_size
            return (1, grid_h, grid_w) if grid_h * grid_w == num_tokens else None
        level = find_downsample(latent_h, latent_w, num_tokens)
        if level is None:
            return None
        return level, math.ceil(latent_h / level), math.ceil(latent_w / level)

    def _grid_if_merging(self, hidden: Any) -> tuple[int, int, int] | None:
        """``(level, grid_h, grid_w)`` of the block input ``hidden`` when this block merges in this call."""
        if self.state.latent_hw is None or not isinstance(hidden, TENSOR_TYPES) or hidden.ndim != 3:
            return None
        grid = self.grid_of(hidden.shape[1])
        if grid is None:
            return None
        finest = self.state.saw_level(grid[0])
        # "auto": the finest level with transformer blocks over the whole model (from its structure), else the
        # finest one seen so far in this call, which is the first one a UNet's down path reaches
        if self.auto_level and self.auto_finest is not None:
            finest = self.auto_finest
        return grid if grid[0] <= (finest if self.auto_level else self.config.max_downsample) else None

    def _below_min_tokens(self, hidden: Any) -> bool:
        batch = hidden.shape[0]
        if batch is None or batch < 0:
            raise ToMeStaticGraphError(
                f"ToMe with min_tokens={self.config.min_tokens} compares batch * tokens with it, but this program's "
                "batch is dynamic; give the InputSpec a fixed batch or set min_tokens=0 before converting"
            )
        return batch * hidden.shape[1] < self.config.min_tokens

    def _ratio_now(self) -> float:
        if self.fixed_ratio is not None:
            return self.fixed_ratio
        progress = self.state.progress
        config = self.config
        return check_ratio(ratio_at(config.ratio, progress), config.sx, config.sy, f"(progress={progress:.3f})")

    def _cached_or_new(self, block_index: int, hidden: Any, grid_h: int, grid_w: int, ratio: float
                       ) -> MergePlan | None:
        """A new plan, or under ``recompute_every`` the one cached for this block (or level) and step; None when
        ``ratio`` merges nothing here. A ratio of 0 (a schedule's "off") merges nothing even when a plan is cached."""
        if ratio <= 0:
            return None
        state = self.state
        key = f"level{hidden.shape[1]}" if self.share_level else str(block_index)
        plan = state.cached_plan(key, hidden.shape[0], grid_h, grid_w) if self.caches else None
        if plan is not None:
            state.plans_reused += 1
            return plan
        if self.config.match_window is not None:
            plan = self.local_plan(block_index, hidden, grid_h, grid_w, ratio)
        else:
            r = tokens_to_merge(hidden.shape[1], ratio)  # (Paddle's SOT tracer cannot call dataclass methods)
            plan = self.global_plan(block_index, hidden, grid_h, grid_w, r) if r > 0 else None
            if r <= 0:
                self.rounded_to_nothing = (hidden.shape[1], ratio)
        if plan is None:
            return None
        state.plans_computed += 1
        if self.caches:
            state.store_plan(key, plan, grid_h, grid_w)
        return plan

    # the plans ----------------------------------------------------------------------------------------------------
    def global_plan(self, block_index: int, hidden: Any, grid_h: int, grid_w: int, r: int) -> MergePlan:
        """Match the block input ``hidden`` on its ``grid_h x grid_w`` grid and plan the merge of ``r`` tokens."""
        config = self.config
        cells = (grid_h // config.sy) * (grid_w // config.sx)
        partition = self.partition(block_index, grid_h, grid_w) if config.use_rand and cells else None
        return bipartite_soft_matching_random2d(
            hidden, grid_w, grid_h, config.sx, config.sy, r, no_rand=True, partition=partition,
            deterministic=config.deterministic,
        )

    def local_plan(self, block_index: int, hidden: Any, grid_h: int, grid_w: int, ratio: float
                   ) -> LocalMergePlan | None:
        """Match the block input within windows of about ``match_window`` tokens per side; each window merges
        ``int(ratio * window tokens)`` of its src. None when no window holds a cell or nothing would merge."""
        config = self.config
        wy, wx = window_sides(grid_h, grid_w, config.match_window, config.sx, config.sy)
        cells = (wy // config.sy) * (wx // config.sx)
        window_r = min(tokens_to_merge(wy * wx, ratio), wy * wx - cells)
        if cells == 0 or window_r <= 0:
            if cells:
                self.rounded_to_nothing = (wy * wx, ratio)
            return None
        partition = self.window_partition(block_index, grid_h, grid_w, wy, wx)
        windows = (grid_h, grid_w, wy, wx, config.sx, config.sy)
        return LocalMergePlan.from_matching(hidden, windows, partition, window_r, order=config.match_order)

    # partitions: one table per call and grid, for every block at once ----------------------------------------------
    def partition(self, block_index: int, grid_h: int, grid_w: int) -> Any:
        """Block ``block_index``'s random partition of a ``grid_h x grid_w`` grid in the call in flight: a row of a
        table drawn once per call and grid for every block, on the device, from the timestep tensor."""
        call, key = self.state.call, f"{grid_h}x{grid_w}"
        table = call.partitions[key] if key in call.partitions else None
        if table is None:
            config = self.config
            table = partition_table(grid_h, grid_w, config.sx, config.sy, self._step_key(), config.seed,
                                    self.num_blocks)
            call.partitions[key] = table
        return table[block_index]

    def window_partition(self, block_index: int, grid_h: int, grid_w: int, wy: int, wx: int) -> Any:
        """Block ``block_index``'s partition for local matching in the call in flight (drawn once per call, grid and
        window for every block; top-left dst without ``use_rand``): ``[W, T]`` window-local, or in feature order the
        ``[N]`` grid positions of every window's src, then dst."""
        config = self.config
        call, key = self.state.call, f"{grid_h}x{grid_w}/{wy}x{wx}/{config.match_order}"
        table = call.partitions[key] if key in call.partitions else None
        if table is None:
            step = self._step_key() if config.use_rand else None
            make = feature_partition_table if config.match_order == "feature" else window_partition_table
            table = make(grid_h, grid_w, wy, wx, config.sx, config.sy, step, config.seed, self.num_blocks)
            call.partitions[key] = table
        return table[block_index]

    def _step_key(self) -> Any:
        """The call's step key, made from its timestep the first time a block needs it (from the number of the call
        when there is no timestep: then the call history does matter)."""
        call = self.state.call
        if call.step_key is None:
            call.step_key = step_key(call.timestep if call.timestep is not None else call.number)
        return call.step_key
