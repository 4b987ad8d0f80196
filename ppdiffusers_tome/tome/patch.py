"""ToMe on one model (a UNet, one ControlNet, one DiT / PixArt-alpha transformer): its hooks, what a block call
does, and the record of each call.

One :class:`ModelPatch` per patched model adds, through :mod:`ppdiffusers_tome.core.registry` (all named ``"tome"``):

* a :class:`~ppdiffusers_tome.tome.hooks.ModelHook` on the model (inside the model's :class:`~.calls.ModelCalls`);
* a :class:`~ppdiffusers_tome.tome.hooks.BlockHook` on every ``BasicTransformerBlock`` that can merge: with a model whose
  structure says each block's level (a UNet, a ControlNet), only the blocks at a level that merges are hooked;
* a :class:`~ppdiffusers_tome.tome.hooks.SublayerHook` on ``attn1`` (and ``attn2`` / ``ff`` when enabled) of those blocks.

:meth:`ModelPatch.remove` takes exactly those off; the last hook of a layer gives it back its class.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple

import paddle
from ppdiffusers.models.attention import BasicTransformerBlock, JointTransformerBlock

from ..core.calls import drop_calls_if_alone, model_calls, refuse_if_running
from ..core.registry import LOCK, add_hook, hooks_of, remove_hook
from ..ops.runtime import converting, device_kind, tracing
from .checkpoint import RecomputePlans
from .config import ToMeConfig, check_ratio, ratio_at
from .decision import OFF, POOLED, SKIPPED, BlockDecision, Settings, block_levels, decide, grid_of
from .hooks import TENSOR_TYPES, BlockHook, ModelHook, SublayerHook
from .joint_attention import attention_core
from .planner import Planner
from .state import (
    CallRecord,
    Counters,
    ToMeState,
    ToMeStaticGraphError,
    progress_of,
    refuse_conversion,
    refuse_dynamic_size,
    refuse_dynamic_tokens,
)

logger = logging.getLogger(__name__)

NAME = "tome"  # the name of ToMe's hooks in every registry
BLOCK_TYPES: Tuple[type, ...] = (BasicTransformerBlock, JointTransformerBlock)
# the sub-layers that can run on merged tokens, by block type: (name, option that enables it, self-attention)
SUBLAYERS = {
    BasicTransformerBlock: (("attn1", "merge_attn", True), ("attn2", "merge_crossattn", False), ("ff", "merge_mlp", False)),
    # SD3's MMDiT: the joint attention (the image stream's queries, keys and values; the text stream stays) and the
    # image stream's MLP
    JointTransformerBlock: (("attn", "merge_attn", True), ("ff", "merge_mlp", False)),
}
PATCH_LOCK = LOCK  # (the registry's lock: installs and removals of any technique are atomic with each other)
MAX_DECISIONS = 1024  # block decisions memoised per patch (by shapes, kernels, ratio); the memo starts over beyond

__all__ = ["BLOCK_TYPES", "ModelPatch", "PATCH_LOCK", "ToMeState", "ToMeStaticGraphError", "find_blocks",
           "get_patch"]


def find_blocks(model: paddle.nn.Layer) -> List[Tuple[str, paddle.nn.Layer]]:
    """The transformer blocks ToMe can patch inside ``model``, as ``(name, block)`` in definition order."""
    return [(name, layer) for name, layer in model.named_sublayers(include_self=True) if isinstance(layer, BLOCK_TYPES)]


def get_patch(model: Any) -> Optional["ModelPatch"]:
    """The :class:`ModelPatch` installed on ``model`` by this package, or ``None`` (a shallow copy of a patched
    model shares its patch, as it shares its sub-layers)."""
    registry = hooks_of(model)
    hook = registry.get(NAME) if registry is not None else None
    return getattr(hook, "patch", None)


def _timestep_index(model: Any) -> int:
    """Where ``timestep`` sits among the positional arguments of the model's forward (second for a UNet, third
    for ``Transformer2DModel``)."""
    import inspect

    try:
        names = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return 1
    return names.index("timestep") if "timestep" in names else 1


class _Local(threading.local):
    call: Optional[CallRecord] = None  # the record of this thread's call in flight
    last: Optional[CallRecord] = None  # the record of this thread's latest call that returned


class ModelPatch:
    """ToMe installed on one model. Create with :meth:`install`, undo with :meth:`remove`.

    Example:
        >>> from ppdiffusers_tome.testing import tiny_unet
        >>> unet = tiny_unet()
        >>> patch = ModelPatch.install(unet, ToMeConfig(ratio=0.5))
        >>> len(patch.blocks) > 0, get_patch(unet) is patch
        (True, True)
        >>> patch.remove()
        >>> get_patch(unet) is None
        True
    """

    planner_type = Planner  # what makes each block's plan (a subclass may swap it)

    def __init__(self, model: paddle.nn.Layer, config: ToMeConfig, train_timesteps: int = 1000,
                 blocks: Optional[List[Tuple[str, paddle.nn.Layer]]] = None):
        self.model = model
        self.config = config
        self.train_timesteps = int(train_timesteps)
        all_blocks = find_blocks(model) if blocks is None else blocks
        self.settings = Settings(config, model, all_blocks)
        self.planner = self.planner_type(config, len(all_blocks))
        self.counters = Counters()
        self.recompute = RecomputePlans(model, all_blocks)  # gradient checkpointing: plans kept for the recompute
        self.local = _Local()
        self.timestep_arg = _timestep_index(model)
        self.scheduled = config.is_scheduled
        self.needs_python = self.scheduled or config.caches_plans  # what a static graph cannot hold
        # whether any block call may plan (ToDo, a ratio above 0 or a schedule): then the token grid must be known
        self.plans = self.settings.merges_something and (self.settings.todo or self.scheduled or config.ratio > 0)
        # the blocks that can merge (all of them unless the model's structure says each one's level)
        levels = block_levels(model, all_blocks) if self.settings.merges_something else None
        limit = self.settings.auto_finest if self.settings.auto_level else self.settings.max_downsample
        self.hooked = [(index, name, block) for index, ((name, block), level) in
                       enumerate(zip(all_blocks, levels or [None] * len(all_blocks)))
                       if level is None or limit is None or level <= limit]
        # the finest level of the model's structure (None when unknown): names the level to use when max_downsample
        # is below every block, so that no block is hooked and no call sees a block's level
        self.structure_finest = min(levels) if levels else None
        self.num_blocks = len(all_blocks)
        self.runtime_finest = self.settings.auto_level and self.settings.auto_finest is None
        self._grids: Dict[str, Any] = {}
        self._decisions: Dict[str, BlockDecision] = {}
        self.installed = False

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["local"] = None  # (a thread-local: calls in flight belong to this process)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.local = _Local()

    @property
    def blocks(self) -> List[Tuple[str, paddle.nn.Layer]]:
        """The blocks this patch hooked, as ``(name, block)``."""
        return [(name, block) for _, name, block in self.hooked] if self.installed else []

    @property
    def merged_blocks(self) -> int:
        """Blocks that merged in this thread's latest call that returned."""
        return self.local.last.merged_blocks if self.local.last is not None else 0

    @property
    def finest_level(self) -> Optional[int]:
        """The finest level a transformer block ran at in this thread's latest call that returned."""
        return self.local.last.finest_level if self.local.last is not None else None

    @property
    def state(self) -> Counters:
        """The counters of ``tome_stats`` (an alias kept for code written against 0.11)."""
        return self.counters

    # lifecycle ------------------------------------------------------------------------------------------------------
    @classmethod
    def install(cls, model: paddle.nn.Layer, config: ToMeConfig, train_timesteps: int = 1000) -> "ModelPatch":
        """Patch ``model`` with ``config``, replacing this package's earlier patch on it. Raises ``RuntimeError``
        (and changes nothing) while a forward of the model is running."""
        blocks = find_blocks(model)
        if not blocks:
            raise ValueError(f"{type(model).__name__} has no transformer blocks (BasicTransformerBlock, "
                             "JointTransformerBlock) to patch")
        with LOCK:
            refuse_if_running(model, type(model).__name__, "ToMe")
            patch = cls(model, config, train_timesteps, blocks)
            patch._check_blocks(blocks)  # (before anything changes)
            previous = get_patch(model)
            if previous is not None:
                previous.remove()
            try:
                patch._add_hooks()
            except BaseException:
                patch._remove_hooks()
                raise
            if not patch.settings.merges_something:
                warnings.warn(
                    f"ToMe will change nothing in {type(model).__name__}: merge_attn, merge_crossattn and merge_mlp are "
                    "all False, so no sub-layer runs on merged tokens (and no merge is planned). Enable one of them "
                    "(merge_attn=True is the paper's setting) or remove ToMe.",
                    UserWarning,
                    stacklevel=3,
                )
        return patch

    def _sublayers(self, block: paddle.nn.Layer) -> List[Tuple[str, bool]]:
        """The sub-layers of ``block`` that get a hook, as ``(name, self-attention)``."""
        config = self.config
        for block_type, sublayers in SUBLAYERS.items():
            if isinstance(block, block_type):
                if self.settings.todo:  # ToDo changes the keys and values of self-attention only
                    return [(name, True) for name, _, self_attention in sublayers if self_attention]
                return [(name, self_attention) for name, option, self_attention in sublayers if getattr(config, option)]
        return []

    def _check_blocks(self, blocks: List[Tuple[str, paddle.nn.Layer]]) -> None:
        """Refuse, naming the option, what a block type cannot do (before anything is installed)."""
        if not any(isinstance(block, JointTransformerBlock) for _, block in blocks):
            return
        name = type(self.model).__name__
        if self.config.merge_crossattn:
            raise ValueError(f"merge_crossattn=True has no meaning on {name}: its joint attention runs the image and "
                             "text tokens in one sequence (merge_attn merges the image tokens before it); there is no "
                             "cross-attention to merge before. Leave merge_crossattn=False")
        if self.settings.todo:  # ToDo runs the joint attention with the core of the layer's processor
            unknown = {f"{where}.attn": type(block.attn.processor).__name__ for where, block in blocks
                       if isinstance(block, JointTransformerBlock) and attention_core(block.attn.processor) is None}
            if unknown:
                raise ValueError(f"method='todo' on {name} computes the joint attention with the attention core of "
                                 "ppdiffusers' JointAttnProcessor2_5 or of JointMathAttnProcessor (use_math_attention); "
                                 f"these layers have other processors: {unknown}")

    def _add_hooks(self) -> None:
        calls = model_calls(self.model, create=True)
        if self.config.caches_plans:
            calls.use_clock(NAME)
        add_hook(self.model, NAME, ModelHook(self), outer=False)
        self.installed = True
        for index, _, block in self.hooked:
            hook = BlockHook(self, index)
            # inside any other technique's hook on the block: a transformer's step cache skips its middle blocks on
            # cached steps, and a block that does not run must not plan a merge (whichever was applied first)
            add_hook(block, NAME, hook, outer=False)
            for name, self_attention in self._sublayers(block):
                sublayer = getattr(block, name, None)
                if isinstance(sublayer, paddle.nn.Layer):
                    joint = isinstance(block, JointTransformerBlock)
                    add_hook(sublayer, NAME, SublayerHook(hook, self_attention, joint=joint and name == "attn"))

    def _remove_hooks(self) -> None:
        for _, _, block in self.hooked:
            for name in ("attn1", "attn2", "attn", "ff"):
                sublayer = getattr(block, name, None)
                registry = hooks_of(sublayer)
                hook = registry.get(NAME) if registry is not None else None
                if hook is not None and getattr(hook, "block", None) is not None and hook.block.patch is self:
                    remove_hook(sublayer, NAME)
            registry = hooks_of(block)
            if registry is not None and getattr(registry.get(NAME), "patch", None) is self:
                remove_hook(block, NAME)
        if get_patch(self.model) is self:
            remove_hook(self.model, NAME)
            calls = model_calls(self.model)
            if calls is not None:
                calls.drop_clock(NAME)
            drop_calls_if_alone(self.model)
        self.installed = False

    def check_idle(self) -> None:
        """Raise ``RuntimeError`` if a forward of this model is running (in this thread or another), or if plans
        kept for a gradient-checkpointing backward are still alive."""
        refuse_if_running(self.model, type(self.model).__name__, "ToMe")
        if len(self.recompute):
            raise RuntimeError(
                f"cannot change ToMe on {type(self.model).__name__} while {len(self.recompute)} checkpointed block "
                "call(s) wait for their backward: the backward recomputes those blocks with the plans they merged "
                "with. Run the backward first (or drop its outputs), or run such forwards under paddle.no_grad()"
            )

    def calls_in_flight(self) -> int:
        """Forward calls of this model running right now, in every thread."""
        calls = model_calls(self.model)
        return 0 if calls is None else calls.in_flight_here() + calls.in_flight_elsewhere()

    def remove(self, force: bool = False) -> None:
        """Take every hook off; the model is then exactly as before ``install``. Raises ``RuntimeError`` (and
        changes nothing) while a forward of the model is running, unless ``force`` (used to roll back an
        ``apply_tome`` that failed half-way). Removing a patch that is already removed does nothing."""
        with LOCK:
            if not self.installed:
                return
            if not force:
                self.check_idle()
            self._remove_hooks()

    def reset(self) -> None:
        """Forget what earlier calls left: counters, cached plans (this thread's; every thread's generation)."""
        self.counters.reset()
        if self.planner.cache is not None:
            self.planner.cache.clear()
        calls = model_calls(self.model)
        if calls is not None:
            calls.reset_clock()

    # one call ------------------------------------------------------------------------------------------------------
    def begin_call(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> CallRecord:
        """The record of a call that starts now (the model hook). Refuses a static-graph conversion of options that
        need Python at run time, and re-entrant recompute, before anything is recorded."""
        if self.needs_python and converting():
            refuse_conversion(self.scheduled)
        if self.recompute.possible:
            self.recompute.check_call()
        sample = args[0] if args else kwargs.get("sample", kwargs.get("hidden_states"))
        index = self.timestep_arg
        timestep = args[index] if len(args) > index else kwargs.get("timestep")
        shape = getattr(sample, "shape", None)
        latent_hw = (int(shape[-2]), int(shape[-1])) if shape is not None and len(shape) == 4 else None
        if latent_hw is not None and (latent_hw[0] < 0 or latent_hw[1] < 0) and self.plans:  # (-1: tracing)
            refuse_dynamic_size(type(self.model).__name__, "ToDo" if self.settings.todo else "ToMe", shape)
        ratio = self.config.ratio
        if self.scheduled and self.settings.merges_something and not self.settings.todo:
            progress = progress_of(timestep, self.train_timesteps, self.counters)
            ratio = check_ratio(ratio_at(ratio, progress), self.config.sx, self.config.sy, f"(progress={progress:.3f})")
        counters = self.counters
        counters.calls += 1
        record = CallRecord(latent_hw, timestep, counters.calls, device_kind(sample), ratio)
        if self.planner.caches:
            step, site, fresh = model_calls(self.model).position
            record.step, record.site = step, site
            if fresh:
                self.planner.cache.clear()
        return record

    @contextlib.contextmanager
    def in_call(self, sample: Any, timestep: Any = None) -> Iterator[CallRecord]:
        """Inside the ``with`` block, this thread is in a call of the model with ``sample`` (``[B, C, H, W]``: the
        latent size) and ``timestep``, as the model hook makes one: for running a block on its own, in tests and
        tools. Yields the call's record.

        >>> from ppdiffusers_tome.testing import tiny_unet
        >>> patch = ModelPatch.install(tiny_unet(), ToMeConfig())
        >>> with patch.in_call(paddle.zeros([2, 4, 16, 16])) as call:
        ...     call.latent_hw
        (16, 16)
        >>> patch.remove()
        """
        record = self.begin_call((sample,), {"timestep": timestep})  # (timestep by name: its position differs by model)
        outer, self.local.call = self.local.call, record
        try:
            yield record
        finally:
            self.local.call = outer

    def end_call(self, record: CallRecord) -> None:
        """A call has returned: warn (once) when it merged nothing although the settings ask for merging."""
        self.local.last = record
        if tracing():  # (a traced call's record describes the program being built, not a call that ran)
            return
        if not record.merged_blocks and not self.counters.warned_no_merge:
            self._warn_if_nothing_merged(record)

    def abandon_call(self, record: CallRecord) -> None:
        """A call did not finish (an error, Ctrl-C): forget the plans it kept for later steps, as its step is
        taken back (the model's step clock does that)."""
        if self.planner.caches:
            self.planner.cache.forget(record.step, record.site)

    def plan_block(self, index: int, hidden: Any, call: CallRecord) -> Any:
        """The plan of block ``index`` for its input ``hidden`` in ``call`` (None when it does not merge)."""
        if call.latent_hw is None or not isinstance(hidden, TENSOR_TYPES) or hidden.ndim != 3:
            return None
        batch, tokens = hidden.shape[0], hidden.shape[1]
        batch = -1 if batch is None or batch < 0 else batch
        grids, where = self._grids, f"{call.latent_hw}/{tokens}"
        if where in grids:
            grid = grids[where]
        else:
            if tokens < 0 and self.plans:  # (a dynamic token count while tracing: no grid is known)
                refuse_dynamic_tokens(type(self.model).__name__, "ToDo" if self.settings.todo else "ToMe", hidden.shape)
            grid = grids[where] = grid_of(self.settings, call.latent_hw, tokens)
        if grid is not None and (call.finest_level is None or grid[0] < call.finest_level):
            call.finest_level = grid[0]
        finest = call.finest_level if self.runtime_finest else None
        key = f"{where}/{batch}/{call.kernels}/{call.ratio}/{finest}"
        decisions = self._decisions
        if key in decisions:
            decision = decisions[key]
        else:
            if len(decisions) >= MAX_DECISIONS:  # a ratio schedule over continuous timesteps: a new key per call
                decisions.clear()
            decision = decisions[key] = decide(self.settings, tokens, batch, grid, finest, call.kernels, call.ratio)
        action = decision.action
        if action == OFF:
            call.decisions[tokens] = decision
            return None
        counters = self.counters
        if decision.policy is not None:
            counters.decisions[tokens] = decision.policy
        if action == SKIPPED:
            counters.blocks_skipped += 1
            if decision.policy is not None:
                self.settings.policy.log_first_skip(decision.policy, type(self.model).__name__)
            return None
        if action == POOLED:
            counters.blocks_pooled += 1
        plan = self.planner.plan(decision, index, hidden, call, counters)
        if plan is None:
            return None
        if not plan.is_identity:
            call.merged_blocks += 1
        if self.recompute.possible and not hidden.stop_gradient:  # (only a graph for a backward can recompute)
            self.recompute.keep(index, hidden, plan)
        return plan

    def _warn_if_nothing_merged(self, record: CallRecord) -> None:
        """Warn once when a completed call merged nothing although the settings ask for merging, naming why (from
        the decisions of its blocks)."""
        settings, model = self.settings, type(self.model).__name__
        if not settings.merges_something or (not self.scheduled and self.config.ratio == 0):
            return
        name = "ToDo" if settings.todo else "ToMe"
        finest_level = record.finest_level
        if not self.hooked:  # every block is above max_downsample, by the model's structure: none was hooked
            if self.structure_finest is None or settings.auto_level:
                return
            finest_level = self.structure_finest
            message = self._level_advice(name, model, finest_level)
        elif finest_level is None:
            message = (
                f"{name} changed nothing in {model}: no transformer block's tokens form the "
                f"{'patch' if settings.patch_size else 'latent'} grid of the input (a layout this package does "
                "not know, such as video frames folded into the tokens)."
            )
        else:
            finest = [d for tokens, d in sorted(record.decisions.items(), key=lambda item: -item[0])
                      if d.level == record.finest_level]
            decision = finest[0] if finest else None
            if decision is None or decision.action != OFF:
                return
            if decision.reason == "no_cell" and self.config.match_window is None:
                message = (
                    f"ToMe merged no tokens in {model}: its {decision.grid_h}x{decision.grid_w} token grid holds no "
                    f"sy x sx = {self.config.sy}x{self.config.sx} cell, so there is no dst token to merge into "
                    "(nothing was planned). Use smaller sx and sy (2 is the paper's setting) for latents this small."
                )
            elif decision.reason == "rounds" and not self.scheduled:
                tokens, window = decision.tokens, self.config.match_window is not None
                where = f"each {tokens}-token match_window" if window else f"{tokens} tokens"
                message = (
                    f"ToMe merged no tokens in {model}: ratio={record.ratio:g} rounds to int({tokens} * "
                    f"{record.ratio:g}) = 0 tokens merged in {where}. Use ratio >= {1 / tokens:.3g}"
                    + (" or a larger match_window." if window else ".")
                )
            elif decision.reason == "level" and not settings.auto_level:
                message = self._level_advice(name, model, finest_level)
            else:
                return
        self.counters.warned_no_merge = True
        warnings.warn(message, UserWarning, stacklevel=4)

    def _level_advice(self, name: str, model: str, finest_level: int) -> str:
        return (
            f"{name} merged no tokens in {model}: its highest-resolution transformer blocks run at "
            f"{finest_level}x downsampling, above max_downsample={self.config.max_downsample}. Use "
            f"max_downsample={finest_level} (or 'auto') to merge there."
        )

    def plan_in_flight(self, block_index: int) -> Any:
        """The plan block ``block_index`` uses in the call in flight in this thread (None when it does not merge):
        for inspection, e.g. from a forward pre-hook on the block's ``attn1``."""
        for index, _, block in self.hooked:
            if index == block_index:
                return hooks_of(block).get(NAME).slot.plan
        return None
