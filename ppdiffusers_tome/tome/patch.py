"""ToMe (or ToDo) on one model (a UNet, one ControlNet, one DiT / PixArt-alpha / SD3 transformer): installing its
hooks and removing them. What the hooks do in each call is :class:`~ppdiffusers_tome.tome.runner.CallRunner`'s.

One :class:`ModelPatch` per patched model adds, through :mod:`ppdiffusers_tome.core.registry` (all named ``"tome"``):

* a :class:`~ppdiffusers_tome.tome.hooks.ModelHook` on the model (inside the model's :class:`~.calls.ModelCalls`);
* a :class:`~ppdiffusers_tome.tome.hooks.BlockHook` on every ``BasicTransformerBlock`` that can merge: with a model whose
  structure says each block's level (a UNet, a ControlNet), only the blocks at a level that merges are hooked;
* a :class:`~ppdiffusers_tome.tome.hooks.SublayerHook` on ``attn1`` (and ``attn2`` / ``ff`` when enabled) of those blocks.

:meth:`ModelPatch.remove` takes exactly those off; the last hook of a layer gives it back its class.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Iterator, List, Optional, Tuple

import paddle
from ppdiffusers.models.attention import BasicTransformerBlock, JointTransformerBlock

from ..core.calls import drop_calls_if_alone, model_calls, refuse_if_running
from ..core.registry import LOCK, add_hook, hooks_of, remove_hook
from .config import ToMeConfig
from .decision import Settings, block_levels
from .hooks import BlockHook, ModelHook, SublayerHook
from .joint_attention import attention_core
from .planner import Planner
from .runner import CallRunner
from .state import CallRecord, ToMeState, ToMeStaticGraphError
from .todo import ToDoConfig, technique_config

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


class ModelPatch:
    """ToMe installed on one model, or ToDo (with a :class:`~ppdiffusers_tome.tome.todo.ToDoConfig`, or 0.14's
    ``ToMeConfig(method="todo")``: ``config`` is what was given, ``runner.config`` what runs). Create with
    :meth:`install`, undo with :meth:`remove`.

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

    def __init__(self, model: paddle.nn.Layer, config: Any, train_timesteps: int = 1000,
                 blocks: Optional[List[Tuple[str, paddle.nn.Layer]]] = None):
        self.model = model
        self.config = config  # as given (what tome_config reports)
        technique = technique_config(config)  # what runs: a ToMeConfig, or ToDo's ToDoConfig
        all_blocks = find_blocks(model) if blocks is None else blocks
        settings = Settings(technique, model, all_blocks)
        # the blocks that can merge (all of them unless the model's structure says each one's level)
        levels = block_levels(model, all_blocks) if settings.merges_something else None
        limit = settings.auto_finest if settings.auto_level else settings.max_downsample
        self.hooked = [(index, name, block) for index, ((name, block), level) in
                       enumerate(zip(all_blocks, levels or [None] * len(all_blocks)))
                       if level is None or limit is None or level <= limit]
        # structure_finest, the finest level of the model's structure (None when unknown): names the level to use
        # when max_downsample is below every block, so that no block is hooked and no call sees a block's level
        self.runner = CallRunner(model, technique, all_blocks, train_timesteps, self.planner_type,
                                 hooked_blocks=len(self.hooked), structure_finest=min(levels) if levels else None,
                                 settings=settings)
        self.num_blocks = len(all_blocks)
        self.installed = False

    # what the runner holds, under the names of 0.14 (tools and tests read them)
    settings = property(lambda self: self.runner.settings)
    planner = property(lambda self: self.runner.planner)
    counters = property(lambda self: self.runner.counters)
    recompute = property(lambda self: self.runner.recompute)
    local = property(lambda self: self.runner.local)
    train_timesteps = property(lambda self: self.runner.train_timesteps)
    state = property(lambda self: self.runner.counters, doc="The counters of ``tome_stats`` (0.11's name).")

    def in_call(self, sample: Any, timestep: Any = None) -> Iterator[CallRecord]:
        """:meth:`CallRunner.in_call <ppdiffusers_tome.tome.runner.CallRunner.in_call>`: this thread in a call of the
        model, for running a block on its own.

        >>> from ppdiffusers_tome.testing import tiny_unet
        >>> patch = ModelPatch.install(tiny_unet(), ToMeConfig())
        >>> with patch.in_call(paddle.ones([2, 4, 16, 16])) as call:
        ...     call.latent_hw
        (16, 16)
        >>> patch.remove()
        """
        return self.runner.in_call(sample, timestep)

    @property
    def blocks(self) -> List[Tuple[str, paddle.nn.Layer]]:
        """The blocks this patch hooked, as ``(name, block)``."""
        return [(name, block) for _, name, block in self.hooked] if self.installed else []

    @property
    def merged_blocks(self) -> int:
        """Blocks that merged in this thread's latest call that returned."""
        last = self.runner.local.last
        return last.merged_blocks if last is not None else 0

    @property
    def finest_level(self) -> Optional[int]:
        """The finest level a transformer block ran at in this thread's latest call that returned."""
        last = self.runner.local.last
        return last.finest_level if last is not None else None

    # lifecycle ------------------------------------------------------------------------------------------------------
    @classmethod
    def install(cls, model: paddle.nn.Layer, config: Any, train_timesteps: int = 1000) -> "ModelPatch":
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
        config = self.runner.config
        for block_type, sublayers in SUBLAYERS.items():
            if isinstance(block, block_type):
                if isinstance(config, ToDoConfig):  # ToDo changes the keys and values of self-attention only
                    return [(name, True) for name, _, self_attention in sublayers if self_attention]
                return [(name, self_attention) for name, option, self_attention in sublayers if getattr(config, option)]
        return []

    def _check_blocks(self, blocks: List[Tuple[str, paddle.nn.Layer]]) -> None:
        """Refuse, naming the option, what a block type cannot do (before anything is installed)."""
        if not any(isinstance(block, JointTransformerBlock) for _, block in blocks):
            return
        name, config = type(self.model).__name__, self.runner.config
        if isinstance(config, ToMeConfig) and config.merge_crossattn:
            raise ValueError(f"merge_crossattn=True has no meaning on {name}: its joint attention runs the image and "
                             "text tokens in one sequence (merge_attn merges the image tokens before it); there is no "
                             "cross-attention to merge before. Leave merge_crossattn=False")
        if isinstance(config, ToDoConfig):  # ToDo runs the joint attention with the core of the layer's processor
            unknown = {f"{where}.attn": type(block.attn.processor).__name__ for where, block in blocks
                       if isinstance(block, JointTransformerBlock) and attention_core(block.attn.processor) is None}
            if unknown:
                raise ValueError(f"method='todo' on {name} computes the joint attention with the attention core of "
                                 "ppdiffusers' JointAttnProcessor2_5 or of JointMathAttnProcessor (use_math_attention); "
                                 f"these layers have other processors: {unknown}")

    def _add_hooks(self) -> None:
        calls = model_calls(self.model, create=True)
        if self.runner.planner.caches:  # (recompute_every counts steps)
            calls.use_clock(NAME)
        add_hook(self.model, NAME, ModelHook(self, self.runner), outer=False)
        self.installed = True
        for index, _, block in self.hooked:
            hook = BlockHook(self, self.runner, index)
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
        self.runner.reset()

    def plan_in_flight(self, block_index: int) -> Any:
        """The plan block ``block_index`` uses in the call in flight in this thread (None when it does not merge):
        for inspection, e.g. from a forward pre-hook on the block's ``attn1``."""
        for index, _, block in self.hooked:
            if index == block_index:
                return hooks_of(block).get(NAME).slot.plan
        return None
