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
import threading
import warnings
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import paddle
from ppdiffusers.models.attention import BasicTransformerBlock

from .config import ToMeConfig, tokens_to_merge
from .merge import MergePlan, bipartite_soft_matching_random2d, find_downsample

logger = logging.getLogger(__name__)

PATCH_ATTR = "_ppdiffusers_tome_patch"
BLOCK_TYPES: Tuple[type, ...] = (BasicTransformerBlock,)

__all__ = [
    "ModelPatch",
    "ToMeState",
    "ToMeStaticGraphError",
    "PATCH_ATTR",
    "find_blocks",
    "get_patch",
    "remove_builtin_tome",
]


def _tensor_types() -> Tuple[type, ...]:
    """Tensor classes of dynamic mode and of static-graph tracing (``paddle.jit.to_static``)."""
    types = [paddle.Tensor]
    for owner, name in ((getattr(paddle, "pir", None), "Value"), (paddle.static, "Variable")):
        cls = getattr(owner, name, None) if owner is not None else None
        if isinstance(cls, type):
            types.append(cls)
    return tuple(types)


TENSOR_TYPES = _tensor_types()


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


class ToMeStaticGraphError(RuntimeError):
    """Raised when a ToMe option cannot be converted to a static graph (``paddle.jit.to_static``)."""


def _tracing() -> bool:
    """Whether this code is being converted to a static graph rather than run eagerly."""
    if not paddle.in_dynamic_mode():
        return True
    try:
        from paddle.base.dygraph.base import in_sot_simulation_mode, in_to_static_mode
    except ImportError:  # pragma: no cover - older Paddle
        return False
    return bool(in_to_static_mode() or in_sot_simulation_mode())


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


def _take(table: Dict, key: Any) -> Any:
    """``table.pop(key, None)`` spelled so that Paddle's SOT tracer can follow it."""
    if key in table:
        return table.pop(key)
    return None


class _CallContext(threading.local):
    """What one forward call in one thread needs: a model called from two threads at once keeps two of these."""

    def __init__(self) -> None:
        self.latent_hw: Optional[Tuple[int, int]] = None
        self.timestep_key: Optional[Tuple[int, ...]] = None
        self.number = 0  # which call of the model this is (keys the partition when there is no timestep)
        self.merged_blocks = 0
        self.finest_level: Optional[int] = None
        self.plans: Dict[int, MergePlan] = {}
        self.active: Dict[str, MergePlan] = {}  # by "<block>/<sub-layer>" (SOT supports no tuple keys)


class ToMeState:
    """Runtime state of one patched model: what the current forward call looks like (per thread), and counters.

    The random partition of a block is drawn from a generator keyed by ``(seed, block, grid, timestep)``, so it
    does not depend on how many calls came before, does not touch Paddle's RNG (on CPU or GPU), and is the same
    for the prompted and unprompted halves of classifier-free guidance even when they arrive in separate calls.
    (A model called without a timestep falls back to keying by the number of the call.)
    """

    def __init__(self, config: ToMeConfig):
        self.config = config
        self.reset()

    def reset(self) -> None:
        """Forget everything about earlier calls (the counters too)."""
        self.call = _CallContext()
        self.calls = 0
        self.merges = 0  # sub-layer calls that ran on merged tokens, all calls together
        self.warned_no_merge = False

    def __deepcopy__(self, memo) -> "ToMeState":
        # a copied model starts with the same counters and no call in flight (thread-locals cannot be copied)
        twin = ToMeState(self.config)
        twin.calls, twin.merges, twin.warned_no_merge = self.calls, self.merges, self.warned_no_merge
        memo[id(self)] = twin
        return twin

    # the current call, as seen from this thread
    @property
    def latent_hw(self) -> Optional[Tuple[int, int]]:
        return self.call.latent_hw

    @property
    def merged_blocks(self) -> int:
        """Blocks that merged during the latest call in this thread."""
        return self.call.merged_blocks

    @property
    def finest_level(self) -> Optional[int]:
        """Smallest downsampling factor seen at a transformer block during the latest call in this thread."""
        return self.call.finest_level

    def begin_call(self, sample: Any, timestep: Any) -> None:
        self.calls += 1
        call = self.call
        call.number = self.calls
        call.merged_blocks = 0
        call.finest_level = None
        call.plans.clear()
        call.active.clear()
        shape = getattr(sample, "shape", None)
        call.latent_hw = (int(shape[-2]), int(shape[-1])) if shape is not None and len(shape) == 4 else None
        # the timestep is only needed to key the random partition (reading it would break static-graph tracing)
        if self.config.use_rand and _tracing():
            raise ToMeStaticGraphError(
                "ToMe with use_rand=True cannot be converted with paddle.jit.to_static: its random partition is "
                "drawn per timestep at run time and would be frozen into the program. Apply ToMe with "
                "use_rand=False before converting."
            )
        call.timestep_key = _timestep_bits(timestep) if self.config.use_rand else None

    def end_call(self) -> None:
        """Drop what only the call in flight may use (plans, size, timestep); the counters for reporting stay."""
        call = self.call
        call.plans.clear()
        call.active.clear()
        call.latent_hw = None
        call.timestep_key = None

    def generator_for(self, block_index: int, grid_h: int, grid_w: int) -> np.random.Generator:
        key_part = self.call.timestep_key
        if key_part is not None:
            key = [self.config.seed, block_index, grid_h, grid_w, 1, *key_part]
        else:  # no timestep given: fall back to the number of this call (then the history does matter)
            key = [self.config.seed, block_index, grid_h, grid_w, 0, self.call.number]
        return np.random.default_rng(key)


class _HookCall:
    """A hook as a plain callable object calling ``owner.<method>``. Unlike a bound method it survives Paddle's
    SOT tracer (which writes a bound method's repr into its guard code) and ``copy.deepcopy`` alike."""

    def __init__(self, owner: Any, method: str) -> None:
        self.owner = owner
        self.method = method

    def __call__(self, *args):
        return getattr(self.owner, self.method)(*args)


class _HookRecord:
    """One registered hook, removable from the layer's own hook tables (unlike Paddle's HookRemoveHelper, whose
    weak references would still point at the original model after ``copy.deepcopy``)."""

    _TABLES = {
        "pre": ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs_flag"),
        "post": ("_forward_post_hooks", "_forward_post_hooks_with_kwargs_flag", "_forward_post_hooks_always_called"),
    }

    def __init__(self, layer: paddle.nn.Layer, kind: str, owner: Any, method: str) -> None:
        self.layer = layer
        self.kind = kind
        hook = _HookCall(owner, method)
        if kind == "pre":
            handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
        else:
            handle = layer.register_forward_post_hook(hook, with_kwargs=True, always_call=True)
        self.hook_id = handle._hook_id

    def remove(self) -> None:
        for table in self._TABLES[self.kind]:
            getattr(self.layer, table, {}).pop(self.hook_id, None)


class _SublayerHooks:
    """Merge the input of one sub-layer (attn1, attn2 or ff) of one block and unmerge its output."""

    def __init__(self, block: "_BlockHooks", name: str, self_attention: bool):
        self.block = block
        self.name = name
        self.self_attention = self_attention
        self.key = f"{block.index}/{name}"

    def before(self, layer, args, kwargs):
        call = self.block.patch.state.call
        key = self.key
        _take(call.active, key)
        index = self.block.index
        plan = call.plans[index] if index in call.plans else None
        if plan is None or plan.is_identity:
            return None
        if self.self_attention and kwargs.get("attention_mask") is not None:
            return None  # a mask over N keys cannot follow merged keys
        from_kwargs = not args
        x = kwargs.get("hidden_states") if from_kwargs else args[0]
        if not isinstance(x, TENSOR_TYPES) or x.ndim != 3:
            return None
        if x.shape[0] != plan.batch_size or x.shape[1] != plan.num_tokens:
            return None  # e.g. chunked feed-forward: leave such calls alone
        merged = plan.merge(x)
        call.active[key] = plan
        self.block.patch.state.merges += 1
        if from_kwargs:
            return args, dict(kwargs, hidden_states=merged)
        return (merged,) + tuple(args[1:]), kwargs

    def after(self, layer, args, kwargs, output):
        plan = _take(self.block.patch.state.call.active, self.key)
        if plan is None or output is None:  # output is None when the sub-layer raised (hooks run anyway)
            return None
        if isinstance(output, (tuple, list)):
            return type(output)([plan.unmerge(output[0]), *output[1:]])
        return plan.unmerge(output)


class _BlockHooks:
    """Plans the merge of one transformer block from its input, for its sub-layer hooks to use."""

    def __init__(self, patch: "ModelPatch", index: int):
        self.patch = patch
        self.index = index

    @property
    def plan(self) -> Optional[MergePlan]:
        """The plan of the call in flight in this thread, if this block is merging."""
        plans = self.patch.state.call.plans
        return plans[self.index] if self.index in plans else None

    def before(self, layer, args, kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        plan = self.patch.plan_for(self.index, hidden)
        if plan is not None:
            self.patch.state.call.plans[self.index] = plan
        return None

    def after(self, layer, args, kwargs, output):
        call = self.patch.state.call
        _take(call.plans, self.index)
        prefix = f"{self.index}/"
        for key in [k for k in call.active if k.startswith(prefix)]:
            del call.active[key]
        return None


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
        self._hooks: List[_HookRecord] = []

    @classmethod
    def install(cls, model: paddle.nn.Layer, config: ToMeConfig) -> "ModelPatch":
        blocks = find_blocks(model)
        if not blocks:
            raise ValueError(f"{type(model).__name__} has no transformer blocks (BasicTransformerBlock) to patch")
        previous = get_patch(model)
        if previous is not None:  # never leave a patch's hooks behind unreachable
            previous.remove()
        patch = cls(model, config)
        try:
            patch._register(blocks)
        except BaseException:
            patch._remove_hooks()
            raise
        model.__dict__[PATCH_ATTR] = patch
        return patch

    def _register(self, blocks) -> None:
        add = self._hooks.append
        add(_HookRecord(self.model, "pre", self, "_before_model"))
        add(_HookRecord(self.model, "post", self, "_after_model"))
        selected = [
            ("attn1", self.config.merge_attn, True),
            ("attn2", self.config.merge_crossattn, False),
            ("ff", self.config.merge_mlp, False),
        ]
        for index, (_, block) in enumerate(blocks):
            hooks = _BlockHooks(self, index)
            self.blocks.append(hooks)
            add(_HookRecord(block, "pre", hooks, "before"))
            add(_HookRecord(block, "post", hooks, "after"))
            for name, enabled, self_attention in selected:
                sublayer = getattr(block, name, None)
                if enabled and isinstance(sublayer, paddle.nn.Layer):
                    sub = _SublayerHooks(hooks, name, self_attention)
                    add(_HookRecord(sublayer, "pre", sub, "before"))
                    add(_HookRecord(sublayer, "post", sub, "after"))

    def _remove_hooks(self) -> None:
        while self._hooks:
            self._hooks.pop().remove()

    def remove(self) -> None:
        """Take every hook off and drop the patch attribute; the model is then exactly as before ``install``."""
        self._remove_hooks()
        self.state.end_call()
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
        state.end_call()
        if state.merged_blocks == 0 and config.ratio > 0 and not state.warned_no_merge:
            level = state.finest_level
            if level is not None and level > config.max_downsample:
                state.warned_no_merge = True
                message = (
                    f"ToMe merged no tokens in {type(self.model).__name__}: its highest-resolution transformer "
                    f"blocks run at {level}x downsampling, above max_downsample={config.max_downsample}. "
                    f"Use max_downsample={level} to merge there."
                )
                warnings.warn(message, UserWarning, stacklevel=2)
        return None

    def plan_for(self, block_index: int, hidden: Any) -> Optional[MergePlan]:
        """The merge plan of one block call, or None when this block does not merge in this call."""
        state, config = self.state, self.config
        if state.latent_hw is None or not isinstance(hidden, TENSOR_TYPES) or hidden.ndim != 3:
            return None
        num_tokens = hidden.shape[1]
        latent_h, latent_w = state.latent_hw
        level = find_downsample(latent_h, latent_w, num_tokens)
        if level is None:
            return None
        if state.call.finest_level is None or level < state.call.finest_level:
            state.call.finest_level = level
        if level > config.max_downsample:
            return None
        r = tokens_to_merge(num_tokens, config.ratio)  # (Paddle's SOT tracer cannot call dataclass methods)
        if r <= 0:
            return None
        plan = self.make_plan(block_index, hidden, math.ceil(latent_h / level), math.ceil(latent_w / level), r)
        if not plan.is_identity:
            state.call.merged_blocks += 1
        return plan

    def make_plan(self, block_index: int, hidden: Any, grid_h: int, grid_w: int, r: int) -> MergePlan:
        """Match the block input ``hidden`` on its ``grid_h x grid_w`` grid and plan the merge of ``r`` tokens."""
        config = self.config
        generator = self.state.generator_for(block_index, grid_h, grid_w) if config.use_rand else None
        return bipartite_soft_matching_random2d(
            hidden, grid_w, grid_h, config.sx, config.sy, r, no_rand=not config.use_rand, generator=generator
        )
