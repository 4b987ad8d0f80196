"""Step caching (DeepCache-style for UNets, block caching for transformers): a full pass every few denoising steps;
on the steps between, only the shallow part runs and the deep part's work comes from the last full step.

One technique in one file: :class:`CacheConfig` (the validated settings), the hooks that do it (through
:mod:`ppdiffusers_tome.core.registry`), and :func:`apply_cache` / :func:`remove_cache` / :func:`reset_cache` /
:func:`cache_status`. Which parts of a model are deep is :mod:`ppdiffusers_tome.cache.layout`'s.

**UNets and ControlNets.** ``down_blocks[i]`` and ``up_blocks[-1 - i]`` are tied by skip connections. With
``depth=d`` the deep blocks (``down_blocks[d:]``, ``mid_block``, ``up_blocks[:-d]``, and the downsampler of
``down_blocks[d - 1]``, whose output only they read) run on full steps, where their outputs are kept; on a cached step
each returns its kept output without computing anything, so the shallow up blocks receive the deep feature of the
last full step and this step's own skip connections. A ControlNet gets the same treatment (the residuals it would
compute for the deep blocks are thrown away by the UNet on a cached step). With ``layers=k`` the cached step runs
still less (DeepCache's finer branches, see :mod:`~ppdiffusers_tome.cache.layout`).

**Transformer-only models** (SD3's MMDiT, DiT, PixArt-alpha). The first ``depth`` and the last ``depth`` transformer
blocks run on every step; on a cached step the blocks between contribute what they added on the last full step
(their output minus their input, for SD3 on both streams), so the changes of the blocks that run still reach the
output.

Steps are the pipeline's denoising steps and each call site of a step (split guidance, a panorama's views) keeps its
own features (:mod:`ppdiffusers_tome.core.generation`): every pipeline call that reaches a cached model starts at step 0,
whatever pipeline object made it. A model called outside a pipeline counts its calls from :func:`apply_cache` or
:func:`reset_cache`. With gradients on (training, guidance by gradients) every call is full and nothing is kept.
Nothing is read from the device: which steps are full is decided by Python counters.
"""

from __future__ import annotations

import logging
import threading
import warnings
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Dict, List, Optional, Tuple, Union

import paddle

from ..core import generation
from ..core.calls import drop_calls_if_alone, model_calls, refuse_if_running
from ..core.registry import LOCK, Hook, StaticGraphError, add_hook, hooks_of, remove_hook
from ..core.targets import fused_sd3_reason, is_fused_sd3, keyword_call, pipeline_candidates, resolve
from ..core.validation import as_choice, is_int, shown
from ..ops.runtime import converting
from .layout import AUTO, Layout, TransformerLayout, layout_of, too_few_blocks

__all__ = ["CacheConfig", "StepCache", "StepCacheError", "apply_cache", "cache_status", "get_cache", "remove_cache",
           "reset_cache"]

logger = logging.getLogger(__name__)

NAME = "cache"  # the name of the step cache's hooks in every registry


class StepCacheError(StaticGraphError):
    """Raised when a step cache cannot do what a call asks (for example, conversion to a static graph)."""


@dataclass(frozen=True)
class CacheConfig:
    """Settings of the step cache.

    Args:
        interval: a full pass every ``interval`` steps (``int >= 1``; 1 = every step, the vanilla forward).
        depth: how much runs on every step: for a UNet or ControlNet, the resolution levels of the shallow branch
            (``down_blocks[:depth]`` and ``up_blocks[-depth:]``; ``int >= 1``, at most the number of down blocks
            minus 1); for a transformer-only model, the blocks that run at each end (``int >= 1``, less than half
            of its blocks).
        layers: UNets and ControlNets at ``depth=1``: how many layers (resnet + attention pairs) of the last up
            block run on a cached step (``int >= 1``, fewer than that block has): DeepCache's finer branches,
            ``layers=1`` is its ``cache_branch_id=0``; ``None`` runs the whole first level (its branch 2 on
            SD-1.5). ``"auto"`` (the default) is ``1`` on a UNet or ControlNet at ``depth=1`` and ``None`` otherwise
            (deeper ``depth``, transformer-only models).
        start: steps before ``start`` are all full (``int >= 0``); cached steps begin at ``start + 1``.
        stop: steps from ``stop`` on are all full (``None``: to the end; else ``int > start``).
        full_steps: the 0-based steps that are full, e.g. ``(0, 1, 2, 4, 7, 11)`` to spend full steps early; when
            given, ``interval`` is not used (``start``/``stop`` still are). Step 0 is always full.

    Integers may be Python or numpy integers.

    >>> config = CacheConfig(interval=3)
    >>> [step for step in range(10) if config.is_full(step)]
    [0, 3, 6, 9]
    >>> [step for step in range(10) if CacheConfig(interval=2, start=3, stop=8).is_full(step)]
    [0, 1, 2, 3, 5, 7, 8, 9]
    """

    interval: int = 3
    depth: int = 1
    layers: Union[int, str, None] = AUTO
    start: int = 0
    stop: Optional[int] = None
    full_steps: Optional[Tuple[int, ...]] = None

    def __post_init__(self) -> None:
        store = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 - frozen dataclass
        if not is_int(self.interval) or self.interval < 1:
            raise ValueError("interval must be an integer >= 1 (a full pass every interval steps); "
                             f"got {self.interval!r}")
        if not is_int(self.depth) or self.depth < 1:
            raise ValueError("depth must be an integer >= 1 (levels of a UNet, or blocks at each end of a "
                             f"transformer, that run on every step); got {self.depth!r}")
        if as_choice(self.layers, (AUTO,)) is not None:
            store("layers", AUTO)  # (a numpy str as a plain one)
        elif self.layers is not None and (not is_int(self.layers) or self.layers < 1):
            raise ValueError(f"layers must be {AUTO!r}, None or an integer >= 1 (layers of the last up block that run "
                             f"on a cached step); got {shown(self.layers)}")
        if is_int(self.layers) and self.depth != 1:
            raise ValueError(f"layers={self.layers!r} cuts inside the first level, so it needs depth=1; got "
                             f"depth={self.depth!r}")
        if not is_int(self.start) or self.start < 0:
            raise ValueError(f"start must be an integer >= 0 (steps before it are full); got {self.start!r}")
        if self.stop is not None and (not is_int(self.stop) or self.stop <= self.start):
            raise ValueError(f"stop must be None or an integer > start={self.start} (steps from it are full); "
                             f"got {self.stop!r}")
        for name in ("interval", "depth", "layers", "start", "stop"):
            value = getattr(self, name)
            if is_int(value):
                store(name, int(value))
        if self.full_steps is not None:
            steps = self.full_steps
            if isinstance(steps, (str, bytes)) or not isinstance(steps, (list, tuple, range)) or not all(
                    is_int(s) and s >= 0 for s in steps) or len(steps) == 0:
                raise ValueError("full_steps must be None or a non-empty list, tuple or range of integers >= 0 (the "
                                 f"0-based full steps); got {steps!r}")
            store("full_steps", tuple(sorted({int(s) for s in steps} | {0})))

    def is_full(self, step: int) -> bool:
        """Whether 0-based ``step`` of a generation runs the whole model."""
        if step <= self.start or (self.stop is not None and step >= self.stop):
            return True
        if self.full_steps is not None:
            return step in self.full_steps
        return (step - self.start) % self.interval == 0

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


class _Step(threading.local):
    """This thread's call of the model in flight: what the deep parts do (``mode``: None outside a call or with
    gradients on, else ``"full"`` or ``"cached"``), and what is kept, per call site."""

    mode: Optional[str] = None
    site = 0
    program: Optional[bool] = None  # set by a StepProgram: the kind of step it fixes (True = full)
    run: Optional[List[int]] = None  # this pipeline call's [calls, cached calls, last step, fallbacks before it]

    def __init__(self) -> None:
        self.kept: Dict[int, Dict[str, Any]] = {}  # call site -> the deep parts' kept outputs (and "__shape__")
        self.pending: Dict[str, Any] = {}  # what a full step records while it runs


class StepCache:
    """The step cache of one model: its settings, its layout (the deep parts), the per-thread step and counters.
    Made by :func:`apply_cache`; :meth:`remove` takes its hooks off."""

    def __init__(self, model: paddle.nn.Layer, config: CacheConfig, layout: Layout):
        self.model, self.config, self.layout = model, config, layout
        self.deep = layout.deep  # (name, layer) of the deep parts, in call order
        self.step = _Step()
        self.calls = self.full_calls = self.cached_calls = self.fallbacks = self.grad_calls = 0
        self.warned_all_full = False  # the "no cached step in a pipeline call" warning is given once

    def thread_state(self) -> _Step:
        return self.step

    # lifecycle ---------------------------------------------------------------------------------------------------
    def install(self) -> None:
        calls = model_calls(self.model, create=True)
        calls.use_clock(NAME)
        add_hook(self.model, NAME, _ModelHook(self), outer=False)
        for hook, layer in self.layout.hooks(self):
            add_hook(layer, NAME, hook)

    def remove(self) -> None:
        for _, layer in self.layout.hooked():
            remove_hook(layer, NAME)
        remove_hook(self.model, NAME)
        calls = model_calls(self.model)
        if calls is not None:
            calls.drop_clock(NAME)
        drop_calls_if_alone(self.model)

    def reset(self) -> None:
        """The next call of the model (outside a pipeline: of any thread) is step 0, with nothing kept."""
        self.step.kept = {}
        self.warned_all_full = False
        calls = model_calls(self.model)
        if calls is not None:
            calls.reset_clock()

    def run_finished(self) -> None:
        """A pipeline call's denoising loop finished (in this thread): warn, once, when it had calls of this model
        and none was cached although the settings cache some step."""
        run, self.step.run = self.step.run, None
        if run is None or self.warned_all_full or not run[0] or run[1]:
            return
        config = self.config
        first = next((s for s in range(1, config.start + max(config.interval, len(config.full_steps or ())) + 2)
                      if not config.is_full(s)), None)
        if first is None:  # (interval=1, or full steps everywhere: every call full, as asked)
            return
        self.warned_all_full = True
        steps, fallbacks = run[2] + 1, self.fallbacks - run[3]
        shown = ("full_steps", "start", "stop") if config.full_steps is not None else ("interval", "start", "stop")
        settings = ", ".join(f"{k}={getattr(config, k)!r}" for k in shown
                             if k == shown[0] or getattr(config, k) != getattr(CacheConfig, k))
        shapes = (f" {fallbacks} of them because the input's shape differed from the kept step's (fallbacks)."
                  if fallbacks else "")
        warnings.warn(
            f"The step cache on {type(self.model).__name__} ran every call of a pipeline call in full ({run[0]} "
            f"call{'s' if run[0] != 1 else ''}, {steps} denoising step{'s' if steps != 1 else ''}), so it saved "
            f"nothing.{shapes} With {settings} the first cached step is step {first} (0-based), and "
            "steps are counted by the pipeline's denoising loop: a short run has none (few num_inference_steps, or "
            "img2img and inpainting at a low strength, which denoise about strength x num_inference_steps steps; "
            "PNDM's warm-up call belongs to step 0). Use more steps, a smaller interval or start, or remove_cache. "
            "(Said once; reset_cache says it again.)",
            UserWarning,
            stacklevel=2,
        )

    def status(self) -> Dict[str, Any]:
        return {"settings": self.config.to_dict(), "layers": self.layout.layers, "deep_blocks": len(self.deep),
                "calls": self.calls, "full_calls": self.full_calls, "cached_calls": self.cached_calls,
                "fallbacks": self.fallbacks, "grad_calls": self.grad_calls}

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("step")
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.step = _Step()


class _ModelHook(Hook):
    """The step cache on the model: decides whether this call is full or cached and keeps what a full one made."""

    def __init__(self, cache: StepCache) -> None:
        self.cache = cache

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cache = self.cache
        step = cache.step
        if step.program is not None:  # a StepProgram fixes the kind of step and supplies the kept features
            return self._program(step, args, kwargs)
        if converting():
            raise StepCacheError(_static_refusal(cache))
        if step.mode is not None:  # the model called inside its own forward: that inner call is plain
            return self.next(*args, **kwargs)
        position, config = model_calls(cache.model).position, cache.config
        index, site, fresh = position
        if fresh:
            step.kept, step.run = {}, None
            run = None if cache.warned_all_full else generation.current()
            if run is not None:  # a pipeline call: its calls are counted, for the warning when none is cached
                step.run = [0, 0, 0, cache.fallbacks]
                run.on_finish(cache.run_finished)
        if paddle.is_grad_enabled():
            cache.grad_calls += 1
            return self.next(*args, **kwargs)
        kept = step.kept.get(site)
        full = kept is None or config.is_full(index)
        step.mode, step.site, step.pending = ("full" if full else "cached"), site, {}
        try:  # (a call that does not finish keeps nothing and leaves its site's kept features as they were)
            output = self.next(*args, **kwargs)
        finally:
            mode, step.mode = step.mode, None
        cache.calls += 1
        if mode == "full":
            cache.full_calls += 1
            keep = not config.is_full(index + 1)  # only when the next step can use them
            if keep:
                step.kept[site] = step.pending
            else:
                step.kept.pop(site, None)
        else:
            cache.cached_calls += 1
        counts = step.run
        if counts is not None:
            counts[0] += 1
            counts[1] += mode != "full"
            counts[2] = index
        step.pending = {}
        return output

    def _program(self, step: _Step, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """A call made by a step program: its kind and kept features are the program's; what a full one records
        stays in ``step.pending`` for the program to return."""
        step.mode = "full" if step.program else "cached"
        step.site, step.pending = 0, {}
        try:
            return self.next(*args, **kwargs)
        finally:
            step.mode = None


def _static_refusal(cache: StepCache) -> str:
    """Why a model with a step cache cannot be converted to a static graph, and what to do instead."""
    kept = "the step cache keeps deep features between calls in Python, which a static graph cannot hold: "
    if isinstance(cache.layout, TransformerLayout):
        return kept + (f"{type(cache.model).__name__} is a transformer-only model, whose step cache has no step "
                       "programs (they are built for UNets); remove it (remove_cache) before paddle.jit.to_static "
                       "(ToMe alone exports)")
    return kept + ("export the full and the cached step as two programs (ppdiffusers_tome.cache.export."
                   "StepPrograms), or remove it (remove_cache) before paddle.jit.to_static")


# public functions ------------------------------------------------------------------------------------------------
def get_cache(model: Any) -> Optional[StepCache]:
    """The :class:`StepCache` on ``model``, or None."""
    registry = hooks_of(model)
    hook = registry.get(NAME) if registry is not None else None
    return hook.cache if isinstance(hook, _ModelHook) else None


def _cacheable(model: paddle.nn.Layer) -> bool:
    return layout_of(model, None) is not None


def _models(obj: Any, for_apply: bool, what: str) -> List[Tuple[str, paddle.nn.Layer]]:
    """The UNet, ControlNets or transformer a step cache goes on inside ``obj``; bad input raises ``ValueError``
    naming ``what``, the function called."""
    pipeline, models = resolve(obj, what, _cacheable)
    if for_apply and pipeline is not None and not models:
        fused = [name for name, model in pipeline_candidates(pipeline) if is_fused_sd3(model)]
        if fused:
            raise ValueError(fused_sd3_reason(f"{type(pipeline).__name__}.{fused[0]}", "the step cache"))
        for name, model in pipeline_candidates(pipeline):  # a transformer-only model that is too short
            short = too_few_blocks(model, f"{type(pipeline).__name__}.{name}")
            if short is not None:
                raise ValueError(short)
        raise ValueError(f"apply_cache needs a pipeline with a UNet, a ControlNet or a transformer-only model (SD3, "
                         f"DiT, PixArt-alpha); {type(pipeline).__name__} has none")
    return models


def apply_cache(obj: Any, config: Optional[CacheConfig] = None, **options: Any) -> Any:
    """Put a step cache on a pipeline (its UNet and ControlNets, or its SD3 / DiT / PixArt-alpha transformer), on a
    model, a MultiControlNet or a list of them; returns ``obj``. ``config`` is a :class:`CacheConfig` (e.g.
    ``CacheConfig(interval=3)``), ``options`` its fields by name (``interval=3, depth=1, layers="auto", start=0,
    stop=None, full_steps=None``); options given with a config replace those fields of it. Applying again replaces
    the settings; :func:`remove_cache` takes it off. Bad settings raise ``ValueError`` naming the argument before
    anything changes. For inference: the kept features are the tensors of the last full step.

    Example:
        >>> import ppdiffusers_tome
        >>> from ppdiffusers_tome.testing import tiny_sd_pipeline
        >>> pipe = tiny_sd_pipeline().apply_cache(interval=3)
        >>> ppdiffusers_tome.cache_status(pipe)["unet"]["settings"]["interval"]
        3
        >>> pipe = pipe.remove_cache()
    """
    return _apply_cache(obj, config, options, method=False)


def _apply_cache(obj: Any, config: Any, options: Dict[str, Any], method: bool) -> Any:
    """:func:`apply_cache` called as a function or (``method``) as the method ``obj.apply_cache``: a hint names the
    call in the caller's form."""
    if config is not None and not isinstance(config, CacheConfig):
        meant = keyword_call(obj, "apply_cache", "interval", config, method)
        hint = f" (the interval is a keyword: {meant})" if is_int(config) else ""
        raise ValueError(f"config must be None or a CacheConfig; got {type(config).__name__} {config!r}{hint}")
    unknown = sorted(set(options) - set(CONFIG_FIELDS))
    if unknown:
        raise ValueError(f"apply_cache got unknown option(s) {', '.join(unknown)}; the options are "
                         f"{', '.join(CONFIG_FIELDS)}")
    config = replace(config, **options) if config is not None else CacheConfig(**options)
    models = _models(obj, for_apply=True, what="apply_cache")
    layouts = [layout_of(model, config, name) for name, model in models]  # every check before any change
    with LOCK:
        for name, model in models:
            refuse_if_running(model, name, "the step cache")
        for _, model in models:
            _remove_from(model)
        for (_, model), layout in zip(models, layouts):
            StepCache(model, config, layout).install()
    return obj


def _remove_from(model: paddle.nn.Layer) -> bool:
    cache = get_cache(model)
    if cache is None:
        return False
    cache.remove()
    return True


def remove_cache(obj: Any) -> Any:
    """Take the step cache off everything :func:`apply_cache` put it on in ``obj``: every deep block computes
    again, and a layer without other hooks gets its own class back. Returns ``obj``; a no-op where there is none.

    >>> from ppdiffusers_tome.testing import tiny_unet
    >>> unet = apply_cache(tiny_unet())
    >>> remove_cache(unet) is unet, get_cache(unet) is None, type(unet.mid_block).__name__
    (True, True, 'UNetMidBlock2DCrossAttn')
    """
    models = _models(obj, for_apply=False, what="remove_cache")
    with LOCK:
        for name, model in models:
            if get_cache(model) is not None:
                refuse_if_running(model, name, "the step cache")
        for _, model in models:
            _remove_from(model)
    return obj


def reset_cache(obj: Any) -> Any:
    """Start a fresh history (step 0, nothing kept) on every cached model of ``obj``; needed only when a model is
    called directly, outside a pipeline call, for a new generation (a pipeline call starts one on its own).

    >>> from ppdiffusers_tome.testing import tiny_unet
    >>> unet = apply_cache(tiny_unet())
    >>> reset_cache(unet) is unet
    True
    """
    for _, model in _models(obj, for_apply=False, what="reset_cache"):
        cache = get_cache(model)
        if cache is not None:
            cache.reset()
    return obj


def cache_status(obj: Any) -> Dict[str, Optional[Dict[str, Any]]]:
    """Per model of ``obj`` a step cache can go on: ``None`` without a step cache, else its ``settings``, the number
    of ``deep_blocks``, the ``layers`` in effect (``layers="auto"`` resolved: an int, or None for whole levels) and
    the counters ``calls``, ``full_calls``, ``cached_calls``, ``fallbacks`` (cached steps
    computed in full because the input's shape differed from the kept step's) and ``grad_calls`` (calls with
    gradients on, always full).

    >>> from ppdiffusers_tome.testing import tiny_unet
    >>> cache_status(tiny_unet())
    {'UNet2DConditionModel': None}
    """
    status = {}
    for name, model in _models(obj, for_apply=False, what="cache_status"):
        cache = get_cache(model)
        status[name] = None if cache is None else cache.status()
    return status


def deep_blocks(model: paddle.nn.Layer, depth: int = 1,
                layers: Union[int, str, None] = AUTO) -> List[Tuple[str, paddle.nn.Layer]]:
    """The parts of a UNet or ControlNet that run only on full steps at ``depth`` and ``layers`` (as
    :class:`CacheConfig` takes them), in call order (see :func:`~ppdiffusers_tome.cache.layout.layout_of`)."""
    return layout_of(model, CacheConfig(depth=depth, layers=layers)).deep


CONFIG_FIELDS = tuple(field.name for field in fields(CacheConfig))
