"""How a block call's plan is made, once :func:`~ppdiffusers_tome.tome.decision.decide_block` has said what the block
does.

K/V pooling and ToDo get a :class:`~ppdiffusers_tome.ops.downsample.DownsamplePlan` (one plan builder for both: the
decision carries the factor and mode of the :class:`~ppdiffusers_tome.tome.todo.ToDoConfig` it runs, ToDo's
defaults for the pooling). A merge gets, in this order: the plan an earlier block of the same call made at the
same token count (when the decision says the plan is shared: ``share_plan="level"``, or SD3's joint blocks on GPU
kernels with ``share_plan="auto"``), the plan kept from an earlier step for this block and call site
(``recompute_every``), or a new plan: matching inside windows (``match_window``) or over the whole grid. The random
partitions are drawn once per call and grid for every block at once, on the device, from the timestep tensor (one
picker, :func:`~ppdiffusers_tome.ops.partition.pick_partitions`, over the grid's or the windows'
:class:`~ppdiffusers_tome.ops.partition.Layout`). Plans run on the call's kernel family, found once per call.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from ..ops.downsample import DownsamplePlan
from ..ops.global_plan import MergePlan, bipartite_soft_matching_random2d
from ..ops.local_plan import LocalMergePlan
from ..ops.partition import layout, pick_partitions, step_key
from ..ops.windows import window_sides, windows
from .actions import Action
from .config import ToMeConfig, tokens_to_merge
from .decision import BlockDecision, finest_block_level
from .state import CallRecord, PlanCache

__all__ = ["COMPUTED", "REUSED", "SHARED", "Planner", "finest_block_level"]

# where a merge plan came from (the caller counts them): made now, kept from an earlier step, an earlier block's
COMPUTED, REUSED, SHARED = "computed", "reused", "shared"


class Planner:
    """Makes the plan of every merging block call of one patched model. A subclass may replace
    :meth:`global_plan` (the benchmark's zero-overhead bound does).

    >>> from ppdiffusers_tome.testing import tiny_unet
    >>> from ppdiffusers_tome.tome.patch import find_blocks
    >>> planner = Planner(ToMeConfig(), num_blocks=len(find_blocks(tiny_unet())))
    >>> planner.caches, planner.num_blocks
    (False, 7)
    """

    def __init__(self, config: Any, num_blocks: int):
        self.config = config  # a ToMeConfig, or ToDo's ToDoConfig (whose plans need no option of this class)
        self.num_blocks = num_blocks
        # plain attributes read on the traced path (Paddle's SOT tracer cannot call dataclass properties)
        self.caches = isinstance(config, ToMeConfig) and config.caches_plans
        self.cache = PlanCache(config.recompute_every) if self.caches else None

    def plan(self, decision: BlockDecision, block_index: int, hidden: Any, call: CallRecord) -> Tuple[Any, Any]:
        """``(plan, where it came from)`` for a block call that ``decision`` says merges, pools or downsamples:
        :data:`COMPUTED`, :data:`REUSED` or :data:`SHARED` for a merge plan, None for a downsampling plan; ``(None,
        None)`` when there is nothing to plan."""
        todo = decision.downsample  # pooling and ToDo: ToDo's (factor, mode), its defaults for the pooling
        if todo is not None:
            return DownsamplePlan(hidden.shape[1], hidden.shape[0], decision.grid_h, decision.grid_w, todo[0],
                                  todo[1]), None
        if decision.action != Action.MERGE:
            return None, None
        tokens = hidden.shape[1]
        shared = decision.shared
        if shared:  # an earlier block of this call planned at this token count
            plans = call.shared
            plan = plans[tokens] if tokens in plans else None
            if plan is not None and plan.batch_size == hidden.shape[0]:
                return plan, SHARED
        grid = (decision.grid_h, decision.grid_w)
        key = f"level{tokens}" if shared else str(block_index)
        plan = self.cache.lookup(key, call, hidden.shape[0], grid) if self.caches else None
        source = REUSED
        if plan is None:
            if self.config.match_window is not None:
                plan = self.local_plan(block_index, hidden, grid[0], grid[1], decision.ratio, call)
            else:
                r = int(tokens * decision.ratio)  # tokens_to_merge, inline: a call fewer per merging block
                plan = self.global_plan(block_index, hidden, grid[0], grid[1], r, call)
            source = COMPUTED
            if self.caches:
                self.cache.store(key, call, plan, grid)
        if shared:
            call.shared[tokens] = plan
        return plan, source

    # the plans ----------------------------------------------------------------------------------------------------
    def global_plan(self, block_index: int, hidden: Any, grid_h: int, grid_w: int, r: int,
                    call: Optional[CallRecord] = None) -> MergePlan:
        """Match the block input ``hidden`` on its ``grid_h x grid_w`` grid and plan the merge of ``r`` tokens."""
        config = self.config
        cells = (grid_h // config.sy) * (grid_w // config.sx)
        partition = self.partition(block_index, grid_h, grid_w, call) if config.use_rand and cells else None
        return bipartite_soft_matching_random2d(
            hidden, grid_w, grid_h, config.sx, config.sy, r, no_rand=True, partition=partition,
            kind=call.kernels if call is not None else None, deterministic=config.deterministic,
        )

    def local_plan(self, block_index: int, hidden: Any, grid_h: int, grid_w: int, ratio: float,
                   call: CallRecord) -> LocalMergePlan:
        """Match the block input within windows of about ``match_window`` tokens per side; each window merges
        ``int(ratio * window tokens)`` of its src (the decision made sure that is at least one)."""
        config = self.config
        wy, wx = window_sides(grid_h, grid_w, config.match_window, config.sx, config.sy)
        cells = (wy // config.sy) * (wx // config.sx)
        window_r = min(tokens_to_merge(wy * wx, ratio), wy * wx - cells)
        partition = self.window_partition(block_index, grid_h, grid_w, wy, wx, call)
        spec = (grid_h, grid_w, wy, wx, config.sx, config.sy)
        return LocalMergePlan.from_matching(hidden, spec, partition, window_r, call.kernels, config.match_order)

    # partitions: one table per call and grid, for every block at once ----------------------------------------------
    def partition(self, block_index: int, grid_h: int, grid_w: int, call: CallRecord) -> Any:
        """Block ``block_index``'s random partition of a ``grid_h x grid_w`` grid in ``call``: a row of a table drawn
        once per call and grid for every block, on the device, from the timestep tensor."""
        partitions, key = call.partitions, f"{grid_h}x{grid_w}"
        table = partitions[key] if key in partitions else None
        if table is None:
            config = self.config
            table = pick_partitions(layout(grid_h, grid_w, config.sx, config.sy), self._step_key(call), config.seed,
                                    self.num_blocks)
            partitions[key] = table
        return table[block_index]

    def window_partition(self, block_index: int, grid_h: int, grid_w: int, wy: int, wx: int, call: CallRecord) -> Any:
        """Block ``block_index``'s partition for local matching in ``call`` (drawn once per call, grid and window for
        every block; top-left dst without ``use_rand``): ``[W, T]`` window-local, or in feature order the ``[N]``
        grid positions of every window's src, then dst."""
        config = self.config
        partitions, key = call.partitions, f"{grid_h}x{grid_w}/{wy}x{wx}/{config.match_order}"
        table = partitions[key] if key in partitions else None
        if table is None:
            step = self._step_key(call) if config.use_rand else None
            table = pick_partitions(windows(grid_h, grid_w, wy, wx, config.sx, config.sy), step, config.seed,
                                    self.num_blocks, local=config.match_order != "feature")
            partitions[key] = table
        return table[block_index]

    @staticmethod
    def _step_key(call: CallRecord) -> Any:
        """The call's step key, made from its timestep the first time a block needs it (from the number of the call
        when there is no timestep: then the call history does matter)."""
        if call.step_key is None:
            call.step_key = step_key(call.timestep if call.timestep is not None else call.number)
        return call.step_key
