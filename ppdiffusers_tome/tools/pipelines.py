"""The pipelines of the presets (txt2img, img2img, inpainting, ControlNet, SDXL) assembled from the tiny parts of
:mod:`.tiny` with random, seeded weights, and the tiny test pipelines among them."""

from __future__ import annotations

from typing import Any

from .preset_configs import load_preset
from .tiny import _finish, _libs, _seeded_model, make_scheduler, random_controlnet, tiny_text_encoder, tiny_tokenizer

__all__ = ["assemble_pipeline", "tiny_controlnet_pipeline", "tiny_sd_pipeline", "tiny_sdxl_pipeline"]

_PIPELINES = {
    "sd": {
        "txt2img": "StableDiffusionPipeline",
        "img2img": "StableDiffusionImg2ImgPipeline",
        "inpaint": "StableDiffusionInpaintPipeline",
    },
    "controlnet": {"txt2img": "StableDiffusionControlNetPipeline"},
    "sdxl": {"txt2img": "StableDiffusionXLPipeline"},
}
_DEFAULT_SCHEDULERS = {"sd": "DDIMScheduler", "controlnet": "DDIMScheduler", "sdxl": "EulerDiscreteScheduler"}
_NO_SAFETY_CHECKER = dict(safety_checker=None, feature_extractor=None, requires_safety_checker=False)


def _text_parts(config: dict[str, Any], suffix: str, seed: int) -> dict[str, Any]:
    """``tokenizer{suffix}`` and ``text_encoder{suffix}`` of a preset ``config``: ``suffix`` is ``""``, or ``"_2"``
    for SDXL's second text encoder (the one with a projection)."""
    max_length = config.get("tokenizer_max_length", 77)
    tokenizer = tiny_tokenizer(max_length=max_length)
    encoder = tiny_text_encoder(len(tokenizer.get_vocab()), max_length=max_length, projection=bool(suffix), seed=seed,
                                **config["text_encoder" + suffix])
    return {"tokenizer" + suffix: tokenizer, "text_encoder" + suffix: encoder}


def _controlnet_part(config: dict[str, Any], unet, seed: int, count: int):
    """The ControlNet of a ``controlnet`` preset, or a ``MultiControlNetModel`` of ``count`` of them."""
    _, ppdiffusers, _ = _libs()
    nets = [random_controlnet(unet, seed + 3 + i, **config["controlnet"]) for i in range(count)]
    return nets[0] if count == 1 else ppdiffusers.pipelines.controlnet.MultiControlNetModel(nets)


def assemble_pipeline(name: str, scheduler: str | None = None, seed: int = 0, dtype: str = "float32",
              task: str = "txt2img", unet: Any | None = None, num_controlnets: int = 1):
    """The pipeline of preset ``name`` for ``task`` with random weights (seeded, so reproducible); ``unet``
    replaces the preset's UNet, ``num_controlnets > 1`` gives a ControlNet preset a MultiControlNet."""
    _, ppdiffusers, _ = _libs()
    config = load_preset(name)
    kind = config.get("pipeline", "sd")
    if kind not in _PIPELINES:
        raise ValueError(f"preset {name!r} has an unknown pipeline kind {kind!r}")
    if task not in _PIPELINES[kind]:
        raise ValueError(f"kind must be one of {sorted(_PIPELINES[kind])}; got {task!r}")
    parts = _text_parts(config, "", seed)
    if unet is None:
        inpaint = {"in_channels": 9} if task == "inpaint" else {}  # image latents and mask join the noisy latents
        unet = _seeded_model("UNet2DConditionModel", dict(config["unet"], **inpaint), seed)
    parts.update(unet=unet, vae=_seeded_model("AutoencoderKL", config["vae"], seed + 1))
    if "text_encoder_2" in config:  # after the VAE, as preset_pipeline always did: Paddle's generator ends the same
        parts.update(_text_parts(config, "_2", seed + 2))
    parts["scheduler"] = make_scheduler(scheduler or _DEFAULT_SCHEDULERS[kind])
    if kind == "sdxl":
        parts["add_watermarker"] = False
    else:
        parts.update(_NO_SAFETY_CHECKER)
    if kind == "controlnet":
        parts["controlnet"] = _controlnet_part(config, unet, seed, num_controlnets)
    return _finish(getattr(ppdiffusers, _PIPELINES[kind][task])(**parts), dtype)


def tiny_sd_pipeline(
    kind: str = "txt2img", scheduler: str = "DDIMScheduler", seed: int = 0, unet: Any | None = None
):
    """The ``tiny`` preset's Stable Diffusion pipeline (as :func:`preset_pipeline`) for ``kind`` ``txt2img``,
    ``img2img`` or ``inpaint`` (a UNet with 9 input channels); ``unet`` replaces the preset's UNet.

    >>> pipe = tiny_sd_pipeline()
    >>> type(pipe).__name__
    'StableDiffusionPipeline'
    """
    return assemble_pipeline("tiny", scheduler, seed, task=kind, unet=unet)


def tiny_controlnet_pipeline(num_controlnets: int = 1, scheduler: str = "DDIMScheduler", seed: int = 0):
    """The ``tiny-controlnet`` preset's ``StableDiffusionControlNetPipeline``; with ``num_controlnets > 1`` it holds
    a MultiControlNet."""
    return assemble_pipeline("tiny-controlnet", scheduler, seed, num_controlnets=num_controlnets)


def tiny_sdxl_pipeline(scheduler: str = "EulerDiscreteScheduler", seed: int = 0):
    """The ``tiny-sdxl`` preset's ``StableDiffusionXLPipeline`` (two text encoders, SDXL-style UNet)."""
    return assemble_pipeline("tiny-sdxl", scheduler, seed)
