"""Model glue: attach ToMe to the transformer blocks of one model with forward hooks, and take it off again.

No block's ``forward`` is copied or replaced. One :class:`ModelPatch` per patched model (a UNet, one ControlNet)
registers (see :mod:`ppdiffusers_tome.hooks`):

* a pre-hook on the model that starts the record of the call (latent size, timestep) in :class:`ToMeState`;
* a pre-hook on every ``BasicTransformerBlock`` that asks the patch's :class:`~ppdiffusers_tome.planner.Planner`
  for the block's plan, made from the block's input (the same metric as tomesd);
* a pre-hook/post-hook pair on ``attn1`` (and ``attn2``/``ff`` when enabled) that merges the sub-layer's input and
  unmerges its output, so the block's residual add sees full-size tensors, exactly where tomesd puts them.
  With ``method="todo"`` only ``attn1`` gets a pre-hook, which passes the downsampled tokens as its keys/values.

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
import threading
import warnings
from typing import Any, List, Optional, Tuple

import paddle
from ppdiffusers.models.attention import BasicTransformerBlock

from .checkpoint import RecomputePlans
from .config import ToMeConfig
from .hooks import BlockHooks, HookCall, HookRecord, SublayerHooks
from .planner import Planner
from .state import ToMeState, ToMeStaticGraphError

logger = logging.getLogger(__name__)

BLOCK_TYPES: Tuple[type, ...] = (BasicTransformerBlock,)
PATCH_LOCK = threading.RLock()  # held across every check, install and removal of a patch, on any model

__all__ = [
    "ModelPatch", "ToMeState", "ToMeStaticGraphError", "PATCH_LOCK", "find_blocks", "get_patch",
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

    planner_type = Planner  # what decides and builds each block's plan (a subclass may swap it)

    def __init__(self, model: paddle.nn.Layer, config: ToMeConfig, train_timesteps: int = 1000,
                 blocks: Optional[List[Tuple[str, paddle.nn.Layer]]] = None):
        self.model = model
        self.config = config
        self.train_timesteps = int(train_timesteps)
        if blocks is None:
            blocks = find_blocks(model)
        self.state = ToMeState(config, train_timesteps, num_blocks=len(blocks))
        self.planner = self.planner_type(config, self.state, model, blocks)
        self.blocks: List[BlockHooks] = []
        self._hooks: List[HookRecord] = []
        self.installed = False  # True from install to remove
        self.recompute = RecomputePlans(model, blocks)  # gradient checkpointing: plans kept for the recomputation
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
            patch = cls(model, config, train_timesteps, blocks)
            try:
                patch._register(blocks)
            except BaseException:
                patch._remove_hooks()
                raise
            patch.installed = True
            if not patch.planner.merges_something:
                warnings.warn(
                    f"ToMe will change nothing in {type(model).__name__}: merge_attn, merge_crossattn and merge_mlp are "
                    "all False, so no sub-layer runs on merged tokens (and no merge is planned). Enable one of them "
                    "(merge_attn=True is the paper's setting) or remove ToMe.",
                    UserWarning,
                    stacklevel=3,
                )
        return patch

    def _register(self, blocks) -> None:
        add = self._hooks.append
        add(HookRecord(self.model, "pre", self, "_before_model"))
        add(HookRecord(self.model, "post", self, "_after_model"))
        todo = self.planner.todo
        selected = [
            ("attn1", self.config.merge_attn or todo, True),
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
                    if not todo:  # ToDo leaves the output as it is
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
            if not self.installed:
                return
            if not force:
                self.check_idle()
            self._remove_hooks()
            self.state.forget_calls_in_flight()  # what is left belongs to calls that never reached their end
            self.blocks = []
            self.installed = False

    # hooks ---------------------------------------------------------------------------------------------------
    def _before_model(self, layer, args, kwargs):
        if self.recompute.possible:
            self.recompute.check_call()  # (before anything of the call is recorded)
        sample = args[0] if args else kwargs.get("sample", kwargs.get("hidden_states"))
        timestep = args[self.timestep_arg] if len(args) > self.timestep_arg else kwargs.get("timestep")
        self.state.begin_call(sample, timestep, layer)
        return None

    def _after_model(self, layer, args, kwargs, output):
        completed = output is not None  # None when the forward raised (Paddle runs this hook anyway)
        ended = self.state.end_call(completed)  # (this call's record: a nested call's caller may still be running)
        if completed and ended is not None:
            self._warn_if_nothing_merged(ended)
        return None

    def _warn_if_nothing_merged(self, ended: Any) -> None:
        """Warn once when a completed call merged nothing although the settings ask for merging, naming why."""
        state, config, planner = self.state, self.config, self.planner
        # (nothing to merge by configuration was said at apply; a ratio of 0 merges nothing on purpose)
        if not (self.blocks and planner.merges_something) or ended.merged_blocks or planner.fixed_ratio == 0:
            return
        if state.warned_no_merge:
            return
        level, name, model = ended.finest_level, "ToDo" if planner.todo else "ToMe", type(self.model).__name__
        message = None
        if level is None:
            message = (
                f"{name} changed nothing in {model}: no transformer block's tokens form the "
                f"{'patch' if planner.patch_size else 'latent'} grid of the input (a layout this package does "
                "not know, such as video frames folded into the tokens)."
            )
        elif planner.grid_without_cells is not None and (planner.auto_level or level <= config.max_downsample):
            grid_h, grid_w = planner.grid_without_cells
            message = (
                f"ToMe merged no tokens in {model}: its {grid_h}x{grid_w} token grid holds no "
                f"sy x sx = {config.sy}x{config.sx} cell, so there is no dst token to merge into (nothing was "
                "planned). Use smaller sx and sy (2 is the paper's setting) for latents this small."
            )
        elif planner.rounded_to_nothing is not None and planner.fixed_ratio is not None:
            tokens, ratio = planner.rounded_to_nothing
            where = f"each {tokens}-token match_window" if config.match_window is not None else f"{tokens} tokens"
            message = (
                f"ToMe merged no tokens in {model}: ratio={ratio:g} rounds to int({tokens} * {ratio:g}) = 0 tokens "
                f"merged in {where}. Use ratio >= {1 / tokens:.3g}"
                + (" or a larger match_window." if config.match_window is not None else ".")
            )
        elif not planner.auto_level and level > config.max_downsample:
            message = (
                f"{name} merged no tokens in {model}: its highest-resolution transformer "
                f"blocks run at {level}x downsampling, above max_downsample={config.max_downsample}. "
                f"Use max_downsample={level} (or 'auto') to merge there."
            )
        if message is not None:
            state.warned_no_merge = True
            warnings.warn(message, UserWarning, stacklevel=3)

    def plan_in_flight(self, block_index: int) -> Any:
        """The plan block ``block_index`` uses in the call in flight in this thread (None when it does not merge):
        for inspection, e.g. from a forward pre-hook on the block's ``attn1``."""
        return self.state.plan_of(block_index)
