"""What the benchmark measures: the methods and ``--variants`` (:class:`Method`), the settings of a run
(:class:`BenchSettings`) and the list of configurations they expand to (:func:`method_list`), and how each one is
put in place on a pipeline (:func:`configure`), including the zero-overhead ``bound``."""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import paddle

from ... import api
from ...cache.step_cache import CONFIG_FIELDS as CACHE_FIELDS, CacheConfig, apply_cache, remove_cache
from ...ops import MergePlan
from ...sd3_attention import joint_attention_layers
from ...tome.config import ToMeConfig
from ...tome.patch import ModelPatch
from ...tome.planner import Planner

ALL_METHODS = ("vanilla", "tome", "tome-efficient", "todo", "todo-efficient", "builtin", "bound", "cache")
RATIO_FREE = ("vanilla", "todo", "todo-efficient", "cache")  # methods that do not run once per --ratios value
APPLIED = ("tome", "tome-efficient", "todo", "todo-efficient")  # methods that are this package's apply_tome
_SHORT_OPTION = {"downsample_factor": "f", "downsample_mode": "mode", "recompute_every": "k", "max_downsample": "level"}


# the zero-overhead bound ------------------------------------------------------------------------------------------
class TruncationPlan:
    """Keep the first ``N - r`` tokens, pad the output back with zeros: the cost of running attention on fewer
    tokens with no matching at all. Same interface as :class:`ppdiffusers_tome.ops.MergePlan`."""

    def __init__(self, num_tokens: int, batch_size: int, r: int):
        self.num_tokens, self.batch_size, self.r = num_tokens, batch_size, r
        self.is_identity = r <= 0

    def merge(self, x: paddle.Tensor, mode: str = "mean") -> paddle.Tensor:
        return x[:, : self.num_tokens - self.r]

    def unmerge(self, y: paddle.Tensor) -> paddle.Tensor:
        pad = paddle.zeros([y.shape[0], self.r, y.shape[2]], dtype=y.dtype)
        return paddle.concat([y, pad], axis=1)

    run_sublayer = MergePlan.run_sublayer  # truncate, run the sub-layer, pad back: as a merge plan runs it


class BoundPlanner(Planner):
    """ToMe's level selection, with the matching replaced by :class:`TruncationPlan`."""

    def global_plan(self, block_index: int, hidden: Any, grid_h: int, grid_w: int, r: int,
                    call: Any = None) -> TruncationPlan:
        return TruncationPlan(hidden.shape[1], hidden.shape[0], r)


class BoundPatch(ModelPatch):
    """ToMe's hooks, with :class:`BoundPlanner` deciding every block's plan."""

    planner_type = BoundPlanner


# methods ---------------------------------------------------------------------------------------------------------
@dataclass
class Method:
    """One configuration to measure: a method name, its ratio and extra ``apply_tome`` options."""

    name: str
    ratio: float = 0.0
    options: dict[str, Any] = field(default_factory=dict)
    cache: dict[str, Any] | None = None  # apply_cache options (the "cache" method, or "cache=k" on a tome/todo variant)

    @property
    def label(self) -> str:
        label = self.name if self.name in RATIO_FREE or "ratio" in self.options else f"{self.name}@{self.ratio:g}"
        if self.cache is not None:
            extra = ",".join(f"{k}={v}".replace(" ", "") for k, v in self.cache.items() if k != "interval")
            cache = f"cache{self.cache.get('interval', 3)}" + (f"[{extra}]" if extra else "")
            label = cache if self.name == "cache" else f"{label}+{cache}"
        if self.options:
            parts = []
            for key, value in self.options.items():
                text = "-".join(f"{v:g}" for v in value) if isinstance(value, tuple) else str(value)
                parts.append(f"{_SHORT_OPTION.get(key, key)}={text}".replace(" ", ""))
            label += "[" + ",".join(parts) + "]"
        return label


@dataclass
class BenchSettings:
    """One benchmark run: the grid (resolutions x batch sizes x methods) and how each cell is measured."""

    resolutions: Sequence[int] = (512,)
    batch_sizes: Sequence[int] = (1,)
    ratios: Sequence[float] = (0.5,)
    methods: Sequence[str] = ("vanilla", "tome")
    variants: Sequence[str] = ()
    steps: int = 20
    repeats: int = 3
    warmup: int = 1
    max_downsample: Any = "auto"
    unet_only: bool = False
    seed: int = 0
    prompt: str = "a lighthouse on a cliff at sunset, detailed oil painting"
    guidance_scale: float | None = None  # None: the pipeline's default
    count_ops: bool = True  # ops/block: one extra denoiser forward per cell and method, profiled


def _split_top_level(text: str) -> list[str]:
    """Split ``a=1,b=(2,3)`` at the commas outside brackets."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def parse_variant(text: str) -> Method:
    """``"todo:downsample_factor=4,downsample_mode=average"`` -> a :class:`Method` with those options (validated
    by :class:`ToMeConfig`). Values are Python literals; bare words are strings. ``cache:interval=2`` is the step
    cache alone (options of :class:`~ppdiffusers_tome.cache.step_cache.CacheConfig`); ``cache=k`` on a tome or todo
    variant adds a step cache with ``interval=k``.

    >>> parse_variant("tome:recompute_every=5,ratio=(0.6,0.3)").label
    'tome[k=5,ratio=0.6-0.3]'
    >>> parse_variant("cache:interval=2").label, Method("tome", 0.5, cache=parse_variant("tome:cache=3").cache).label
    ('cache2', 'tome@0.5+cache3')
    """
    name, _, rest = text.partition(":")
    name = name.strip()
    if name == "cache":
        return _cache_variant(text, rest)
    if name not in APPLIED:
        raise ValueError(f"--variants: the method before ':' must be tome, tome-efficient, todo, todo-efficient or "
                         f"cache; got {text!r}")
    options: dict[str, Any] = {}
    cache = None
    for item in _split_top_level(rest):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"--variants: expected option=value in {text!r}; got {item!r}")
        if key == "cache":
            cache = {"interval": _literal(value)}
            CacheConfig(**cache)
            continue
        if key == "method" or key not in ToMeConfig.__dataclass_fields__:
            allowed = sorted(set(ToMeConfig.__dataclass_fields__) - {"method"})
            raise ValueError(f"--variants: unknown option {key!r} in {text!r}; options are {', '.join(allowed)}")
        try:
            options[key] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            options[key] = value.strip()
        if isinstance(options[key], list):
            options[key] = tuple(options[key])
    method = Method(name, float(options["ratio"]) if isinstance(options.get("ratio"), (int, float)) else 0.0, options,
                    cache)
    ToMeConfig(**config_kwargs(method))  # validate now, not after minutes of vanilla runs
    return method


def _literal(value: str) -> Any:
    try:
        return ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        return value.strip()


def _cache_variant(text: str, rest: str) -> Method:
    options: dict[str, Any] = {}
    for item in _split_top_level(rest):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in CACHE_FIELDS:
            raise ValueError(f"--variants: expected option=value with options {', '.join(CACHE_FIELDS)} in {text!r}; "
                             f"got {item!r}")
        options[key] = _literal(value)
    CacheConfig(**options)
    return Method("cache", 0.0, {}, options or {"interval": 3})


def config_kwargs(method: Method, max_downsample: Any = "auto") -> dict[str, Any]:
    """The ``apply_tome`` keyword arguments of one of this package's methods (``tome``/``todo``, with options)."""
    kwargs: dict[str, Any] = dict(max_downsample=max_downsample)
    if method.name.startswith("todo"):
        kwargs["method"] = "todo"
    else:
        kwargs["ratio"] = method.ratio
    kwargs.update(method.options)
    return kwargs


def _expand_variant(text: str, settings: BenchSettings) -> list[Method]:
    """The configurations one ``--variants`` entry adds: one, or one per ``--ratios`` value for a ``tome`` variant
    without its own ratio."""
    variant = parse_variant(text)
    across_steps = [k for k in ("recompute_every", "ratio") if k in variant.options and not
                    (k == "ratio" and isinstance(variant.options[k], (int, float)))]
    if settings.unet_only and across_steps:
        raise ValueError(
            f"--variants {text!r}: {' and '.join(across_steps)} act across denoising steps, which one denoiser "
            "forward (--unet-only) does not have; measure it with pipeline calls"
        )
    if settings.unet_only and variant.cache is not None:
        raise ValueError(f"--variants {text!r}: a step cache acts across denoising steps, which one denoiser forward "
                         "(--unet-only) does not have; measure it with pipeline calls")
    if variant.name.startswith("todo") or variant.name == "cache" or "ratio" in variant.options:
        return [variant]
    return [Method(variant.name, float(r), dict(variant.options), variant.cache) for r in settings.ratios]


def method_list(settings: BenchSettings) -> list[Method]:
    """Every configuration a run of ``settings`` measures, vanilla first, one per label."""
    methods = []
    for name in settings.methods:
        if name not in ALL_METHODS:
            raise ValueError(f"--methods must be among {ALL_METHODS}; got {name!r}")
        if name == "cache":
            if settings.unet_only:
                raise ValueError("--methods cache: a step cache acts across denoising steps, which one denoiser "
                                 "forward (--unet-only) does not have; measure it with pipeline calls")
            methods.append(Method(name, cache={"interval": 3}))
        elif name in RATIO_FREE:
            methods.append(Method(name))
        else:
            methods.extend(Method(name, float(r)) for r in settings.ratios)
    for text in settings.variants:
        methods.extend(_expand_variant(text, settings))
    if not any(m.name == "vanilla" for m in methods):
        methods.insert(0, Method("vanilla"))  # every ratio is against vanilla
    unique: dict[str, Method] = {}
    for method in methods:  # one cell per label: a variant equal to a plain method is measured once
        unique.setdefault(method.label, method)
    return list(unique.values())


# putting a method in place -----------------------------------------------------------------------------------------
class NotSupported(Exception):
    """The method cannot run on this device (reported as ``n/a`` in its cell)."""


def builtin_level(pipe, max_downsample: Any) -> int:
    """The integer level ppdiffusers' built-in port needs for ``max_downsample`` (it has no ``"auto"``): 2 for
    SDXL-style UNets (no attention at the first level), else 1."""
    if max_downsample != "auto":
        return int(max_downsample)
    return 2 if getattr(pipe.unet.config, "addition_embed_type", None) == "text_time" else 1


def configure(pipe, method: Method, max_downsample: Any) -> None:
    """Put ``pipe`` in the state that ``method`` measures."""
    api.remove_tome(pipe)
    remove_cache(pipe)
    set_efficient_attention(pipe, False)
    if method.cache is not None:
        apply_cache(pipe, **method.cache)
    if method.name in ("vanilla", "cache"):
        return
    if method.name in APPLIED:
        api.apply_tome(pipe, **config_kwargs(method, max_downsample))
        if method.name.endswith("-efficient"):
            set_efficient_attention(pipe, True)
    elif method.name == "builtin":
        for _, model in api.tome_models(pipe, patchable=True):
            paddle.nn.Layer.apply_tome(model, ratio=method.ratio, max_downsample=builtin_level(pipe, max_downsample))
    elif method.name == "bound":
        config = ToMeConfig(ratio=method.ratio, max_downsample=max_downsample, use_rand=False)
        for _, model in api.tome_models(pipe, patchable=True):
            BoundPatch.install(model, config)
    else:
        raise ValueError(f"method must be one of {ALL_METHODS}; got {method.name!r}")


def set_efficient_attention(pipe, enabled: bool) -> None:
    """Switch Paddle's memory-efficient attention on or off; raises :class:`NotSupported` where it is missing."""
    if enabled:
        try:
            pipe.enable_xformers_memory_efficient_attention()
        except (NotImplementedError, ValueError, RuntimeError) as error:
            pipe.disable_xformers_memory_efficient_attention()
            if not paddle.is_compiled_with_cuda():  # the usual case, said plainly rather than in ppdiffusers' words
                raise NotSupported("efficient attention unavailable: this PaddlePaddle is a CPU build, and Paddle's "
                                   "memory-efficient attention needs a GPU build (paddlepaddle-gpu)") from error
            raise NotSupported(f"efficient attention unavailable: {str(error).splitlines()[0][:120]}") from error
    elif not joint_attention_layers(pipe):  # (on SD3 it would put a one-stream processor on the joint layers)
        try:
            pipe.disable_xformers_memory_efficient_attention()
        except Exception:  # pragma: no cover - pipelines without attention processors
            pass
