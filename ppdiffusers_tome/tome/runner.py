"""ToMe's (and ToDo's) work inside one model call, as its hooks run it: the record of the call, what each block call
does (:func:`~ppdiffusers_tome.tome.decision.decide_block`), its plan (:class:`~ppdiffusers_tome.tome.planner.Planner`),
each sub-layer run through its plan, and the counters of ``tome_stats``.

One :class:`CallRunner` per patched model is the handle the hooks hold (:mod:`~ppdiffusers_tome.tome.hooks`); the
:class:`~ppdiffusers_tome.tome.patch.ModelPatch` that installs them only installs and removes. Every counter is
written here: those of a call, its blocks and its plans, and ``merges``, the sub-layers run through a plan.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple

import paddle

from ..core.calls import model_calls
from ..ops.runtime import converting, device_kind, tracing
from .actions import Action
from .checkpoint import RecomputePlans
from .config import ToMeConfig, check_ratio, ratio_at
from .decision import BlockDecision, Settings, decide_block, grid_of
from .planner import REUSED, SHARED, Planner
from .state import (
    CallRecord,
    Counters,
    progress_of,
    refuse_conversion,
    refuse_dynamic_size,
    refuse_dynamic_tokens,
)
from .todo import technique_config

__all__ = ["CallRunner", "MAX_DECISIONS", "TENSOR_TYPES", "why_nothing_merged"]

MAX_DECISIONS = 1024  # block decisions memoised per model (by shapes, kernels, ratio); the memo starts over beyond


def _tensor_types() -> Tuple[type, ...]:
    """Tensor classes of dynamic mode and of static-graph tracing (``paddle.jit.to_static``)."""
    types = [paddle.Tensor]
    for owner, name in ((getattr(paddle, "pir", None), "Value"), (paddle.static, "Variable")):
        cls = getattr(owner, name, None) if owner is not None else None
        if isinstance(cls, type):
            types.append(cls)
    return tuple(types)


TENSOR_TYPES = _tensor_types()


def _timestep_index(model: Any) -> int:
    """Where ``timestep`` sits among the positional arguments of the model's forward (second for a UNet, third
    for ``Transformer2DModel``)."""
    try:
        names = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return 1
    return names.index("timestep") if "timestep" in names else 1


class _Local(threading.local):
    call: Optional[CallRecord] = None  # the record of this thread's call in flight
    last: Optional[CallRecord] = None  # the record of this thread's latest call that returned


class CallRunner:
    """What ToMe (or ToDo, with a :class:`~ppdiffusers_tome.tome.todo.ToDoConfig`) does in each call of one model,
    for the hooks to run: :meth:`begin_call` / :meth:`end_call` / :meth:`abandon_call` around the model's forward,
    :meth:`plan_block` for each hooked block call, :meth:`run_sublayer` for each sub-layer that runs through a plan.

    The patch that installs the hooks passes ``hooked_blocks`` (how many blocks it hooked; all of them by default)
    and ``structure_finest`` (the finest level of the model's structure, None when unknown), for the warning of a
    call that merged nothing, and the ``settings`` it read when choosing the blocks (made here when not given).

    >>> from ppdiffusers_tome.testing import tiny_unet
    >>> from ppdiffusers_tome.tome.patch import find_blocks
    >>> unet = tiny_unet()
    >>> runner = CallRunner(unet, ToMeConfig(), find_blocks(unet))
    >>> with runner.in_call(paddle.zeros([2, 4, 16, 16])) as call:
    ...     call.latent_hw, runner.counters.calls
    ((16, 16), 1)
    """

    def __init__(self, model: paddle.nn.Layer, config: Any, blocks: List[Tuple[str, paddle.nn.Layer]],
                 train_timesteps: int = 1000, planner_type: type = Planner, hooked_blocks: Optional[int] = None,
                 structure_finest: Optional[int] = None, settings: Optional[Settings] = None):
        self.model_name = type(model).__name__
        self.model = model
        self.config = config = technique_config(config)  # a ToMeConfig, or ToDo's ToDoConfig
        tome = config if isinstance(config, ToMeConfig) else None
        self.train_timesteps = int(train_timesteps)
        self.settings = settings if settings is not None else Settings(config, model, blocks)
        self.planner = planner_type(config, len(blocks))
        self.counters = Counters()
        self.recompute = RecomputePlans(model, blocks)  # gradient checkpointing: plans kept for the recompute
        self.local = _Local()
        self.timestep_arg = _timestep_index(model)
        self.scheduled = tome is not None and tome.is_scheduled
        self.needs_python = self.scheduled or (tome is not None and tome.caches_plans)  # what a static graph cannot hold
        self.ratio = tome.ratio if tome is not None else 0.0  # (ToDo has no ratio)
        todo = self.settings.todo is not None
        # whether any block call may plan (ToDo, a ratio above 0 or a schedule): then the token grid must be known
        self.plans = self.settings.merges_something and (todo or self.scheduled or self.ratio > 0)
        self.runtime_finest = self.settings.auto_level and self.settings.auto_finest is None
        self.technique = "ToDo" if todo else "ToMe"
        self.hooked_blocks = len(blocks) if hooked_blocks is None else hooked_blocks
        self.structure_finest = structure_finest  # the finest level of the model's structure, when known
        self._grids: Dict[str, Any] = {}
        self._decisions: Dict[str, BlockDecision] = {}

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["local"] = None  # (a thread-local: calls in flight belong to this process)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.local = _Local()

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
        need Python at run time, a dynamic latent size, and re-entrant recompute, before anything is recorded."""
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
            refuse_dynamic_size(self.model_name, self.technique, shape)
        ratio = self.ratio
        if self.scheduled and self.settings.merges_something:
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
        tools. Yields the call's record."""
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
            self.warn_if_nothing_merged(record)

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
        decision = self.decision(tokens, batch, call, hidden.shape)
        action = decision.action
        if action == Action.OFF:
            call.decisions[tokens] = decision
            return None
        counters = self.counters
        if decision.policy is not None:
            counters.decisions[tokens] = decision.policy
        if action == Action.SKIP:
            counters.blocks_skipped += 1
            policy = self.settings.policy
            if decision.policy is not None and not policy.warned:  # (a call only for the first skip)
                policy.log_first_skip(decision.policy, self.model_name)
            return None
        if action == Action.POOL:
            counters.blocks_pooled += 1
        plan, source = self.planner.plan(decision, index, hidden, call)
        if source == SHARED:
            counters.plans_shared += 1
        elif source == REUSED:
            counters.plans_reused += 1
        elif source is not None:
            counters.plans_computed += 1
        if plan is None:
            return None
        if not plan.is_identity:
            call.merged_blocks += 1
        if self.recompute.possible and not hidden.stop_gradient:  # (only a graph for a backward can recompute)
            self.recompute.keep(index, hidden, plan)
        return plan

    def run_sublayer(self, plan: Any, sublayer: Any, x: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """Run ``sublayer`` (a :class:`~ppdiffusers_tome.tome.hooks.SublayerHook`) on its input ``x`` through
        ``plan``, whatever its kind (``plan.run_sublayer``: a merge plan merges and unmerges around it, a
        downsampling plan gives it downsampled keys and values), and count it in ``merges``; ``NotImplemented``
        when the plan does not apply to this sub-layer (nothing is counted: the hook runs it as it is)."""
        output = plan.run_sublayer(sublayer, x, args, kwargs)
        if output is not NotImplemented:
            self.counters.merges += 1
        return output

    def decision(self, tokens: int, batch: int, call: CallRecord, shape: Any = None) -> BlockDecision:
        """What a block call with ``tokens`` tokens and ``batch`` images does in ``call``: the grid and the decision
        are memoised by the shapes, the kernels, the ratio now and the finest level so far."""
        grids, where = self._grids, f"{call.latent_hw}/{tokens}"
        if where in grids:
            grid = grids[where]
        else:
            if tokens < 0 and self.plans:  # (a dynamic token count while tracing: no grid is known)
                refuse_dynamic_tokens(self.model_name, self.technique, shape)
            grid = grids[where] = grid_of(self.settings, call.latent_hw, tokens)
        if grid is not None and (call.finest_level is None or grid[0] < call.finest_level):
            call.finest_level = grid[0]
        finest = call.finest_level if self.runtime_finest else None
        key = f"{where}/{batch}/{call.kernels}/{call.ratio}/{finest}"
        decisions = self._decisions
        if key in decisions:
            return decisions[key]
        if len(decisions) >= MAX_DECISIONS:  # a ratio schedule over continuous timesteps: a new key per call
            decisions.clear()
        decision = decisions[key] = decide_block(self.settings, tokens, batch, grid, finest, call.kernels, call.ratio)
        return decision

    def warn_if_nothing_merged(self, record: CallRecord) -> None:
        """Warn once when a completed call merged nothing although the settings ask for merging, naming why (from
        the decisions of its blocks)."""
        if not self.settings.merges_something or (self.technique == "ToMe" and not self.scheduled and self.ratio == 0):
            return
        message = why_nothing_merged(self, record)
        if message is not None:
            self.counters.warned_no_merge = True
            warnings.warn(message, UserWarning, stacklevel=4)


# the warning of a call that merged nothing -------------------------------------------------------------------------
def why_nothing_merged(runner: CallRunner, record: CallRecord) -> Optional[str]:
    """The warning's text for a call of ``runner``'s model that merged nothing, or None when that was expected."""
    name, model, settings = runner.technique, runner.model_name, runner.settings
    if not runner.hooked_blocks:  # every block is above max_downsample, by the model's structure: none was hooked
        if runner.structure_finest is None or settings.auto_level:
            return None
        return _level_advice(runner, runner.structure_finest)
    if record.finest_level is None:
        return (f"{name} changed nothing in {model}: no transformer block's tokens form the "
                f"{'patch' if settings.patch_size else 'latent'} grid of the input (a layout this package does "
                "not know, such as video frames folded into the tokens).")
    finest = [d for tokens, d in sorted(record.decisions.items(), key=lambda item: -item[0])
              if d.level == record.finest_level]
    decision = finest[0] if finest else None
    if decision is None or decision.action != Action.OFF:
        return None
    if decision.reason == "no_cell" and runner.config.match_window is None:
        return (f"ToMe merged no tokens in {model}: its {decision.grid_h}x{decision.grid_w} token grid holds no "
                f"sy x sx = {runner.config.sy}x{runner.config.sx} cell, so there is no dst token to merge into "
                "(nothing was planned). Use smaller sx and sy (2 is the paper's setting) for latents this small.")
    if decision.reason == "rounds" and not runner.scheduled:
        tokens, window = decision.tokens, runner.config.match_window is not None
        where = f"each {tokens}-token match_window" if window else f"{tokens} tokens"
        return (f"ToMe merged no tokens in {model}: ratio={record.ratio:g} rounds to int({tokens} * "
                f"{record.ratio:g}) = 0 tokens merged in {where}. Use ratio >= {1 / tokens:.3g}"
                + (" or a larger match_window." if window else "."))
    if decision.reason == "level" and not settings.auto_level:
        return _level_advice(runner, record.finest_level)
    return None


def _level_advice(runner: CallRunner, finest_level: int) -> str:
    return (
        f"{runner.technique} merged no tokens in {runner.model_name}: its highest-resolution transformer blocks run "
        f"at {finest_level}x downsampling, above max_downsample={runner.config.max_downsample}. Use "
        f"max_downsample={finest_level} (or 'auto') to merge there."
    )
