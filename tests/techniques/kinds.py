"""The model kinds every technique's shared checks run over: a tiny random pipeline of each kind (from
``ppdiffusers_tome.testing``), the arguments of one call, and the denoisers a technique patches in it.

The five kinds of the issue are ``unet`` (SD-1.5's layout), ``controlnet`` (a UNet and one ControlNet), ``sdxl``,
``sd3`` (an MMDiT of joint blocks) and ``dit``; the other entries are the same denoisers behind another pipeline
(img2img, inpainting, two ControlNets), which the older per-model tests also covered."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from typing import Any, Callable

import numpy as np
from PIL import Image

from ppdiffusers_tome.testing import (
    tiny_controlnet_pipeline,
    tiny_dit_pipeline,
    tiny_sd3_pipeline,
    tiny_sd_pipeline,
    tiny_sdxl_pipeline,
)
from tests.conftest import generator

SIZE = 32  # pixels: 16 x 16 latents for every kind


def same(got, expected):
    """Bit-identical arrays (np.testing.assert_array_equal, whose report of a mismatch raises ValueError on some
    arrays with numpy 2, so a check meant to fail would not fail with an AssertionError)."""
    got, expected = np.asarray(got), np.asarray(expected)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert np.array_equal(got, expected), f"not bit-identical: max |difference| {np.abs(got - expected).max()}"


def picture(seed=0):
    return Image.fromarray(np.random.default_rng(seed).uniform(0, 255, (SIZE, SIZE, 3)).astype("uint8"))


def mask():
    pixels = np.zeros((SIZE, SIZE), dtype="uint8")
    pixels[8:24, 4:20] = 255
    return Image.fromarray(pixels)


def every_step(steps):
    return steps


@dataclasses.dataclass(frozen=True)
class Kind:
    name: str
    build: Callable[[], Any]
    arguments: Callable[[], dict]  # a call's arguments (fresh images each time)
    denoisers: dict  # name (as tome_stats and cache_status give it) -> the blocks ToMe merges in it per call
    deep: dict  # name -> the step cache's deep blocks in it (``deep_blocks`` of cache_status)
    denoising_steps: Callable[[int], int] = every_step  # the model calls of a pipeline call of ``steps`` steps

    def images(self, pipe, steps):
        """One call with a fixed seed, its images as a float numpy array."""
        return pipe(num_inference_steps=steps, generator=generator(0), output_type="np", **self.arguments()).images

    def models(self, pipe):
        """The denoisers of ``pipe`` by name (``controlnet.nets.0``: the first net of a MultiControlNetModel)."""
        found = {}
        for name in self.denoisers:
            model = pipe
            for part in name.split("."):
                model = model[int(part)] if part.isdigit() else getattr(model, part)
            found[name] = model
        return found


# Layers that only the step cache's full steps run, by the denoiser's class: a UNet's (and a ControlNet's) second
# level and the first level's downsampler, which feeds only deeper levels; the middle block of a 3-block transformer.
FULL_STEP_ONLY = {
    "UNet2DConditionModel": ("down_blocks.0.downsamplers.0", "down_blocks.1"),
    "ControlNetModel": ("down_blocks.0.downsamplers.0", "down_blocks.1"),
    "SD3Transformer2DModel": ("transformer_blocks.1",),
    "Transformer2DModel": ("transformer_blocks.1",),
}

TEXT = dict(prompt="a red cube on a table", height=SIZE, width=SIZE)
SD3_TEXT = dict(prompt="a red cube", height=SIZE, width=SIZE)
UNET = dict(denoisers={"unet": 3}, deep={"unet": 10})  # three blocks at the 1x level (256 tokens)
CONTROLNET = dict(denoisers={"unet": 3, "controlnet": 1}, deep={"unet": 10, "controlnet": 6})
TRANSFORMER = dict(denoisers={"transformer": 3}, deep={"transformer": 1})  # 3 blocks: 1 between the outer two
KINDS = {kind.name: kind for kind in [
    Kind("unet", tiny_sd_pipeline, lambda: dict(TEXT), **UNET),
    Kind("unet-img2img", lambda: tiny_sd_pipeline("img2img"),
         lambda: dict(prompt=TEXT["prompt"], image=picture(), strength=0.9), **UNET,
         denoising_steps=lambda steps: int(steps * 0.9)),
    Kind("unet-inpaint", lambda: tiny_sd_pipeline("inpaint"), lambda: dict(TEXT, image=picture(), mask_image=mask()),
         **UNET),
    Kind("controlnet", lambda: tiny_controlnet_pipeline(1), lambda: dict(TEXT, image=picture(7)), **CONTROLNET),
    Kind("multicontrolnet", lambda: tiny_controlnet_pipeline(2), lambda: dict(TEXT, image=[picture(7), picture(7)]),
         denoisers={"unet": 3, "controlnet.nets.0": 1, "controlnet.nets.1": 1},
         deep={"unet": 10, "controlnet.nets.0": 6, "controlnet.nets.1": 6}),
    Kind("sdxl", tiny_sdxl_pipeline, lambda: dict(TEXT), denoisers={"unet": 3},  # "auto" finds SDXL's 2x level
         deep={"unet": 8}),
    Kind("sd3", tiny_sd3_pipeline, lambda: dict(SD3_TEXT), **TRANSFORMER),
    Kind("sd3-img2img", lambda: tiny_sd3_pipeline("img2img"),
         lambda: dict(prompt=SD3_TEXT["prompt"], image=picture(), strength=0.75), **TRANSFORMER,
         denoising_steps=lambda steps: steps - int(steps * 0.25)),  # (flow matching keeps the rounded-up steps)
    Kind("dit", tiny_dit_pipeline, lambda: dict(class_labels=[3, 7]), **TRANSFORMER),
]}

MODEL_KINDS = ["unet", "controlnet", "sdxl", "sd3", "dit"]  # the five kinds of denoiser
ALL_KINDS = list(KINDS)  # and the same denoisers behind img2img, inpainting and two ControlNets


COPIERS = {"pickle": lambda model: pickle.loads(pickle.dumps(model)), "deepcopy": copy.deepcopy}


def with_models(pipe, replacements):
    """A new pipeline of ``pipe``'s components with the denoisers named in ``replacements`` replaced."""
    components = dict(pipe.components)
    for name, model in replacements.items():
        head, _, index = name.partition(".nets.")
        if index:  # a net of a MultiControlNetModel: a new one around the nets
            nets = list(components[head].nets)
            nets[int(index)] = model
            components[head] = type(components[head])(nets)
        else:
            components[name] = model
    return type(pipe)(**components)
