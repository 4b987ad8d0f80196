"""The whole-model step cache (``apply_cache(..., whole_model=True)``): whole calls of a denoiser skipped, for models
whose blocks cannot be reached (SD3 built with ``INFERENCE_OPTIMIZE=True``, whose fused transformer has no blocks to
hook) and for any UNet or transformer it is asked for.

The model's own forward is wrapped (one hook through :mod:`ppdiffusers_tome.core.registry`; nothing inside the model
is touched, no fused kernel is imported or called). A full call runs the model and keeps its *residual*, the output
minus the input latents (EasyCache's quantity; when the output's shape differs from the input's, as with a learned
variance, the output itself); a cached call runs nothing and returns the input plus the kept residual (or its
forecast), in the structure of the full call's output. Which calls are full: the interval, or the adaptive rule with
the model's input as the signal (:mod:`.adaptive`: its relative change since the previous step, summed since the last
full step; the timestep is not read, the input's change already follows the sampler's step).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Dict, List, Tuple

import paddle

from ..core.registry import Hook
from .kept import KeptStep
from .layout import CacheLayout

__all__ = ["WholeModelHook", "WholeModelLayout", "is_controlnet", "takes_latents"]


def is_controlnet(model: Any) -> bool:
    """Whether ``model`` is a ControlNet (its output is residuals for a UNet, not a prediction of the latents)."""
    return any(cls.__name__ == "ControlNetModel" for cls in type(model).__mro__) or hasattr(
        model, "controlnet_down_blocks")


def takes_latents(model: Any) -> bool:
    """Whether ``model``'s forward takes the latents first (a parameter named ``hidden_states`` or ``sample``), as
    ppdiffusers' denoisers do."""
    try:
        parameters = list(inspect.signature(type(model).forward).parameters)
    except (TypeError, ValueError):
        return False
    return len(parameters) > 1 and parameters[1] in ("hidden_states", "sample")


class WholeModelLayout(CacheLayout):
    """The whole-model cache's layout: no part of the model is hooked, the model's forward is the deep part. Made
    for a model that takes the latents first (:func:`takes_latents`) and is not a ControlNet; else ``ValueError``
    naming ``whole_model``."""

    def __init__(self, model: paddle.nn.Layer, name: str = "") -> None:
        name = name or type(model).__name__
        if is_controlnet(model):
            raise ValueError(f"whole_model=True caches a denoiser's prediction; {name} is a ControlNet, whose outputs "
                             "are residuals for the UNet: put whole_model=True on the UNet (the pipeline does), or "
                             "give the ControlNet the block cache (whole_model=False)")
        if not takes_latents(model):
            raise ValueError(f"whole_model=True needs a denoiser whose forward takes the latents first (hidden_states "
                             f"or sample), as ppdiffusers' UNets and transformers do; {name} "
                             f"({type(model).__name__}) does not")
        self.deep: List[Tuple[str, paddle.nn.Layer]] = []
        self.layers = None

    def hooks(self, cache: Any) -> List[Tuple[Hook, paddle.nn.Layer]]:
        return []


def _latents(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    if args:
        return args[0]
    return kwargs["hidden_states"] if "hidden_states" in kwargs else kwargs.get("sample")


def _first_output(output: Any) -> Any:
    """The prediction in a model's output: the tensor itself, the first item of a tuple or list, or ``.sample``."""
    if isinstance(output, (tuple, list)):
        return output[0]
    return getattr(output, "sample", output)


def _rebuilt(template: Any, value: paddle.Tensor) -> Any:
    """``template`` (a full call's output) with its prediction replaced by ``value``."""
    if isinstance(template, (tuple, list)):
        return type(template)([value, *template[1:]])
    if isinstance(template, paddle.Tensor):
        return value
    return dataclasses.replace(template, sample=value)


def _structure(output: Any) -> str:
    return "sequence" if isinstance(output, (tuple, list)) else "tensor" if isinstance(output, paddle.Tensor) \
        else "output"


class WholeModelHook(Hook):
    """The whole-model cache on the model (see the module docstring); the bookkeeping of steps, call sites, the rule
    and the counters is the :class:`~ppdiffusers_tome.cache.step_cache.StepCache`'s, as for the other layouts."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cache = self.cache
        step = cache.step
        if step.mode is not None or step.program is not None:  # the model called inside its own forward
            return self.next(*args, **kwargs)
        cache.refuse_conversion()
        begun = cache.begin(step)
        if begun is None:  # gradients on: a plain call
            return self.next(*args, **kwargs)
        index, site, mode = begun
        try:
            output = self._step(cache, step, site, index, mode, args, kwargs)
        except BaseException:
            cache.failed(step, site)  # keeps nothing, and leaves the site as it was before the call
            raise
        mode, step.mode = step.mode, None
        cache.finish(step, site, index, mode)
        return output

    def _step(self, cache: Any, step: Any, site: Any, index: int, mode: str, args: Tuple[Any, ...],
              kwargs: Dict[str, Any]) -> Any:
        latents = _latents(args, kwargs)
        shape = tuple(latents.shape)
        mode = cache.arrive(step, site, shape, latents, mode)
        if mode == "cached" and (kwargs.get("return_dict") is False) != (_structure(site.kept.template) == "sequence"):
            cache.fallbacks += 1  # asked for another structure than the kept call returned: compute this one
            mode, step.mode, step.pending = "full", "full", KeptStep(index, shape)
            site.accumulated, site.skips = 0.0, 0
        if mode == "cached":
            kept = site.kept
            earlier = site.earlier.delta if site.earlier is not None else None
            work = cache.work(site, index, kept.delta, earlier)[0]
            return _rebuilt(kept.template, latents + work if kept.residual else work)
        output = self.next(*args, **kwargs)
        pending = step.pending
        if pending is None:  # nothing of this full call is kept
            return output
        prediction = _first_output(output)
        pending.residual = prediction.shape == latents.shape
        pending.delta = (prediction - latents if pending.residual else prediction,)
        pending.template = output
        return output
