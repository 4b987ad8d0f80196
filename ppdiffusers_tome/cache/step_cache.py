"""Step caching (DeepCache-style for UNets, block caching for transformers): a full pass every few denoising steps;
on the steps between, only the shallow part runs and the deep part's work comes from the last full step.

The technique's door: :class:`CacheConfig` (the validated settings, :mod:`.config`), the hooks that do it (through
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
With the fixed interval nothing is read from the device: which steps are full is decided by Python counters; the
adaptive rule (``threshold=``, :mod:`ppdiffusers_tome.cache.adaptive`) reads one scalar per call, and with the forecast
one per full step.

**The whole-model cache** (``whole_model=True``, :mod:`ppdiffusers_tome.cache.whole_model`) skips whole calls of a
denoiser, for models whose blocks cannot be reached (SD3 built with ``INFERENCE_OPTIMIZE=True``).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections import deque
from dataclasses import replace
from typing import Any, Deque, Dict, List, Optional, Tuple, Union

import paddle

from ..core import generation
from ..core.calls import drop_calls_if_alone, model_calls, refuse_if_running
from ..core.registry import LOCK, Hook, StaticGraphError, add_hook, hooks_of, remove_hook
from ..core.targets import fused_sd3_reason, is_fused_sd3, keyword_call, pipeline_candidates, resolve
from ..core.validation import is_int
from ..ops.runtime import converting
from .adaptive import cached_steps_ahead, extrapolate, forecast_error, full_step_due, relative_change
from .config import CONFIG_FIELDS, CacheConfig
from .kept import KeptStep, Site
from .layout import AUTO, CacheLayout, TransformerLayout, layout_of, too_few_blocks
from .whole_model import WholeModelHook, WholeModelLayout, is_controlnet, takes_latents

__all__ = ["CacheConfig", "StepCache", "StepCacheError", "apply_cache", "cache_status", "get_cache", "remove_cache",
           "reset_cache"]

logger = logging.getLogger(__name__)

NAME = "cache"  # the name of the step cache's hooks in every registry
RECENT = 1000  # cache_status's last_full_steps and last_cached_steps hold at most this many steps each


class StepCacheError(StaticGraphError):
    """Raised when a step cache cannot do what a call asks (for example, conversion to a static graph)."""


class _Step(threading.local):
    """This thread's call of the model in flight: what the deep parts do (``mode``: None outside a call or with
    gradients on, else ``"full"``, ``"cached"``, or ``"decide"`` until the adaptive rule has decided at the first
    deep part), the call's step ``index``, its call ``site`` and that site's :class:`~.kept.Site` (``state``), and
    what a full step records while it runs (``pending``, a :class:`~.kept.KeptStep`)."""

    mode: Optional[str] = None
    site = 0
    index = 0
    keep = False  # whether this call's work is kept, if it runs in full
    saved: Tuple[Any, float, int] = (None, 0.0, 0)  # the adaptive rule's state of the site before this call
    program: Optional[bool] = None  # set by a StepProgram: the kind of step it fixes (True = full)
    run: Optional[List[int]] = None  # this pipeline call's [calls, cached calls, last step, fallbacks before it]

    def __init__(self) -> None:
        self.sites: Dict[int, Site] = {}  # call site -> what it remembers
        self.state: Optional[Site] = None
        self.pending: Optional[KeptStep] = None


class StepCache:
    """The step cache of one model: its settings, its layout (the deep parts), the per-thread step and counters,
    and the bookkeeping every call of its hooks shares (:meth:`begin`, :meth:`arrive`, :meth:`finish`). Made by
    :func:`apply_cache`; :meth:`remove` takes its hooks off."""

    def __init__(self, model: paddle.nn.Layer, config: CacheConfig, layout: CacheLayout):
        self.model, self.config, self.layout = model, config, layout
        self.deep = layout.deep  # (name, layer) of the deep parts, in call order
        self.threshold, self.max_skips, self.forecast = config.threshold, config.max_skips, config.forecast
        # which rule decides the full steps: the interval, the signal's change, or the forecast's error
        self.rule = "interval" if self.threshold is None else "adaptive" if self.forecast is None else "forecast"
        self.step = _Step()
        self.calls = self.full_calls = self.cached_calls = self.fallbacks = self.grad_calls = 0
        self.recent = _recent()  # site 0's full and cached steps of the latest generation
        self.warned_all_full = False  # the "no cached step in a pipeline call" warning is given once

    def thread_state(self) -> _Step:
        return self.step

    # lifecycle ---------------------------------------------------------------------------------------------------
    def install(self) -> None:
        calls = model_calls(self.model, create=True)
        calls.use_clock(NAME)
        whole = isinstance(self.layout, WholeModelLayout)
        add_hook(self.model, NAME, WholeModelHook(self) if whole else _ModelHook(self), outer=False)
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
        self.step.sites = {}
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
        reason = _why_all_full(self.config)
        if reason is None:  # (interval=1, threshold=0, or full steps everywhere: every call full, as asked)
            return
        self.warned_all_full = True
        steps, fallbacks = run[2] + 1, self.fallbacks - run[3]
        shapes = (f" {fallbacks} of them because the input's shape differed from the kept step's (fallbacks)."
                  if fallbacks else "")
        warnings.warn(
            f"The step cache on {type(self.model).__name__} ran every call of a pipeline call in full ({run[0]} "
            f"call{'s' if run[0] != 1 else ''}, {steps} denoising step{'s' if steps != 1 else ''}), so it saved "
            f"nothing.{shapes} {reason} (Said once; reset_cache says it again.)",
            UserWarning,
            stacklevel=2,
        )

    def status(self) -> Dict[str, Any]:
        return {"settings": self.config.to_dict(), "layers": self.layout.layers, "deep_blocks": len(self.deep),
                "rule": self.rule, "threshold": self.threshold,
                "calls": self.calls, "full_calls": self.full_calls, "cached_calls": self.cached_calls,
                "fallbacks": self.fallbacks, "grad_calls": self.grad_calls,
                "last_full_steps": list(self.recent[0]), "last_cached_steps": list(self.recent[1])}

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("step")
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.step = _Step()

    # one call ----------------------------------------------------------------------------------------------------
    def refuse_conversion(self) -> None:
        if converting():
            raise StepCacheError(_static_refusal(self))

    def begin(self, step: _Step) -> Optional[Tuple[int, Optional[Site], str]]:
        """The start of a call: ``(step index, the call site's Site or None, mode)``, with ``step`` set up (and a
        :class:`KeptStep` to fill in ``step.pending`` when a full step's work will be kept); None with gradients on
        (a plain call, counted in ``grad_calls``)."""
        index, site_id, fresh = model_calls(self.model).position
        if fresh:
            step.sites, step.run = {}, None
            if site_id == 0:
                self.recent = _recent()
            run = None if self.warned_all_full else generation.current()
            if run is not None:  # a pipeline call: its calls are counted, for the warning when none is cached
                step.run = [0, 0, 0, self.fallbacks]
                run.on_finish(self.run_finished)
        if paddle.is_grad_enabled():
            self.grad_calls += 1
            return None
        site = step.sites.get(site_id)
        if self.threshold is not None:
            if site is None:
                site = step.sites[site_id] = Site()
            mode = self._adaptive_mode(index, site)
            step.saved = (site.signal, site.accumulated, site.skips)  # (restored when the call does not finish)
        else:
            mode = "full" if site is None or self.config.is_full(index) else "cached"
        # the work of a full step is kept when a later step can use it
        step.keep = self.threshold is not None or self.forecast is not None or not self.config.is_full(index + 1)
        step.site, step.state, step.index, step.mode = site_id, site, index, mode
        step.pending = KeptStep(index) if mode == "full" and step.keep else None
        return index, site, mode

    def _adaptive_mode(self, index: int, site: Site) -> str:
        """The kind of step a call of the adaptive rule starts as: ``"full"`` (nothing kept, ``threshold=0``,
        ``max_skips`` reached, a protected step, or with the forecast the step its last full step chose),
        ``"cached"`` (with the forecast, before that step) or ``"decide"`` (the rule decides on the signal at the
        first deep part)."""
        if site.kept is None or self.threshold == 0 or (self.max_skips is not None and site.skips >= self.max_skips):
            return "full"
        forecast = self.rule == "forecast"
        if forecast and index >= site.next_full:
            return "full"
        current = generation.current()
        last = current.total - 1 if current is not None and current.total else None
        if self.config.protects(index, last):
            return "full"
        return "cached" if forecast else "decide"

    def arrive(self, step: _Step, site: Optional[Site], shape: Any, signal: Any, mode: str) -> str:
        """At the first deep part (the whole model: at the call): the step's final kind. A step whose ``shape``
        differs from the kept step's runs in full (counted in ``fallbacks``); the adaptive rule reads the change of
        ``signal`` since the site's previous call (the one device read) and decides a ``"decide"`` step."""
        if mode != "full" and shape != site.kept.shape:
            mode = "full"
            self.fallbacks += 1
        if self.rule == "adaptive":
            previous, site.signal = site.signal, signal
            if mode == "decide" and previous is not None and previous.shape == signal.shape:
                change = float(relative_change(signal, previous))  # the one scalar read to the host per call
                full, site.accumulated, site.skips = full_step_due(site.accumulated, change, site.skips,
                                                                   self.threshold, self.max_skips)
                mode = "full" if full else "cached"
            elif mode != "cached":
                mode, site.accumulated, site.skips = "full", 0.0, 0
        if mode == "full" and step.keep:
            if step.pending is None:
                step.pending = KeptStep(step.index)
            step.pending.shape = shape
        step.mode = mode
        return mode

    def work(self, site: Site, index: int, last: Any, earlier: Any) -> Any:
        """The kept work ``last`` of the site's last full step for step ``index``: as it is, or with
        ``forecast="linear"`` extrapolated from it and ``earlier`` (the same work at the full step before)."""
        if self.forecast is None or site.earlier is None:
            return last
        return extrapolate(last, earlier, site.kept.step, site.earlier.step, index)

    def finish(self, step: _Step, site: Optional[Site], index: int, mode: Optional[str]) -> None:
        """The end of a call that returned: the counters, and what a full one made kept for its site (when a
        later step can use it)."""
        self.calls += 1
        if step.site == 0:
            self.recent[mode == "cached"].append(index)
        counts = step.run
        if counts is not None:
            counts[0] += 1
            counts[1] += mode == "cached"
            counts[2] = index
        if mode == "cached":
            self.cached_calls += 1
            return
        self.full_calls += 1
        pending, step.pending = step.pending, None
        if pending is None:
            step.sites.pop(step.site, None)  # nothing the next step can use
            return
        if site is None:
            site = step.sites[step.site] = Site()
        before, earlier = site.earlier, site.kept
        site.earlier = earlier if self.forecast is not None and earlier is not None and \
            earlier.shape == pending.shape else None
        if self.rule == "forecast":
            site.next_full = index + 1 + self._cached_ahead(pending, site.earlier, before)
        site.kept = pending

    def _cached_ahead(self, kept: KeptStep, earlier: Optional[KeptStep], before: Optional[KeptStep]) -> int:
        """The rule with the forecast at the full step ``kept``: how many steps after it are cached, from the error
        of the forecast ``before`` and ``earlier`` made for it (:func:`~.adaptive.cached_steps_ahead`; the one
        scalar read of a full step). 0 until three full steps of the same shape are kept (a site keeps ``earlier``
        only when its shape is the next full step's, so ``before`` has ``earlier``'s), and at ``threshold=0`` (every
        step full, nothing measured)."""
        if self.threshold == 0 or earlier is None or before is None:
            return 0
        work = [_work_tensor(k, self.deep) for k in (kept, earlier, before)]
        if any(w is None for w in work):
            return 0
        error = float(forecast_error(*work, kept.step, earlier.step, before.step))
        current = generation.current()
        sizes = current.step_sizes() if current is not None else None
        return cached_steps_ahead(error, kept.step - earlier.step, earlier.step - before.step, self.threshold,
                                  self.max_skips, sizes[kept.step + 1:] if sizes else None)

    def failed(self, step: _Step, site: Optional[Site]) -> None:
        """A call that raised or was interrupted keeps nothing and leaves its site as it was before the call (the
        step clock takes the call back too, so the next call is the same step)."""
        step.mode, step.pending = None, None
        if site is not None and self.threshold is not None:
            site.signal, site.accumulated, site.skips = step.saved


def _work_tensor(kept: KeptStep, deep: List[Tuple[str, paddle.nn.Layer]]) -> Optional[paddle.Tensor]:
    """The work of a full step the rule with the forecast measures: the first stream's contribution (a transformer,
    the whole model), else the last deep part's output (its first tensor); None when the step kept neither."""
    value = kept.delta[0] if kept.delta is not None else kept.outputs.get(deep[-1][0]) if deep else None
    if isinstance(value, (tuple, list)):
        value = value[0] if value else None
    return value if isinstance(value, paddle.Tensor) else None


def _recent() -> Tuple[Deque[int], Deque[int]]:
    """The steps of a generation's first call site that ran in full and cached, the last ``RECENT`` of each (a model
    called outside a pipeline without ``reset_cache`` makes one endless generation)."""
    return deque(maxlen=RECENT), deque(maxlen=RECENT)


class _ModelHook(Hook):
    """The step cache on the model: starts each call's step (:meth:`StepCache.begin`), runs it, and keeps what a
    full one made (:meth:`StepCache.finish`); the deep parts' hooks do the rest."""

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
        begun = cache.begin(step)
        if begun is None:
            return self.next(*args, **kwargs)
        index, site, _ = begun
        try:
            output = self.next(*args, **kwargs)
        except BaseException:
            cache.failed(step, site)  # keeps nothing, and leaves the site as it was before the call
            raise
        mode, step.mode = step.mode, None
        cache.finish(step, site, index, mode)
        return output

    def _program(self, step: _Step, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """A call made by a step program: its kind and kept features are the program's; what a full one records
        stays in ``step.pending`` for the program to return."""
        step.mode = "full" if step.program else "cached"
        step.site, step.pending = 0, KeptStep()
        step.state = step.sites.get(0)
        try:
            return self.next(*args, **kwargs)
        finally:
            step.mode = None


def _why_all_full(config: CacheConfig) -> Optional[str]:
    """What to change when a pipeline call of a cache with ``config`` cached nothing (the end of the warning of
    :meth:`StepCache.run_finished`); None when ``config`` caches no step at all (interval 1, threshold 0)."""
    if config.threshold is not None:
        if config.threshold == 0:
            return None
        found = (f"With threshold={config.threshold!r} the adaptive rule found the deep part's input changed by at "
                 "least that much at every step it could cache (" if config.forecast is None else
                 f"With threshold={config.threshold!r} and forecast={config.forecast!r} the rule found the forecast's "
                 "error too large to cache any step (it needs three full steps first; ")
        return found + ("the first and the last step of a pipeline call, and the steps of start, stop and full_steps, "
                        "are always full): a larger threshold caches more; or use more steps, or remove_cache.")
    first = next((s for s in range(1, config.start + max(config.interval, len(config.full_steps or ())) + 2)
                  if not config.is_full(s)), None)
    if first is None:
        return None
    shown = ("full_steps", "start", "stop") if config.full_steps is not None else ("interval", "start", "stop")
    settings = ", ".join(f"{k}={getattr(config, k)!r}" for k in shown
                         if k == shown[0] or getattr(config, k) != getattr(CacheConfig, k))
    return (f"With {settings} the first cached step is step {first} (0-based), and "
            "steps are counted by the pipeline's denoising loop: a short run has none (few num_inference_steps, or "
            "img2img and inpainting at a low strength, which denoise about strength x num_inference_steps steps; "
            "PNDM's warm-up call belongs to step 0). Use more steps, a smaller interval or start, or remove_cache.")


def _static_refusal(cache: StepCache) -> str:
    """Why a model with a step cache cannot be converted to a static graph, and what to do instead."""
    config = cache.config
    if config.threshold is not None:
        return (f"the step cache's adaptive rule (threshold={config.threshold}) decides every step on the host from a "
                "value read from the device, which a static graph cannot do: remove the cache (remove_cache) before "
                "paddle.jit.to_static, or export a UNet's fixed interval (threshold=None) as step programs "
                "(ppdiffusers_tome.cache.export.StepPrograms)")
    kept = "the step cache keeps deep features between calls in Python, which a static graph cannot hold: "
    if config.whole_model:
        return kept + (f"the whole-model cache of {type(cache.model).__name__} (whole_model=True) returns a kept output "
                       "in place of the model's; remove it (remove_cache) before paddle.jit.to_static")
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
    return hook.cache if isinstance(hook, (_ModelHook, WholeModelHook)) else None


def _cacheable(model: paddle.nn.Layer) -> bool:
    """Whether a step cache can go on ``model`` (a fused SD3 takes only the whole-model cache) or is on it."""
    return layout_of(model, None) is not None or get_cache(model) is not None or is_fused_sd3(model)


def _denoiser(model: paddle.nn.Layer) -> bool:
    """What ``whole_model=True`` goes on inside a pipeline: its UNet or transformer, fused (INFERENCE_OPTIMIZE) or
    not; never a ControlNet."""
    return (layout_of(model, None) is not None or is_fused_sd3(model)) and not is_controlnet(model) and \
        takes_latents(model)


def _models(obj: Any, for_apply: bool, what: str, whole: bool = False) -> List[Tuple[str, paddle.nn.Layer]]:
    """The UNet, ControlNets or transformer a step cache goes on inside ``obj`` (``whole``: the denoiser a
    whole-model cache goes on); bad input raises ``ValueError`` naming ``what``, the function called."""
    pipeline, models = resolve(obj, what, _denoiser if whole else _cacheable)
    if for_apply and pipeline is not None and not models:
        fused = [name for name, model in pipeline_candidates(pipeline) if is_fused_sd3(model)]
        if fused:
            raise ValueError(fused_sd3_reason(f"{type(pipeline).__name__}.{fused[0]}", "the step cache") +
                             "; or cache whole calls of it: apply_cache(pipe, whole_model=True)")
        for name, model in pipeline_candidates(pipeline):  # a transformer-only model that is too short
            short = too_few_blocks(model, f"{type(pipeline).__name__}.{name}")
            if short is not None:
                raise ValueError(short)
        raise ValueError(f"apply_cache needs a pipeline with a UNet, a ControlNet or a transformer-only model (SD3, "
                         f"DiT, PixArt-alpha); {type(pipeline).__name__} has none")
    return models


def _layout(model: paddle.nn.Layer, config: "CacheConfig", name: str, owner: Any) -> CacheLayout:
    """The layout ``config`` asks for on ``model`` (named ``name`` inside ``owner``, the object given to
    :func:`apply_cache`), or ``ValueError`` naming the argument."""
    if config.whole_model:
        return WholeModelLayout(model, name)
    if is_fused_sd3(model):
        where = f"{type(owner).__name__}.{name}" if owner is not model and hasattr(owner, "components") else name
        raise ValueError(fused_sd3_reason(where, "the step cache") + "; or cache whole calls of it: apply_cache(..., "
                         "whole_model=True)")
    return layout_of(model, config, name)


def apply_cache(obj: Any, config: Optional[CacheConfig] = None, **options: Any) -> Any:
    """Put a step cache on a pipeline (its UNet and ControlNets, or its SD3 / DiT / PixArt-alpha transformer), on a
    model, a MultiControlNet or a list of them; returns ``obj``. ``config`` is a :class:`CacheConfig` (e.g.
    ``CacheConfig(interval=3)``), ``options`` its fields by name (``interval=3, depth=1, layers="auto", start=0,
    stop=None, full_steps=None, threshold=None, max_skips=None, forecast=None, whole_model=False``); options given
    with a config replace those fields of it. ``threshold=0.15`` switches from the fixed interval to the adaptive
    rule; ``whole_model=True`` caches whole calls of the denoiser (the only cache an SD3 built with
    ``INFERENCE_OPTIMIZE=True`` takes). Applying again replaces
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
    models = _models(obj, for_apply=True, what="apply_cache", whole=config.whole_model)
    layouts = [_layout(model, config, name, obj) for name, model in models]  # every check before any change
    # (the whole-model cache replaces the caches of every model of obj: a pipeline's ControlNets too)
    cached = models if not config.whole_model else _models(obj, for_apply=False, what="apply_cache")
    with LOCK:
        for name, model in cached + models:
            refuse_if_running(model, name, "the step cache")
        for _, model in cached + models:
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
    gradients on, always full); the ``rule`` (``"interval"``, ``"adaptive"``, or ``"forecast"``: the adaptive rule with the forecast) and the ``threshold`` in effect
    (None with the interval); ``last_full_steps`` and ``last_cached_steps``, the 0-based steps of the latest
    generation's first call site that ran in full and cached (the last 1,000 of each).

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

