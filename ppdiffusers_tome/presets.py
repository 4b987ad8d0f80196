"""Pipelines built from the configs shipped in ``ppdiffusers_tome/configs`` (random weights, no downloads), and the
loader for a real local pipeline folder. The demo's embedded default model and the benchmark architectures live here.

Each preset carries the resolution it is meant to run at (``default_resolution``). :func:`check_attention_memory`
estimates the memory of a run's largest self-attention from the layout alone, before anything is built, so that a
run that cannot fit stops with a clear message instead of being killed by the operating system.

Paddle and ppdiffusers are imported only by the functions that build pipelines: listing and reading presets is
instant (the command line's ``--help`` relies on it).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")

__all__ = [
    "available_presets",
    "load_preset",
    "preset_summary",
    "default_resolution",
    "preset_layout",
    "folder_layout",
    "estimate_attention_bytes",
    "available_memory_bytes",
    "check_attention_memory",
    "preset_pipeline",
    "load_local_pipeline",
    "DEFAULT_PRESET",
]

DEFAULT_PRESET = "sd15-narrow"


def available_presets() -> List[str]:
    """Names of the shipped pipeline configs.

    >>> "sd15-narrow" in available_presets()
    True
    """
    return sorted(name[: -len(".json")] for name in os.listdir(CONFIG_DIR) if name.endswith(".json"))


def load_preset(name: str) -> Dict[str, Any]:
    """The config dict of preset ``name`` (see :func:`available_presets`)."""
    names = available_presets()
    if name not in names:
        raise ValueError(f"preset must be one of {names}; got {name!r}")
    with open(os.path.join(CONFIG_DIR, name + ".json"), encoding="utf-8") as f:
        return json.load(f)


def preset_summary(name: str) -> str:
    """A few words on what preset ``name`` is (its config's ``summary``), for ``--help``."""
    return str(load_preset(name).get("summary", ""))


def default_resolution(name: str) -> int:
    """The image size in pixels (height = width) preset ``name`` is meant to run at.

    >>> default_resolution("tiny"), default_resolution("sd15-narrow"), default_resolution("sdxl")
    (64, 256, 1024)
    """
    return int(load_preset(name)["default_resolution"])


# memory check -----------------------------------------------------------------------------------------------------
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Live copies of the attention matrix in ppdiffusers' AttnProcessor: the scores and their softmax. Measured on the
# tiny preset with Paddle 3.3 on CPU: the memory a UNet forward adds is 2.00x one [rows, heads, N, N] float32 matrix.
_ATTENTION_COPIES = 2
_GIB = 1024.0**3

Layout = Tuple[Dict[str, Any], int]  # (UNet config, VAE scale factor)


def preset_layout(name: str) -> Layout:
    """The UNet config and VAE scale factor of preset ``name``, for :func:`estimate_attention_bytes`."""
    config = load_preset(name)
    return config["unet"], 2 ** (len(config["vae"]["block_out_channels"]) - 1)


def folder_layout(folder: str) -> Optional[Layout]:
    """The UNet config and VAE scale factor of a local pipeline folder (read from ``unet/config.json`` and
    ``vae/config.json``, nothing loaded), or ``None`` when the folder has no UNet (a DiT, for example)."""
    try:
        with open(os.path.join(folder, "unet", "config.json"), encoding="utf-8") as f:
            unet = json.load(f)
    except (OSError, ValueError):
        return None
    try:
        with open(os.path.join(folder, "vae", "config.json"), encoding="utf-8") as f:
            scale = 2 ** (len(json.load(f)["block_out_channels"]) - 1)
    except (OSError, ValueError, KeyError, TypeError):
        scale = 8
    return unet, scale


def _attention_levels(unet: Dict[str, Any], resolution: int, vae_scale: int) -> List[Tuple[int, int]]:
    """``(tokens, heads)`` of every UNet level with transformer blocks at ``resolution`` pixels."""
    heads = unet.get("num_attention_heads") or unet.get("attention_head_dim") or 8
    types = list(unet.get("down_block_types", []))
    side = max(resolution // vae_scale, 1)
    levels = []
    for index, kind in enumerate(types):
        if "Attn" in kind:
            level_heads = heads[index] if isinstance(heads, (list, tuple)) else heads
            levels.append((side * side, int(level_heads)))
        if index < len(types) - 1:
            side = math.ceil(side / 2)  # a stride-2 convolution with padding 1
    mid = unet.get("mid_block_type", "UNetMidBlock2DCrossAttn")
    if mid and "Attn" in mid and types:
        levels.append((side * side, int(heads[-1] if isinstance(heads, (list, tuple)) else heads)))
    return levels


def estimate_attention_bytes(
    layout: Layout, resolution: int, images: int = 1, dtype: str = "float32", guidance: bool = True
) -> int:
    """Bytes held by the largest self-attention of one vanilla UNet forward: ``rows x heads x N x N`` elements
    for the scores and again for their softmax, where ``N`` is the token count of a level with transformer blocks
    and ``rows`` is ``images``, doubled by classifier-free guidance. That matrix dominates a UNet's memory at
    high resolution and grows with the fourth power of the image side.

    >>> layout = preset_layout("tiny")  # 2x VAE, 8 heads, attention at the full latent resolution
    >>> estimate_attention_bytes(layout, 256) == 2 * 2 * 8 * (128 * 128) ** 2 * 4
    True
    """
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPE_BYTES)}; got {dtype!r}")
    unet, vae_scale = layout
    rows = images * (2 if guidance else 1)
    largest = max((heads * tokens * tokens for tokens, heads in _attention_levels(unet, resolution, vae_scale)),
                  default=0)
    return _ATTENTION_COPIES * rows * largest * _DTYPE_BYTES[dtype]


def available_memory_bytes() -> Optional[int]:
    """Memory the system can give a new process without swapping (``MemAvailable`` of ``/proc/meminfo``), or
    ``None`` where that is not known (not Linux)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _fitting_resolution(layout: Layout, upto: int, budget: float, images: int, dtype: str, step: int = 32) -> int:
    """The largest multiple of ``step`` pixels up to ``upto`` whose estimate is within ``budget`` bytes (0: none)."""
    for size in range(upto - upto % step, 0, -step):
        if estimate_attention_bytes(layout, size, images, dtype) <= budget:
            return size
    return 0


def check_attention_memory(
    layout: Optional[Layout],
    resolutions: Sequence[int],
    images: int = 1,
    dtype: str = "float32",
    source: str = "this model",
    option: str = "--resolution",
    available: Optional[int] = None,
) -> None:
    """Raise ``ValueError`` before anything is built when the largest self-attention of a run at any of
    ``resolutions`` (``images`` per call, with classifier-free guidance) needs more memory than is available.

    The message names the resolution, the model (``source``) and the largest resolution (a multiple of 32) whose
    estimate takes at most half the available memory. ``available`` defaults to :func:`available_memory_bytes`;
    nothing is checked when it is unknown or when ``layout`` is ``None``.

    >>> tiny = preset_layout("tiny")
    >>> check_attention_memory(tiny, [256], source="preset 'tiny'", available=8 * 1024**3)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: preset 'tiny' at 256x256 px needs about 32.0 GiB ... Use --resolution 128 or less (about 2.0 GiB).
    """
    if layout is None:
        return
    available = available_memory_bytes() if available is None else available
    if available is None:
        return
    for resolution in sorted(set(resolutions), reverse=True):
        need = estimate_attention_bytes(layout, resolution, images, dtype)
        if need <= available:
            continue
        tokens, heads = max(_attention_levels(layout[0], resolution, layout[1]), key=lambda th: th[1] * th[0] ** 2)
        fit = _fitting_resolution(layout, resolution, available / 2, images, dtype)
        advice = (
            f"Use {option} {fit} or less (about {estimate_attention_bytes(layout, fit, images, dtype) / _GIB:.1f} GiB)"
            if fit
            else "Even 32 px does not fit: free some memory"
        )
        raise ValueError(
            f"{source} at {resolution}x{resolution} px needs about {need / _GIB:.1f} GiB for one self-attention "
            f"({tokens} tokens, {heads} heads, UNet batch {2 * images}, {dtype}), more than the "
            f"{available / _GIB:.1f} GiB of memory available. {advice}."
        )


def preset_pipeline(name: str = DEFAULT_PRESET, scheduler: Optional[str] = None, seed: int = 0, dtype: str = "float32"):
    """A pipeline built from preset ``name`` with random weights (seeded, so reproducible): a
    ``StableDiffusionPipeline``, a ``StableDiffusionXLPipeline`` or a ``StableDiffusionControlNetPipeline``,
    as the preset's ``pipeline`` key says.

    >>> pipe = preset_pipeline("sd15-narrow")
    >>> pipe.unet.config.block_out_channels
    [64, 128, 256, 256]
    """
    import paddle
    import ppdiffusers
    from ppdiffusers import AutoencoderKL, UNet2DConditionModel

    from .testing import make_scheduler, random_controlnet, tiny_text_encoder, tiny_tokenizer

    config = load_preset(name)
    kind = config.get("pipeline", "sd")
    max_length = config.get("tokenizer_max_length", 77)
    tokenizer = tiny_tokenizer(max_length=max_length)
    vocab = len(tokenizer.get_vocab())
    parts: Dict[str, Any] = dict(
        tokenizer=tokenizer,
        text_encoder=tiny_text_encoder(vocab, max_length=max_length, seed=seed, **config["text_encoder"]),
    )
    paddle.seed(seed)
    parts["unet"] = UNet2DConditionModel(**config["unet"])
    paddle.seed(seed + 1)
    parts["vae"] = AutoencoderKL(**config["vae"])
    default_scheduler = "DDIMScheduler"
    if kind == "sdxl":
        parts["tokenizer_2"] = tiny_tokenizer(max_length=max_length)
        parts["text_encoder_2"] = tiny_text_encoder(
            vocab, max_length=max_length, projection=True, seed=seed + 2, **config["text_encoder_2"]
        )
        cls, extra = ppdiffusers.StableDiffusionXLPipeline, dict(add_watermarker=False)
        default_scheduler = "EulerDiscreteScheduler"
    elif kind in ("sd", "controlnet"):
        extra = dict(safety_checker=None, feature_extractor=None, requires_safety_checker=False)
        cls = ppdiffusers.StableDiffusionPipeline
        if kind == "controlnet":
            extra["controlnet"] = random_controlnet(parts["unet"], seed + 3, **config["controlnet"])
            cls = ppdiffusers.StableDiffusionControlNetPipeline
    else:
        raise ValueError(f"preset {name!r} has an unknown pipeline kind {kind!r}")
    pipe = cls(**parts, scheduler=make_scheduler(scheduler or default_scheduler), **extra)
    for component in pipe.components.values():
        if isinstance(component, paddle.nn.Layer):
            component.eval()
    if dtype != "float32":
        pipe.to(dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def load_local_pipeline(folder: str, dtype: str = "float32", scheduler: Optional[str] = None):
    """Load a pipeline saved with ``save_pretrained`` (or downloaded beforehand) from a local ``folder``."""
    import paddle
    from ppdiffusers import DiffusionPipeline

    from .testing import make_scheduler

    if not os.path.isfile(os.path.join(folder, "model_index.json")):
        raise ValueError(f"--model must be a local pipeline folder with a model_index.json; got {folder!r}")
    kwargs: Dict[str, Any] = {"paddle_dtype": getattr(paddle, dtype)}
    pipe = DiffusionPipeline.from_pretrained(folder, **kwargs)
    if scheduler is not None:
        pipe.scheduler = make_scheduler(scheduler)
    pipe.set_progress_bar_config(disable=True)
    return pipe
