"""Forward hooks that carry ToMe into a model's blocks: registration that survives copies and static-graph
tracing, and the per-block and per-sub-layer hooks themselves.

A :class:`BlockHooks` asks its patch's :class:`~ppdiffusers_tome.planner.Planner` for the block's plan when the
block starts and hands it to the state; a :class:`SublayerHooks` merges the input of ``attn1`` (``attn2``/``ff``) with that
plan and unmerges the output. Every piece of per-call data is written through
:class:`~ppdiffusers_tome.state.ToMeState`'s methods.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import paddle

from .ops.downsample import DownsamplePlan

__all__ = ["BlockHooks", "HookCall", "HookRecord", "SublayerHooks", "TENSOR_TYPES"]


def _tensor_types() -> Tuple[type, ...]:
    """Tensor classes of dynamic mode and of static-graph tracing (``paddle.jit.to_static``)."""
    types = [paddle.Tensor]
    for owner, name in ((getattr(paddle, "pir", None), "Value"), (paddle.static, "Variable")):
        cls = getattr(owner, name, None) if owner is not None else None
        if isinstance(cls, type):
            types.append(cls)
    return tuple(types)


TENSOR_TYPES = _tensor_types()


class HookCall:
    """A hook as a plain callable object calling ``owner.<method>``. Unlike a bound method it survives Paddle's
    SOT tracer (which writes a bound method's repr into its guard code) and ``copy.deepcopy`` alike."""

    def __init__(self, owner: Any, method: str) -> None:
        self.owner = owner
        self.method = method

    def __call__(self, *args):
        return getattr(self.owner, self.method)(*args)


class HookRecord:
    """One registered hook, removable from the layer's own hook tables (unlike Paddle's HookRemoveHelper, whose
    weak references would still point at the original model after ``copy.deepcopy``)."""

    _TABLES = {
        "pre": ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs_flag"),
        "post": ("_forward_post_hooks", "_forward_post_hooks_with_kwargs_flag", "_forward_post_hooks_always_called"),
    }

    def __init__(self, layer: paddle.nn.Layer, kind: str, owner: Any, method: str) -> None:
        self.layer = layer
        self.kind = kind
        hook = HookCall(owner, method)
        if kind == "pre":
            handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
        else:
            handle = layer.register_forward_post_hook(hook, with_kwargs=True, always_call=True)
        self.hook_id = handle._hook_id

    def __setstate__(self, state: Dict[str, Any]) -> None:
        # unpickled in a fresh process: Paddle's hook-id counter starts again at 0 there, and the next hook
        # registered would take this id and overwrite this hook in the layer's table
        self.__dict__.update(state)
        helper = paddle.nn.layer.layers.HookRemoveHelper
        helper.next_hook_id = max(helper.next_hook_id, self.hook_id + 1)

    def remove(self) -> None:
        for table in self._TABLES[self.kind]:
            getattr(self.layer, table, {}).pop(self.hook_id, None)


class SublayerHooks:
    """Merge the input of one sub-layer (attn1, attn2 or ff) of one block and unmerge its output."""

    def __init__(self, block: "BlockHooks", name: str, self_attention: bool):
        self.block = block
        self.name = name
        self.self_attention = self_attention
        self.key = f"{block.index}/{name}"

    def before(self, layer, args, kwargs):
        state = self.block.patch.state
        state.end_merge(self.key)  # (a leftover of a call that failed half-way)
        plan = state.plan_of(self.block.index)
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
        if isinstance(plan, DownsamplePlan):  # ToDo: queries stay, keys/values come from the downsampled tokens
            if not self.self_attention or kwargs.get("encoder_hidden_states") is not None:
                return None  # not self-attention after all (only_cross_attention blocks)
            state.begin_merge(self.key, None)
            return args, dict(kwargs, encoder_hidden_states=plan.keys_values(x))
        merged = plan.merge(x)
        state.begin_merge(self.key, plan)
        if from_kwargs:
            return args, dict(kwargs, hidden_states=merged)
        return (merged,) + tuple(args[1:]), kwargs

    def after(self, layer, args, kwargs, output):
        plan = self.block.patch.state.end_merge(self.key)
        if plan is None or output is None:  # output is None when the sub-layer raised (hooks run anyway)
            return None
        if isinstance(output, (tuple, list)):
            return type(output)([plan.unmerge(output[0]), *output[1:]])
        return plan.unmerge(output)


class BlockHooks:
    """Plans the merge of one transformer block from its input, for its sub-layer hooks to use."""

    def __init__(self, patch: Any, index: int):
        self.patch = patch  # the ModelPatch this block belongs to (it plans; its state records)
        self.index = index

    def before(self, layer, args, kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        patch = self.patch
        if patch.state.latent_hw is None:  # no call in flight: a checkpointed block recomputed during backward
            plan = patch.recompute.replayed(self.index, hidden)
        else:
            plan = patch.planner.plan_for(self.index, hidden)
            if plan is not None and patch.recompute.possible:
                patch.recompute.keep(self.index, hidden, plan)
        if plan is not None:
            patch.state.set_plan(self.index, plan)
        return None

    def after(self, layer, args, kwargs, output):
        self.patch.state.end_block(self.index)
        return None
