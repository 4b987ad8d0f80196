"""Model glue: attach ToMe to the transformer blocks of one model with forward hooks, and take it off again.

No block's ``forward`` is copied or replaced. One :class:`ModelPatch` per patched model (a UNet, one ControlNet)
registers:

* a pre-hook on the model that records the latent size and the timestep of the call (:class:`ToMeState`);
* a pre-hook on every ``BasicTransformerBlock`` that plans the merge from the block's input (the same metric as
  tomesd) when the block's level qualifies;
* a pre-hook/post-hook pair on ``attn1`` (and ``attn2``/``ff`` when enabled) that merges the sub-layer's input and
  unmerges its output, so the block's residual add sees full-size tensors, exactly where tomesd puts them.
  With ``method="todo"`` only ``attn1`` gets a pre-hook, which passes the downsampled tokens as its keys/values.

The token grid of a block comes from the latent size for UNets and ControlNets (``ceil(H/d) x ceil(W/d)`` at
downsampling ``d``) and from the patch embedding for transformer-only models (``H/p x W/p`` for DiT and PixArt-alpha
``Transformer2DModel`` with patch size ``p``, whose blocks all count as level 1).

What one model remembers between calls lives in :class:`ToMeState`: the step count and the cached plans of
``recompute_every`` (per thread), and counters. A ratio schedule is evaluated from the timestep of each call.

Removing the patch removes exactly those hooks and the one attribute it set, so the model's objects, parameters and
state dict are those of the untouched model.
"""

from __future__ import annotations

import inspect
import logging
import math
import threading
import warnings
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import paddle
from ppdiffusers.models.attention import BasicTransformerBlock

from .config import ToMeConfig, ratio_at, tokens_to_merge
from .merge import (
    DownsamplePlan,
    MergePlan,
    bipartite_soft_matching_random2d,
    find_downsample,
    max_ratio,
    partition_table,
    step_key,
    tracing,
)

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


def _timestep_values(timestep: Any) -> Optional[np.ndarray]:
    """The distinct timestep values of a call (float64, sorted), or None when there is none. Reads the timestep on
    the host: only options that need a Python number (a ratio schedule, plan caching) call this."""
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


def _take(table: Dict, key: Any) -> Any:
    """``table.pop(key, None)`` spelled so that Paddle's SOT tracer can follow it."""
    if key in table:
        return table.pop(key)
    return None


def _positional_index(model: Any, name: str, default: int) -> int:
    """Where argument ``name`` sits among the positional arguments of ``model.forward`` (the UNet takes the
    timestep second, ``Transformer2DModel`` third)."""
    try:
        names = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return default
    return names.index(name) if name in names else default


class _CallContext(threading.local):
    """What one forward call in one thread needs: a model called from two threads at once keeps two of these."""

    def __init__(self) -> None:
        self.latent_hw: Optional[Tuple[int, int]] = None
        self.timestep: Any = None  # as passed to the model (a device tensor stays on the device)
        self.step_key: Any = None  # 0-d int64 device tensor made from it when a block first needs a partition
        self.partitions: Dict[str, Any] = {}  # "<h>x<w>" -> partition table of every block at that grid
        self.timestep_key: Optional[Tuple[int, ...]] = None
        self.number = 0  # which call of the model this is (keys the partition when there is no timestep)
        self.epoch = 0  # the state's reset count this thread's step history belongs to
        self.saved: Any = None  # step history before the call in flight, restored if the call fails
        self.merged_blocks = 0
        self.finest_level: Optional[int] = None
        self.plans: Dict[int, MergePlan] = {}
        self.active: Dict[str, MergePlan] = {}  # by "<block>/<sub-layer>" (SOT supports no tuple keys)
        self.progress = 0.0  # 1 - t/T of the call: 0 at pure noise, 1 at the clean image
        # denoising steps, for plan caching: a step is a run of calls with the same timestep
        self.step = -1
        self.slot = 0  # which call at this step this is (the unprompted half of split guidance is slot 1)
        self.last_key: Any = None
        self.last_progress: Optional[float] = None
        self.cache: Dict[str, Tuple[Any, int, Tuple[int, int]]] = {}  # "<block>/<slot>" -> (plan, step, grid)


class ToMeState:
    """Runtime state of one patched model: what the current forward call looks like (per thread), and counters.

    The random partition of a block is a hash of ``(seed, block, grid, timestep, cell)`` computed on the device
    from the timestep tensor (see :func:`ppdiffusers_tome.merge.partition_table`), so it does not depend on how
    many calls came before, does not touch Paddle's RNG, reads nothing back to the host, and is the same for the
    prompted and unprompted halves of classifier-free guidance even when they arrive in separate calls. (A model
    called without a timestep falls back to keying by the number of the call.)

    Thread safety: every call keeps its own record per thread; :meth:`reset` only drops counters and each thread's
    step history (at that thread's next call), never a call in flight; :meth:`ModelPatch.remove` refuses to run
    while a call is in flight.
    """

    def __init__(self, config: ToMeConfig, train_timesteps: int = 1000, num_blocks: int = 1):
        self.config = config
        self.train_timesteps = int(train_timesteps)
        self.num_blocks = int(num_blocks)
        tome = config.method == "tome"
        # only a ratio schedule (r is a shape) and plan caching (steps) need the timestep as a Python number;
        # reading it is a device-to-host sync and cannot be traced into a static graph
        self.reads_timestep = tome and (config.is_scheduled or config.caches_plans)
        self.random = tome and config.use_rand
        self.call = _CallContext()
        self._lock = threading.Lock()
        self.in_flight: Dict[int, int] = {}  # thread ident -> calls of this model running in that thread
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
        self.plans_reused = 0
        self.warned_no_merge = False
        self.warned_timestep_range = False

    def __deepcopy__(self, memo) -> "ToMeState":
        # a copied model starts with the same counters and no call in flight (thread-locals cannot be copied)
        twin = ToMeState(self.config, self.train_timesteps, self.num_blocks)
        for name in ("calls", "merges", "plans_computed", "plans_reused", "warned_no_merge", "warned_timestep_range"):
            setattr(twin, name, getattr(self, name))
        memo[id(self)] = twin
        return twin

    def __getstate__(self) -> Dict[str, Any]:
        # pickle (multiprocessing with spawn, Ray, joblib) like deepcopy: settings and counters, no call in flight
        # (the thread-local call record cannot be pickled, and its cached plans belong to this process's threads)
        skipped = ("call", "_lock", "in_flight")
        return {name: value for name, value in self.__dict__.items() if name not in skipped}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.call = _CallContext()
        self._lock = threading.Lock()
        self.in_flight = {}

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
        call = self.call
        if call.epoch != self.epoch:  # reset() since this thread's last call: forget its step history
            call.epoch = self.epoch
            call.step, call.slot, call.last_key, call.last_progress = -1, 0, None, None
            call.cache.clear()
        shape = getattr(sample, "shape", None)
        latent_hw = (int(shape[-2]), int(shape[-1])) if shape is not None and len(shape) == 4 else None
        if self.reads_timestep:
            self._read_timestep(call, timestep)  # may raise: then nothing below has changed
        self.calls += 1
        call.number = self.calls
        call.merged_blocks = 0
        call.finest_level = None
        call.plans.clear()
        call.active.clear()
        call.partitions.clear()
        call.latent_hw = latent_hw
        call.timestep, call.step_key = timestep, None
        ident = threading.get_ident()
        with self._lock:
            self.in_flight[ident] = self.in_flight.get(ident, 0) + 1

    def _read_timestep(self, call: _CallContext, timestep: Any) -> None:
        """The host-side part of a call for a ratio schedule or plan caching: the progress and the step count."""
        if tracing():
            what = "a ratio schedule" if self.config.is_scheduled else "recompute_every"
            raise ToMeStaticGraphError(
                f"ToMe with {what} cannot be converted with paddle.jit.to_static: it reads the timestep at run time "
                "(the scheduled ratio decides how many tokens merge, a shape; the plan cache counts steps) and would "
                "be frozen into the program. Use a constant ratio and recompute_every=1 before converting."
            )
        values = _timestep_values(timestep)
        if values is not None and not np.isfinite(values).all():
            raise ValueError(
                f"ToMe got a timestep that is not finite ({values.tolist()}); a ratio schedule and plan caching need "
                "a finite timestep. Check the scheduler's timesteps (NaN usually comes from an earlier numeric error)."
            )
        saved = (call.step, call.slot, call.last_key, call.last_progress, dict(call.cache))
        call.timestep_key = None if values is None else tuple(int(v) for v in values.view(np.uint64))
        call.saved = saved
        progress = None
        if values is not None:  # the noisiest item of the batch decides
            progress = 1.0 - float(values[-1]) / self.train_timesteps
            if not 0.0 <= progress <= 1.0 and self.config.is_scheduled and not self.warned_timestep_range:
                self.warned_timestep_range = True
                warnings.warn(
                    f"ToMe's ratio schedule got timestep {float(values[-1]):g}, outside [0, {self.train_timesteps}] "
                    "(num_train_timesteps of the pipeline's scheduler, 1000 for a bare model): the progress "
                    "1 - t/T is clipped to [0, 1]. Schedulers with continuous or sigma-based timesteps (EDM) do "
                    "not fit a ratio schedule; use a constant ratio with them.",
                    UserWarning,
                    stacklevel=3,
                )
            progress = min(max(progress, 0.0), 1.0)
        call.progress = 0.0 if progress is None else progress
        self._track_step(call, progress)

    MAX_SLOTS = 8  # calls at one timestep beyond this start a new generation (bounds the plan cache)

    def _track_step(self, call: _CallContext, progress: Optional[float]) -> None:
        """Count denoising steps: calls at the same timestep are one step (slots 0, 1, ...); a timestep noisier than
        the last one starts a new generation, which forgets the cached plans. So does a run of more than
        ``MAX_SLOTS`` calls at one timestep (a one-step model called again and again)."""
        key = call.timestep_key if call.timestep_key is not None else ("call", call.number)
        if call.last_key is not None and key == call.last_key and call.slot + 1 < self.MAX_SLOTS:
            call.slot += 1
            return
        restart = progress is not None and call.last_progress is not None and progress < call.last_progress
        restart = restart or (call.last_key is not None and key == call.last_key)
        if call.last_key is None or restart:
            call.step = 0
            call.cache.clear()
        else:
            call.step += 1
        call.slot = 0
        call.last_key = key
        call.last_progress = progress

    def end_call(self, completed: bool = True) -> None:
        """Drop what only the call in flight may use (plans, size, timestep); the counters for reporting stay. A call
        that failed puts the step history back as it was before it, so running the same generation again gives
        what a fresh model gives."""
        call = self.call
        if not completed and call.saved is not None:
            call.step, call.slot, call.last_key, call.last_progress, cache = call.saved
            call.cache.clear()
            call.cache.update(cache)
        call.saved = None
        call.plans.clear()
        call.active.clear()
        call.partitions.clear()
        call.latent_hw = None
        call.timestep, call.step_key, call.timestep_key = None, None, None
        ident = threading.get_ident()
        with self._lock:
            if self.in_flight.get(ident, 0) > 1:
                self.in_flight[ident] -= 1
            else:
                self.in_flight.pop(ident, None)

    def busy_elsewhere(self) -> int:
        """How many calls of this model are running in other threads right now."""
        ident = threading.get_ident()
        with self._lock:
            return sum(count for thread, count in self.in_flight.items() if thread != ident)

    def cached_plan(self, block_index: int, batch: int, grid_h: int, grid_w: int) -> Optional[MergePlan]:
        """The plan this block may reuse at the current step under ``recompute_every``, or None. A reused plan
        keeps the ``r`` of the step it was computed at (with a ratio schedule, ``r`` follows the schedule at the
        recompute steps)."""
        call, every = self.call, self.config.recompute_every
        entry = call.cache.get(f"{block_index}/{call.slot}")
        if entry is None:
            return None
        plan, step, grid = entry
        if plan.batch_size != batch or grid != (grid_h, grid_w):
            return None
        if isinstance(every, tuple):
            return None if call.step in every else plan
        return plan if call.step - step < every else None

    def store_plan(self, block_index: int, plan: MergePlan, grid_h: int, grid_w: int) -> None:
        call = self.call
        call.cache[f"{block_index}/{call.slot}"] = (plan, call.step, (grid_h, grid_w))

    def partition_for(self, block_index: int, grid_h: int, grid_w: int) -> Any:
        """Block ``block_index``'s random partition of a ``grid_h x grid_w`` grid in the call in flight: a row of a
        table drawn once per call and grid for every block, on the device, from the timestep tensor."""
        call, key = self.call, f"{grid_h}x{grid_w}"
        table = call.partitions[key] if key in call.partitions else None
        if table is None:
            if call.step_key is None:  # no timestep given: the number of this call (then the history does matter)
                call.step_key = step_key(call.timestep if call.timestep is not None else call.number)
            config = self.config
            table = partition_table(grid_h, grid_w, config.sx, config.sy, call.step_key, config.seed, self.num_blocks)
            call.partitions[key] = table
        return table[block_index]


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

    def __setstate__(self, state: Dict[str, Any]) -> None:
        # unpickled in a fresh process: Paddle's hook-id counter starts again at 0 there, and the next hook
        # registered would take this id and overwrite this hook in the layer's table
        self.__dict__.update(state)
        helper = paddle.nn.layer.layers.HookRemoveHelper
        helper.next_hook_id = max(helper.next_hook_id, self.hook_id + 1)

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
        if isinstance(plan, DownsamplePlan):  # ToDo: queries stay, keys/values come from the downsampled tokens
            if kwargs.get("encoder_hidden_states") is not None:
                return None  # not self-attention after all (only_cross_attention blocks)
            self.block.patch.state.merges += 1
            return args, dict(kwargs, encoder_hidden_states=plan.keys_values(x))
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

    def __init__(self, model: paddle.nn.Layer, config: ToMeConfig, train_timesteps: int = 1000):
        self.model = model
        self.config = config
        self.train_timesteps = int(train_timesteps)
        self.state = ToMeState(config, train_timesteps, num_blocks=len(find_blocks(model)))
        self.blocks: List[_BlockHooks] = []
        self._hooks: List[_HookRecord] = []
        self.auto_level = config.max_downsample == "auto"
        self.todo = config.method == "todo"
        self.fixed_ratio = None if config.is_scheduled else config.ratio
        self.caches = config.caches_plans  # (Paddle's SOT tracer cannot call dataclass properties)
        # transformer-only models (DiT, PixArt-alpha): the token grid is the patch grid
        patch_size = getattr(model, "patch_size", None) if getattr(model, "is_input_patches", False) else None
        self.patch_size: Optional[int] = int(patch_size) if patch_size else None
        self.timestep_arg = _positional_index(model, "timestep", default=1)

    @classmethod
    def install(cls, model: paddle.nn.Layer, config: ToMeConfig, train_timesteps: int = 1000) -> "ModelPatch":
        blocks = find_blocks(model)
        if not blocks:
            raise ValueError(f"{type(model).__name__} has no transformer blocks (BasicTransformerBlock) to patch")
        previous = get_patch(model)
        if previous is not None:  # never leave a patch's hooks behind unreachable
            previous.remove()
        patch = cls(model, config, train_timesteps)
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
            ("attn1", self.config.merge_attn or self.todo, True),
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
                    if not self.todo:  # ToDo leaves the output as it is
                        add(_HookRecord(sublayer, "post", sub, "after"))

    def _remove_hooks(self) -> None:
        while self._hooks:
            self._hooks.pop().remove()

    def check_idle(self) -> None:
        """Raise ``RuntimeError`` if another thread is running this model: taking hooks off (or swapping them)
        half-way through its forward would leave merged tokens that are never unmerged."""
        busy = self.state.busy_elsewhere()
        if busy:
            raise RuntimeError(
                f"cannot change ToMe on {type(self.model).__name__} while {busy} forward call(s) of it are running in "
                "other threads; apply_tome/remove_tome take effect between calls: wait for the calls to finish "
                "(reset_tome is safe at any time)"
            )

    def remove(self) -> None:
        """Take every hook off and drop the patch attribute; the model is then exactly as before ``install``.
        Raises ``RuntimeError`` (and changes nothing) while another thread is running the model."""
        self.check_idle()
        self._remove_hooks()
        self.state.end_call()
        self.state.in_flight.clear()  # what is left belongs to this thread: calls that never reached their end
        self.blocks = []
        if self.model.__dict__.get(PATCH_ATTR) is self:
            del self.model.__dict__[PATCH_ATTR]

    # hooks ---------------------------------------------------------------------------------------------------
    def _before_model(self, layer, args, kwargs):
        sample = args[0] if args else kwargs.get("sample", kwargs.get("hidden_states"))
        timestep = args[self.timestep_arg] if len(args) > self.timestep_arg else kwargs.get("timestep")
        self.state.begin_call(sample, timestep)
        return None

    def _after_model(self, layer, args, kwargs, output):
        state, config = self.state, self.config
        completed = output is not None  # None when the forward raised (Paddle runs this hook anyway)
        state.end_call(completed)
        if completed and state.merged_blocks == 0 and self.fixed_ratio != 0 and not state.warned_no_merge and self.blocks:
            level, name = state.finest_level, "ToDo" if self.todo else "ToMe"
            message = None
            if level is None:
                message = (
                    f"{name} changed nothing in {type(self.model).__name__}: no transformer block's tokens form the "
                    f"{'patch' if self.patch_size else 'latent'} grid of the input (a layout this package does "
                    "not know, such as video frames folded into the tokens)."
                )
            elif not self.auto_level and level > config.max_downsample:
                message = (
                    f"{name} merged no tokens in {type(self.model).__name__}: its highest-resolution transformer "
                    f"blocks run at {level}x downsampling, above max_downsample={config.max_downsample}. "
                    f"Use max_downsample={level} (or 'auto') to merge there."
                )
            if message is not None:
                state.warned_no_merge = True
                warnings.warn(message, UserWarning, stacklevel=2)
        return None

    def token_grid(self, num_tokens: int) -> Optional[Tuple[int, int, int]]:
        """``(level, grid_h, grid_w)`` of a block with ``num_tokens`` tokens in the call in flight, or None."""
        latent_h, latent_w = self.state.latent_hw
        if self.patch_size is not None:  # every block of a patch transformer runs on the patch grid
            grid_h, grid_w = latent_h // self.patch_size, latent_w // self.patch_size
            return (1, grid_h, grid_w) if grid_h * grid_w == num_tokens else None
        level = find_downsample(latent_h, latent_w, num_tokens)
        if level is None:
            return None
        return level, math.ceil(latent_h / level), math.ceil(latent_w / level)

    def plan_for(self, block_index: int, hidden: Any) -> Optional[MergePlan]:
        """The merge plan of one block call, or None when this block does not merge in this call."""
        state, config = self.state, self.config
        if state.latent_hw is None or not isinstance(hidden, TENSOR_TYPES) or hidden.ndim != 3:
            return None
        num_tokens = hidden.shape[1]
        grid = self.token_grid(num_tokens)
        if grid is None:
            return None
        level, grid_h, grid_w = grid
        call = state.call
        if call.finest_level is None or level < call.finest_level:
            call.finest_level = level
        # "auto": the finest level with transformer blocks, which is the first one a UNet's down path reaches
        if level > (call.finest_level if self.auto_level else config.max_downsample):
            return None
        if self.todo:
            call.merged_blocks += 1
            return DownsamplePlan(num_tokens, hidden.shape[0], grid_h, grid_w, config.downsample_factor,
                                  config.downsample_mode)
        ratio = self.fixed_ratio if self.fixed_ratio is not None else self.scheduled_ratio(call.progress)
        r = tokens_to_merge(num_tokens, ratio)  # (Paddle's SOT tracer cannot call dataclass methods)
        if r <= 0:
            return None
        plan = None
        if self.caches:
            plan = state.cached_plan(block_index, hidden.shape[0], grid_h, grid_w)
        if plan is None:
            plan = self.make_plan(block_index, hidden, grid_h, grid_w, r)
            state.plans_computed += 1
            if self.caches:
                state.store_plan(block_index, plan, grid_h, grid_w)
        else:
            state.plans_reused += 1
        if not plan.is_identity:
            call.merged_blocks += 1
        return plan

    def scheduled_ratio(self, progress: float) -> float:
        ratio = ratio_at(self.config.ratio, progress)
        limit = max_ratio(self.config.sx, self.config.sy)
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float, np.floating)) or not (
            ratio == 0 or 0 < ratio < limit
        ):
            raise ValueError(f"ratio(progress={progress:.3f}) returned {ratio!r}; it must be a number in [0, {limit:g})")
        return float(ratio)

    def make_plan(self, block_index: int, hidden: Any, grid_h: int, grid_w: int, r: int) -> MergePlan:
        """Match the block input ``hidden`` on its ``grid_h x grid_w`` grid and plan the merge of ``r`` tokens."""
        config = self.config
        cells = (grid_h // config.sy) * (grid_w // config.sx)
        partition = self.state.partition_for(block_index, grid_h, grid_w) if config.use_rand and cells else None
        return bipartite_soft_matching_random2d(
            hidden, grid_w, grid_h, config.sx, config.sy, r, no_rand=True, partition=partition
        )
