"""Runtime state of one patched model: the record of the call in flight and the step history, per thread.

:class:`ToMeState` is the only writer of both; the hooks in :mod:`ppdiffusers_tome.hooks` and the planner in
:mod:`ppdiffusers_tome.planner` go through its methods. Two kinds of per-thread data, kept apart because they live for
different lengths of time:

* :class:`CallRecord` — what one forward call needs and forgets at its end: latent size, timestep, the partition
  tables drawn for it, each block's plan, the sub-layers waiting for their unmerge;
* :class:`StepHistory` — what outlives calls, for ``recompute_every``: the denoising step and slot, the cached plans.

Nothing here reads a tensor on the host unless the config needs a Python number (a ratio schedule or plan caching).
"""

from __future__ import annotations

import sys
from collections import OrderedDict
import threading
import warnings
from typing import Any, Dict, List, Optional, Set, Tuple

import numpy as np
import paddle

from .config import ToMeConfig
from .ops.global_plan import MergePlan
from .ops.runtime import converting, tracing

__all__ = ["CallRecord", "StepHistory", "ToMeState", "ToMeStaticGraphError", "timestep_values"]


try:
    from paddle.jit.sot.psdb import fallback as _run_as_python
except ImportError:  # pragma: no cover - Paddle without SOT

    def _run_as_python() -> None:
        pass


class ToMeStaticGraphError(RuntimeError):
    """Raised when a ToMe option cannot be converted to a static graph (``paddle.jit.to_static``)."""


def timestep_values(timestep: Any) -> Optional[np.ndarray]:
    """The distinct timestep values of a call (float64, sorted), or None when there is none. Reads the timestep on
    the host: only options that need a Python number (a ratio schedule, plan caching) call this.

    >>> timestep_values([999, 999, 500]).tolist()
    [500.0, 999.0]
    """
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
    return values if values.size else None


# Paddle runs every call of a layer that has forward hooks in ``Layer._dygraph_call_func``: the frames of that code on
# a thread's stack are the layer calls running in that thread. They tell a call that is still running from one that
# was left by an exception Paddle does not show to hooks (KeyboardInterrupt, SystemExit), which never ends itself.
_CALL_CODE = getattr(getattr(paddle.nn.Layer, "_dygraph_call_func", None), "__code__", None)


def _call_frame() -> Optional[int]:
    """The id of the frame of the layer call the calling hook runs in, or None when there is none to be found (a
    call by hand, outside any forward; a Paddle that calls hooks another way)."""
    if _CALL_CODE is None:
        return None
    frame = sys._getframe(1)
    for _ in range(24):  # a hook is a few frames below its layer's call
        if frame is None:
            return None
        if frame.f_code is _CALL_CODE:
            return id(frame)
        frame = frame.f_back
    return None


def _live_calls(frame: Any, layer: Any = None) -> Set[int]:
    """Ids of the layer-call frames on the stack that ``frame`` tops; with ``layer``, only calls of ``layer`` (or
    of a shallow copy of it: they share its hook table)."""
    table = None if layer is None else getattr(layer, "__dict__", {}).get("_forward_pre_hooks")
    found = set()
    while frame is not None:
        if frame.f_code is _CALL_CODE:
            caller = frame.f_locals.get("self") if table is not None else None
            if table is None or getattr(caller, "__dict__", {}).get("_forward_pre_hooks") is table:
                found.add(id(frame))
        frame = frame.f_back
    return found


def _take(table: Dict, key: Any) -> Any:
    """``table.pop(key, None)``."""
    if key in table:
        return table.pop(key)
    return None


class CallRecord:
    """The call in flight in one thread (cleared by :meth:`ToMeState.end_call`)."""

    def __init__(self) -> None:
        self.latent_hw: Optional[Tuple[int, int]] = None
        self.timestep: Any = None  # as passed to the model (a device tensor stays on the device)
        self.step_key: Any = None  # 0-d int64 device tensor made from it when a block first needs a partition
        self.partitions: Dict[str, Any] = {}  # "<h>x<w>" -> partition table of every block at that grid
        self.timestep_key: Optional[Tuple[int, ...]] = None  # host copy, only with plan caching / schedules
        self.progress = 0.0  # 1 - t/T of the call: 0 at pure noise, 1 at the clean image
        self.number = 0  # which call of the model this is (keys the partition when there is no timestep)
        self.frame: Optional[int] = None  # id of the frame of Paddle's layer call running it (None: unknown)
        self.saved: Any = None  # the step history before this call, restored if the call fails
        self.epoch = 0  # the state's reset count when the call began (a reset since then voids ``saved``)
        self.merged_blocks = 0  # (kept after the call ends, for reporting)
        self.finest_level: Optional[int] = None  # (kept after the call ends, for reporting)
        self.plans: Dict[int, Any] = {}  # block index -> plan of this call
        self.shared: Dict[int, Any] = {}  # token count -> plan shared by the blocks at that level (share_plan="level")
        self.active: Dict[str, MergePlan] = {}  # "<block>/<sub-layer>" -> plan whose unmerge is pending


class StepHistory:
    """Denoising steps seen by one thread, for plan caching: a step is a run of calls with the same timestep, and
    the ``k``-th call of a step (its slot) is one call site (the unprompted half of split guidance, one view of a
    panorama, ...), which keeps its own plans from step to step, however many calls a step makes.

    The cache holds at most :data:`MAX_PLANS` plans, the least recently used going first: a step's call sites times
    the merging blocks (or levels, with ``share_plan="level"``) fit unless a step makes hundreds of calls; a plan
    of the global kind holds about ``22 * B * N`` bytes of index tables (180 KB for SD-1.5 at 512² with guidance).
    """

    MAX_PLANS = 512

    def __init__(self) -> None:
        self.epoch = 0  # the state's reset count this history belongs to
        self.clear()

    def clear(self) -> None:
        self.step = -1
        self.slot = 0  # which call at this step this is (the unprompted half of split guidance is slot 1)
        self.last_key: Any = None
        self.last_progress: Optional[float] = None
        # "<block or level>/<slot>" -> (plan, step, grid), least recently used first
        self.cache: "OrderedDict[str, Tuple[Any, int, Tuple[int, int]]]" = OrderedDict()

    def snapshot(self) -> Tuple[Any, ...]:
        return self.step, self.slot, self.last_key, self.last_progress, OrderedDict(self.cache)

    def restore(self, saved: Tuple[Any, ...]) -> None:
        self.step, self.slot, self.last_key, self.last_progress, cache = saved
        self.cache = OrderedDict(cache)

    def lookup(self, key: str) -> Any:
        """The cache entry of ``key`` at this call's slot, or None (a hit becomes the most recently used)."""
        entry = self.cache.get(f"{key}/{self.slot}")
        if entry is not None:
            self.cache.move_to_end(f"{key}/{self.slot}")
        return entry

    def store(self, key: str, plan: Any, grid: Tuple[int, int]) -> None:
        """Cache ``plan`` for ``key`` at this call's slot and step, within :data:`MAX_PLANS`."""
        name = f"{key}/{self.slot}"
        self.cache[name] = (plan, self.step, grid)
        self.cache.move_to_end(name)
        while len(self.cache) > self.MAX_PLANS:
            self.cache.popitem(last=False)

    def advance(self, key: Any, progress: Optional[float]) -> None:
        """Count a call: calls with the same key are one step (slots 0, 1, 2, ... for as many as the step makes); a
        timestep noisier than the last one starts a new generation, which forgets the cached plans."""
        if self.last_key is not None and key == self.last_key:
            self.slot += 1
            return
        restart = progress is not None and self.last_progress is not None and progress < self.last_progress
        if self.last_key is None or restart:
            self.step = 0
            self.cache.clear()
        else:
            self.step += 1
        self.slot = 0
        self.last_key = key
        self.last_progress = progress


class _PerThread(threading.local):
    def __init__(self) -> None:
        self.stack: List[CallRecord] = []  # the calls in flight in this thread, outermost first (nested calls)
        self.call = CallRecord()  # the innermost call in flight, or the latest one that ended (for its report)
        self.history = StepHistory()


class ToMeState:
    """Runtime state of one patched model: the call in flight and the step history (per thread), and counters.

    The random partition of a block is a hash of ``(seed, block, grid, timestep, cell)`` computed on the device
    from the timestep tensor (see :func:`ppdiffusers_tome.ops.partition.partition_table`), so it does not depend on how
    many calls came before, does not touch Paddle's RNG, reads nothing back to the host, and is the same for the
    prompted and unprompted halves of classifier-free guidance even when they arrive in separate calls. (A model
    called without a timestep falls back to keying by the number of the call.)

    Thread safety: every call keeps its own record per thread (a stack: a model called inside its own forward gets a
    record of its own, and the outer call goes on with its own plans afterwards); :meth:`reset` only drops counters
    and each thread's step history (at that thread's next call), never a call in flight; :meth:`busy_elsewhere` and
    :meth:`busy_here` tell the patch whether a forward is running in another thread or in this one.

    A call normally ends in the model's post-hook, which Paddle runs on return and on any ``Exception``. It does not
    run it for ``KeyboardInterrupt`` or ``SystemExit``; such a call is recognised as ended because the frame of its
    layer call is no longer on its thread's stack, and is dropped (its step history put back, as for a failed call)
    at that thread's next call, or when anyone asks whether the model is busy.

    >>> state = ToMeState(ToMeConfig(), num_blocks=2)
    >>> state.begin_call(paddle.zeros([1, 4, 8, 8]), paddle.to_tensor(999))
    >>> state.latent_hw, state.busy_elsewhere()
    ((8, 8), 0)
    >>> ended = state.end_call()
    >>> ended.merged_blocks, state.busy_here()
    (0, 0)
    """

    COUNTERS = ("calls", "merges", "plans_computed", "plans_reused", "plans_shared", "blocks_skipped",
                "blocks_pooled", "warned_no_merge", "warned_timestep_range")

    def __init__(self, config: ToMeConfig, train_timesteps: int = 1000, num_blocks: int = 1):
        self.config = config
        self.train_timesteps = int(train_timesteps)
        self.num_blocks = int(num_blocks)
        tome = config.method == "tome"
        # only a ratio schedule (r is a shape) and plan caching (steps) need the timestep as a Python number;
        # reading it is a device-to-host sync and cannot be traced into a static graph
        self.reads_timestep = tome and (config.is_scheduled or config.caches_plans)
        self._threads = _PerThread()
        self._lock = threading.RLock()  # (re-entrant: a hook that runs while this thread holds it cannot deadlock)
        self.in_flight: Dict[int, List[Optional[int]]] = {}  # thread ident -> frames of its calls in flight
        self.epoch = 0
        self.reset()

    def reset(self) -> None:
        """Forget what earlier calls left: counters, and every thread's step history and cached plans (each thread
        drops its own at its next call). A call in flight in another thread is not disturbed."""
        with self._lock:
            self.epoch += 1
        self.calls = 0
        self.merges = 0  # sub-layer calls that ran on merged tokens, all calls together
        self.plans_computed = 0
        self.plans_reused = 0  # taken from the step cache (recompute_every)
        self.plans_shared = 0  # taken from an earlier block of the same call (share_plan="level")
        self.blocks_skipped = 0  # blocks that would merge but are below min_tokens or the policy's min_work
        self.blocks_pooled = 0  # blocks whose keys and values the policy pooled instead of merging
        self.decisions: Dict[int, Any] = {}  # tokens -> the policy's latest decision at that size
        self.warned_no_merge = False
        self.warned_timestep_range = False

    def record_decision(self, decision: Any) -> None:
        """Keep the policy's decision for block calls of its token count (what ``tome_status`` reports)."""
        self.decisions[decision.tokens] = decision

    # copies: settings and counters, no call in flight (thread-locals and locks cannot be copied or pickled) --------
    def __deepcopy__(self, memo) -> "ToMeState":
        twin = ToMeState(self.config, self.train_timesteps, self.num_blocks)
        for name in self.COUNTERS:
            setattr(twin, name, getattr(self, name))
        memo[id(self)] = twin
        return twin

    def __getstate__(self) -> Dict[str, Any]:
        skipped = ("_threads", "_lock", "in_flight")
        return {name: value for name, value in self.__dict__.items() if name not in skipped}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._threads = _PerThread()
        self._lock = threading.RLock()
        self.in_flight = {}

    # what the current call in this thread looks like ------------------------------------------------------------
    @property
    def call(self) -> CallRecord:
        return self._threads.call

    @property
    def history(self) -> StepHistory:
        return self._threads.history

    @property
    def latent_hw(self) -> Optional[Tuple[int, int]]:
        return self._threads.call.latent_hw

    @property
    def progress(self) -> float:
        return self._threads.call.progress

    @property
    def merged_blocks(self) -> int:
        """Blocks that merged during the latest call in this thread."""
        return self._threads.call.merged_blocks

    @property
    def finest_level(self) -> Optional[int]:
        """Smallest downsampling factor seen at a transformer block during the latest call in this thread."""
        return self._threads.call.finest_level

    # a call's lifetime ---------------------------------------------------------------------------------------------
    def begin_call(self, sample: Any, timestep: Any, layer: Any = None) -> None:
        """Start the record of a forward call of ``layer`` (the model's pre-hook). Calls of this thread that were
        left by an exception the hooks never saw (Ctrl-C) are ended first."""
        self._forget_history_after_reset()
        frame = None if tracing() else _call_frame()
        if self._threads.stack and frame is not None:
            self._drop_ended(layer, running=frame)
        shape = getattr(sample, "shape", None)
        latent_hw = (int(shape[-2]), int(shape[-1])) if shape is not None and len(shape) == 4 else None
        call = CallRecord()
        if self.reads_timestep:
            self._read_timestep(timestep, call)  # may raise: then nothing has changed
        self.calls += 1
        call.number = self.calls
        call.epoch = self.epoch
        call.latent_hw = latent_hw
        call.timestep = timestep
        call.frame = frame
        self._threads.stack.append(call)
        self._threads.call = call
        with self._lock:
            self.in_flight.setdefault(threading.get_ident(), []).append(frame)

    def end_call(self, completed: bool = True) -> Optional[CallRecord]:
        """End the call in flight (the model's post-hook): drop what only it may use (plans, size, timestep); the
        counters for reporting stay. A call that failed puts the step history back as it was before it, so running
        the same generation again gives what a fresh model gives. Does nothing when no call of this thread began
        here (a pre-hook before ToMe's raised). Returns the record of the call it ended (its ``merged_blocks`` and
        ``finest_level`` stay for reporting), or None."""
        stack = self._threads.stack
        if not stack:
            return None
        frame = None if tracing() else _call_frame()
        index = len(stack) - 1
        if frame is not None:
            mine = [i for i, call in enumerate(stack) if call.frame == frame]
            if not mine:
                return None
            index = mine[-1]
        while len(stack) > index + 1:  # calls nested in this one that never ended (interrupted, caught in it)
            self._pop(completed=False)
        return self._pop(completed)

    def _pop(self, completed: bool) -> CallRecord:
        threads = self._threads
        call = threads.stack.pop()
        # a failed call puts the step history back as it found it, unless reset_tome came since: after a reset the
        # next call must start as on a fresh model
        if not completed and call.saved is not None and call.epoch == self.epoch:
            threads.history.restore(call.saved)
        call.saved = None
        call.plans.clear()
        call.shared.clear()
        call.active.clear()
        call.partitions.clear()
        call.latent_hw = None
        call.timestep, call.step_key, call.timestep_key = None, None, None
        threads.call = threads.stack[-1] if threads.stack else call  # (an ended call stays for its report)
        ident = threading.get_ident()
        with self._lock:
            frames = self.in_flight.get(ident)
            if frames:
                frames.pop()
            if not frames:
                self.in_flight.pop(ident, None)
        return call

    def _drop_ended(self, layer: Any, running: Optional[int] = None) -> None:
        """End the calls of this thread whose layer call is no longer running (left by KeyboardInterrupt or
        SystemExit), innermost first, putting back the step history each of them had advanced."""
        stack = self._threads.stack
        live = _live_calls(sys._getframe(1), layer)
        live.discard(running)  # the call starting now has no record yet
        while stack and stack[-1].frame not in live:
            self._pop(completed=False)

    def forget_calls_in_flight(self) -> None:
        """Drop every in-flight count (when the patch is removed: what is left belongs to calls that never ended)."""
        with self._lock:
            self.in_flight.clear()
        threads = self._threads
        while threads.stack:
            self._pop(completed=False)

    def busy_here(self, layer: Any = None) -> int:
        """How many calls of this model are running in this thread right now (more than 0 inside its own forward).
        With ``layer`` (the model), calls left by an interrupt are ended first and not counted."""
        if _CALL_CODE is None:  # a Paddle that runs hooks elsewhere: calls cannot be told apart, none is counted
            return 0
        if self._threads.stack and layer is not None and not tracing():
            self._drop_ended(layer)
        return len(self._threads.stack)

    def busy_elsewhere(self, layer: Any = None) -> int:
        """How many calls of this model are running in other threads right now. With ``layer`` (the model), a call
        whose thread has left its layer call (an interrupt the hooks never saw, or a thread that died) is not
        counted."""
        ident = threading.get_ident()
        with self._lock:  # (no call of another thread can end or begin while its frames are looked at)
            others = {thread: list(frames) for thread, frames in self.in_flight.items() if thread != ident and frames}
            if not others or layer is None or _CALL_CODE is None:
                return sum(len(frames) for frames in others.values())
            stacks = sys._current_frames()
            busy = 0
            for thread, frames in others.items():
                if thread not in stacks:  # the thread has died: its calls can never end, drop them
                    self.in_flight.pop(thread, None)
                    continue
                live = _live_calls(stacks.get(thread), layer)  # (only this model's calls: frame ids are reused)
                busy += sum(1 for frame in frames if frame is None or frame in live)
            return busy

    def _forget_history_after_reset(self) -> None:
        history = self._threads.history
        if history.epoch != self.epoch:
            history.epoch = self.epoch
            history.clear()

    def _read_timestep(self, timestep: Any, call: CallRecord) -> None:
        """The host-side part of a call for a ratio schedule or plan caching: the progress and the step count."""
        if converting():
            self.refuse_conversion()
        values = timestep_values(timestep)
        if values is not None and not np.isfinite(values).all():
            raise ValueError(
                f"ToMe got a timestep that is not finite ({values.tolist()}); a ratio schedule and plan caching need "
                "a finite timestep. Check the scheduler's timesteps (NaN usually comes from an earlier numeric error)."
            )
        history = self._threads.history
        call.saved = history.snapshot()
        call.timestep_key = None if values is None else tuple(int(v) for v in values.view(np.uint64))
        progress = None if values is None else self._progress_of(float(values[-1]))  # the noisiest item decides
        call.progress = 0.0 if progress is None else progress
        key = call.timestep_key if call.timestep_key is not None else ("call", self.calls + 1)
        history.advance(key, progress)

    def refuse_conversion(self) -> None:
        """Raise :class:`ToMeStaticGraphError` naming the option that reads the timestep on the host. Called when
        such a config runs under ``paddle.jit.to_static`` in any mode: when the model's own pre-hook is traced
        (a wrapper converted with ``full_graph=True``) and from the block hooks (which run inside the converted
        forward also when the model itself is converted in SOT mode and its pre-hook runs before the conversion)."""
        # SOT's simulation would hand this error to the user wrapped in an InnerError: have it run this function
        # as plain Python instead (a no-op outside the simulation), so the named error propagates as it is
        _run_as_python()
        what = "a ratio schedule" if self.config.is_scheduled else "recompute_every"
        raise ToMeStaticGraphError(
            f"ToMe with {what} cannot be converted with paddle.jit.to_static (in SOT mode or with full_graph=True): "
            "it reads the timestep at run time (the scheduled ratio decides how many tokens merge, a shape; the plan "
            "cache counts steps) and would be frozen into the program. Use a constant ratio and recompute_every=1 "
            "before converting."
        )

    def _progress_of(self, timestep: float) -> float:
        progress = 1.0 - timestep / self.train_timesteps
        if not 0.0 <= progress <= 1.0 and self.config.is_scheduled and not self.warned_timestep_range:
            self.warned_timestep_range = True
            warnings.warn(
                f"ToMe's ratio schedule got timestep {timestep:g}, outside [0, {self.train_timesteps}] "
                "(num_train_timesteps of the pipeline's scheduler, 1000 for a bare model): the progress "
                "1 - t/T is clipped to [0, 1]. Schedulers with continuous or sigma-based timesteps (EDM) do "
                "not fit a ratio schedule; use a constant ratio with them.",
                UserWarning,
                stacklevel=4,
            )
        return min(max(progress, 0.0), 1.0)

    # what the hooks record during a call ----------------------------------------------------------------------------
    def saw_level(self, level: int) -> int:
        """Note that a transformer block ran at downsampling ``level``; returns the finest level seen so far."""
        call = self._threads.call
        if call.finest_level is None or level < call.finest_level:
            call.finest_level = level
        return call.finest_level

    def set_plan(self, block_index: int, plan: Any) -> None:
        """The plan of block ``block_index`` for the call in flight (counted as merging unless an identity)."""
        call = self._threads.call
        call.plans[block_index] = plan
        if not plan.is_identity:
            call.merged_blocks += 1

    def plan_of(self, block_index: int) -> Any:
        """The plan of block ``block_index`` in the call in flight in this thread, or None."""
        plans = self._threads.call.plans
        return plans[block_index] if block_index in plans else None

    def end_block(self, block_index: int) -> None:
        """Forget a block's plan and any unmerge it left pending (the block's post-hook)."""
        call = self._threads.call
        _take(call.plans, block_index)
        prefix = f"{block_index}/"
        for key in [k for k in call.active if k.startswith(prefix)]:
            del call.active[key]

    def begin_merge(self, key: str, plan: Any) -> None:
        """A sub-layer ran on merged tokens; ``plan`` unmerges its output (``plan=None`` for ToDo: nothing to undo)."""
        self.merges += 1
        if plan is not None:
            self._threads.call.active[key] = plan

    def end_merge(self, key: str) -> Any:
        """The plan that unmerges the output of sub-layer ``key`` (None when it did not merge)."""
        return _take(self._threads.call.active, key)

    # plan caching and sharing --------------------------------------------------------------------------------------
    def cached_plan(self, key: str, batch: int, grid_h: int, grid_w: int) -> Optional[MergePlan]:
        """The plan a block (``key``: its index, or its level when plans are shared) may reuse at the current step
        under ``recompute_every``, or None. A reused plan keeps the ``r`` of the step it was computed at (with a
        ratio schedule, ``r`` follows the schedule at the recompute steps)."""
        history, every = self._threads.history, self.config.recompute_every
        entry = history.lookup(key)
        if entry is None:
            return None
        plan, step, grid = entry
        if plan.batch_size != batch or grid != (grid_h, grid_w):
            return None
        if isinstance(every, tuple):
            return None if history.step in every else plan
        return plan if history.step - step < every else None

    def store_plan(self, key: str, plan: MergePlan, grid_h: int, grid_w: int) -> None:
        self._threads.history.store(key, plan, (grid_h, grid_w))

    def shared_plan(self, num_tokens: int) -> Any:
        """The plan an earlier block of the call in flight made at ``num_tokens`` tokens (``share_plan="level"``)."""
        shared = self._threads.call.shared
        return shared[num_tokens] if num_tokens in shared else None

    def share_plan(self, num_tokens: int, plan: Any) -> None:
        self._threads.call.shared[num_tokens] = plan
