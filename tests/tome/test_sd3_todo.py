"""ToDo (``method="todo"``) on Stable Diffusion 3: in every ``JointTransformerBlock`` the image stream's keys and
values are projected from the image tokens downsampled on the patch grid, every image query stays and the text
stream is unchanged. Checked on the tiny offline SD3 models: one block against a float64 numpy forward, the number
of keys that reach the attention core, both attention cores (the math path and ppdiffusers' GPU function), both
kernel families and the policy, odd and non-square grids, pipelines, removal, status and refusals (the static graph
with a dynamic batch: tests/tome/test_sd3_tome.py)."""

import numpy as np
import paddle
import pytest
from ppdiffusers.models.attention_processor import AttnProcessor

import ppdiffusers_tome
import ppdiffusers_tome.sd3_attention as joint_attention
import ppdiffusers_tome.tome.joint_attention as todo_attention
from ppdiffusers_tome.testing import gpu_kernels, tiny_sd3_pipeline, tiny_sd3_transformer
from ppdiffusers_tome.tome.config import ToMeConfig
from ppdiffusers_tome.tome.decision import Settings, decide_block, grid_of
from ppdiffusers_tome.tome.patch import find_blocks, get_patch
from ppdiffusers_tome.tome.policy import JOINT_MIN_WORK
from tests.test_sd3_model import linear64
from tests.tome.test_sd3_tome import (
    LATENT_CHANNELS,
    WIDTH,
    ada_norm_continuous64,
    ada_norm_zero64,
    call,
    feed_forward64,
    forward,
    layer_norm64,
    transformer_inputs,
)
from tests.unet_calls import hook_shape

MODEL = "SD3Transformer2DModel"


# float64 numpy reference ------------------------------------------------------------------------------------------
def downsample64(x, grid_h, grid_w, factor, mode):
    """``[B, h*w, C]`` tokens downsampled on their grid: the top-left token of each ``factor x factor`` cell, or the
    mean of the tokens each cell holds (cells cut by the grid's edge hold fewer)."""
    grid = x.reshape(x.shape[0], grid_h, grid_w, x.shape[-1])
    if mode == "nearest":
        cells = grid[:, ::factor, ::factor]
    else:
        cells = np.stack([np.stack([grid[:, i:i + factor, j:j + factor].mean(axis=(1, 2))
                                    for j in range(0, grid_w, factor)], axis=1)
                          for i in range(0, grid_h, factor)], axis=1)
    return cells.reshape(x.shape[0], -1, x.shape[-1])


def todo_attention64(attn, image, image_kv, text):
    """Joint attention in float64 with the image keys and values projected from ``image_kv``: queries of every
    image token then every text token, keys and values of the ``image_kv`` tokens then the text tokens, each head's
    softmax(q k^T / sqrt(d)) v, the output cut back at the image token count and projected."""
    q = np.concatenate([linear64(attn.to_q, image), linear64(attn.add_q_proj, text)], axis=1)
    k = np.concatenate([linear64(attn.to_k, image_kv), linear64(attn.add_k_proj, text)], axis=1)
    v = np.concatenate([linear64(attn.to_v, image_kv), linear64(attn.add_v_proj, text)], axis=1)
    batch, _, inner = q.shape
    d = inner // attn.heads
    heads = lambda t: t.reshape(batch, t.shape[1], attn.heads, d).transpose(0, 2, 1, 3)  # noqa: E731
    scores = heads(q) @ heads(k).transpose(0, 1, 3, 2) / np.sqrt(d)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    out = (weights @ heads(v)).transpose(0, 2, 1, 3).reshape(batch, -1, inner)
    n = image.shape[1]
    image_out = linear64(attn.to_out[0], out[:, :n])
    text_out = out[:, n:] if attn.context_pre_only else linear64(attn.to_add_out, out[:, n:])
    return image_out, text_out


def todo_block64(block, hidden, text, temb, grid=None, factor=2, mode="nearest"):
    """One ``JointTransformerBlock`` in float64, ``(text out or None, image out)``; with ``grid`` the image keys and
    values come from the normed image tokens downsampled on it (``grid=None``: the plain block)."""
    hidden, text, temb = (np.asarray(a, dtype=np.float64) for a in (hidden, text, temb))
    norm_hidden, gate_msa, shift_mlp, scale_mlp, gate_mlp = ada_norm_zero64(block.norm1, hidden, temb)
    if block.context_pre_only:
        norm_text = ada_norm_continuous64(block.norm1_context, text, temb)
    else:
        norm_text, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = ada_norm_zero64(block.norm1_context, text, temb)
    image_kv = norm_hidden if grid is None else downsample64(norm_hidden, *grid, factor, mode)
    attn_image, attn_text = todo_attention64(block.attn, norm_hidden, image_kv, norm_text)
    hidden = hidden + gate_msa[:, None] * attn_image
    norm_hidden = layer_norm64(block.norm2, hidden) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
    hidden = hidden + gate_mlp[:, None] * feed_forward64(block.ff, norm_hidden)
    if block.context_pre_only:
        return None, hidden
    text = text + c_gate_msa[:, None] * attn_text
    norm_text = layer_norm64(block.norm2_context, text) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
    return text + c_gate_mlp[:, None] * feed_forward64(block.ff_context, norm_text), hidden


@pytest.mark.parametrize("mode", ["nearest", "average"])
@pytest.mark.parametrize("index", [0, 2], ids=["inner-block", "last-block"])
def test_one_todo_joint_block_matches_a_float64_numpy_forward(index, mode):
    model = tiny_sd3_transformer()
    block = model.transformer_blocks[index]
    grid_h, grid_w, batch = 6, 8, 2  # a non-square patch grid: 48 image tokens, 12 keys after 2x2 downsampling
    rng = np.random.default_rng(index)
    hidden = rng.standard_normal((batch, grid_h * grid_w, WIDTH)).astype("float32")
    text = rng.standard_normal((batch, 5, WIDTH)).astype("float32")
    temb = rng.standard_normal((batch, WIDTH)).astype("float32")
    sample = paddle.zeros([batch, LATENT_CHANNELS, 2 * grid_h, 2 * grid_w])
    with paddle.no_grad():
        plain_text, plain_image = block(paddle.to_tensor(hidden), paddle.to_tensor(text), paddle.to_tensor(temb))
    ppdiffusers_tome.apply_tome(model, method="todo", downsample_mode=mode)
    with paddle.no_grad(), get_patch(model).in_call(sample, paddle.to_tensor([600.0, 600.0])):
        out_text, out_image = block(paddle.to_tensor(hidden), paddle.to_tensor(text), paddle.to_tensor(temb))

    ref_text, ref_image = todo_block64(block, hidden, text, temb, (grid_h, grid_w), 2, mode)
    assert out_image.shape == plain_image.shape == [batch, grid_h * grid_w, WIDTH]
    np.testing.assert_allclose(out_image.numpy(), ref_image, rtol=1e-4, atol=2e-5)
    vanilla_text, vanilla_image = todo_block64(block, hidden, text, temb)  # the reference without ToDo...
    np.testing.assert_allclose(plain_image.numpy(), vanilla_image, rtol=1e-4, atol=2e-5)  # ...is the plain block
    assert np.abs(ref_image - vanilla_image).max() > 1e-3  # ToDo changes the block's output (the test can fail)
    if block.context_pre_only:
        assert out_text is None and ref_text is None
    else:
        np.testing.assert_allclose(out_text.numpy(), ref_text, rtol=1e-4, atol=2e-5)
        np.testing.assert_allclose(plain_text.numpy(), vanilla_text, rtol=1e-4, atol=2e-5)
        assert np.abs(ref_text - vanilla_text).max() > 1e-4  # the text attends to the downsampled image keys


# what reaches the attention core ----------------------------------------------------------------------------------
def count_keys(monkeypatch, where, name):
    """Wrap the attention core ``where.name`` so that every call records ``(query tokens, key tokens, value
    tokens)``; returns the record."""
    seen, core = [], getattr(where, name)

    def counting(query, key, value, *args, **kwargs):
        seen.append((query.shape[1], key.shape[1], value.shape[1]))
        return core(query, key, value, *args, **kwargs)

    monkeypatch.setattr(where, name, counting)
    return seen


@pytest.mark.parametrize("latent_hw, factor, kv_tokens", [((16, 16), 2, 16), ((16, 16), 4, 4), ((16, 16), 3, 9),
                                                           ((18, 26), 2, 35), ((12, 20), 2, 15)],
                         ids=["8x8-f2", "8x8-f4", "8x8-f3", "odd-9x13-f2", "wide-6x10-f2"])
def test_the_attention_core_sees_every_query_and_the_downsampled_image_keys(monkeypatch, latent_hw, factor,
                                                                            kv_tokens):
    """N/factor² image keys on a grid the factor divides; ceil(h/f) * ceil(w/f) on any other grid."""
    model = tiny_sd3_transformer()
    m = 7
    inputs = transformer_inputs(batch=2, latent_hw=latent_hw, text_tokens=m, seed=3)
    n = (latent_hw[0] // 2) * (latent_hw[1] // 2)
    vanilla = forward(model, inputs)
    ppdiffusers_tome.apply_tome(model, method="todo", downsample_factor=factor)
    seen = count_keys(monkeypatch, todo_attention, "math_attention")  # the core attention_core hands to ToDo
    projected = []
    handle = model.transformer_blocks[0].attn.to_k.register_forward_pre_hook(
        lambda layer, args: projected.append(args[0].shape[1]))
    out = forward(model, inputs)
    handle.remove()
    assert seen == [(n + m, kv_tokens + m, kv_tokens + m)] * 3  # every block, the last one included
    assert projected == [kv_tokens]  # downsampled before the key projection
    assert ppdiffusers_tome.tome_stats(model)[MODEL]["merges"] == 3
    assert out.shape == vanilla.shape and np.isfinite(out).all() and 1e-4 < np.abs(out - vanilla).max() < 1.0


def test_with_ppdiffusers_processor_todo_goes_through_its_gpu_attention_function(monkeypatch):
    """A GPU build keeps ppdiffusers' ``JointAttnProcessor2_5``, whose core is
    ``paddle.nn.functional.scaled_dot_product_attention_``; ToDo's joint attention must call that same function.
    Here the function (absent on a CPU) is the math path, so the result equals ToDo on the math processor."""
    F = paddle.nn.functional

    def gpu_function(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False):
        assert attn_mask is None and dropout_p == 0.0 and not is_causal  # as the stock processor calls it
        return joint_attention.math_attention(query, key, value)

    monkeypatch.setattr(F, "scaled_dot_product_attention_", gpu_function, raising=False)
    seen = count_keys(monkeypatch, F, "scaled_dot_product_attention_")
    stock, math = tiny_sd3_transformer(math_attention=False), tiny_sd3_transformer()
    inputs = transformer_inputs(batch=2, text_tokens=7, seed=4)
    for model in (stock, math):
        ppdiffusers_tome.apply_tome(model, method="todo")
    out_stock = forward(stock, inputs)
    assert seen == [(64 + 7, 16 + 7, 16 + 7)] * 3
    seen.clear()
    np.testing.assert_array_equal(forward(math, inputs), out_stock)
    assert seen == []  # the math processor does not call the GPU function


def test_todo_with_ppdiffusers_processor_on_a_cpu_names_use_math_attention():
    if hasattr(paddle.nn.functional, "scaled_dot_product_attention_"):
        pytest.skip("this Paddle has ppdiffusers' GPU attention function")
    model = ppdiffusers_tome.apply_tome(tiny_sd3_transformer(math_attention=False), method="todo")
    with pytest.raises(AttributeError, match="use_math_attention"):
        forward(model, transformer_inputs())


# kernel families and the policy -----------------------------------------------------------------------------------
def test_todo_under_the_gpu_kernels_equals_the_cpu_kernels_when_the_policy_lets_it_run():
    """ToDo's downsampling has no kernel-family branch: with ``min_work=0`` the GPU kernels give the CPU result."""
    inputs = transformer_inputs(batch=2, latent_hw=(18, 26), seed=6)
    vanilla = forward(tiny_sd3_transformer(), inputs)
    cpu_model = ppdiffusers_tome.apply_tome(tiny_sd3_transformer(), method="todo", downsample_mode="average",
                                            min_work=0)
    cpu = forward(cpu_model, inputs)
    gpu_model = ppdiffusers_tome.apply_tome(tiny_sd3_transformer(), method="todo", downsample_mode="average",
                                            min_work=0)
    with gpu_kernels():
        gpu = forward(gpu_model, inputs)
    np.testing.assert_allclose(gpu, cpu, rtol=1e-6, atol=1e-6)
    assert np.abs(gpu - vanilla).max() > 1e-4
    assert ppdiffusers_tome.tome_stats(gpu_model)[MODEL]["merges"] == 3
    status = ppdiffusers_tome.tome_status(gpu_model)[MODEL]["policy"]
    assert status[117]["kernels"] == "gpu" and status[117]["action"] == "merge"  # the settings' plan: ToDo


def test_the_default_gpu_policy_skips_small_sd3_blocks_and_runs_todo_above_joint_min_work():
    model = tiny_sd3_transformer()
    inputs = transformer_inputs(batch=2, seed=6)
    vanilla = forward(model, inputs)
    ppdiffusers_tome.apply_tome(model, method="todo")
    with gpu_kernels():
        skipped = forward(model, inputs)  # 2 x 64 tokens: batch * tokens**2 = 8192 < 2**23
    np.testing.assert_array_equal(skipped, vanilla)
    stats = ppdiffusers_tome.tome_stats(model)[MODEL]
    assert stats["blocks_skipped"] == 3 and stats["merges"] == 0 and stats["blocks_pooled"] == 0
    settings = Settings(ToMeConfig(method="todo"), model, find_blocks(model))
    for tokens, latent_hw, action in ((2048, (128, 64), "todo"), (1024, (64, 64), "skip")):
        decision = decide_block(settings, tokens, 2, grid_of(settings, latent_hw, tokens), 1, "gpu", 0.5)
        assert decision.action == action, decision
        assert (2 * tokens ** 2 >= JOINT_MIN_WORK) == (action == "todo")
    cpu = decide_block(settings, 64, 2, grid_of(settings, (16, 16), 64), 1, "cpu", 0.5)
    assert cpu.action == "todo"  # CPU kernels: ToDo on every block


# pipelines, removal, status, refusals -----------------------------------------------------------------------------
def test_todo_refuses_a_joint_layer_with_a_processor_it_does_not_know_before_anything_changes():
    model = tiny_sd3_transformer()
    model.transformer_blocks[1].attn.set_processor(AttnProcessor())
    unpatched = hook_shape(model)
    with pytest.raises(ValueError, match=r"transformer_blocks\.1\.attn.*AttnProcessor"):
        ppdiffusers_tome.apply_tome(model, method="todo")
    assert get_patch(model) is None and hook_shape(model) == unpatched


def test_a_processor_set_after_todo_was_applied_is_refused_by_name_when_called():
    model = ppdiffusers_tome.apply_tome(tiny_sd3_transformer(), method="todo")
    model.transformer_blocks[0].attn.set_processor(AttnProcessor())
    with pytest.raises(ValueError, match="AttnProcessor"):
        forward(model, transformer_inputs())


def test_todo_and_the_step_cache_together_run_and_both_removals_give_back_vanilla():
    pipe = tiny_sd3_pipeline()
    vanilla = call(pipe, steps=4)
    pipe.apply_cache(interval=2)
    cached = call(pipe, steps=4)
    pipe.apply_tome(method="todo")
    both = call(pipe, steps=4)
    assert ppdiffusers_tome.tome_stats(pipe)["transformer"]["merges"] > 0
    assert np.isfinite(both).all() and np.abs(both - cached).max() > 0
    pipe.remove_tome()
    pipe.remove_cache()
    np.testing.assert_array_equal(call(pipe, steps=4), vanilla)


def test_merge_crossattn_stays_refused_on_sd3_with_todo_too():
    with pytest.raises(ValueError, match="merge_crossattn"):
        ppdiffusers_tome.apply_tome(tiny_sd3_transformer(), method="todo", merge_crossattn=True)
