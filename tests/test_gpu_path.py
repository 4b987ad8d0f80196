"""The GPU path measured on CPU (issue #10): a forward patched with ``apply_tome()``'s defaults makes no host<->device
transfer beyond what the vanilla UNet makes (each one would be a device sync on a GPU), and merging adds few eager
operators per merging block. Both are counted with the instruments of ppdiffusers_tome/measure.py.
"""

import collections

import numpy as np
import paddle
import pytest

import ppdiffusers_tome
from ppdiffusers_tome.measure import TransferCounter, count_forward_ops, ops_added_per_block
from ppdiffusers_tome.testing import tiny_unet

OPS_PER_BLOCK_BUDGET = 45


def unet_call(unet, batch, latent, timestep_kind, seed=0):
    """A no-grad UNet forward as a pipeline makes it: random latents and text states, timestep 500 as a 0-d tensor
    (what iterating ``scheduler.timesteps`` gives) or as a ``[B]`` tensor."""
    rng = np.random.default_rng(seed)
    sample = paddle.to_tensor(rng.standard_normal((batch, 4, latent, latent)).astype("float32"))
    context = paddle.to_tensor(rng.standard_normal((batch, 7, unet.config.cross_attention_dim)).astype("float32"))
    timestep = paddle.to_tensor(500, dtype="int64") if timestep_kind == "0-d" else paddle.to_tensor([500] * batch, dtype="int64")
    assert timestep.shape == ([] if timestep_kind == "0-d" else [batch])

    def run():
        with paddle.no_grad():
            return unet(sample, timestep, context).sample

    return run


def transfers_of(run):
    run()  # warm-up: one-off work of a first call is not the steady state
    with TransferCounter() as transfers:
        out = run()
    return transfers, out


@pytest.mark.parametrize("timestep_kind", ["0-d", "[B]"])
@pytest.mark.parametrize("batch", [1, 2])
def test_patched_forward_adds_no_host_device_transfer(batch, timestep_kind):
    unet = tiny_unet()
    run = unet_call(unet, batch, 16, timestep_kind)
    vanilla, vanilla_out = transfers_of(run)
    ppdiffusers_tome.apply_tome(unet)  # the defaults
    try:
        patched, patched_out = transfers_of(run)
        merged = ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]["merges"]
    finally:
        ppdiffusers_tome.remove_tome(unet)
    assert merged > 0 and np.abs(patched_out.numpy() - vanilla_out.numpy()).max() > 0  # ToMe really ran
    added = collections.Counter(patched.by_site()) - collections.Counter(vanilla.by_site())
    assert not added, (
        f"ToMe added {patched.total - vanilla.total} host<->device transfer(s) per forward (batch {batch}, timestep "
        f"{timestep_kind}); each is a device sync on a GPU:\n"
        + "\n".join(f"  {count} x {site}" for site, count in added.most_common())
    )


def test_ops_added_per_merging_block_within_budget():
    unet = tiny_unet()
    run = unet_call(unet, 2, 32, "[B]")  # 32 x 32 latent: 1024 tokens at the 1x level, as in the issue
    vanilla = count_forward_ops(run, unet)
    ppdiffusers_tome.apply_tome(unet)
    try:
        patched = count_forward_ops(run, unet)
    finally:
        ppdiffusers_tome.remove_tome(unet)
    assert vanilla.merging_blocks == 0 and patched.merging_blocks == 3  # the tiny UNet's three 1x-level blocks
    per_block = ops_added_per_block(vanilla.total, patched.total, patched.merging_blocks)
    added = collections.Counter(patched.by_name) - collections.Counter(vanilla.by_name)
    assert per_block <= OPS_PER_BLOCK_BUDGET, (
        f"{per_block:.1f} eager ops added per merging block (budget {OPS_PER_BLOCK_BUDGET}): {vanilla.total} -> "
        f"{patched.total} over {patched.merging_blocks} blocks; added by operator: {dict(added.most_common())}"
    )
