"""Model glue: attach ToMe to the transformer blocks of one model with forward hooks, and take it off again.

No block's ``forward`` is copied or replaced. One :class:`ModelPatch` per patched model (a UNet, one ControlNet)
registers (see :mod:`ppdiffusers_tome.hooks`):

* a pre-hook on the model that starts the record of the call (latent size, timestep) in :class:`ToMeState`;
* a pre-hook on every ``BasicTransformerBlock`` that plans the merge from the block's input (the same metric as
  tomesd) when the block's level qualifies;
* a pre-hook/post-hook pair on ``attn1`` (and ``attn2``/``ff`` when enabled) that merges the sub-layer's input and
  unmerges its output, so the block's residual add sees full-size tensors, exactly where tomesd puts them.
  With ``method="todo"`` only ``attn1`` gets a pre-hook, which passes the downsampled tokens as its keys/values.

The token grid of a block comes from the latent size for UNets and ControlNets (``ceil(H/d) x ceil(W/d)`` at
downsampling ``d``) and from the patch embedding for transformer-only models (``H/p x W/p`` for DiT and PixArt-alpha
``Transformer2DModel`` with patch size ``p``, whose blocks all count as level 1).

What one model remembers between calls lives in :class:`~ppdiffusers_tome.state.ToMeState`. The patch sets no
attribute on the model and removing it removes exactly those hooks, so the model's objects, parameters and state
dict are those of the untouched model.

Installing and removing hold :data:`PATCH_LOCK` (one re-entrant lock for the process: both take milliseconds), so
threads applying and removing ToMe on one model at once leave it with exactly one patch or none. The patch of a model
is found through the model's own pre-hook table, which ``copy.copy`` shares between a model and its shallow copies
(as it shares their sub-layers): every name of the model sees the patch whose hooks are actually installed.
"""

from __future__ import annotations

import inspect
import logging
import math
import threading
import warnings
import weakref
from typing import Any, List, Optional, Tuple

import paddle
from ppdiffusers.models.attention import BasicTransformerBlock

from .config import ToMeConfig, check_ratio, ratio_at, tokens_to_merge
from .hooks import TENSOR_TYPES, BlockHooks, HookCall, HookRecord, SublayerHooks
from .merge import (
    DownsamplePlan,
    LocalMergePlan,
    MergePlan,
    bipartite_soft_matching_random2d,
    converting,
    find_downsample,
    window_sides,
)
from .state import ToMeState, ToMeStaticGraphError

logger = logging.getLogger(__name__)

PATCH_ATTR = "_ppdiffusers_tome_patch"  # (set by versions up to 0.4.0; removed with the patch when found)
BLOCK_TYPES: Tuple[type, ...] = (BasicTransformerBlock,)
PATCH_LOCK = threading.RLock()  # held across every check, install and removal of a patch, on any model

__all__ = [
    "ModelPatch", "ToMeState", "ToMeStaticGraphError", "PATCH_ATTR", "PATCH_LOCK", "find_blocks", "get_patch",
]


def find_blocks(model: paddle.nn.Layer) -> List[Tuple[str, paddle.nn.Layer]]:
    """The transformer blocks ToMe can patch inside ``model``, as ``(name, block)`` in definition order."""
    return [(name, layer) for name, layer in model.named_sublayers(include_self=True) if isinstance(layer, BLOCK_TYPES)]


def get_patch(model: Any) -> Optional["ModelPatch"]:
    """The :class:`ModelPatch` installed on ``model`` by this package, or ``None``: the owner of the ToMe pre-hook
    in the model's hook table (so a shallow copy, which shares that table, has the same patch as its original)."""
    table = getattr(model, "__dict__", {}).get("_forward_pre_hooks")
    if not table:
        return None
    for hook in list(table.values()):  # (a copy in one step: another thread may be registering hooks)
        if isinstance(hook, HookCall) and hook.method == "_before_model" and isinstance(hook.owner, ModelPatch):
            return hook.owner
    return None


def _positional_index(model: Any, name: str, default: int) -> int:
    """Where argument ``name`` sits among the positional arguments of ``model.forward`` (the UNet takes the
    timestep second, ``Transformer2DModel`` third)."""
    try:
        names = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return default
    return names.index(name) if name in names else default


class _ReplayPlans(dict):
    """Plans kept for the recomputation of checkpointed blocks (see :meth:`ModelPatch.keep_for_recompute`): they
    belong to one process's autograd graph, so a copy or a pickle of the patch starts without them."""

    def __reduce__(self):
        return (_ReplayPlans, ())

    def __deepcopy__(self, memo) -> "_ReplayPlans":
        return _ReplayPlans()


def _finest_block_level(model: Any, blocks: List[Tuple[str, Any]]) -> Optional[int]:
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


class ModelPatch:
    """ToMe installed on one model (a UNet or one ControlNet). Create with :meth:`install`, undo with :meth:`remove`.

    Example:
        >>> from ppdiffusers_tome.testing import tiny_unet
        >>> unet = tiny_unet()
        >>> patch = ModelPatch.install(unet, ToMeConfig(ratio=0.5))
        >>> len(patch.blocks) > 0
        True
        >>> patch.remove()
    """

    def __init__(self, model: paddle.nn.Layer, config: ToMeConfig, train_timesteps: int = 1000,
                 num_blocks: Optional[int] = None):
        self.model = model
        self.config = config
        self.train_timesteps = int(train_timesteps)
        if num_blocks is None:
            num_blocks = len(find_blocks(model))
        self.state = ToMeState(config, train_timesteps, num_blocks=num_blocks)
        self.blocks: List[BlockHooks] = []
        self._hooks: List[HookRecord] = []
        self.installed = False  # True from install to remove
        self.auto_level = config.max_downsample == "auto"
        self.auto_finest: Optional[int] = None  # with "auto": the finest block level of the model, when known
        self.todo = config.method == "todo"
        self.fixed_ratio = None if config.is_scheduled else config.ratio
        self.caches = config.caches_plans  # (Paddle's SOT tracer cannot call dataclass properties)
        self.share_level = config.share_plan == "level"
        # with every sub-layer switched off nothing would run on merged tokens: then nothing is planned either
        self.merges_something = self.todo or config.merge_attn or config.merge_crossattn or config.merge_mlp
        self.grid_without_cells: Optional[Tuple[int, int]] = None  # a grid too small for one sy x sx cell
        # gradient checkpointing: the plan of every checkpointed block call, for its recomputation in backward
        self._checkpoint_owners: List[Any] = []  # block index -> the layer whose gradient_checkpointing covers it
        self._replay = _ReplayPlans()  # (block index, id(input)) -> (weak reference to the input, plan, call number)
        self.keeps_plans = False  # whether any block sits in a layer that can checkpoint it
        # transformer-only models (DiT, PixArt-alpha): the token grid is the patch grid
        patch_size = getattr(model, "patch_size", None) if getattr(model, "is_input_patches", False) else None
        self.patch_size: Optional[int] = int(patch_size) if patch_size else None
        self.timestep_arg = _positional_index(model, "timestep", default=1)

    @classmethod
    def install(cls, model: paddle.nn.Layer, config: ToMeConfig, train_timesteps: int = 1000) -> "ModelPatch":
        """Patch ``model`` with ``config``, replacing this package's earlier patch on it. Raises ``RuntimeError``
        (and changes nothing) while a forward of the model is running (see :meth:`check_idle`)."""
        blocks = find_blocks(model)
        if not blocks:
            raise ValueError(f"{type(model).__name__} has no transformer blocks (BasicTransformerBlock) to patch")
        with PATCH_LOCK:
            previous = get_patch(model)
            if previous is not None:  # never leave a patch's hooks behind unreachable
                previous.remove()
            patch = cls(model, config, train_timesteps, num_blocks=len(blocks))
            try:
                patch._register(blocks)
            except BaseException:
                patch._remove_hooks()
                raise
            patch.installed = True
            if not patch.merges_something:
                warnings.warn(
                    f"ToMe will change nothing in {type(model).__name__}: merge_attn, merge_crossattn and merge_mlp are "
                    "all False, so no sub-layer runs on merged tokens (and no merge is planned). Enable one of them "
                    "(merge_attn=True is the paper's setting) or remove ToMe.",
                    UserWarning,
                    stacklevel=3,
                )
        return patch

    def _register(self, blocks) -> None:
        if self.auto_level and self.patch_size is None:
            self.auto_finest = _finest_block_level(self.model, blocks)
        layers = dict(self.model.named_sublayers(include_self=True))
        self._checkpoint_owners = [layers.get(name.rsplit(".transformer_blocks.", 1)[0]) if ".transformer_blocks." in
                                   name else None for name, _ in blocks]
        self.keeps_plans = any(owner is not None for owner in self._checkpoint_owners)
        add = self._hooks.append
        add(HookRecord(self.model, "pre", self, "_before_model"))
        add(HookRecord(self.model, "post", self, "_after_model"))
        selected = [
            ("attn1", self.config.merge_attn or self.todo, True),
            ("attn2", self.config.merge_crossattn, False),
            ("ff", self.config.merge_mlp, False),
        ]
        for index, (_, block) in enumerate(blocks):
            hooks = BlockHooks(self, index)
            self.blocks.append(hooks)
            add(HookRecord(block, "pre", hooks, "before"))
            add(HookRecord(block, "post", hooks, "after"))
            for name, enabled, self_attention in selected:
                sublayer = getattr(block, name, None)
                if enabled and isinstance(sublayer, paddle.nn.Layer):
                    sub = SublayerHooks(hooks, name, self_attention)
                    add(HookRecord(sublayer, "pre", sub, "before"))
                    if not self.todo:  # ToDo leaves the output as it is
                        add(HookRecord(sublayer, "post", sub, "after"))

    def _remove_hooks(self) -> None:
        while self._hooks:
            self._hooks.pop().remove()

    def check_idle(self) -> None:
        """Raise ``RuntimeError`` if a forward of this model is running, in another thread or in this one (from
        inside the forward itself): taking hooks off (or swapping them) half-way through a forward would leave
        merged tokens that are never unmerged."""
        name = type(self.model).__name__
        if self.state.busy_here(self.model):
            raise RuntimeError(
                f"cannot change ToMe on {name} from inside its own forward call (this thread is running it); "
                "apply_tome/remove_tome take effect between calls: change it after the call returns, e.g. in the "
                "pipeline's step callback (callback_on_step_end)"
            )
        busy = self.state.busy_elsewhere(self.model)
        if busy:
            raise RuntimeError(
                f"cannot change ToMe on {name} while {busy} forward call(s) of it are running in other threads; "
                "apply_tome/remove_tome take effect between calls: wait for the calls to finish "
                "(reset_tome is safe at any time)"
            )

    def calls_in_flight(self) -> int:
        """Forward calls of this model running right now, in every thread. A call left by ``KeyboardInterrupt`` or
        ``SystemExit`` (which Paddle does not show to hooks) is over and not counted."""
        with PATCH_LOCK:
            return self.state.busy_here(self.model) + self.state.busy_elsewhere(self.model)

    def remove(self, force: bool = False) -> None:
        """Take every hook off and drop the patch attribute; the model is then exactly as before ``install``.
        Raises ``RuntimeError`` (and changes nothing) while a forward of the model is running, unless ``force``
        (used to roll back an ``apply_tome`` that failed half-way). Removing a patch that is already removed does
        nothing."""
        with PATCH_LOCK:
            if not getattr(self, "installed", True):  # (a patch pickled by 0.4.0 has no flag: it is installed)
                return
            if not force:
                self.check_idle()
            self._remove_hooks()
            self.state.forget_calls_in_flight()  # what is left belongs to calls that never reached their end
            self.blocks = []
            self.installed = False
            if self.model.__dict__.get(PATCH_ATTR) is self:
                del self.model.__dict__[PATCH_ATTR]

    # hooks ---------------------------------------------------------------------------------------------------
    def _before_model(self, layer, args, kwargs):
        sample = args[0] if args else kwargs.get("sample", kwargs.get("hidden_states"))
        timestep = args[self.timestep_arg] if len(args) > self.timestep_arg else kwargs.get("timestep")
        self.state.begin_call(sample, timestep, layer)
        return None

    def _after_model(self, layer, args, kwargs, output):
        state, config = self.state, self.config
        completed = output is not None  # None when the forward raised (Paddle runs this hook anyway)
        ended = state.end_call(completed)  # (the record of this call: a nested call's caller may still be running)
        warn = self.blocks and self.merges_something and ended is not None  # (nothing by configuration: said at apply)
        if completed and warn and ended.merged_blocks == 0 and self.fixed_ratio != 0 and not state.warned_no_merge:
            level, name = ended.finest_level, "ToDo" if self.todo else "ToMe"
            message = None
            if level is None:
                message = (
                    f"{name} changed nothing in {type(self.model).__name__}: no transformer block's tokens form the "
                    f"{'patch' if self.patch_size else 'latent'} grid of the input (a layout this package does "
                    "not know, such as video frames folded into the tokens)."
                )
            elif self.grid_without_cells is not None and (self.auto_level or level <= config.max_downsample):
                grid_h, grid_w = self.grid_without_cells
                message = (
                    f"ToMe merged no tokens in {type(self.model).__name__}: its {grid_h}x{grid_w} token grid holds no "
                    f"sy x sx = {config.sy}x{config.sx} cell, so there is no dst token to merge into (nothing was "
                    "planned). Use smaller sx and sy (2 is the paper's setting) for latents this small."
                )
            elif not self.auto_level and level > config.max_downsample:
                message = (
                    f"{name} merged no tokens in {type(self.model).__name__}: its highest-resolution transformer "
                    f"blocks run at {level}x downsampling, above max_downsample={config.max_downsample}. "
                    f"Use max_downsample={level} (or 'auto') to merge there."
                )
            if message is not None:
                state.warned_no_merge = True
                warnings.warn(message, UserWarning, stacklevel=2)
        return None

    def token_grid(self, num_tokens: int) -> Optional[Tuple[int, int, int]]:
        """``(level, grid_h, grid_w)`` of a block with ``num_tokens`` tokens in the call in flight, or None."""
        latent_h, latent_w = self.state.latent_hw
        if self.patch_size is not None:  # every block of a patch transformer runs on the patch grid
            grid_h, grid_w = latent_h // self.patch_size, latent_w // self.patch_size
            return (1, grid_h, grid_w) if grid_h * grid_w == num_tokens else None
        level = find_downsample(latent_h, latent_w, num_tokens)
        if level is None:
            return None
        return level, math.ceil(latent_h / level), math.ceil(latent_w / level)

    def plan_in_flight(self, block_index: int) -> Any:
        """The plan block ``block_index`` uses in the call in flight in this thread (None when it does not merge):
        for inspection, e.g. from a forward pre-hook on the block's ``attn1``."""
        return self.state.plan_of(block_index)

    def plan_for(self, block_index: int, hidden: Any) -> Optional[MergePlan]:
        """The merge plan of one block call, or None when this block does not merge in this call."""
        if not self.merges_something:
            return None
        grid = self._grid_if_merging(hidden)
        if grid is None:
            return None
        if self.state.reads_timestep and converting():
            self.state.refuse_conversion()
        _, grid_h, grid_w = grid
        if self.config.min_tokens and self._below_min_tokens(hidden):
            self.state.blocks_skipped += 1
            return None
        if not self.todo and grid_h // self.config.sy * (grid_w // self.config.sx) == 0:
            self.grid_without_cells = (grid_h, grid_w)  # no dst at all: an identity, not worth planning
            return None
        if self.todo:
            config = self.config
            return DownsamplePlan(hidden.shape[1], hidden.shape[0], grid_h, grid_w, config.downsample_factor,
                                  config.downsample_mode)
        state, tokens = self.state, hidden.shape[1]
        if self.share_level:  # an earlier block of this call planned at this token count
            plan = state.shared_plan(tokens)
            if plan is not None and plan.batch_size == hidden.shape[0]:
                state.plans_shared += 1
                return plan
        plan = self._merge_plan(block_index, hidden, grid_h, grid_w, self._ratio_now())
        if plan is not None and self.share_level:
            state.share_plan(tokens, plan)
        return plan

    # gradient checkpointing -----------------------------------------------------------------------------------
    # ppdiffusers' checkpointing (recompute without re-entrance) runs a block's forward again during backward and
    # expects it to save exactly the tensors the first run saved. That second run comes after the model's call has
    # ended, so without help it would not merge at all (and Paddle fails: "Not supported to retrieve a tensor saved
    # by autograd multiple times ..."). The plan of each checkpointed block call is kept, keyed by the block's input
    # tensor (the recomputation gets the same tensor object), and the recomputation merges with it again: the same
    # operations, hence the same gradients as without checkpointing.
    def keep_for_recompute(self, block_index: int, hidden: Any, plan: Any) -> None:
        """Keep ``plan`` for the recomputation of this block call when gradient checkpointing covers it."""
        owner = self._checkpoint_owners[block_index] if block_index < len(self._checkpoint_owners) else None
        if owner is None or not getattr(owner, "gradient_checkpointing", False):
            return
        if not isinstance(hidden, paddle.Tensor) or hidden.stop_gradient or not paddle.is_grad_enabled():
            return
        calls = self.state.calls
        for key in [k for k, (ref, _, call) in self._replay.items() if ref() is None or call < calls - 1]:
            del self._replay[key]  # inputs gone, or calls before the previous one: their backward is over
        self._replay[(block_index, id(hidden))] = (weakref.ref(hidden), plan, calls)

    def replayed_plan(self, block_index: int, hidden: Any) -> Any:
        """The plan a checkpointed block call used, when this is its recomputation in backward (else None)."""
        entry = self._replay.pop((block_index, id(hidden)), None) if self._replay else None
        if entry is None or entry[0]() is not hidden:
            return None
        return entry[1]

    def _below_min_tokens(self, hidden: Any) -> bool:
        batch = hidden.shape[0]
        if batch is None or batch < 0:
            raise ToMeStaticGraphError(
                f"ToMe with min_tokens={self.config.min_tokens} compares batch * tokens with it, but this program's "
                "batch is dynamic; give the InputSpec a fixed batch or set min_tokens=0 before converting"
            )
        return batch * hidden.shape[1] < self.config.min_tokens

    def _grid_if_merging(self, hidden: Any) -> Optional[Tuple[int, int, int]]:
        """``(level, grid_h, grid_w)`` of the block input ``hidden`` when this block merges in this call."""
        if self.state.latent_hw is None or not isinstance(hidden, TENSOR_TYPES) or hidden.ndim != 3:
            return None
        grid = self.token_grid(hidden.shape[1])
        if grid is None:
            return None
        finest = self.state.saw_level(grid[0])
        # "auto": the finest level with transformer blocks over the whole model (from its structure), else the
        # finest one seen so far in this call, which is the first one a UNet's down path reaches
        if self.auto_level and self.auto_finest is not None:
            finest = self.auto_finest
        return grid if grid[0] <= (finest if self.auto_level else self.config.max_downsample) else None

    def _ratio_now(self) -> float:
        if self.fixed_ratio is not None:
            return self.fixed_ratio
        progress = self.state.progress
        config = self.config
        return check_ratio(ratio_at(config.ratio, progress), config.sx, config.sy, f"(progress={progress:.3f})")

    def _merge_plan(self, block_index: int, hidden: Any, grid_h: int, grid_w: int, ratio: float) -> Optional[MergePlan]:
        """A new plan, or under ``recompute_every`` the one cached for this block (or level) and step; None when
        ``ratio`` merges nothing here."""
        state = self.state
        key = f"level{hidden.shape[1]}" if self.share_level else str(block_index)
        plan = state.cached_plan(key, hidden.shape[0], grid_h, grid_w) if self.caches else None
        if plan is not None:
            state.plans_reused += 1
            return plan
        if self.config.match_window is not None:
            plan = self.make_local_plan(block_index, hidden, grid_h, grid_w, ratio)
        else:
            r = tokens_to_merge(hidden.shape[1], ratio)  # (Paddle's SOT tracer cannot call dataclass methods)
            plan = self.make_plan(block_index, hidden, grid_h, grid_w, r) if r > 0 else None
        if plan is None:
            return None
        state.plans_computed += 1
        if self.caches:
            state.store_plan(key, plan, grid_h, grid_w)
        return plan

    def make_local_plan(self, block_index: int, hidden: Any, grid_h: int, grid_w: int, ratio: float
                        ) -> Optional[LocalMergePlan]:
        """Match the block input within windows of about ``match_window`` tokens per side; each window merges
        ``int(ratio * window tokens)`` of its src. None when no window holds a cell or nothing would merge."""
        config = self.config
        wy, wx = window_sides(grid_h, grid_w, config.match_window, config.sx, config.sy)
        cells = (wy // config.sy) * (wx // config.sx)
        window_r = min(tokens_to_merge(wy * wx, ratio), wy * wx - cells)
        if cells == 0 or window_r <= 0:
            return None
        partition = self.state.window_partition_for(block_index, grid_h, grid_w, wy, wx)
        windows = (grid_h, grid_w, wy, wx, config.sx, config.sy)
        return LocalMergePlan.from_matching(hidden, windows, partition, window_r, order=config.match_order)

    def make_plan(self, block_index: int, hidden: Any, grid_h: int, grid_w: int, r: int) -> MergePlan:
        """Match the block input ``hidden`` on its ``grid_h x grid_w`` grid and plan the merge of ``r`` tokens."""
        config = self.config
        cells = (grid_h // config.sy) * (grid_w // config.sx)
        partition = self.state.partition_for(block_index, grid_h, grid_w) if config.use_rand and cells else None
        return bipartite_soft_matching_random2d(
            hidden, grid_w, grid_h, config.sx, config.sy, r, no_rand=True, partition=partition,
            deterministic=config.deterministic,
        )
