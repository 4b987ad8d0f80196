"""The tiny models for tests, examples and the offline demo, under their old address.

Kept so that existing test code and user scripts (``from ppdiffusers_tome.testing import tiny_sd_pipeline``) keep
working; the models live in :mod:`ppdiffusers_tome.presets`, where "tiny" is just another preset:
``tiny_sd_pipeline(seed=s)`` builds exactly what ``preset_pipeline("tiny", seed=s)`` builds.
"""

from .presets import (
    TEXT_HIDDEN,
    make_scheduler,
    random_controlnet,
    tiny_controlnet,
    tiny_controlnet_pipeline,
    tiny_dit_pipeline,
    tiny_dit_transformer,
    tiny_sd_pipeline,
    tiny_sdxl_pipeline,
    tiny_sdxl_unet,
    tiny_text_encoder,
    tiny_tokenizer,
    tiny_unet,
    tiny_vae,
    write_tokenizer_files,
)

__all__ = [
    "TEXT_HIDDEN",
    "make_scheduler",
    "random_controlnet",
    "tiny_controlnet",
    "tiny_controlnet_pipeline",
    "tiny_dit_pipeline",
    "tiny_dit_transformer",
    "tiny_sd_pipeline",
    "tiny_sdxl_pipeline",
    "tiny_sdxl_unet",
    "tiny_text_encoder",
    "tiny_tokenizer",
    "tiny_unet",
    "tiny_vae",
    "write_tokenizer_files",
]
