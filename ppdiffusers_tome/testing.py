"""Helpers for tests, examples and the offline demo: tiny models built from configs, and the GPU kernels on a CPU.

``tiny_sd_pipeline(seed=s)`` builds exactly what ``preset_pipeline("tiny", seed=s)`` builds (see
:mod:`ppdiffusers_tome.presets`). :func:`gpu_kernels` runs the merge core's GPU kernel family on any device, which
is how the package's GPU properties (launches, transfers, memory, half precision) are checked on a CPU.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from .ops.runtime import force_kernels
from .tools.pipelines import tiny_controlnet_pipeline, tiny_sd_pipeline, tiny_sdxl_pipeline
from .tools.tiny import (
    TEXT_HIDDEN,
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
    "TEXT_HIDDEN",
    "gpu_kernels",
    "make_scheduler",
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


@contextlib.contextmanager
def gpu_kernels() -> Iterator[None]:
    """Inside the ``with`` block, the merge core runs its GPU kernel family whatever the tensors' place (in every
    thread); the previous setting comes back on exit.

    >>> import paddle
    >>> from ppdiffusers_tome.ops.runtime import device_kind
    >>> with gpu_kernels():
    ...     device_kind(paddle.ones([1]))
    'gpu'
    """
    with force_kernels("gpu"):
        yield
