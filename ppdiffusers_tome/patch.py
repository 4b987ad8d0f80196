"""Model glue: attach ToMe to the transformer blocks of one model with forward hooks, and take it off again.

No block's ``forward`` is copied or replaced. One :class:`ModelPatch` per patched model (a UNet, one ControlNet)
registers:

* a pre-hook on the model that records the latent size and the timestep of the call (:class:`ToMeState`);
* a pre-hook on every ``BasicTransformerBlock`` that plans the merge from the block's input (the same metric as
  tomesd) when the block's level qualifies;
* a pre-hook/post-hook pair on ``attn1`` (and ``attn2``/``ff`` when enabled) that merges the sub-layer's input and
  unmerges its output, so the block's residual add sees full-size tensors, exactly where tomesd puts them.

Removing the patch removes exactly those hooks and the one attribute it set, so the model's objects, parameters and
state dict are those of the untouched model.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import paddle
from ppdiffusers.models.attention import BasicTransformerBlock

from .config import ToMeConfig
from .merge import MergePlan, bipartite_soft_matching_random2d, find_downsample

logger = logging.getLogger(__name__)

PATCH_ATTR = "_ppdiffusers_tome_patch"
BLOCK_TYPES: Tuple[type, ...] = (BasicTransformerBlock,)

__all__ = ["ModelPatch", "ToMeState", "PATCH_ATTR", "find_blocks", "get_patch", "remove_builtin_tome"]


def find_blocks(model: paddle.nn.Layer) -> List[Tuple[str, paddle.nn.Layer]]:
    """The transformer blocks ToMe can patch inside ``model``, as ``(name, block)`` in definition order."""
    return [(name, layer) for name, layer in model.named_sublayers(include_self=True) if isinstance(layer, BLOCK_TYPES)]


def get_patch(model: Any) -> Optional["ModelPatch"]:
    """The :class:`ModelPatch` installed on ``model`` by this package, or ``None``."""
    return getattr(model, "__dict__", {}).get(PATCH_ATTR)


def remove_builtin_tome(model: paddle.nn.Layer) -> bool:
    """Undo ppdiffusers' built-in ToMe port on ``model`` (class swap, size hook, ``_tome_info``), if present.

    Returns whether anything was removed. The built-in ``remove_tome`` leaves its ``_tome_info`` attributes behind;
    this removes them too.
    """
    found = False
    for _, layer in model.named_sublayers(include_self=True):
        info = layer.__dict__.get("_tome_info")
        if isinstance(info, dict):
            for handle in info.get("hooks", []):
                handle.remove()
            info.get("hooks", []).clear()
            del layer.__dict__["_tome_info"]
            found = True
        parent = type(layer).__dict__.get("_parent")
        if type(layer).__name__.startswith("ToMe") and isinstance(parent, type):
            layer.__class__ = parent
            found = True
    return found


def _timestep_bits(timestep: Any) -> Optional[Tuple[int, ...]]:
    """A hashable, exact key for the timestep(s) of a call, or None when there is none."""
    if timestep is None:
        return None
    if isinstance(timestep, paddle.Tensor):
        values = timestep.detach().astype("float64").numpy()
    else:
        try:
            values = np.asarray(timestep, dtype=np.float64)
        except (TypeError, ValueError):
            return None
    values = np.unique(values.reshape(-1))
    return tuple(int(v) for v in values.view(np.uint64))


class ToMeState:
    """Runtime state of one patched model: what the current forward call looks like, and a few counters.

    The random partition of a block is drawn from a generator keyed by ``(seed, block, grid, timestep)``, so it
    does not depend on how many calls came before, does not touch Paddle's RNG (on CPU or GPU), and is the same
    for the prompted and unprompted halves of classifier-free guidance even when they arrive in separate calls.
    """

    def __init__(self, config: ToMeConfig):
        self.config = config
        self.reset()

    def reset(self) -> None:
        """Forget everything about earlier calls (the counters too)."""
        self.latent_hw: Optional[Tuple[int, int]] = None
        self.timestep_key: Optional[Tuple[int, ...]] = None
        self.calls = 0
        self.merges = 0  # sub-layer calls that ran on merged tokens, all calls together
        self.merged_blocks = 0  # blocks that merged during the current call
        self.finest_level: Optional[int] = None  # smallest downsampling seen at a transformer block this call
        self.warned_no_merge = False

    def begin_call(self, sample: Any, timestep: Any) -> None:
        self.calls += 1
        self.merged_blocks = 0
        self.finest_level = None
        shape = getattr(sample, "shape", None)
        self.latent_hw = (int(shape[-2]), int(shape[-1])) if shape is not None and len(shape) == 4 else None
        self.timestep_key = _timestep_bits(timestep)

    def generator_for(self, block_index: int, grid_h: int, grid_w: int) -> np.random.Generator:
        if self.timestep_key is not None:
            key = [self.config.seed, block_index, grid_h, grid_w, 1, *self.timestep_key]
        else:  # no timestep given: fall back to the call count
            key = [self.config.seed, block_index, grid_h, grid_w, 0, self.calls]
        return np.random.default_rng(key)


class _BlockHooks:
    """Per-block plan plus the merge/unmerge hooks of its sub-layers."""

    def __init__(self, patch: "ModelPatch", index: int, block: paddle.nn.Layer):
        self.patch = patch
        self.index = index
        self.block = block
        self.plan: Optional[MergePlan] = None
        self.active: Dict[str, Optional[MergePlan]] = {}

    # block hooks -----------------------------------------------------------------------------------------------
    def before_block(self, layer, args, kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        self.plan = self.patch.plan_for(self.index, hidden)
        return None

    def after_block(self, layer, args, kwargs, output):
        self.plan = None
        for key in self.active:
            self.active[key] = None
        return None

    # sub-layer hooks -------------------------------------------------------------------------------------------
    def make_sublayer_hooks(self, name: str, self_attention: bool):
        self.active[name] = None

        def before(layer, args, kwargs):
            self.active[name] = None
            plan = self.plan
            if plan is None or plan.is_identity:
                return None
            if self_attention and kwargs.get("attention_mask") is not None:
                return None  # a mask over N keys cannot follow merged keys
            from_kwargs = not args
            x = kwargs.get("hidden_states") if from_kwargs else args[0]
            if not isinstance(x, paddle.Tensor) or x.ndim != 3:
                return None
            if x.shape[0] != plan.batch_size or x.shape[1] != plan.num_tokens:
                return None  # e.g. chunked feed-forward: leave such calls alone
            merged = plan.merge(x)
            self.active[name] = plan
            self.patch.state.merges += 1
            if from_kwargs:
                kwargs = dict(kwargs, hidden_states=merged)
                return args, kwargs
            return (merged,) + tuple(args[1:]), kwargs

        def after(layer, args, kwargs, output):
            plan = self.active.get(name)
            if plan is None:
                return None
            self.active[name] = None
            if isinstance(output, (tuple, list)):
                return type(output)([plan.unmerge(output[0]), *output[1:]])
            return plan.unmerge(output)

        return before, after


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

    def __init__(self, model: paddle.nn.Layer, config: ToMeConfig):
        self.model = model
        self.config = config
        self.state = ToMeState(config)
        self.blocks: List[_BlockHooks] = []
        self._handles: List[Any] = []

    @classmethod
    def install(cls, model: paddle.nn.Layer, config: ToMeConfig) -> "ModelPatch":
        blocks = find_blocks(model)
        if not blocks:
            raise ValueError(f"{type(model).__name__} has no transformer blocks (BasicTransformerBlock) to patch")
        patch = cls(model, config)
        try:
            patch._register(blocks)
        except BaseException:
            patch._remove_handles()
            raise
        model.__dict__[PATCH_ATTR] = patch
        return patch

    def _register(self, blocks) -> None:
        hook = self._handles.append
        hook(self.model.register_forward_pre_hook(self._before_model, with_kwargs=True))
        hook(self.model.register_forward_post_hook(self._after_model, with_kwargs=True, always_call=True))
        selected = [
            ("attn1", self.config.merge_attn, True),
            ("attn2", self.config.merge_crossattn, False),
            ("ff", self.config.merge_mlp, False),
        ]
        for index, (_, block) in enumerate(blocks):
            hooks = _BlockHooks(self, index, block)
            self.blocks.append(hooks)
            hook(block.register_forward_pre_hook(hooks.before_block, with_kwargs=True))
            hook(block.register_forward_post_hook(hooks.after_block, with_kwargs=True, always_call=True))
            for name, enabled, self_attention in selected:
                sublayer = getattr(block, name, None)
                if not enabled or not isinstance(sublayer, paddle.nn.Layer):
                    continue
                before, after = hooks.make_sublayer_hooks(name, self_attention)
                hook(sublayer.register_forward_pre_hook(before, with_kwargs=True))
                hook(sublayer.register_forward_post_hook(after, with_kwargs=True, always_call=True))

    def _remove_handles(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    def remove(self) -> None:
        """Take every hook off and drop the patch attribute; the model is then exactly as before ``install``."""
        self._remove_handles()
        for hooks in self.blocks:
            hooks.plan = None
        self.blocks = []
        if self.model.__dict__.get(PATCH_ATTR) is self:
            del self.model.__dict__[PATCH_ATTR]

    # hooks ---------------------------------------------------------------------------------------------------
    def _before_model(self, layer, args, kwargs):
        sample = args[0] if args else kwargs.get("sample", kwargs.get("hidden_states"))
        timestep = args[1] if len(args) > 1 else kwargs.get("timestep")
        self.state.begin_call(sample, timestep)
        return None

    def _after_model(self, layer, args, kwargs, output):
        state, config = self.state, self.config
        if state.merged_blocks == 0 and config.ratio > 0 and not state.warned_no_merge:
            level = state.finest_level
            if level is not None and level > config.max_downsample:
                state.warned_no_merge = True
                message = (
                    f"ToMe merged no tokens in {type(self.model).__name__}: its highest-resolution transformer "
                    f"blocks run at {level}x downsampling, above max_downsample={config.max_downsample}. "
                    f"Use max_downsample={level} to merge there."
                )
                logger.warning(message)
                warnings.warn(message, UserWarning, stacklevel=2)
        return None

    def plan_for(self, block_index: int, hidden: Any) -> Optional[MergePlan]:
        """The merge plan of one block call, or None when this block does not merge in this call."""
        state, config = self.state, self.config
        if state.latent_hw is None or not isinstance(hidden, paddle.Tensor) or hidden.ndim != 3:
            return None
        num_tokens = hidden.shape[1]
        latent_h, latent_w = state.latent_hw
        level = find_downsample(latent_h, latent_w, num_tokens)
        if level is None:
            return None
        if state.finest_level is None or level < state.finest_level:
            state.finest_level = level
        if level > config.max_downsample:
            return None
        r = config.tokens_to_merge(num_tokens)
        if r <= 0:
            return None
        grid_h, grid_w = math.ceil(latent_h / level), math.ceil(latent_w / level)
        generator = state.generator_for(block_index, grid_h, grid_w) if config.use_rand else None
        plan = bipartite_soft_matching_random2d(
            hidden, grid_w, grid_h, config.sx, config.sy, r, no_rand=not config.use_rand, generator=generator
        )
        if not plan.is_identity:
            state.merged_blocks += 1
        return plan
