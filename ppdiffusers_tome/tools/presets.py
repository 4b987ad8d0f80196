"""The embedded models: pipelines built from the configs shipped in ``ppdiffusers_tome/tools/configs`` with random
weights (no downloads), the memory check that runs before anything is built, and the loader for a real local
pipeline folder. The demo's default model and the benchmark architectures live here; the tiny test models in
:mod:`~ppdiffusers_tome.tools.tiny`, which this module re-exports (every import of them from here keeps working).

Each preset carries the resolution it is meant to run at (``default_resolution``). :func:`check_attention_memory`
estimates the memory of a run's largest self-attention from the layout alone, before anything is built, so that a
run that cannot fit stops with a clear message instead of being killed by the operating system.

Every pipeline is assembled by one path from its preset's config (:func:`_assemble`, from the parts built in
:mod:`~ppdiffusers_tome.tools.tiny`): "tiny" is just another preset, so ``tiny_sd_pipeline(seed=s)`` builds exactly
what ``preset_pipeline("tiny", seed=s)`` builds (same weights). (``ppdiffusers_tome.testing`` re-exports the tiny
builders, for existing test code and scripts.)

Paddle and ppdiffusers are imported only by the functions that build pipelines (through ``_libs``): listing and
reading presets and the memory check are instant (the command line's ``--help`` relies on it).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

from .pipelines import assemble_pipeline, tiny_controlnet_pipeline, tiny_sd_pipeline, tiny_sdxl_pipeline  # noqa: F401
from .preset_configs import CONFIG_DIR, available_presets, load_preset  # noqa: F401
from .tiny import (  # noqa: F401  (the tiny builders and the parts of every pipeline: see tiny.py)
    TEXT_HIDDEN,
    _byte_symbols,
    _finish,
    _libs,
    _seeded_model,
    make_scheduler,
    random_controlnet,
    tiny_controlnet,
    tiny_dit_pipeline,
    tiny_dit_transformer,
    tiny_sd3_pipeline,
    tiny_sd3_transformer,
    tiny_sdxl_unet,
    tiny_text_encoder,
    tiny_tokenizer,
    tiny_unet,
    tiny_vae,
    write_tokenizer_files,
)

__all__ = [
    "DEFAULT_PRESET",
    "DTYPES",
    "TINY_TIMINGS",
    "available_memory_bytes",
    "available_presets",
    "check_attention_memory",
    "check_dtype",
    "default_resolution",
    "estimate_attention_bytes",
    "folder_layout",
    "folder_resolution",
    "load_local_pipeline",
    "load_preset",
    "make_scheduler",
    "preset_layout",
    "preset_pipeline",
    "preset_summary",
    "random_controlnet",
    "tiny_controlnet",
    "tiny_controlnet_pipeline",
    "tiny_dit_pipeline",
    "tiny_dit_transformer",
    "tiny_sd3_pipeline",
    "tiny_sd3_transformer",
    "tiny_sd_pipeline",
    "tiny_sdxl_pipeline",
    "tiny_sdxl_unet",
    "tiny_text_encoder",
    "tiny_tokenizer",
    "tiny_unet",
    "tiny_vae",
    "write_tokenizer_files",
]

DEFAULT_PRESET = "sd15-narrow"


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

UNetShape = tuple[dict[str, Any], int]  # (UNet config, VAE scale factor); not ops.partition.Layout


def preset_layout(name: str) -> UNetShape:
    """The UNet config and VAE scale factor of preset ``name``, for :func:`estimate_attention_bytes`."""
    config = load_preset(name)
    return config["unet"], 2 ** (len(config["vae"]["block_out_channels"]) - 1)


def _read_config(folder: str, component: str) -> dict[str, Any] | None:
    """``component/config.json`` of a pipeline folder as a dict, or ``None`` when it is missing or unreadable."""
    try:
        with open(os.path.join(folder, component, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _vae_scale(folder: str) -> int:
    """The VAE's scale factor of a pipeline folder (8 when its config does not say)."""
    try:
        return 2 ** (len((_read_config(folder, "vae") or {})["block_out_channels"]) - 1)
    except (KeyError, TypeError):
        return 8


def folder_layout(folder: str) -> UNetShape | None:
    """The UNet config and VAE scale factor of a local pipeline folder (read from ``unet/config.json`` and
    ``vae/config.json``, nothing loaded), or ``None`` when the folder has no UNet (a DiT, for example)."""
    unet = _read_config(folder, "unet")
    return None if unet is None else (unet, _vae_scale(folder))


def folder_resolution(folder: str) -> int | None:
    """The image side in pixels that a local pipeline folder's denoiser was built for: its UNet's or transformer's
    ``sample_size`` times the VAE's scale factor (``None`` when neither config gives one)."""
    for component in ("unet", "transformer"):
        sample = (_read_config(folder, component) or {}).get("sample_size")
        if isinstance(sample, int):
            return sample * _vae_scale(folder)
    return None


def _attention_levels(unet: dict[str, Any], resolution: int, vae_scale: int) -> list[tuple[int, int]]:
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
    layout: UNetShape, resolution: int, images: int = 1, dtype: str = "float32", guidance: bool = True
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


def available_memory_bytes() -> int | None:
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


def _fitting_resolution(layout: UNetShape, upto: int, budget: float, images: int, dtype: str, step: int = 32) -> int:
    """The largest multiple of ``step`` pixels up to ``upto`` whose estimate is within ``budget`` bytes (0: none)."""
    for size in range(upto - upto % step, 0, -step):
        if estimate_attention_bytes(layout, size, images, dtype) <= budget:
            return size
    return 0


def check_attention_memory(
    layout: UNetShape | None,
    resolutions: Sequence[int],
    images: int = 1,
    dtype: str = "float32",
    source: str = "this model",
    option: str = "--resolution",
    available: int | None = None,
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


# assembly: every preset pipeline, tiny or not, is built here ------------------------------------------------------
# A preset's ``pipeline`` key (default "sd") gives its kind; a kind's tasks name the pipeline class. Seeds: the UNet
# draws from ``seed``, the VAE from ``seed + 1``, the text encoders from ``seed`` and ``seed + 2``, ControlNet ``i``
# from ``seed + 3 + i``.
DTYPES = ("float32", "float16", "bfloat16")
# what the examples say after timing a tiny model
TINY_TIMINGS = ("These timings are of a tiny model with random weights, built to run in seconds: its attention holds "
                "too few tokens for merging to pay, so they show that the example runs, not how fast ToMe is. Time a "
                "real model (--model DIR); the measured tables are in docs/benchmarks.md.")


def check_dtype(dtype: str) -> None:
    """Raise ``ValueError`` with a clear message unless ``dtype`` can run here: float16 and bfloat16 need a GPU
    (Paddle's CPU build has no half-precision matmul).

    >>> check_dtype("float32")
    """
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if dtype == "float32":
        return
    paddle, _, _ = _libs()
    if not (paddle.is_compiled_with_cuda() and str(paddle.device.get_device()).startswith("gpu")):
        from ..api import GPU_INSTALL_HINT

        raise ValueError(f"--dtype {dtype} needs a GPU: Paddle's CPU build has no half-precision matmul. On a CPU, "
                         f"leave --dtype at float32 (the default); for half precision, {GPU_INSTALL_HINT}")


def preset_pipeline(name: str = DEFAULT_PRESET, scheduler: str | None = None, seed: int = 0, dtype: str = "float32"):
    """A pipeline built from preset ``name`` with random weights (seeded, so reproducible): a
    ``StableDiffusionPipeline``, a ``StableDiffusionXLPipeline`` or a ``StableDiffusionControlNetPipeline``,
    as the preset's ``pipeline`` key says.

    >>> pipe = preset_pipeline("sd15-narrow")
    >>> pipe.unet.config.block_out_channels
    [64, 128, 256, 256]
    """
    return assemble_pipeline(name, scheduler, seed, dtype)


def load_local_pipeline(folder: str, dtype: str = "float32", scheduler: str | None = None):
    """Load a pipeline saved with ``save_pretrained`` (or downloaded beforehand) from a local ``folder``, without
    ppdiffusers' loading bar (its setting is restored afterwards).

    A component saved as absent (``[null, null]`` in ``model_index.json``) is passed as ``None``: ppdiffusers 0.29
    refuses to load a pipeline with a missing component that its class does not list as optional, which is how an
    SD3 pipeline saved without its T5 encoder (``text_encoder_3=None``) is written. An SD3 pipeline loaded where
    ppdiffusers found no GPU attention function (a CPU) gets :func:`ppdiffusers_tome.sd3_attention.use_math_attention`,
    so that it runs."""
    paddle, ppdiffusers, _ = _libs()
    index_path = os.path.join(folder, "model_index.json")
    if not os.path.isfile(index_path):
        raise ValueError(f"--model must be a local pipeline folder with a model_index.json; got {folder!r}")
    kwargs: dict[str, Any] = {"paddle_dtype": getattr(paddle, dtype)}
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError):
        index = {}
    for name, entry in index.items() if isinstance(index, dict) else ():
        if not name.startswith("_") and isinstance(entry, list) and entry and all(part is None for part in entry):
            kwargs[name] = None
    from ppdiffusers.utils import logging as ppdiffusers_logging

    shown = ppdiffusers_logging.is_progress_bar_enabled()
    ppdiffusers_logging.disable_progress_bar()  # ("Loading pipeline components..." on stderr: noise for a CLI)
    try:
        pipe = ppdiffusers.DiffusionPipeline.from_pretrained(folder, **kwargs)
    finally:
        if shown:
            ppdiffusers_logging.enable_progress_bar()
    if scheduler is not None:
        pipe.scheduler = make_scheduler(scheduler)
    if getattr(paddle.nn.functional, "scaled_dot_product_attention_", None) is None:
        from ..sd3_attention import joint_attention_layers, use_math_attention

        if joint_attention_layers(pipe):  # SD3 on a device without ppdiffusers' attention function (a CPU)
            use_math_attention(pipe)
    pipe.set_progress_bar_config(disable=True)
    return pipe
