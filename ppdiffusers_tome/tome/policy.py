"""The policy: whether a block call that could merge is worth merging on the kernels that run it, and with what.

``policy="tomesd"``: every eligible block merges as tomesd does, on any device (the settings say how).

``policy="auto"`` (the default):

* **CPU kernels**: as ``"tomesd"``. Attention there is computed in full, so merging pays at every size (the CPU
  tables of docs/benchmarks.md), unless ``min_work`` is set.
* **GPU kernels**: a block call is skipped when its attention work ``batch * tokens**2`` is below ``min_work``
  (unless set: :data:`POOL_MIN_WORK` where the policy pools, :data:`MERGE_MIN_WORK` where it keeps the settings'
  plan): with flash attention a plan's kernel launches cost more than the attention it saves there. Where it pays,
  a block with the default plan settings gets K/V pooling (every query kept, keys and values taken from the top-left
  token of every 2 x 2 cell: three cheap operators, no matching), which was both the fastest plan and the closest to
  vanilla in every table (docs/gpu.md). Any option that shapes the plan, set to other than its default
  (``match_window``, ``share_plan``, ``use_rand``, ``seed``, ``method``, ...), a ratio schedule or a ratio below
  :data:`POOL_MIN_RATIO` keeps the settings' plan: an option a user sets wins over the policy.
* **SD3** (``JointTransformerBlock``, GPU kernels): with the default plan settings a block whose
  ``batch * tokens**2`` (image tokens) is below :data:`JOINT_MIN_WORK` runs as vanilla, and at or above it gets ToDo's
  2 x 2 downsampling of the image keys and values (the policy's pooling: every query, the text stream and the MLP
  stay full), the fastest plan measured on SD3. Settings that keep their plan merge from
  :data:`JOINT_MERGE_MIN_WORK` (ToDo with ``method="todo"`` from :data:`JOINT_MIN_WORK`), and, with
  ``share_plan="auto"``, one plan per call is shared by every joint block (also with ``policy="tomesd"``). On CPU
  kernels SD3 merges as tomesd, a plan per block.

A program traced with a dynamic batch cannot read its batch size: the decision then assumes
:data:`ASSUMED_BATCH` (one image with classifier-free guidance), so it depends on shapes known when tracing only.
"""

from __future__ import annotations

import logging
import numbers
from dataclasses import fields
from typing import Any

from ..ops.runtime import KERNELS, device_kind, tracing
from .actions import Action
from .config import ToMeConfig
from .state import ToMeStaticGraphError
from .todo import ToDoConfig, technique_config

__all__ = ["ASSUMED_BATCH", "JOINT_MERGE_MIN_WORK", "JOINT_MIN_WORK", "MERGE_MIN_WORK", "POOL_MIN_RATIO",
           "POOL_MIN_WORK", "Decision", "Policy", "pools_by_default"]

logger = logging.getLogger(__name__)

# The H100 tables of docs/gpu.md, by attention work batch * tokens**2. K/V pooling lost at 3.4e7 (512 px, one image:
# 0.92-0.96x eager) and gained from 1.7e8 up (768 px, one image: 1.02-1.17x); 2**26 = 6.7e7 sits between the two on a
# log scale. The plans that match tokens (tomesd's, the shared dense plan) lost up to 1.7e8 and broke even at
# 2.7e8 = 2**28 (512 px, eight images: 0.96-1.08x), gaining above it.
POOL_MIN_WORK = 2**26
MERGE_MIN_WORK = 2**28
# SD3's MMDiT, by batch * image tokens**2, from a PyTorch transcription of SD3's joint block timed on an NVIDIA H200
# (FP16, FlashAttention, SD3-medium's 24 x 1536 layout, 333 text tokens; speed-up over vanilla in eager mode, then as a
# CUDA graph; docs/gpu.md section 9, raw files in docs/measurements/h200/). ToDo's 2 x 2 image key/value downsampling:
#   512 px, batch 2 (2 * 1024**2 = 2.1e6): 0.89-1.03x, 1.04x (SD3.5-large: 0.97x, 1.10x)
#   512 px, batch 8 (8 * 1024**2 = 8.4e6): 1.06x, 1.09x
#   768 px, batch 2 (2 * 2304**2 = 1.1e7): 0.70-1.14x, 1.16-1.17x
#   768 px, batch 8 (4.2e7): 1.18x, 1.19x; 1024 px, batch 2 (3.4e7): 1.28-1.29x, 1.30-1.32x; batch 8: 1.31x, 1.31x
# 512 px with one image gained at most 1.04x as a CUDA graph (1.10x on SD3.5-large) and lost in eager mode, the mode
# Paddle's dygraph runs (its host time per operator on a GPU was not measured); from 768 px with one image every
# CUDA-graph run gained 1.16x or more (eager runs there swung between 0.70x and 1.14x: host-bound). 2**23 = 8.4e6,
# 512 px with four images, is the smallest product measured above 512 px with one image, and gained in both modes:
# so 512 px downsamples from four images per call (two images, 2**22, were not measured and stay vanilla), 768 px and
# 1024 px from one.
JOINT_MIN_WORK = 2**23
# ToMe's plan on SD3 (r = 0.5, attention only), one plan per call shared by every block / a plan per block:
#   512 px, batch 8 (8.4e6): shared 0.82x, 1.04x; per block 0.61x, 0.95x
#   768 px, batch 2 (1.1e7): shared 0.69-1.01x, 1.08x; per block 0.54-0.74x, 0.92x
#   1024 px, batch 2 (3.4e7): shared 1.13-1.14x, 1.22-1.23x; per block 1.01-1.03x, 1.08-1.09x
#   768 px, batch 8 (4.2e7): shared 1.12x, 1.15x; per block 1.02x, 1.04x
# Below 1024 px with one image a plan per block lost in both modes and a shared plan lost or at best broke even in
# eager mode: 2**25 = 2 * 4096**2, that product, is where merging starts.
JOINT_MERGE_MIN_WORK = 2**25
ASSUMED_BATCH = 2
POOL_MIN_RATIO = 0.3  # the smallest ratio at which K/V pooling was measured closer to vanilla than merging

class Decision:
    """What the policy chose for block calls of one shape: ``action`` (:data:`Action.MERGE
    <ppdiffusers_tome.tome.actions.Action>`: the settings' plan, :data:`Action.POOL`: K/V pooling, ToDo's plan at its
    defaults, :data:`Action.SKIP`: no merging), on ``kernels``, for ``batch`` (``-1``: dynamic) x ``tokens``; ``joint``:
    the blocks are SD3's (the pooling is then of the image keys and values); ``shared``: a merge plan is made once per
    call and token count and used by every block there (``share_plan``)."""

    def __init__(self, action: str, kernels: str, batch: int, tokens: int, work: int, threshold: int, policy: str,
                 joint: bool = False, shared: bool = False):
        self.action, self.kernels, self.batch, self.tokens = action, kernels, batch, tokens
        self.work, self.threshold, self.policy = work, threshold, policy
        self.joint, self.shared = joint, shared

    def why(self) -> str:
        """One line: the numbers behind the choice."""
        batch = f"batch {self.batch}" if self.batch >= 0 else f"dynamic batch (assumed {ASSUMED_BATCH})"
        size = (f"{batch} x {self.tokens} tokens on {self.kernels.upper()} kernels: "
                f"batch * tokens**2 = {_exact(self.work)}")
        shared = ", one plan per call shared by every block" if self.shared else ""
        if self.policy == "tomesd":
            return f"{size}; policy='tomesd' merges every eligible block{shared}"
        if self.action == Action.SKIP:
            return f"{size} < min_work = {_exact(self.threshold)}: merging would cost more than it saves"
        if self.action == Action.POOL and self.joint:
            plan = "ToDo's 2x2 downsampling of the image keys and values (the fastest plan measured on SD3)"
        elif self.action == Action.POOL:
            plan = "K/V pooling (the cheapest plan, closest to vanilla)"
        else:
            plan = f"the settings' plan{shared}"
        return f"{size} >= min_work = {_exact(self.threshold)}: {plan}"

    def as_dict(self) -> dict[str, Any]:
        return {"action": self.action, "kernels": self.kernels, "batch": self.batch, "tokens": self.tokens,
                "work": self.work, "min_work": self.threshold, "shared": self.shared, "why": self.why()}


def _exact(number: float) -> str:
    """``number`` with every digit, so that two numbers compared in :meth:`Decision.why` never print alike: an
    integer in full (with its power of ten when it is large, for reading), anything else as Python's shortest
    exact form.

    >>> _exact(131072), _exact(2**28), _exact(1.5)
    ('131072', '268435456 (2.68e+08)', '1.5')
    """
    if isinstance(number, float) and number.is_integer() or isinstance(number, numbers.Integral):
        number = int(number)
    if isinstance(number, int):
        return f"{number} ({number:.3g})" if abs(number) >= 10**6 else str(number)
    return repr(number)


class Policy:
    """The choice for one patched model (see the module docstring) of the plan kind a block call of some size gets
    (skip, pool, or the settings' plan); :meth:`choose_plan` is called once per block call that could merge, and
    answers from a dict after the first call of each shape. ``config``: a :class:`ToMeConfig` or a
    :class:`~ppdiffusers_tome.tome.todo.ToDoConfig`.

    >>> import paddle
    >>> policy = Policy(ToMeConfig())
    >>> [policy.choose_plan(paddle.zeros([2, tokens, 8]), "gpu").action for tokens in (4096, 16384)]
    ['skip', 'pool']
    >>> policy.choose_plan(paddle.zeros([2, 4096, 8]), "cpu").action
    'merge'

    On SD3's joint blocks (image tokens of 512, 768 and 1024 px with one image):

    >>> joint = Policy(ToMeConfig(), joint=True)
    >>> [joint.choose_plan_for("gpu", 2, tokens).action for tokens in (1024, 2304, 4096)]
    ['skip', 'pool', 'pool']
    >>> merging = Policy(ToMeConfig(merge_mlp=True), joint=True)
    >>> [(d.action, d.shared) for d in (merging.choose_plan_for("gpu", 2, 2304), merging.choose_plan_for("gpu", 2, 4096))]
    [('skip', False), ('merge', True)]
    """

    def __init__(self, config: Any, joint: bool = False, joint_pools: bool = True):
        config = technique_config(config)  # (0.14's ToMeConfig(method="todo") is ToDo's config)
        todo = isinstance(config, ToDoConfig)
        self.name = config.policy
        self.auto = config.policy == "auto"
        self.min_work = config.min_work
        self.joint = joint
        # SD3's joint attention: the policy's pooling is ToDo's downsampling of the image keys and values, which runs
        # the joint attention with the core of the layer's processor (``joint_pools``: every core is known)
        self.pools = self.auto and pools_by_default(config) and (joint_pools or not joint)
        if joint:
            self.pool_min_work = JOINT_MIN_WORK
            self.merge_min_work = JOINT_MIN_WORK if todo else JOINT_MERGE_MIN_WORK
        else:
            self.pool_min_work, self.merge_min_work = POOL_MIN_WORK, MERGE_MIN_WORK
        # one merge plan per call and token count: asked for, or SD3's blocks on GPU kernels with share_plan="auto"
        # (ToDo has no plan to share)
        tome = not todo
        self.share_level = tome and config.share_plan == "level"
        self.share_joint = tome and joint and config.share_plan == "auto"
        self._decisions: dict[tuple[str, int, int], Decision] = {}
        self.warned = False

    def choose_plan(self, hidden: Any, kernels: str | None = None) -> Decision:
        """The plan kind for a block input ``hidden`` (``[B, N, C]``) on ``kernels`` (default: its place)."""
        batch = hidden.shape[0]
        batch = -1 if batch is None or batch < 0 else int(batch)
        return self.choose_plan_for(kernels or device_kind(hidden), batch, int(hidden.shape[1]))

    def choose_plan_for(self, kernels: str, batch: int, tokens: int) -> Decision:
        """The plan kind for block calls of ``batch`` (``-1``: dynamic) x ``tokens`` on ``kernels``."""
        key = f"{kernels}/{batch}/{tokens}"  # (a str key and no dict.get: what Paddle's SOT tracer can follow)
        if key in self._decisions:
            return self._decisions[key]
        decision = self._choose(kernels, batch, tokens)
        self._decisions[key] = decision
        return decision

    # the names of 0.15.0 and before, kept until 0.17 (see ppdiffusers_tome.compat.RENAMED_METHODS)
    decide = property(lambda self: _renamed_method(self, "decide"))
    decide_shape = property(lambda self: _renamed_method(self, "decide_shape"))

    def _choose(self, kernels: str, batch: int, tokens: int) -> Decision:
        if tokens < 0:  # (a dynamic token count while tracing: the work is unknown)
            raise ToMeStaticGraphError(
                "ToMe's policy decides from a block's batch * tokens**2, and this block's token count is dynamic in "
                "the traced program; give the InputSpec a fixed height and width, or convert in SOT mode")
        work = (batch if batch >= 0 else ASSUMED_BATCH) * tokens * tokens
        # where every operator is a kernel launch (the GPU family), a small block costs more than merging saves
        launch_bound = KERNELS[kernels].few_launches
        shared = self.share_level or (self.share_joint and launch_bound)
        if not self.auto:
            return Decision(Action.MERGE, kernels, batch, tokens, work, 0, self.name, self.joint, shared)
        pools = launch_bound and self.pools
        if self.min_work is not None:
            threshold = self.min_work
        elif launch_bound:
            threshold = self.pool_min_work if pools else self.merge_min_work
        else:
            threshold = 0
        if work < threshold:
            action = Action.SKIP
        else:
            action = Action.POOL if pools else Action.MERGE
        return Decision(action, kernels, batch, tokens, work, threshold, self.name, self.joint,
                        shared and action == Action.MERGE)

    def log_first_skip(self, decision: Decision, model_name: str) -> None:
        """Log the first skip of this patch, once, naming the options that force merging (not while tracing)."""
        if self.warned or tracing():
            return
        self.warned = True
        logger.warning(
            "ToMe skips blocks of %s with %s. Pass min_work=0 (or policy='tomesd') to apply_tome to merge them anyway.",
            model_name, decision.why(),
        )


def pools_by_default(config: Any) -> bool:
    """Whether the settings leave the plan to the policy: every option that shapes the plan at its default (only
    ``ratio``, ``max_downsample``, ``min_tokens`` and the policy's own options set) and a constant ratio of at least
    :data:`POOL_MIN_RATIO`. An option a user sets wins over the policy; ToDo (a
    :class:`~ppdiffusers_tome.tome.todo.ToDoConfig`, or ``method="todo"``) has its own plan.

    >>> pools_by_default(ToMeConfig()), pools_by_default(ToMeConfig(share_plan="level")), pools_by_default(ToMeConfig(ratio=0.2))
    (True, False, False)
    >>> pools_by_default(ToMeConfig(use_rand=False)), pools_by_default(ToMeConfig(max_downsample=2))
    (False, True)
    """
    if not isinstance(config, ToMeConfig) or config.is_scheduled or config.ratio < POOL_MIN_RATIO:
        return False
    return all(getattr(config, field.name) == field.default for field in fields(ToMeConfig)
               if field.name not in _POLICY_FREE)


# the options that do not shape a plan: how much, where, and the policy's own
_POLICY_FREE = frozenset({"ratio", "max_downsample", "min_tokens", "policy", "min_work"})


def _renamed_method(policy: Policy, old: str) -> Any:
    from ..compat import renamed_method

    return renamed_method(policy, "Policy", old)
