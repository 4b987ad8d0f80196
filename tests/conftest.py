"""Shared fixtures: small pipelines and helpers to run them deterministically."""

import contextlib

import numpy as np
import paddle
import pytest
from PIL import Image

import ppdiffusers_tome  # noqa: F401  (installs the methods)
from ppdiffusers_tome.testing import gpu_kernels

paddle.set_device("cpu")

SIZE = 32  # pixels; the tiny VAE scales by 2, so latents are 16 x 16 and the 1x level has 256 tokens


def generator(seed=0):
    return paddle.Generator().manual_seed(seed)


def run(pipe, steps=2, seed=0, **kwargs):
    """Run a pipeline and return its images as a float numpy array."""
    kwargs.setdefault("prompt", "a red cube on a table")
    if "image" not in kwargs or "mask_image" in kwargs or "controlnet" in pipe.components:
        kwargs.setdefault("height", SIZE)
        kwargs.setdefault("width", SIZE)
    return pipe(num_inference_steps=steps, generator=generator(seed), output_type="np", **kwargs).images


@pytest.fixture
def init_image():
    pixels = np.random.default_rng(0).uniform(0, 255, (SIZE, SIZE, 3)).astype("uint8")
    return Image.fromarray(pixels)


@pytest.fixture
def mask_image():
    mask = np.zeros((SIZE, SIZE), dtype="uint8")
    mask[8:24, 4:20] = 255
    return Image.fromarray(mask)


@pytest.fixture
def kernels():
    """``kernels(kind)`` runs the merge core's ``kind`` kernel family until the test ends: ``"gpu"`` forces the GPU
    family (through the public ``ppdiffusers_tome.testing.gpu_kernels``), ``"cpu"`` is this machine's own."""
    with contextlib.ExitStack() as stack:

        def use(kind):
            if kind == "gpu":
                stack.enter_context(gpu_kernels())

        yield use


def pytest_configure(config):
    """A line per test file as it finishes (file, counts, seconds, time elapsed): see tests/progress_plugin.py."""
    from tests.progress_plugin import register

    register(config)


# The files that take longest on the 2-core machine (seconds of a whole run, 0.12.0), run first: a distributed run
# (run.sh test: one file per process at a time, handed out in collection order) then ends with short files on both
# processes instead of one long file on one of them. Every other file keeps pytest's order.
LONGEST_FIRST = (
    "tests/tome/test_static_graph.py",  # SOT conversions, about 30 s each
    "tests/tools/test_shapes_shipped.py",  # generations with the shipped model, scored by its classifier
    "tests/test_examples.py",  # every example in its own interpreter
    "tests/cache/test_step_cache_export.py",
    "tests/ops/test_gpu_kernels.py",
    "tests/test_tutorial.py",  # the notebook from a wheel in a fresh folder
)


def pytest_collection_modifyitems(session, config, items):
    rank = {path: place for place, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # (a stable sort)
