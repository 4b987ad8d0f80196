"""The UNet outputs of every configuration stay what they were when they were pinned.

``tests/tome/data/pinned_unet_outputs.npz`` holds the outputs of a tiny UNet (random weights, seed 0) patched with each
configuration of :data:`CASES`, on the CPU kernels and on the GPU kernels (run on the CPU; with ``policy="tomesd"``
unless the case sets the policy, so that every block of the tiny UNet merges there too). Release 0.8.1 wrote the
first pins, which 0.9.0 reproduced bit for bit; 0.10.0 regenerated them on purpose (partitions drawn from 61 cached
variants, the merge added onto the kept rows instead of onto zeros, feature order by clusters). A change of layout
must leave every number as it was; a change that is meant to alter outputs regenerates the file on purpose, says so
in its commit and in the changelog.

Regenerate (on purpose only): ``bash run.sh python tests/tome/test_outputs_pinned.py``.
"""

from __future__ import annotations

import contextlib
import os
import sys

import numpy as np
import paddle
import pytest

PINS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "pinned_unet_outputs.npz")
LATENT, BATCH = 16, 2  # a 16 x 16 latent: 256 tokens at the tiny UNet's finest level
TIMESTEPS = (901, 500, 87)  # three calls, noisiest first, as a sampler makes them

# name -> apply_tome options; every case runs three calls (the timesteps above) and every output is pinned
CASES = {
    "defaults": {},
    "ratio0.3-norand": dict(ratio=0.3, use_rand=False),
    "all-sublayers": dict(merge_crossattn=True, merge_mlp=True),
    "level2": dict(max_downsample=2),
    "strides4x2-seed7": dict(sx=4, sy=2, ratio=0.6, seed=7),
    "schedule": dict(ratio=(0.6, 0.2)),
    "recompute2": dict(recompute_every=2),
    "recompute-list": dict(recompute_every=[0, 1]),
    "share-level": dict(share_plan="level"),
    "min-tokens": dict(max_downsample=2, min_tokens=300),  # 1x merges, 2x is skipped
    "deterministic": dict(deterministic=True),
    "window8": dict(match_window=8),
    "window8-share": dict(match_window=8, share_plan="level"),
    "feature8": dict(match_window=8, match_order="feature"),
    "feature4-share": dict(match_window=4, match_order="feature", share_plan="level"),
    "todo": dict(method="todo"),
    "todo-average4": dict(method="todo", downsample_factor=4, downsample_mode="average"),
    "auto-everywhere": dict(min_work=0),  # the default policy made to merge at every size
}
KINDS = ("cpu", "gpu")
# pins that must equal another case's: deterministic=True changes only the GPU kernels' merge; min_tokens that
# skips the 2x level of max_downsample=2 leaves exactly the 1x merging of the defaults; the default policy merges
# as tomesd on CPU kernels and pools keys and values as ToDo does on GPU kernels
SAME = {("deterministic", "cpu"): "defaults", ("min-tokens", "cpu"): "defaults", ("min-tokens", "gpu"): "defaults",
        ("auto-everywhere", "cpu"): "defaults", ("auto-everywhere", "gpu"): "todo"}


@contextlib.contextmanager
def kernels(kind):
    """The merge core's ``kind`` kernels, whatever the tensors' place."""
    try:
        from ppdiffusers_tome.testing import gpu_kernels
    except ImportError:  # releases before 0.9.0 had a module-level switch
        import ppdiffusers_tome.ops as merge_module

        previous, merge_module.DEVICE_OVERRIDE = merge_module.DEVICE_OVERRIDE, kind
        try:
            yield
        finally:
            merge_module.DEVICE_OVERRIDE = previous
        return
    if kind == "gpu":
        with gpu_kernels():
            yield
    else:
        yield


def inputs(unet):
    rng = np.random.default_rng(0)
    sample = rng.standard_normal((BATCH, 4, LATENT, LATENT)).astype("float32")
    context = rng.standard_normal((BATCH, 7, unet.config.cross_attention_dim)).astype("float32")
    return paddle.to_tensor(sample), paddle.to_tensor(context)


def outputs_of(options, kind):
    """The three outputs of a fresh tiny UNet patched with ``options`` on ``kind`` kernels."""
    import ppdiffusers_tome
    from ppdiffusers_tome.testing import tiny_unet

    unet = tiny_unet(seed=0)
    sample, context = inputs(unet)
    if kind == "gpu" and "policy" not in options and "min_work" not in options:
        options = dict(options, policy="tomesd")  # (at 256 tokens the default policy skips every block)
    ppdiffusers_tome.apply_tome(unet, **options)
    found = []
    with kernels(kind), paddle.no_grad():
        for t in TIMESTEPS:
            found.append(unet(sample, paddle.to_tensor(t, dtype="int64"), context).sample.numpy())
    stats = ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]
    return np.stack(found), stats


def key(case, kind):
    return f"{case}/{kind}"


@pytest.fixture(scope="module")
def pinned():
    with np.load(PINS) as data:
        return {name: data[name] for name in data.files}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", list(CASES))
def test_unet_output_equals_the_pinned_output(case, kind, pinned):
    found, stats = outputs_of(CASES[case], kind)
    expected = pinned[key(case, kind)]
    assert stats["merges"] > 0, "the case must really merge, or it pins nothing"
    assert found.shape == expected.shape
    np.testing.assert_array_equal(found, expected, err_msg=f"{case} on {kind} kernels changed its output")


# ToDo's own door, apply_todo(factor, mode), and the translating alias apply_tome(method="todo") give the ToDo pins
TODO_CASES = {"todo": dict(), "todo-average4": dict(factor=4, mode="average")}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", list(TODO_CASES))
def test_apply_todo_gives_the_pinned_todo_outputs_bit_for_bit(case, kind, pinned):
    import ppdiffusers_tome
    from ppdiffusers_tome.testing import tiny_unet

    options = dict(TODO_CASES[case], policy="tomesd") if kind == "gpu" else TODO_CASES[case]
    unet = ppdiffusers_tome.apply_todo(tiny_unet(seed=0), **options)
    sample, context = inputs(unet)
    with kernels(kind), paddle.no_grad():
        found = np.stack([unet(sample, paddle.to_tensor(t, dtype="int64"), context).sample.numpy() for t in TIMESTEPS])
    assert ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]["merges"] > 0
    np.testing.assert_array_equal(found, pinned[key(case, kind)])
    np.testing.assert_array_equal(found, outputs_of(CASES[case], kind)[0])  # and the alias, in the same process


def test_the_pinned_cases_differ_from_vanilla_and_from_each_other(pinned):
    """Each pin is a real ToMe output (not vanilla's), so a pin that stopped merging would be caught."""
    import ppdiffusers_tome  # noqa: F401
    from ppdiffusers_tome.testing import tiny_unet

    unet = tiny_unet(seed=0)
    sample, context = inputs(unet)
    with paddle.no_grad():
        vanilla = unet(sample, paddle.to_tensor(TIMESTEPS[0], dtype="int64"), context).sample.numpy()
    for name, value in pinned.items():
        assert np.abs(value[0] - vanilla).max() > 1e-4, name
    for kind in KINDS:  # every other case pins something of its own (all three calls together)
        distinct = [case for case in CASES if (case, kind) not in SAME]
        assert len({pinned[key(case, kind)].tobytes() for case in distinct}) == len(distinct), kind
    for (case, kind), twin in SAME.items():
        np.testing.assert_array_equal(pinned[key(case, kind)], pinned[key(twin, kind)])


def regenerate():
    arrays = {}
    for case, options in CASES.items():
        for kind in KINDS:
            arrays[key(case, kind)], _ = outputs_of(options, kind)
    os.makedirs(os.path.dirname(PINS), exist_ok=True)
    np.savez_compressed(PINS, **arrays)
    print(f"wrote {len(arrays)} pinned outputs to {PINS}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    paddle.set_device("cpu")
    regenerate()
