"""What a measured run is given: the keyword arguments of a pipeline call (:func:`pipeline_kwargs`, with a control
image for ControlNet pipelines) and fixed random inputs for one denoiser forward (:class:`DenoiserInputs`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle
from PIL import Image


def control_image(size: int, seed: int) -> Image.Image:
    """A ``size`` x ``size`` black-and-white block pattern (8 px blocks), the same for the same ``seed``."""
    rng = np.random.default_rng(seed)
    pixels = (rng.uniform(0, 1, (size // 8 + 1, size // 8 + 1, 3)) > 0.5).astype("uint8") * 255
    return Image.fromarray(pixels).resize((size, size), Image.NEAREST)


def pipeline_kwargs(pipe, size: int, batch: int, steps: int, seed: int, prompt: str,
                    guidance_scale: float | None = None) -> dict[str, Any]:
    """The keyword arguments of one pipeline call of ``batch`` images (numpy output, seeded generator;
    ``guidance_scale`` ``None``: the pipeline's default)."""
    kwargs: dict[str, Any] = dict(
        prompt=[prompt] * batch,
        num_inference_steps=steps,
        height=size,
        width=size,
        generator=paddle.Generator().manual_seed(seed),
        output_type="np",
    )
    if guidance_scale is not None:
        kwargs["guidance_scale"] = float(guidance_scale)
    if "controlnet" in pipe.components and pipe.components["controlnet"] is not None:
        controlnet = pipe.components["controlnet"]
        count = len(controlnet.nets) if hasattr(controlnet, "nets") else 1
        image = control_image(size, seed)
        kwargs["image"] = [image] * count if count > 1 else image
    return kwargs


class DenoiserInputs:
    """Fixed random inputs for one denoiser forward (UNet, plus ControlNet or SDXL conditioning when present),
    shaped as a pipeline with classifier-free guidance would pass them for ``batch`` images."""

    def __init__(self, pipe, size: int, batch: int, seed: int):
        rng = np.random.default_rng(seed)
        unet = self.unet = pipe.unet
        factor = getattr(pipe, "vae_scale_factor", 8)
        rows = 2 * batch
        dtype = unet.dtype if hasattr(unet, "dtype") else paddle.float32

        def tensor(*shape):
            return paddle.to_tensor(rng.standard_normal(shape).astype("float32")).astype(dtype)

        self.sample = tensor(rows, unet.config.in_channels, size // factor, size // factor)
        self.timestep = paddle.to_tensor([500] * rows, dtype="int64")
        self.context = tensor(rows, 77, unet.config.cross_attention_dim)
        self.unet_kwargs: dict[str, Any] = {}
        if getattr(unet.config, "addition_embed_type", None) == "text_time":
            proj = unet.config.projection_class_embeddings_input_dim - 6 * unet.config.addition_time_embed_dim
            time_ids = paddle.to_tensor([[size, size, 0, 0, size, size]] * rows, dtype="float32").astype(dtype)
            self.unet_kwargs["added_cond_kwargs"] = {"text_embeds": tensor(rows, proj), "time_ids": time_ids}
        self.controlnet = pipe.components.get("controlnet")
        if self.controlnet is not None:
            self.cond = tensor(rows, 3, size, size)

    def run(self):
        """One denoiser forward (ControlNet residuals first, summed over a MultiControlNet's nets)."""
        kwargs = dict(self.unet_kwargs)
        if self.controlnet is not None:
            nets = list(self.controlnet.nets) if hasattr(self.controlnet, "nets") else [self.controlnet]
            down, mid = None, None
            for net in nets:
                d, m = net(self.sample, self.timestep, self.context, controlnet_cond=self.cond, return_dict=False)
                down = d if down is None else [a + b for a, b in zip(down, d)]
                mid = m if mid is None else mid + m
            kwargs.update(down_block_additional_residuals=down, mid_block_additional_residual=mid)
        return self.unet(self.sample, self.timestep, self.context, **kwargs)
