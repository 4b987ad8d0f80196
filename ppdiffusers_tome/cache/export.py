"""Static graphs for the step cache: the full step and the cached step of a UNet as two layers that
``paddle.jit.to_static`` converts and ``paddle.jit.save`` exports, and a host-side driver that runs them on the
cache's fixed schedule.

Two programs, not one with a branch. A cached step reads one tensor that the last full step produced: the output of
the last deep part in call order, the only deep feature the layers that run consume: the last deep up block
(``up_blocks[-depth - 1]``) with ``layers=None``, or with ``layers=k`` (the default ``"auto"`` is 1) the layer of the
last up block just before the ``k`` that run (the skip connections those read come from layers that run too). So the
full program is the UNet's forward with that tensor as a second output, and the cached program takes it as an input
and contains no deep part at all (the other deep parts return their own input, which nothing reads, and the program
drops them). One program with a branch would have to carry a step counter onto the device and hold both halves.
Which program a step runs is decided on the host by :meth:`CacheConfig.is_full` from a Python counter: nothing is
read from the device.

>>> import paddle, ppdiffusers_tome
>>> from ppdiffusers_tome.cache.export import StepPrograms
>>> from ppdiffusers_tome.testing import tiny_unet
>>> unet = ppdiffusers_tome.apply_cache(tiny_unet(), interval=2)
>>> programs = StepPrograms(unet)
>>> sample, t, text = paddle.randn([2, 4, 16, 16]), paddle.to_tensor([10, 10]), paddle.randn([2, 5, 32])
>>> (noise,), feature = programs.full(sample, t, text)
>>> list(programs.cached(feature, sample, t, text)[0].shape)
[2, 4, 16, 16]
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import paddle
from paddle.static import InputSpec

from .kept import KeptStep, Site
from .layout import TransformerLayout
from .step_cache import CacheConfig, get_cache

__all__ = ["CachedStep", "FullStep", "ScheduledSteps", "StepPrograms"]


def refuse_unscheduled(config: CacheConfig, what: str) -> None:
    """``ValueError`` naming the option when ``config`` (of ``what``) asks for more than a fixed schedule: step
    programs and :class:`ScheduledSteps` run the interval only."""
    for name, value, why in (("threshold", config.threshold, "decides each step from a value read from the device"),
                             ("forecast", config.forecast, "extrapolates the kept feature in Python"),
                             ("whole_model", config.whole_model, "returns a kept output in place of the UNet's")):
        if value is not None and value is not False:
            raise ValueError(f"step programs run the fixed interval; {what} has {name}={value!r}, which {why}: "
                             f"apply the cache with {name} at its default "
                             f"({CacheConfig.__dataclass_fields__[name].default!r}) to export it")


class _Step(paddle.nn.Layer):
    """A UNet with a step cache, run as one fixed kind of step (full or cached)."""

    full_step: bool = True

    def __init__(self, unet: paddle.nn.Layer):
        super().__init__()
        cache = get_cache(unet)
        if cache is None:
            raise ValueError(f"{type(unet).__name__} has no step cache: call apply_cache on it before building its "
                             "step programs")
        refuse_unscheduled(cache.config, f"{type(unet).__name__}'s step cache")
        if getattr(unet, "up_blocks", None) is None:
            what = ("is a transformer-only model, whose step cache runs eagerly only: export it without the cache "
                    "(remove_cache; ToMe alone exports)" if isinstance(cache.layout, TransformerLayout)
                    else "has no up blocks")
            raise ValueError(f"step programs are built for a UNet (a cached step reads the output of a deep part of "
                             f"its up blocks); {type(unet).__name__} {what}")
        self.unet = unet
        self._cache = cache
        self._live = cache.deep[-1][0]  # the last deep part: up_blocks[-depth - 1], or a layer of up_blocks[-1]

    def _run(self, feature: Optional[paddle.Tensor], sample: paddle.Tensor, timestep: paddle.Tensor,
             encoder_hidden_states: paddle.Tensor, text_embeds: Optional[paddle.Tensor],
             time_ids: Optional[paddle.Tensor]) -> Tuple[Tuple[paddle.Tensor, ...], Any]:
        if get_cache(self.unet) is not self._cache:
            raise ValueError(f"the step cache these step programs were built from is no longer on "
                             f"{type(self.unet).__name__} (remove_cache or apply_cache since): build StepPrograms "
                             "again from the model as it is now")
        added = None
        if text_embeds is not None or time_ids is not None:  # SDXL's added conditioning
            added = {"text_embeds": text_embeds, "time_ids": time_ids}
        state = self._cache.thread_state()
        state.program = self.full_step
        state.sites = {}
        if feature is not None:
            site = state.sites[0] = Site()
            site.kept = KeptStep(outputs={self._live: feature})
        try:
            outputs = self.unet(sample, timestep, encoder_hidden_states, added_cond_kwargs=added, return_dict=False)
            kept = state.pending.outputs.get(self._live) if state.pending is not None else None
            if isinstance(kept, (tuple, list)):  # a transformer layer's 1-tuple
                kept = kept[0]
        finally:
            state.program, state.sites, state.state, state.pending = None, {}, None, None
        return outputs, kept


class FullStep(_Step):
    """The UNet's forward as a full step: ``(outputs, feature)``, the UNet's outputs as a tuple
    (``return_dict=False``) and the deep feature that :class:`CachedStep` takes."""

    full_step = True

    def forward(self, sample: paddle.Tensor, timestep: paddle.Tensor, encoder_hidden_states: paddle.Tensor,
                text_embeds: Optional[paddle.Tensor] = None,
                time_ids: Optional[paddle.Tensor] = None) -> Tuple[Tuple[paddle.Tensor, ...], paddle.Tensor]:
        return self.step(sample, timestep, encoder_hidden_states, text_embeds, time_ids)

    def step(self, sample: paddle.Tensor, timestep: paddle.Tensor, encoder_hidden_states: paddle.Tensor,
             text_embeds: Optional[paddle.Tensor] = None,
             time_ids: Optional[paddle.Tensor] = None) -> Tuple[Tuple[paddle.Tensor, ...], paddle.Tensor]:
        """The full step, run eagerly even after ``paddle.jit.to_static`` has converted :meth:`forward`."""
        return self._run(None, sample, timestep, encoder_hidden_states, text_embeds, time_ids)


class CachedStep(_Step):
    """The UNet's forward as a cached step: ``forward(feature, sample, timestep, encoder_hidden_states, ...)`` with
    the ``feature`` of the last :class:`FullStep`; no deep block runs. Returns the UNet's outputs as a tuple."""

    full_step = False

    def forward(self, feature: paddle.Tensor, sample: paddle.Tensor, timestep: paddle.Tensor,
                encoder_hidden_states: paddle.Tensor, text_embeds: Optional[paddle.Tensor] = None,
                time_ids: Optional[paddle.Tensor] = None) -> Tuple[paddle.Tensor, ...]:
        outputs, _ = self._run(feature, sample, timestep, encoder_hidden_states, text_embeds, time_ids)
        return outputs


class StepPrograms:
    """The full and the cached step of a UNet with a step cache (SD 1.x/2.x, or SDXL with ``text_embeds`` and
    ``time_ids``), as two layers to convert with ``paddle.jit.to_static`` and save with ``paddle.jit.save``;
    :class:`ScheduledSteps` runs them (or the loaded programs) on the cache's schedule. ToMe applied to the UNet is
    traced into both programs.

    Example (converted, saved, loaded and run for four steps of ``interval=3``):
        >>> import tempfile, paddle, ppdiffusers_tome
        >>> from paddle.static import InputSpec
        >>> from ppdiffusers_tome.cache.export import ScheduledSteps, StepPrograms
        >>> from ppdiffusers_tome.testing import tiny_unet
        >>> unet = ppdiffusers_tome.apply_cache(tiny_unet(), interval=3)
        >>> inputs = [paddle.randn([2, 4, 16, 16]), paddle.to_tensor([10, 10]), paddle.randn([2, 5, 32])]
        >>> spec = [InputSpec(x.shape, x.dtype) for x in inputs]
        >>> programs = StepPrograms(unet)
        >>> full = paddle.jit.to_static(programs.full, input_spec=spec, full_graph=True)
        >>> cached = paddle.jit.to_static(programs.cached, input_spec=[programs.feature_spec(*inputs)] + spec,
        ...                               full_graph=True)
        >>> folder = tempfile.mkdtemp()
        >>> paddle.jit.save(full, folder + "/full"); paddle.jit.save(cached, folder + "/cached")
        >>> steps = ScheduledSteps(paddle.jit.load(folder + "/full"), paddle.jit.load(folder + "/cached"),
        ...                        programs.config)
        >>> [list(steps(*inputs)[0].shape) for _ in range(4)][-1], steps.full_calls, steps.cached_calls
        ([2, 4, 16, 16], 2, 2)
    """

    def __init__(self, unet: paddle.nn.Layer):
        self.full = FullStep(unet)
        self.cached = CachedStep(unet)
        self.config: CacheConfig = self.full._cache.config

    def feature_spec(self, *args: Any, dynamic_batch: bool = False, **kwargs: Any) -> InputSpec:
        """The ``InputSpec`` of the deep feature, from one eager full step on example inputs (the batch ``None``
        with ``dynamic_batch``)."""
        with paddle.no_grad():
            _, feature = self.full.step(*args, **kwargs)
        shape = [None, *feature.shape[1:]] if dynamic_batch else feature.shape
        return InputSpec(shape, feature.dtype, name="deep_feature")


class ScheduledSteps:
    """Runs a full and a cached step (eager or converted layers, or loaded programs) on a :class:`CacheConfig`'s
    schedule: call it once per denoising step with the UNet's inputs; :meth:`reset` starts a new generation. The
    choice is a Python counter on the host; a step whose sample's shape (batch, height or width) differs from the one
    the kept feature was made from runs in full, as the eager cache does (counted in ``fallbacks``). Returns the step's UNet outputs as a tuple (a loaded full program
    returns ``[sample, feature]``; a loaded cached program the sample)."""

    def __init__(self, full: Callable[..., Any], cached: Callable[..., Any], config: CacheConfig):
        if not isinstance(config, CacheConfig):
            raise ValueError(f"config must be a CacheConfig (StepPrograms.config); got {type(config).__name__}")
        refuse_unscheduled(config, "config")
        self._full, self._cached, self.config = full, cached, config
        self.full_calls = self.cached_calls = self.fallbacks = 0  # fallbacks: cached steps run in full (shape changed)
        self.reset()

    def reset(self) -> None:
        """Start a new generation: the next call is step 0 (full)."""
        self.step = 0
        self._feature: Optional[paddle.Tensor] = None
        self._shape: Optional[Tuple[int, ...]] = None  # the sample's shape the feature was made from

    def __call__(self, *args: Any, **kwargs: Any) -> Tuple[paddle.Tensor, ...]:
        sample = args[0] if args else kwargs.get("sample")
        shape = tuple(int(n) for n in sample.shape) if sample is not None else None
        changed = self._feature is not None and shape != self._shape
        if self._feature is None or changed or self.config.is_full(self.step):
            self.fallbacks += int(changed and not self.config.is_full(self.step))
            self._shape = shape
            result = self._full(*args, **kwargs)
            if isinstance(result[0], (tuple, list)):  # a FullStep layer: ((sample,), feature)
                outputs, self._feature = tuple(result[0]), result[1]
            else:  # a loaded program: [sample, feature]
                outputs, self._feature = tuple(result[:-1]), result[-1]
            self.full_calls += 1
        else:
            result = self._cached(self._feature, *args, **kwargs)
            outputs = tuple(result) if isinstance(result, (tuple, list)) else (result,)  # a loaded program: a tensor
            self.cached_calls += 1
        self.step += 1
        return outputs
