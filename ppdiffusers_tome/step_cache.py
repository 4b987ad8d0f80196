"""Step caching for UNet pipelines (DeepCache-style): a full UNet pass every few denoising steps; on the steps between,
only the shallow branch runs and the deep features come from the last full pass.

One technique in one file: :class:`CacheConfig` (the validated settings), :class:`StepCache` (the per-model state and
hooks) and :func:`apply_cache` / :func:`remove_cache` / :func:`reset_cache` / :func:`cache_status`.

How a cached step works. A UNet's skip connections tie ``down_blocks[i]`` to ``up_blocks[-1 - i]``. With
``depth=d`` the shallow branch is ``conv_in``, ``down_blocks[:d]``, ``up_blocks[-d:]`` and the output layers; the
deep blocks (``down_blocks[d:]``, ``mid_block``, ``up_blocks[:-d]``) run only on full steps, where their outputs are
kept. On a cached step each deep block returns its output of the last full step without computing anything, so the
shallow up blocks receive the deep feature of that step and this step's own skip connections. A ControlNet gets the
same treatment (its ``down_blocks[d:]`` and ``mid_block``): the residuals it would compute for the deep blocks are
thrown away by the UNet on a cached step, so they are not computed. The downsampler of ``down_blocks[d - 1]`` is kept
like a deep block, in the UNet and in a ControlNet: its output feeds only deep blocks. What still runs on a cached
step and is thrown away: a ControlNet's 1x1 output convolutions on the kept deep features (one per deep residual, and
the mid block's).

Steps are counted per pipeline call: calling a pipeline starts a fresh history for the calling thread (and ends it
when the call returns or raises), so two calls, or two threads, never share cached features. A model used without a
pipeline counts its own calls from :func:`apply_cache` or :func:`reset_cache`. Nothing is read from the device:
which steps are full is decided by a Python counter, never by a timestep's value.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import paddle

from .hooks import HookCall
from .ops.runtime import converting

__all__ = ["CacheConfig", "StepCache", "StepCacheError", "apply_cache", "cache_status", "get_cache", "remove_cache",
           "reset_cache"]

logger = logging.getLogger(__name__)

_ATTRIBUTE = "_ppdiffusers_tome_step_cache"  # where a model keeps its StepCache (in its __dict__)
_LOCK = threading.RLock()


class StepCacheError(RuntimeError):
    """Raised when a step cache cannot do what a call asks (for example, conversion to a static graph)."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class CacheConfig:
    """Settings of the step cache.

    Args:
        interval: a full UNet pass every ``interval`` steps (``int >= 1``; 1 = every step, the vanilla forward).
        depth: how many resolution levels form the shallow branch that runs on every step (``int >= 1``, at most the
            model's number of down blocks minus 1): ``down_blocks[:depth]`` and ``up_blocks[-depth:]``.
        start: steps before ``start`` are all full (``int >= 0``); cached steps begin at ``start + 1``.
        stop: steps from ``stop`` on are all full (``None``: to the end; else ``int > start``).
        full_steps: the 0-based steps that are full, e.g. ``(0, 1, 2, 4, 7, 11)`` to spend full steps early; when
            given, ``interval`` is not used (``start``/``stop`` still are). Step 0 is always full.

    >>> config = CacheConfig(interval=3)
    >>> [step for step in range(10) if config.is_full(step)]
    [0, 3, 6, 9]
    >>> [step for step in range(10) if CacheConfig(interval=2, start=3, stop=8).is_full(step)]
    [0, 1, 2, 3, 5, 7, 8, 9]
    """

    interval: int = 3
    depth: int = 1
    start: int = 0
    stop: Optional[int] = None
    full_steps: Optional[Tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if not _is_int(self.interval) or self.interval < 1:
            raise ValueError("interval must be an integer >= 1 (a full UNet pass every interval steps); "
                             f"got {self.interval!r}")
        if not _is_int(self.depth) or self.depth < 1:
            raise ValueError("depth must be an integer >= 1 (resolution levels in the shallow branch); "
                             f"got {self.depth!r}")
        if not _is_int(self.start) or self.start < 0:
            raise ValueError(f"start must be an integer >= 0 (steps before it are full); got {self.start!r}")
        if self.stop is not None and (not _is_int(self.stop) or self.stop <= self.start):
            raise ValueError(f"stop must be None or an integer > start={self.start} (steps from it are full); "
                             f"got {self.stop!r}")
        if self.full_steps is not None:
            steps = self.full_steps
            if isinstance(steps, (str, bytes)) or not isinstance(steps, (list, tuple, range)) or not all(
                    _is_int(s) and s >= 0 for s in steps) or len(steps) == 0:
                raise ValueError("full_steps must be None or a non-empty list, tuple or range of integers >= 0 (the "
                                 f"0-based full steps); got {steps!r}")
            object.__setattr__(self, "full_steps", tuple(sorted({int(s) for s in steps} | {0})))

    def is_full(self, step: int) -> bool:
        """Whether 0-based ``step`` of a generation runs the whole UNet."""
        if step <= self.start or (self.stop is not None and step >= self.stop):
            return True
        if self.full_steps is not None:
            return step in self.full_steps
        return (step - self.start) % self.interval == 0

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


class _ThreadState:
    """One thread's history on one model: the step of the generation, the kept deep outputs and their input shape."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.step = 0
        self.kept: Dict[str, Any] = {}
        self.pending: Dict[str, Any] = {}
        self.shape: Optional[Tuple[int, ...]] = None  # the input shape of the first deep block at the kept step
        self.full = True
        self.in_flight = False
        self.program: Optional[bool] = None  # set by a StepProgram: the kind of step it fixes (True = full)


class _DeepBlock:
    """The ``forward`` a deep block gets while the cache is on: the block's own forward on full steps (its output
    kept when the next step may be cached), its kept output on cached steps."""

    def __init__(self, cache: StepCache, name: str, layer: paddle.nn.Layer, first: bool):
        self.cache, self.name, self.layer, self.first = cache, name, layer, first
        self.original = layer.__dict__.get("forward")  # an instance override present before, to put back

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = self.cache.thread_state()
        if not state.in_flight:  # called outside the model's forward: behave as the block itself
            return self._run(*args, **kwargs)
        if self.first and state.program is None:
            hidden = args[0] if args else kwargs.get("hidden_states")
            shape = tuple(hidden.shape) if hasattr(hidden, "shape") else None
            if not state.full and shape != state.shape:  # another size or batch than the kept step: compute it all
                state.full = True
                self.cache.fallbacks += 1
            if state.full:
                state.pending["__shape__"] = shape
        if not state.full:
            if self.name in state.kept:
                return state.kept[self.name]
            return self._stand_in(args, kwargs)  # a step program keeps only the feature the shallow branch reads
        out = self._run(*args, **kwargs)
        state.pending[self.name] = out
        return out

    def _stand_in(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """What a deep block whose output nothing reads returns on a cached step of a step program: its own input,
        in the structure of its output (a down block: hidden states and one residual per output), at no cost."""
        hidden = args[0] if args else kwargs["hidden_states"]
        if not self.name.startswith("down_blocks") or ".downsamplers." in self.name:
            return hidden
        count = len(self.layer.resnets) + len(getattr(self.layer, "downsamplers", None) or ())
        return hidden, (hidden,) * count

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        if self.original is not None:
            return self.original(*args, **kwargs)
        return type(self.layer).forward(self.layer, *args, **kwargs)


class StepCache:
    """The step cache of one model (a UNet or a ControlNet): hooks on the model that count its calls, and the
    ``forward`` of its deep blocks. Made by :func:`apply_cache`; :meth:`remove` puts everything back."""

    def __init__(self, model: paddle.nn.Layer, config: CacheConfig):
        self.model, self.config = model, config
        self.deep = deep_blocks(model, config.depth)
        self._local = threading.local()
        self._handles: List[Any] = []
        self.calls = self.full_calls = self.cached_calls = self.fallbacks = 0

    def thread_state(self) -> _ThreadState:
        state = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = _ThreadState()
        return state

    # lifecycle ---------------------------------------------------------------------------------------------------
    def install(self) -> None:
        for i, (name, layer) in enumerate(self.deep):
            layer.forward = _DeepBlock(self, name, layer, first=i == 0)
        # plain callable objects, not bound methods: Paddle's SOT tracer writes a bound method's repr into its guards
        self._handles = [self.model.register_forward_pre_hook(HookCall(self, "_before")),
                         self.model.register_forward_post_hook(HookCall(self, "_after"))]
        self.model.__dict__[_ATTRIBUTE] = self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for _, layer in self.deep:
            hook = layer.__dict__.get("forward")
            if isinstance(hook, _DeepBlock):
                if hook.original is not None:
                    layer.forward = hook.original
                else:
                    del layer.__dict__["forward"]
        self.model.__dict__.pop(_ATTRIBUTE, None)

    def begin_generation(self) -> None:
        """A pipeline call starts (this thread): the next model call is step 0."""
        self.thread_state().reset()

    end_generation = begin_generation  # a pipeline call ended or failed: nothing is kept for the next one

    # hooks -------------------------------------------------------------------------------------------------------
    def _before(self, layer: paddle.nn.Layer, inputs: Any) -> None:
        state = self.thread_state()
        if state.program is not None:  # a StepProgram fixes the kind of step and supplies the kept features
            state.full, state.pending, state.in_flight = state.program, {}, True
            return
        if converting():
            raise StepCacheError(
                "the step cache keeps deep features between calls in Python, which a static graph cannot hold: "
                "export the full and the cached step as two programs (ppdiffusers_tome.cache_export.StepPrograms), "
                "or remove it (remove_cache) before paddle.jit.to_static"
            )
        if state.in_flight:  # the previous call of this thread raised (or was interrupted): start over
            state.reset()
        state.full = self.config.is_full(state.step) or not state.kept
        state.pending = {}
        state.in_flight = True

    def _after(self, layer: paddle.nn.Layer, inputs: Any, outputs: Any) -> None:
        state = self.thread_state()
        if state.program is not None:  # the StepProgram reads the pending outputs; no step is counted
            state.in_flight = False
            return
        self.calls += 1
        if state.full:
            self.full_calls += 1
            keep = not self.config.is_full(state.step + 1)  # keep the deep outputs only if the next step can use them
            shape = state.pending.pop("__shape__", None)
            state.kept, state.shape = (state.pending, shape) if keep else ({}, None)
        else:
            self.cached_calls += 1
        state.pending = {}
        state.step += 1
        state.in_flight = False

    def status(self) -> Dict[str, Any]:
        return {"settings": self.config.to_dict(), "deep_blocks": len(self.deep), "calls": self.calls,
                "full_calls": self.full_calls, "cached_calls": self.cached_calls, "fallbacks": self.fallbacks}


def deep_blocks(model: paddle.nn.Layer, depth: int) -> List[Tuple[str, paddle.nn.Layer]]:
    """The blocks of ``model`` that run only on full steps, in call order (the downsampler of the last shallow down
    block first). Raises ValueError, naming ``depth`` and
    its range, when the model has no such structure or ``depth`` leaves no deep block."""
    down = getattr(model, "down_blocks", None)
    if down is None or not isinstance(down, paddle.nn.LayerList) or len(down) < 2:
        raise ValueError(
            f"apply_cache needs a UNet2DConditionModel or a ControlNetModel (down_blocks, mid_block, up_blocks); "
            f"{type(model).__name__} has no such blocks"
        )
    up = getattr(model, "up_blocks", None)
    if not depth < len(down) or (up is not None and len(up) != len(down)):
        raise ValueError(f"depth must be in [1, {len(down) - 1}] for {type(model).__name__} ({len(down)} down "
                         f"blocks: at least one level must stay deep); got {depth}")
    # the last shallow down block's downsampler feeds only the deep blocks (its output is their input and a skip
    # connection of a deep up block): it is kept like them
    samplers = getattr(down[depth - 1], "downsamplers", None) or []
    blocks = [(f"down_blocks.{depth - 1}.downsamplers.{i}", sampler) for i, sampler in enumerate(samplers)]
    blocks += [(f"down_blocks.{i}", down[i]) for i in range(depth, len(down))]
    if getattr(model, "mid_block", None) is not None:
        blocks.append(("mid_block", model.mid_block))
    if up is not None:
        blocks += [(f"up_blocks.{i}", up[i]) for i in range(len(up) - depth)]
    return blocks


def get_cache(model: Any) -> Optional[StepCache]:
    """The :class:`StepCache` on ``model``, or None."""
    return getattr(model, "__dict__", {}).get(_ATTRIBUTE)


# pipelines -------------------------------------------------------------------------------------------------------
_PIPELINE_ATTRIBUTE = "_ppdiffusers_tome_step_caches"
_wrapped_classes: Set[type] = set()  # the pipeline classes whose __call__ is wrapped


def _wrap_pipeline_class(cls: type) -> None:
    """Make calls of pipelines of ``cls`` open and close a generation on the step caches they carry. The class's
    ``__call__`` is wrapped once per process and left wrapped: an instance without step caches (or after
    :func:`remove_cache`) runs the original call directly, with nothing else done."""
    if cls in _wrapped_classes:
        return
    original = cls.__call__
    _wrapped_classes.add(cls)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        caches = self.__dict__.get(_PIPELINE_ATTRIBUTE)
        if not caches:
            return original(self, *args, **kwargs)
        for cache in caches:
            cache.begin_generation()
        try:
            return original(self, *args, **kwargs)
        finally:
            for cache in caches:
                cache.end_generation()

    __call__.__wrapped__ = original
    __call__.__doc__ = getattr(original, "__doc__", None)
    cls.__call__ = __call__


# public functions ------------------------------------------------------------------------------------------------
def _models(obj: Any) -> Tuple[Optional[Any], List[Tuple[str, paddle.nn.Layer]]]:
    """``(pipeline or None, [(name, model)])``: the UNet and ControlNets a step cache goes on."""
    from ppdiffusers import DiffusionPipeline

    if isinstance(obj, DiffusionPipeline):
        found = []
        for name in ("unet", "controlnet"):
            found += _expand(getattr(obj, name, None), name)
        if not any(name == "unet" for name, _ in found):
            raise ValueError(f"apply_cache needs a pipeline with a UNet (a `unet` component); {type(obj).__name__} "
                             "has none")
        return obj, found
    models = _expand(obj, type(obj).__name__)
    if not models:
        raise ValueError("apply_cache/remove_cache expects a ppdiffusers pipeline, a UNet2DConditionModel, a "
                         f"ControlNetModel, a MultiControlNetModel or a list of them; got {type(obj).__name__}")
    return None, models


def _expand(obj: Any, name: str) -> List[Tuple[str, paddle.nn.Layer]]:
    if obj is None:
        return []
    nets = getattr(obj, "nets", None)
    if isinstance(nets, paddle.nn.LayerList):  # MultiControlNetModel: net by net
        return [(f"{name}.nets.{i}", net) for i, net in enumerate(nets)]
    if isinstance(obj, (list, tuple)):
        return [item for i, sub in enumerate(obj) for item in _expand(sub, f"{name}[{i}]")]
    if isinstance(obj, paddle.nn.Layer):
        return [(name, obj)]
    return []


def apply_cache(obj: Any, interval: int = 3, depth: int = 1, start: int = 0, stop: Optional[int] = None,
                full_steps: Optional[Sequence[int]] = None) -> Any:
    """Put a step cache on a pipeline (its UNet and ControlNets), a UNet, a ControlNet, a MultiControlNet or a list
    of them; returns ``obj``. Applying again replaces the settings; :func:`remove_cache` takes it off. Bad settings
    raise ``ValueError`` naming the argument before anything changes. For inference: the kept features are the
    tensors of the last full step.

    See :class:`CacheConfig` for the arguments.

    Example:
        >>> import ppdiffusers_tome
        >>> from ppdiffusers_tome.testing import tiny_sd_pipeline
        >>> pipe = tiny_sd_pipeline().apply_cache(interval=3)
        >>> ppdiffusers_tome.cache_status(pipe)["unet"]["settings"]["interval"]
        3
        >>> pipe = pipe.remove_cache()
    """
    config = CacheConfig(interval=interval, depth=depth, start=start, stop=stop, full_steps=full_steps)
    pipeline, models = _models(obj)
    for _, model in models:  # every check before any change
        deep_blocks(model, config.depth)
    with _LOCK:
        for _, model in models:
            _remove_from(model)
        caches = []
        for _, model in models:
            cache = StepCache(model, config)
            cache.install()
            caches.append(cache)
        if pipeline is not None:
            pipeline.__dict__[_PIPELINE_ATTRIBUTE] = tuple(caches)
            _wrap_pipeline_class(type(pipeline))
    return obj


def _remove_from(model: paddle.nn.Layer) -> bool:
    cache = get_cache(model)
    if cache is None:
        return False
    cache.remove()
    return True


def remove_cache(obj: Any) -> Any:
    """Take the step cache off everything :func:`apply_cache` put it on in ``obj``; every deep block gets its own
    ``forward`` back and the model its hooks. Returns ``obj``; a no-op where there is none.

    >>> from ppdiffusers_tome.testing import tiny_unet
    >>> unet = apply_cache(tiny_unet())
    >>> remove_cache(unet) is unet, get_cache(unet) is None, "forward" in unet.mid_block.__dict__
    (True, True, False)
    """
    pipeline, models = _models(obj)
    with _LOCK:
        for _, model in models:
            _remove_from(model)
        if pipeline is not None:
            pipeline.__dict__.pop(_PIPELINE_ATTRIBUTE, None)
    return obj


def reset_cache(obj: Any) -> Any:
    """Start a fresh history (step 0, nothing kept) for the calling thread on every cached model of ``obj``; needed
    only when a model is called directly, outside a pipeline call, for a new generation."""
    _, models = _models(obj)
    for _, model in models:
        cache = get_cache(model)
        if cache is not None:
            cache.begin_generation()
    return obj


def cache_status(obj: Any) -> Dict[str, Optional[Dict[str, Any]]]:
    """Per model of ``obj``: ``None`` without a step cache, else its ``settings``, the number of ``deep_blocks``
    and the counters ``calls``, ``full_calls``, ``cached_calls`` and ``fallbacks`` (cached steps computed in full
    because the input's shape differed from the kept step's)."""
    _, models = _models(obj)
    status = {}
    for name, model in models:
        cache = get_cache(model)
        status[name] = None if cache is None else cache.status()
    return status


CONFIG_FIELDS = tuple(field.name for field in fields(CacheConfig))
