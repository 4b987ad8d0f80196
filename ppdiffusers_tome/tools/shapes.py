"""The trained shapes pipeline that ships inside the package, for the offline demo, and how to load it.

``shapes_model/pipeline/`` is a ``save_pretrained`` folder (UNet, VAE, text encoder, tokenizer, DDIM scheduler):
a small text-to-image model trained on 64x64 images of coloured shapes on plain backgrounds; ``training.json`` beside
it records the commands and step counts that made it (the training code is in the repository's ``research/``, not
in the package). Nothing is downloaded: the pipeline loads with ``StableDiffusionPipeline.from_pretrained``, which
is all :func:`load_pipeline` does.

What it can show: it draws the background colour a caption names reliably, and a shape's colour most of the time;
it does not draw a shape's outline or its position reliably. So its images show what merging does to colours and
flat regions, not to fine structure.

``shapes_sd3_model/pipeline/`` is the same task on Stable Diffusion 3's MMDiT (``StableDiffusion3Pipeline``: six joint
blocks, the UNet model's VAE, two CLIP encoders with projection, no T5, flow-matching Euler sampling), trained by the
repository's ``research/shapes/sd3.py``; :func:`load_sd3_pipeline` loads it (on a CPU its joint attention runs
through :func:`ppdiffusers_tome.sd3_attention.use_math_attention`).

    >>> from ppdiffusers_tome.tools import shapes
    >>> shapes.DEMO_PROMPT
    'a small orange circle at the top on a blue background'
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["DEMO_GUIDANCE", "DEMO_PROMPT", "DEMO_STEPS", "MODEL_DIR", "SD3_DEMO_GUIDANCE", "SD3_DEMO_STEPS",
           "SD3_MODEL_DIR", "has_sd3_weights",
           "has_weights", "load_pipeline", "load_sd3_pipeline", "pipeline_folder", "sd3_pipeline_folder",
           "training_info"]

MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shapes_model")
SD3_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shapes_sd3_model")
# What the demo draws by default: every word is in the dataset's grammar (a single object, so its position is named),
# and at the demo's seed 0 the model draws what it says (a small orange blob at the top centre on blue; with "a large
# red star at the top left" it drew a small red blob at the top centre)
DEMO_PROMPT = "a small orange circle at the top on a blue background"
DEMO_GUIDANCE = 4.0  # classifier-free guidance that suits the small model (SD's 7.5 over-saturates its colours)
DEMO_STEPS = 20  # DDIM steps: the small model needs more than the 8 the random presets are timed with
SD3_DEMO_STEPS = 20  # flow-matching Euler steps of the SD3 shapes model
SD3_DEMO_GUIDANCE = 4.0


def pipeline_folder() -> str:
    """The folder of the shipped pipeline (``model_index.json`` and one folder per component)."""
    return os.path.join(MODEL_DIR, "pipeline")


def has_weights() -> bool:
    """Whether this installation carries the trained weights (a source tree or a wheel built from one does)."""
    return os.path.isfile(os.path.join(pipeline_folder(), "model_index.json"))


def load_pipeline(dtype: str = "float32", folder: str = ""):
    """The shipped text-to-image pipeline (``StableDiffusionPipeline`` with DDIM), loaded offline from
    ``folder`` (default :func:`pipeline_folder`) in ``dtype``; the progress bar is off.

        >>> from ppdiffusers_tome.tools import shapes
        >>> pipe = shapes.load_pipeline()
        >>> image = pipe(shapes.DEMO_PROMPT, num_inference_steps=4, guidance_scale=shapes.DEMO_GUIDANCE,
        ...              height=64, width=64, output_type="np").images[0]
        >>> image.shape
        (64, 64, 3)
    """
    from .presets import load_local_pipeline

    if not folder and not has_weights():
        raise FileNotFoundError(
            f"the trained shapes weights are missing from {MODEL_DIR}; reinstall the package (the repository's "
            "research/shapes/train.py and training.json there reproduce them)")
    return load_local_pipeline(folder or pipeline_folder(), dtype=dtype)


def sd3_pipeline_folder() -> str:
    """The folder of the shipped SD3 shapes pipeline."""
    return os.path.join(SD3_MODEL_DIR, "pipeline")


def has_sd3_weights() -> bool:
    """Whether this installation carries the trained SD3 shapes weights."""
    return os.path.isfile(os.path.join(sd3_pipeline_folder(), "model_index.json"))


def load_sd3_pipeline(dtype: str = "float32", folder: str = ""):
    """The shipped SD3 shapes pipeline (``StableDiffusion3Pipeline``, flow-matching Euler, no T5), loaded offline
    from ``folder`` (default :func:`sd3_pipeline_folder`) in ``dtype``; where Paddle lacks ppdiffusers' GPU attention
    function (a CPU), its joint attention runs on the package's math path. Progress bar off.

        >>> from ppdiffusers_tome.tools import shapes
        >>> pipe = shapes.load_sd3_pipeline()
        >>> image = pipe(shapes.DEMO_PROMPT, num_inference_steps=2, guidance_scale=shapes.DEMO_GUIDANCE,
        ...              height=64, width=64, output_type="np").images[0]
        >>> type(pipe).__name__, image.shape
        ('StableDiffusion3Pipeline', (64, 64, 3))
    """
    from .presets import load_local_pipeline

    if not folder and not has_sd3_weights():
        raise FileNotFoundError(
            f"the trained SD3 shapes weights are missing from {SD3_MODEL_DIR}; reinstall the package (the "
            "repository's research/shapes/sd3.py and training.json there reproduce them)")
    return load_local_pipeline(folder or sd3_pipeline_folder(), dtype=dtype)


def training_info(model: str = "unet") -> dict[str, Any]:
    """What ``training.json`` records for the shipped ``model`` (``"unet"`` or ``"sd3"``): the commands that made
    the weights, their step counts and accuracy."""
    if model not in ("unet", "sd3"):
        raise ValueError(f"model must be 'unet' or 'sd3'; got {model!r}")
    path = os.path.join(MODEL_DIR if model == "unet" else SD3_MODEL_DIR, "training.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)
