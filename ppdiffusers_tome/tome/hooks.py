"""ToMe's three hooks (see :mod:`ppdiffusers_tome.core.registry`): on the model, on each transformer block that can
merge, and on the sub-layers that run on merged tokens.

* :class:`ModelHook` keeps the record of each call (latent size, timestep, kernel family, the ratio now, the call's
  step and site) for the blocks to read, and puts back the previous record when the call ends, however it ends.
* :class:`BlockHook` asks the model's :class:`~ppdiffusers_tome.tome.runner.CallRunner` for the block's plan (a decision, then a plan; see
  :mod:`~ppdiffusers_tome.tome.decision` and :mod:`~ppdiffusers_tome.tome.planner`) and holds it, for this thread, while the
  block runs.
* :class:`SublayerHook` runs ``attn1`` (``attn2``/``ff``) through that plan, whatever its kind, with one call
  (:meth:`CallRunner.run_sublayer <ppdiffusers_tome.tome.runner.CallRunner.run_sublayer>`, which calls the plan's
  ``run_sublayer`` and counts it): a merge plan merges the input, runs the sub-layer on the merged tokens and
  unmerges its output, so the block's residual add sees full-size tensors, exactly where tomesd merges; ToDo's plan
  (and the policy's pooling, ToDo's plan at its defaults) passes the downsampled tokens as the keys and values
  instead (on SD3's joint attention, through :meth:`SublayerHook.joint_attention`).
"""

from __future__ import annotations

import threading
from typing import Any

from ..core.registry import Hook
from ..ops.runtime import begin_eager, end_eager
from .joint_attention import downsampled_joint_attention
from .runner import TENSOR_TYPES

__all__ = ["BlockHook", "ModelHook", "SublayerHook", "TENSOR_TYPES"]


class ModelHook(Hook):
    """ToMe on the model: one :class:`~ppdiffusers_tome.tome.state.CallRecord` per call, for this thread."""

    def __init__(self, patch: Any, runner: Any) -> None:
        self.patch = patch  # (which patch installed the hook: what its removal looks for)
        self.runner = runner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        runner = self.runner
        record = runner.begin_call(args, kwargs)
        local = runner.local
        outer = local.call
        local.call = record
        eager = begin_eager()
        try:
            output = self.next(*args, **kwargs)
        except BaseException:
            runner.abandon_call(record)
            raise
        finally:
            end_eager(eager)
            local.call = outer
        runner.end_call(record)
        return output


class _Slot(threading.local):
    plan: Any = None  # the plan of the block call in flight in this thread


class BlockHook(Hook):
    """Plans one transformer block's merge from its input and holds the plan while the block runs."""

    def __init__(self, patch: Any, runner: Any, index: int) -> None:
        self.patch = patch
        self.runner = runner
        self.index = index  # the block's place among all the model's transformer blocks
        self.slot = _Slot()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if args else kwargs.get("hidden_states")
        runner = self.runner
        call = runner.local.call
        if call is None:  # no call in flight: a checkpointed block recomputed during backward
            plan = runner.recompute.replayed(self.index, hidden)
        else:
            plan = runner.plan_block(self.index, hidden, call)
        if plan is None:
            return self.next(*args, **kwargs)
        slot = self.slot
        outer = slot.plan
        slot.plan = plan
        try:
            return self.next(*args, **kwargs)
        finally:
            slot.plan = outer

    def __getstate__(self) -> dict:
        state = Hook.__getstate__(self)
        state.pop("slot", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.slot = _Slot()


class SublayerHook(Hook):
    """Runs one sub-layer (``attn1``, ``attn2`` or ``ff``; SD3's ``attn`` with ``joint``) of a block through the
    plan of the block call in flight. What a plan's ``run_sublayer(sublayer, x, args, kwargs)`` may use of it:
    :meth:`next` (the sub-layer itself), ``self_attention``, ``joint`` and :meth:`joint_attention`."""

    def __init__(self, block: BlockHook, self_attention: bool, joint: bool = False) -> None:
        self.block = block
        self.self_attention = self_attention
        self.joint = joint  # SD3's joint attention: its second stream is the text, not the keys and values

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        plan = self.block.slot.plan
        if plan is None or plan.is_identity:
            return self.next(*args, **kwargs)
        if self.self_attention and kwargs.get("attention_mask") is not None:
            return self.next(*args, **kwargs)  # a mask over N keys cannot follow merged keys
        x = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(x, TENSOR_TYPES) or x.ndim != 3 or x.shape[0] != plan.batch_size or \
                x.shape[1] != plan.num_tokens:
            return self.next(*args, **kwargs)  # e.g. chunked feed-forward: leave such calls alone
        output = self.block.runner.run_sublayer(plan, self, x, args, kwargs)
        if output is NotImplemented:  # the plan does not apply here (ToDo's on a layer that is not self-attention)
            return self.next(*args, **kwargs)
        return output

    def joint_attention(self, hidden: Any, text: Any, image_kv: Any) -> Any:
        """SD3's joint attention of this layer with the image keys and values from ``image_kv`` (the text stream
        and every query stay)."""
        return downsampled_joint_attention(self.layer, hidden, text, image_kv)
