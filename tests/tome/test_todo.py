"""ToDo (method="todo"): only self-attention's keys and values are downsampled, every query stays, nothing is
matched, and it composes with the efficient attention processor."""

import numpy as np
import paddle
import pytest

import ppdiffusers_tome
from ppdiffusers_tome.core.registry import hooks_of
from ppdiffusers_tome.testing import tiny_unet
from ppdiffusers_tome.tome.config import ToMeConfig
from ppdiffusers_tome.tome.patch import ModelPatch, find_blocks
from tests.unet_calls import hook_counts, unet_inputs


# ToDo ---------------------------------------------------------------------------------------------------------------
def expected_todo_block_output(block, x, context, h, w, factor, mode):
    """BasicTransformerBlock with ToDo written out by hand: self-attention's keys/values from the downsampled
    normed tokens, every query kept, nothing else changed."""
    from tests.numpy_reference import reference_downsample

    n = block.norm1(x)
    kv = paddle.to_tensor(reference_downsample(n.numpy(), h, w, factor, mode).astype("float32"))
    x = block.attn1(n, encoder_hidden_states=kv) + x
    x = block.attn2(block.norm2(x), encoder_hidden_states=context) + x
    return block.ff(block.norm3(x)) + x


@pytest.mark.parametrize("factor, mode", [(2, "nearest"), (2, "average"), (4, "average")])
def test_todo_downsamples_only_the_keys_and_values_of_self_attention(factor, mode):
    unet = tiny_unet()
    block = find_blocks(unet)[0][1]
    rng = np.random.default_rng(11)
    x = paddle.to_tensor(rng.standard_normal((2, 256, 32)).astype("float32"))
    context = paddle.to_tensor(rng.standard_normal((2, 5, 32)).astype("float32"))
    with paddle.no_grad():
        expected = expected_todo_block_output(block, x, context, 16, 16, factor, mode).numpy()
        vanilla = block(x, encoder_hidden_states=context).numpy()
        patch = ModelPatch.install(unet, ToMeConfig(method="todo", downsample_factor=factor, downsample_mode=mode))
        with patch.in_call(paddle.zeros([2, 4, 16, 16])):  # the block runs as inside a call on a 16 x 16 latent
            got = block(x, encoder_hidden_states=context).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert np.abs(got - vanilla).max() > 1e-3
    patch.remove()


def test_todo_hooks_only_self_attention_inputs_and_never_matches():
    unet = tiny_unet()
    before = hook_counts(unet)
    ppdiffusers_tome.apply_tome(unet, method="todo")
    block = find_blocks(unet)[0][1]
    assert hooks_of(block.attn1).names() == ["tome"]  # self-attention only
    assert hooks_of(block.attn2) is None and hooks_of(block.ff) is None
    assert not any(m._forward_pre_hooks or m._forward_post_hooks for m in unet.sublayers(include_self=True))
    queries, keys = [], []  # the token counts self-attention's projections see, inside attn1
    handles = [block.attn1.to_q.register_forward_pre_hook(lambda layer, args: queries.append(args[0].shape[1])),
               block.attn1.to_k.register_forward_pre_hook(lambda layer, args: keys.append(args[0].shape[1]))]
    with paddle.no_grad():
        unet(*unet_inputs(unet))
    for handle in handles:
        handle.remove()
    stats = ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]
    assert (queries, keys) == ([256], [64])  # every query kept, keys (and values) from 64 downsampled tokens
    assert stats["merges"] == 3 and stats["plans_computed"] == 0
    ppdiffusers_tome.remove_tome(unet)
    assert hook_counts(unet) == before
    assert all(hooks_of(layer) is None for layer in unet.sublayers(include_self=True))


def test_todo_composes_with_the_efficient_attention_processor(monkeypatch):
    """ppdiffusers' XFormersAttnProcessor calls F.scaled_dot_product_attention_, which Paddle's CPU build lacks; a
    plain implementation of the same contract stands in, so the processor path itself runs with fewer keys."""
    from ppdiffusers.models.attention_processor import AttnProcessor, XFormersAttnProcessor

    seen = []

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, training=False,
             attention_op=None):  # [batch, tokens, heads, head_dim], as ppdiffusers passes them
        seen.append((query.shape[1], key.shape[1]))
        q, k, v = (t.transpose([0, 2, 1, 3]) for t in (query, key, value))
        weights = paddle.nn.functional.softmax(paddle.matmul(q * scale, k, transpose_y=True), axis=-1)
        return paddle.matmul(weights, v).transpose([0, 2, 1, 3])

    monkeypatch.setattr(paddle.nn.functional, "scaled_dot_product_attention_", sdpa, raising=False)
    unet = tiny_unet()
    inputs = unet_inputs(unet)
    ppdiffusers_tome.apply_tome(unet, method="todo", downsample_mode="average")
    with paddle.no_grad():
        plain = unet(*inputs).sample.numpy()
        unet.set_attn_processor(XFormersAttnProcessor())
        efficient = unet(*inputs).sample.numpy()
        unet.set_attn_processor(AttnProcessor())
    assert (256, 64) in seen and (256, 256) not in seen  # the first level's self-attention ran on 64 keys
    np.testing.assert_allclose(efficient, plain, rtol=1e-4, atol=1e-5)
