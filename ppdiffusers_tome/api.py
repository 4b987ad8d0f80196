"""Public surface: ``apply_tome`` / ``remove_tome`` (and ToDo's ``apply_todo`` / ``remove_todo``) for pipelines,
UNets and ControlNets, and the methods that ``import ppdiffusers_tome`` puts on ppdiffusers' ``DiffusionPipeline`` and
``ModelMixin``."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import sys
import warnings
from typing import Any, Dict, List, Optional, Tuple

import paddle
from ppdiffusers import DiffusionPipeline, ModelMixin

from .cache.step_cache import _apply_cache, apply_cache, get_cache, remove_cache
from .core.calls import refuse_if_running
from .core.registry import original_class, set_original_class
from .core.targets import (
    fused_sd3_reason,
    is_fused_sd3,
    is_multi_controlnet,
    keyword_call,
    pipeline_candidates,
    resolve,
)
from .tome.config import ToMeConfig
from .tome.patch import PATCH_LOCK, ModelPatch, find_blocks, get_patch
from .tome.todo import ToDoConfig

logger = logging.getLogger(__name__)

__all__ = [
    "apply_todo",
    "apply_tome",
    "remove_builtin_tome",
    "remove_todo",
    "remove_tome",
    "reset_tome",
    "tome_config",
    "tome_models",
    "tome_status",
    "tome_stats",
    "install_methods",
    "uninstall_methods",
]

# where a user with half-precision weights on a CPU should go: the README section with the GPU install recipe
GPU_INSTALL_HINT = (
    'install paddlepaddle-gpu as in README.md "Install into your own environment" (README_cn.md: "二、装进自己的环境")'
)
_warned_half_on_cpu = False  # apply_tome warns about half precision on a CPU once per process


def _ours(module: str) -> bool:
    """Whether ``module`` is this package or one of its modules (not a user module that merely starts alike, such
    as ``ppdiffusers_tome_demo``)."""
    return module == "ppdiffusers_tome" or module.startswith("ppdiffusers_tome.")


def _caller_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` called from the caller of this function that points at the first
    frame outside this package (the user's ``pipe.apply_tome(...)`` line, through however many of our frames)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and _ours(frame.f_globals.get("__name__", "")):
        frame, level = frame.f_back, level + 1
    return level


def _warn_if_half_on_cpu(targets: List[Tuple[str, paddle.nn.Layer]]) -> None:
    """Warn (once per process) when a model about to get ToMe holds float16/bfloat16 weights on a CPU: Paddle's CPU
    build has no half-precision kernels, so its first call would die deep inside Paddle."""
    global _warned_half_on_cpu
    if _warned_half_on_cpu:
        return
    for name, model in targets:
        param = next(iter(model.parameters()), None)
        dtype = str(getattr(param, "dtype", "")).replace("paddle.", "")
        if dtype in ("float16", "bfloat16") and param.place.is_cpu_place():
            _warned_half_on_cpu = True
            warnings.warn(
                f"{name} holds {dtype} weights on the CPU: Paddle's CPU build has no {dtype} kernels (matmul, "
                f"softmax, conv2d, ...), so its first call will fail with \"(NotFound) The kernel with key (CPU, ..., "
                f'{dtype}) ... is not registered". On a CPU, load the model in float32 (leave out paddle_dtype); for '
                f"half precision, {GPU_INSTALL_HINT} and run on the GPU.",
                UserWarning,
                stacklevel=_caller_stacklevel(),
            )
            return


def _is_builtin_block(layer: paddle.nn.Layer) -> bool:
    """Whether ppdiffusers' built-in ToMe swapped ``layer``'s class for its own (which keeps the original class as
    ``_parent``), underneath any hooks of this package."""
    cls = original_class(layer)
    return cls.__name__.startswith("ToMe") and isinstance(cls.__dict__.get("_parent"), type)


def remove_builtin_tome(model: paddle.nn.Layer) -> bool:
    """Undo ppdiffusers' built-in ToMe port on ``model`` (class swap, size hook, ``_tome_info``), if present.

    Returns whether anything was removed. The built-in ``remove_tome`` leaves its ``_tome_info`` attributes behind;
    this removes them too. (:func:`apply_tome` and :func:`remove_tome` call it for you.)

    Example:
        >>> from ppdiffusers_tome.testing import tiny_unet
        >>> remove_builtin_tome(tiny_unet())   # nothing to undo
        False
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
        if _is_builtin_block(layer):
            set_original_class(layer, original_class(layer).__dict__["_parent"])
            found = True
    return found


def _unsupported_reason(model: paddle.nn.Layer) -> str:
    """Why ToMe cannot patch a model with no transformer block it knows (``BasicTransformerBlock``,
    ``JointTransformerBlock``), for the error message."""
    if is_fused_sd3(model):
        return fused_sd3_reason(type(model).__name__, "ToMe")
    names = {type(layer).__name__ for _, layer in model.named_sublayers() if "Block" in type(layer).__name__}
    blocks = sorted(names, key=lambda n: ("Transformer" not in n and "Attention" not in n, n))  # relevant ones first
    if blocks:
        return (
            f"{type(model).__name__} is built from {', '.join(blocks[:4])}, not ppdiffusers' BasicTransformerBlock "
            "(as in UNet2DConditionModel, ControlNetModel and the DiT / PixArt-alpha Transformer2DModel) or "
            "JointTransformerBlock (SD3Transformer2DModel); it is not supported"
        )
    return f"{type(model).__name__} has no transformer blocks (BasicTransformerBlock)"


def _has_blocks(model: paddle.nn.Layer) -> bool:
    return bool(find_blocks(model))


def _targets(obj: Any, for_apply: bool, what: str) -> List[Tuple[str, paddle.nn.Layer]]:
    """Resolve what ``obj`` means: every model to patch, as ``(name, model)``. Raises ValueError on bad input, naming
    ``what``, the function called."""
    pipeline, targets = resolve(obj, what, _has_blocks)
    if not for_apply:
        return targets
    if pipeline is not None and not targets:
        found = pipeline_candidates(pipeline)
        denoisers = [(n, m) for n, m in found if n.startswith(("unet", "transformer", "prior", "decoder"))]
        detail = "; ".join(_unsupported_reason(m) for _, m in denoisers)
        raise ValueError(
            f"{type(pipeline).__name__} has no component with transformer blocks ToMe can patch (looked at: "
            f"{', '.join(n for n, _ in found) or 'nothing'}){': ' + detail if detail else ''}. ToMe needs a "
            "UNet, a ControlNet or a DiT / PixArt-alpha / SD3 transformer"
        )
    empty = [(n, m) for n, m in targets if not find_blocks(m)]
    if empty:
        reasons = "; ".join(_unsupported_reason(m) for _, m in empty)
        if all(is_fused_sd3(m) for _, m in empty):  # (the right model, built the wrong way)
            raise ValueError(reasons)
        raise ValueError(
            f"{reasons}. Apply ToMe to the pipeline, its unet, its controlnet or its DiT / PixArt-alpha / SD3 "
            "transformer, not to the VAE or a text encoder"
        )
    return targets


def tome_models(obj: Any, patchable: bool = False) -> List[Tuple[str, paddle.nn.Layer]]:
    """The models ToMe acts on inside ``obj`` (a pipeline, a model, a MultiControlNet or a list), as
    ``(name, model)`` in a stable order: a pipeline's UNet / ControlNets / DiT transformer, a MultiControlNet net by
    net. With ``patchable=True`` it raises ``ValueError`` (naming the reason) when ``obj`` holds no model ToMe can
    patch, exactly as :func:`apply_tome` would.

    Example:
        >>> from ppdiffusers_tome.testing import tiny_controlnet_pipeline
        >>> [name for name, _ in tome_models(tiny_controlnet_pipeline(num_controlnets=2))]
        ['unet', 'controlnet.nets.0', 'controlnet.nets.1']
    """
    return _targets(obj, for_apply=patchable, what="tome_models")


def apply_tome(obj: Any, config: Optional[ToMeConfig] = None, **options: Any) -> Any:
    """Patch a pipeline, a UNet, a ControlNet (single or multi), a DiT / PixArt-alpha transformer or a list of
    them with ToMe; returns ``obj``.

    ``config`` is a :class:`ToMeConfig` (for example ``tome_config(other_pipe)``), ``options`` its fields by name
    (``ratio=0.5, ...``); options given with a config replace those fields of it.

    Every model in ``obj`` that holds transformer blocks gets its own patch (the VAE and text encoders never do).
    Applying again replaces the previous settings (twice is the same as once); a model patched by ppdiffusers'
    built-in ``apply_tome`` is cleaned of it once every model is patched. Arguments are validated before anything is
    touched (see :class:`ToMeConfig` for their meaning and ranges); bad input raises ``ValueError`` and leaves
    ``obj`` as it was. A failure half-way through the models leaves a built-in patch exactly as it was and puts
    back this package's earlier settings (its counters and cached plans start afresh).

    Beyond tomesd: ``max_downsample="auto"`` (the default) finds the finest level with transformer blocks, so SDXL
    merges too; ``ratio=(0.6, 0.3)`` or a callable of the denoising progress schedules the ratio;
    ``recompute_every=k`` reuses each block's matching for ``k`` steps; ``method="todo"`` downsamples keys and
    values instead of merging tokens; ``match_window=16`` matches within windows and, on a GPU, merges with two
    small matmuls (``match_order="feature"`` cuts those windows along the features instead of the grid);
    ``share_plan="level"`` plans once per level and call; ``deterministic=True`` merges without float atomics on a
    GPU (bit-identical run to run); ``policy="auto"`` (the default) skips, on a GPU, the blocks whose attention work
    ``batch * tokens**2`` is below ``min_work`` and pools keys and values where merging pays (``policy="tomesd"``
    merges every eligible block, as tomesd).

    Example:
        >>> import ppdiffusers_tome
        >>> from ppdiffusers_tome.testing import tiny_sd_pipeline
        >>> pipe = tiny_sd_pipeline()
        >>> pipe = ppdiffusers_tome.apply_tome(pipe, ratio=0.5)   # or: pipe.apply_tome(ratio=0.5)
        >>> ppdiffusers_tome.tome_config(pipe.unet).ratio
        0.5
        >>> pipe = ppdiffusers_tome.remove_tome(pipe)
    """
    return _apply_tome(obj, config, options, method=False)


def apply_todo(obj: Any, config: Optional[ToDoConfig] = None, **options: Any) -> Any:
    """Patch a pipeline, a UNet, a ControlNet (single or multi), a DiT / PixArt-alpha / SD3 transformer or a list of
    them with ToDo (token downsampling: every query stays, the keys and values of self-attention come from the tokens
    downsampled on their grid); returns ``obj``.

    ``config`` is a :class:`~ppdiffusers_tome.tome.todo.ToDoConfig`, ``options`` its fields by name (``factor=2,
    mode="nearest", ...``). ToDo runs on ToMe's per-block machinery and takes its place on a model: applying one
    replaces the other, :func:`tome_status` and :func:`tome_stats` report it, :func:`remove_todo` (or
    :func:`remove_tome`) takes it off. The same as 0.14's ``apply_tome(obj, method="todo", downsample_factor=...,
    downsample_mode=...)``, which still works.

    Example:
        >>> import ppdiffusers_tome
        >>> from ppdiffusers_tome.testing import tiny_unet
        >>> unet = ppdiffusers_tome.apply_todo(tiny_unet(), factor=4)
        >>> ppdiffusers_tome.tome_config(unet)
        ToDoConfig(factor=4, mode='nearest', max_downsample='auto', min_tokens=0, policy='auto', min_work=None)
        >>> unet = ppdiffusers_tome.remove_todo(unet)
    """
    return _install(obj, _config_from(config, options, obj, False, "apply_todo"), "apply_todo")


def _apply_tome(obj: Any, config: Any, options: Dict[str, Any], method: bool, what: str = "apply_tome") -> Any:
    """:func:`apply_tome` (``what="apply_todo"``: :func:`apply_todo`) called as a function (``method=False``) or as
    the method ``obj.apply_tome`` (``True``): the errors name the form the caller used."""
    return _install(obj, _config_from(config, options, obj, method, what), what)


def _install(obj: Any, config: Any, what: str) -> Any:
    """Install ``config`` (a ToMeConfig or a ToDoConfig) on every model of ``obj``; ``what``: the door called."""
    targets = _targets(obj, for_apply=True, what=what)
    _warn_if_half_on_cpu(targets)
    with PATCH_LOCK:  # atomic: threads applying and removing at once leave one patch per model, or none
        _install_everywhere(targets, config, _train_timesteps(obj))
        for name, model in targets:
            if remove_builtin_tome(model):
                logger.debug("removed ppdiffusers' built-in ToMe patch from %s", name)
    return obj


# each door: its config class and the option a bare number given as ``config`` was probably meant for
_DOORS = {"apply_tome": (ToMeConfig, "ratio"), "apply_todo": (ToDoConfig, "factor")}


def _config_from(config: Any, options: Dict[str, Any], obj: Any, method: bool, what: str = "apply_tome") -> Any:
    """The config of an ``apply_tome`` (``apply_todo``: ``what``) call on ``obj`` (the method form with ``method``):
    ``config`` (or the defaults) with ``options`` put in; an unknown option or a ``config`` of another class raises
    ``ValueError`` naming it (a number there is taken for a ratio or a factor, and the hint writes the call in the
    caller's form)."""
    cls, keyword = _DOORS[what]
    if config is not None and not isinstance(config, cls):
        meant = keyword_call(obj, what, keyword, config, method)
        hint = f" (the {keyword} is a keyword: {meant})" if isinstance(config, (int, float)) else ""
        raise ValueError(f"config must be None or a {cls.__name__}; got {type(config).__name__} {config!r}{hint}")
    names = [field.name for field in dataclasses.fields(cls)]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise ValueError(f"{what} got unknown option(s) {', '.join(unknown)}; the options are the fields of "
                         f"{cls.__name__}: {', '.join(names)}")
    if config is None:
        return cls(**options)
    return dataclasses.replace(config, **options) if options else config


def _signature(cls: type) -> inspect.Signature:
    """What help() shows for a door taking ``cls``: every option by name with its default, after obj and config."""
    return inspect.Signature(
        [inspect.Parameter("obj", inspect.Parameter.POSITIONAL_OR_KEYWORD),
         inspect.Parameter("config", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)]
        + [inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=field.default,
                             annotation=field.type) for field in dataclasses.fields(cls)],
        return_annotation=Any,
    )


apply_tome.__signature__, apply_todo.__signature__ = _signature(ToMeConfig), _signature(ToDoConfig)


def _install_everywhere(targets: List[Tuple[str, paddle.nn.Layer]], config: Any, train_timesteps: int) -> None:
    """Patch every target, or none: a failure half-way puts back what this package had applied before. (ppdiffusers'
    built-in port stays until every target is patched: our hooks do not depend on the block classes, so a failure
    leaves the built-in patch untouched.)"""
    for name, model in targets:
        refuse_if_running(model, name, "ToMe")
        patch = get_patch(model)
        if patch is not None:
            patch.check_idle()
    previous = [get_patch(model) for _, model in targets]
    previous = [(p.config, p.train_timesteps) if p is not None else None for p in previous]
    installed: List[ModelPatch] = []
    try:
        for name, model in targets:
            installed.append(ModelPatch.install(model, config, train_timesteps))  # replaces this package's patch
            logger.debug("ToMe applied to %s (%d blocks): %s", name, len(installed[-1].blocks), config)
    except BaseException:
        # roll back every model on its own, so that one that cannot be put back does not stop the others
        for patch in installed:
            try:
                patch.remove(force=True)  # (a forward that started meanwhile must not keep half of the models)
            except Exception:  # pragma: no cover - removing hooks does not fail in practice
                logger.exception("could not take ToMe off %s while rolling back", type(patch.model).__name__)
        for (name, model), before in zip(targets, previous):  # put back what this package had applied
            if before is not None and get_patch(model) is None:
                try:
                    ModelPatch.install(model, *before)
                except Exception:  # pragma: no cover
                    logger.exception("could not put the previous ToMe patch back on %s", name)
        raise


def _train_timesteps(obj: Any) -> int:
    """``num_train_timesteps`` of a pipeline's scheduler (the ``T`` of the denoising progress ``1 - t/T``); 1000,
    the value of every Stable Diffusion scheduler, for a bare model."""
    scheduler = obj.components.get("scheduler") if isinstance(obj, DiffusionPipeline) else None
    value = getattr(getattr(scheduler, "config", None), "num_train_timesteps", None)
    return int(value) if isinstance(value, int) and value > 0 else 1000


def _unpatch(model: paddle.nn.Layer) -> None:
    patch = get_patch(model)
    if patch is not None:
        patch.remove()
    if remove_builtin_tome(model):
        logger.debug("removed ppdiffusers' built-in ToMe patch from %s", type(model).__name__)


def remove_tome(obj: Any) -> Any:
    """Remove ToMe (this package's, and ppdiffusers' built-in one) from ``obj``; a no-op when nothing is applied.

    Returns ``obj``, whose models then compute exactly what they computed before ``apply_tome``.

    Example:
        >>> import ppdiffusers_tome
        >>> from ppdiffusers_tome.testing import tiny_unet
        >>> unet = ppdiffusers_tome.remove_tome(tiny_unet())   # nothing applied: nothing happens
        >>> ppdiffusers_tome.tome_config(unet) is None
        True
    """
    _remove(obj, "remove_tome")
    return obj


def remove_todo(obj: Any) -> Any:
    """Remove this package's ToDo (:func:`apply_todo`, or ``apply_tome(method="todo")``) from the models of ``obj``
    that carry it (see :func:`apply_todo`'s example); a model carrying ToMe keeps it. Returns ``obj``."""
    _remove(obj, "remove_todo", only=ToDoConfig)
    return obj


def _remove(obj: Any, what: str, only: Optional[type] = None) -> List[Tuple[str, paddle.nn.Layer]]:
    """Take this package's patch (and ppdiffusers' built-in ToMe) off the models of ``obj`` (with ``only``: those
    whose patch runs a config of that class); returns them as ``(name, model)``."""
    targets = _targets(obj, for_apply=False, what=what)
    with PATCH_LOCK:  # atomic with respect to apply_tome/remove_tome in other threads
        if only is not None:
            targets = [(name, model) for name, model in targets
                       if get_patch(model) is not None and isinstance(get_patch(model).runner.config, only)]
        for name, model in targets:
            patch = get_patch(model)
            if patch is not None:
                patch.check_idle()
        for _, model in targets:
            _unpatch(model)
    return targets


def reset_tome(obj: Any) -> Any:
    """Forget what the patches in ``obj`` remember between calls: cached plans (``recompute_every``), the step
    count and the counters of :func:`tome_stats`. The settings stay. Returns ``obj``.

    Every pipeline call starts a new generation on its own (steps are counted by the pipeline's progress bar).
    Call this between two generations of a model called directly, outside a pipeline.

    Example:
        >>> import ppdiffusers_tome
        >>> from ppdiffusers_tome.testing import tiny_unet
        >>> unet = ppdiffusers_tome.apply_tome(tiny_unet(), recompute_every=5)
        >>> ppdiffusers_tome.reset_tome(unet) is unet
        True
    """
    for _, model in _targets(obj, for_apply=False, what="reset_tome"):
        patch = get_patch(model)
        if patch is not None:
            patch.reset()
    return obj


def tome_config(obj: Any) -> Optional[ToMeConfig]:
    """The :class:`ToMeConfig` this package applied to ``obj`` (a model, a pipeline, a MultiControlNet or a list of
    models; the :class:`~ppdiffusers_tome.tome.todo.ToDoConfig` after :func:`apply_todo`), or ``None`` when none of
    its models carries this package's ToMe.

    For a pipeline or a list it is the config its patched models share (``apply_tome`` on a pipeline gives each
    model the same one); models without ToMe are ignored. If the models carry different configs there is no single
    answer, and a ``ValueError`` says which model has which. ppdiffusers' built-in ToMe is not a
    :class:`ToMeConfig`: use :func:`tome_status` to see it, or to see each model.

    Example:
        >>> import ppdiffusers_tome
        >>> from ppdiffusers_tome.testing import tiny_sd_pipeline
        >>> pipe = tiny_sd_pipeline()
        >>> ppdiffusers_tome.tome_config(pipe) is None
        True
        >>> ppdiffusers_tome.tome_config(pipe.apply_tome(ratio=0.4)).ratio
        0.4
    """
    patch = get_patch(obj)
    if patch is not None:
        return patch.config
    if not (isinstance(obj, (DiffusionPipeline, list, tuple)) or is_multi_controlnet(obj)):
        return None
    found = [(name, get_patch(model)) for name, model in _targets(obj, for_apply=False, what="tome_config")]
    configs = [(name, patch.config) for name, patch in found if patch is not None]
    if not configs:
        return None
    if any(config != configs[0][1] for _, config in configs[1:]):
        detail = "; ".join(f"{name}: {config}" for name, config in configs)
        raise ValueError(
            f"the models of this {type(obj).__name__} carry different ToMe configs ({detail}); ask each model, "
            "or use ppdiffusers_tome.tome_status"
        )
    return configs[0][1]


def _builtin_patch(model: paddle.nn.Layer) -> Tuple[int, Optional[Dict[str, Any]]]:
    """Blocks of ``model`` that ppdiffusers' built-in ToMe has swapped to its own class, and that port's settings."""
    blocks = [layer for _, layer in model.named_sublayers(include_self=True) if _is_builtin_block(layer)]
    if not blocks:
        return 0, None
    info = model.__dict__.get("_tome_info") or blocks[0].__dict__.get("_tome_info")
    args = info.get("args") if isinstance(info, dict) else None
    return len(blocks), dict(args) if isinstance(args, dict) else {}


def tome_status(obj: Any) -> Dict[str, Dict[str, Any]]:
    """Which ToMe is active on each model of ``obj`` (a pipeline, a model, a MultiControlNet or a list of models),
    with its settings. The one documented way to answer "is ToMe on?".

    For every model that has transformer blocks (for a pipeline: its UNet, ControlNets, DiT transformer; never the
    VAE or text encoders), keyed by component name:

    * ``"active"``: ``"ppdiffusers_tome"`` (this package), ``"builtin"`` (ppdiffusers' own port, which
      ``pipe.apply_tome`` runs when ``ppdiffusers_tome`` was not imported), or ``None``. Each removes the other
      when applied, so both at once should not happen; if it does, this reads ``"ppdiffusers_tome+builtin"``
      and ``settings`` are this package's;
    * ``"settings"``: the settings of the active ToMe as a dict (:meth:`ToMeConfig.to_dict`, or the built-in
      port's arguments), or ``None``;
    * ``"blocks"``: how many transformer blocks it patched (0 when none);
    * ``"policy"`` (this package only): what the policy chose at each token count seen so far, ``{tokens:
      {"action", "kernels", "batch", "tokens", "work", "min_work", "shared", "why"}}``; ``action`` is ``"merge"``
      (the settings' plan), ``"pool"`` (K/V pooling; on SD3, of the image keys and values) or ``"skip"``,
      ``shared`` says whether a merge plan is made once per call for every block at that token count, and ``why``
      says it in one line with the numbers;
    * ``"cache"``: the step cache on the model (:func:`ppdiffusers_tome.apply_cache`), as
      :func:`~ppdiffusers_tome.cache.step_cache.cache_status` gives it, or ``None``.

    Example:
        >>> import ppdiffusers_tome
        >>> from ppdiffusers_tome.testing import tiny_sd_pipeline
        >>> pipe = tiny_sd_pipeline().apply_tome(ratio=0.3)
        >>> status = ppdiffusers_tome.tome_status(pipe)["unet"]
        >>> status["active"], status["settings"]["ratio"], status["blocks"]  # (the blocks at a level that merges)
        ('ppdiffusers_tome', 0.3, 3)
    """
    status: Dict[str, Dict[str, Any]] = {}
    for name, model in _targets(obj, for_apply=False, what="tome_status"):
        patch = get_patch(model)
        builtin_blocks, builtin_settings = _builtin_patch(model)
        active = [label for label, on in (("ppdiffusers_tome", patch is not None), ("builtin", builtin_blocks)) if on]
        if patch is not None:
            settings, blocks = patch.config.to_dict(), len(patch.blocks)
        else:
            settings, blocks = builtin_settings, builtin_blocks
        status[name] = {"active": "+".join(active) or None, "settings": settings, "blocks": blocks}
        if patch is not None:
            decisions = dict(patch.counters.decisions)
            status[name]["policy"] = {tokens: decisions[tokens].as_dict() for tokens in sorted(decisions)}
        cache = get_cache(model)
        status[name]["cache"] = None if cache is None else cache.status()
    return status


def tome_stats(obj: Any) -> Dict[str, Dict[str, int]]:
    """Counters per patched model of ``obj``, all since ``apply_tome``: ``blocks`` patched, forward ``calls`` seen,
    sub-layer ``merges`` run on merged (or, with ToDo, downsampled) tokens, merge plans ``plans_computed``
    (matching run), ``plans_reused`` (taken from the cache of ``recompute_every``) and ``plans_shared`` (taken from
    an earlier block of the same call: ``share_plan="level"``, or SD3 on GPU kernels), ``blocks_skipped``: block
    calls that would have merged but were below ``min_tokens`` or the policy's ``min_work``, and ``blocks_pooled``:
    block calls whose keys and values the policy pooled instead of merging.

    Example:
        >>> import ppdiffusers_tome
        >>> from ppdiffusers_tome.testing import tiny_unet
        >>> unet = ppdiffusers_tome.apply_tome(tiny_unet(), share_plan="level")
        >>> sorted(ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"])
        ['blocks', 'blocks_pooled', 'blocks_skipped', 'calls', 'merges', 'plans_computed', 'plans_reused', 'plans_shared']
    """
    stats = {}
    for name, model in _targets(obj, for_apply=False, what="tome_stats"):
        patch = get_patch(model)
        if patch is not None:
            stats[name] = {"blocks": len(patch.blocks), **patch.counters.as_dict()}
    return stats


# methods on ppdiffusers classes ---------------------------------------------------------------------------------
def _apply_method(self, config=None, **options):
    return _apply_tome(self, config, options, method=True)


def _remove_method(self, only_return_self: bool = True):
    # ``only_return_self`` keeps the signature of ppdiffusers' built-in method, whose apply_tome calls it
    targets = _remove(self, "remove_tome")
    if only_return_self:
        return self
    return self, [model for _, model in targets]


_apply_method.__doc__ = apply_tome.__doc__
_apply_method.__signature__ = inspect.signature(apply_tome).replace(  # what help(pipe.apply_tome) shows
    parameters=[inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    + list(inspect.signature(apply_tome).parameters.values())[1:]
)
_remove_method.__doc__ = remove_tome.__doc__
_apply_method.__name__, _remove_method.__name__ = "apply_tome", "remove_tome"


def _apply_todo_method(self, config=None, **options):
    return _apply_tome(self, config, options, method=True, what="apply_todo")


def _remove_todo_method(self):
    return remove_todo(self)


_apply_todo_method.__doc__, _remove_todo_method.__doc__ = apply_todo.__doc__, remove_todo.__doc__
_apply_todo_method.__name__, _remove_todo_method.__name__ = "apply_todo", "remove_todo"

def _apply_cache_method(self, config=None, **options):
    return _apply_cache(self, config, options, method=True)


def _remove_cache_method(self):
    return remove_cache(self)


_apply_cache_method.__doc__, _remove_cache_method.__doc__ = apply_cache.__doc__, remove_cache.__doc__
_apply_cache_method.__name__, _remove_cache_method.__name__ = "apply_cache", "remove_cache"

_METHOD_OWNERS = (DiffusionPipeline, ModelMixin)
_METHODS = (("apply_tome", _apply_method), ("remove_tome", _remove_method), ("apply_todo", _apply_todo_method),
            ("remove_todo", _remove_todo_method), ("apply_cache", _apply_cache_method),
            ("remove_cache", _remove_cache_method))
_saved_methods: Dict[Tuple[type, str], Any] = {}


def install_methods() -> None:
    """Make ``apply_tome``/``remove_tome`` methods of ``DiffusionPipeline`` and ``ModelMixin`` call this package
    (taking precedence over ppdiffusers' built-in port), and add ``apply_todo``/``remove_todo`` and
    ``apply_cache``/``remove_cache``. Runs on ``import ppdiffusers_tome``; idempotent."""
    for owner in _METHOD_OWNERS:
        for name, method in _METHODS:
            if (owner, name) not in _saved_methods:
                _saved_methods[(owner, name)] = owner.__dict__.get(name)
            setattr(owner, name, method)


def uninstall_methods() -> None:
    """Put back whatever ``DiffusionPipeline``/``ModelMixin`` had before :func:`install_methods`."""
    for (owner, name), previous in _saved_methods.items():
        if previous is None:
            if name in owner.__dict__:
                delattr(owner, name)
        else:
            setattr(owner, name, previous)
    _saved_methods.clear()
