"""Pipelines built from the configs shipped in ``ppdiffusers_tome/configs`` (random weights, no downloads), and the
loader for a real local pipeline folder. The demo's embedded default model and the benchmark architectures live here.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

import paddle

from .testing import make_scheduler, random_controlnet, tiny_text_encoder, tiny_tokenizer

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")

__all__ = ["available_presets", "load_preset", "preset_pipeline", "load_local_pipeline", "DEFAULT_PRESET"]

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


def preset_pipeline(name: str = DEFAULT_PRESET, scheduler: Optional[str] = None, seed: int = 0, dtype: str = "float32"):
    """A pipeline built from preset ``name`` with random weights (seeded, so reproducible): a
    ``StableDiffusionPipeline``, a ``StableDiffusionXLPipeline`` or a ``StableDiffusionControlNetPipeline``,
    as the preset's ``pipeline`` key says.

    >>> pipe = preset_pipeline("sd15-narrow")
    >>> pipe.unet.config.block_out_channels
    [64, 128, 256, 256]
    """
    import ppdiffusers
    from ppdiffusers import AutoencoderKL, UNet2DConditionModel

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
    from ppdiffusers import DiffusionPipeline

    if not os.path.isfile(os.path.join(folder, "model_index.json")):
        raise ValueError(f"--model must be a local pipeline folder with a model_index.json; got {folder!r}")
    kwargs: Dict[str, Any] = {"paddle_dtype": getattr(paddle, dtype)}
    pipe = DiffusionPipeline.from_pretrained(folder, **kwargs)
    if scheduler is not None:
        pipe.scheduler = make_scheduler(scheduler)
    pipe.set_progress_bar_config(disable=True)
    return pipe
