"""Pipelines built from the configs shipped in ``ppdiffusers_tome/configs`` (random weights, no downloads), and the
loader for a real local pipeline folder. The demo's embedded default model and the benchmark architectures live here.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Dict, List, Optional

import paddle

from .testing import make_scheduler, tiny_text_encoder, tiny_tokenizer

logger = logging.getLogger(__name__)

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


def preset_pipeline(name: str = DEFAULT_PRESET, scheduler: str = "DDIMScheduler", seed: int = 0, dtype: str = "float32"):
    """A ``StableDiffusionPipeline`` built from preset ``name`` with random weights (seeded, so reproducible).

    >>> pipe = preset_pipeline("sd15-narrow")
    >>> pipe.unet.config.block_out_channels
    [64, 128, 256, 256]
    """
    from ppdiffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel

    config = load_preset(name)
    tokenizer = tiny_tokenizer(max_length=config.get("tokenizer_max_length", 77))
    text_encoder = tiny_text_encoder(
        len(tokenizer.get_vocab()), max_length=config.get("tokenizer_max_length", 77), seed=seed, **config["text_encoder"]
    )
    paddle.seed(seed)
    unet = UNet2DConditionModel(**config["unet"])
    paddle.seed(seed + 1)
    vae = AutoencoderKL(**config["vae"])
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=make_scheduler(scheduler),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    for model in (unet, vae, text_encoder):
        model.eval()
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
