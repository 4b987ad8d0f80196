"""ToMe on Stable Diffusion 3 (``SD3Transformer2DModel``, built from ``JointTransformerBlock``s): the image stream is
merged before the joint attention (and, with ``merge_mlp``, before the image MLP) and unmerged after it, the text
stream is left alone. Checked on the tiny offline SD3 models (the math attention processor, so on a CPU): token
counts at the projections, one merged block against a float64 numpy forward, pipelines (merging, ratio 0, removal and
copies on SD3: tests/techniques/test_tome.py), odd and non-square grids, a static graph with a dynamic batch, refused options,
threads and the status functions. ToDo on SD3: tests/tome/test_sd3_todo.py."""

import math
import threading

import numpy as np
import paddle
import pytest
from paddle.static import InputSpec
from PIL import Image

import ppdiffusers_tome
from ppdiffusers_tome.core.registry import hooks_of
from ppdiffusers_tome.testing import tiny_sd3_pipeline, tiny_sd3_transformer, tiny_sd_pipeline
from ppdiffusers_tome.tome.patch import get_patch
from tests.conftest import generator
from tests.numpy_reference import reference_plan
from tests.test_sd3_model import NoisePredictor, joint_attention_reference, linear64
from tests.unet_calls import hook_shape

PROMPT = "a red cube"
SIZE = 32  # pixels: 16 x 16 latents, an 8 x 8 patch grid (64 image tokens)
STEPS = 3
WIDTH = 32  # the tiny transformer's width (2 heads of 16)
TEXT_CHANNELS, POOLED_CHANNELS, LATENT_CHANNELS = 96, 64, 16
MODEL = "SD3Transformer2DModel"


# helpers ----------------------------------------------------------------------------------------------------------
def call(pipe, steps=STEPS, seed=0, **kwargs):
    """One pipeline call with a fixed seed, images as a float numpy array."""
    if "image" not in kwargs:
        kwargs.setdefault("height", SIZE)
        kwargs.setdefault("width", SIZE)
    return pipe(PROMPT, num_inference_steps=steps, generator=generator(seed), output_type="np", **kwargs).images


def init_picture(seed=0):
    pixels = np.random.default_rng(seed).uniform(0, 255, (SIZE, SIZE, 3)).astype("uint8")
    return Image.fromarray(pixels)


def transformer_inputs(batch=2, latent_hw=(16, 16), text_tokens=7, seed=0, timestep=500.0):
    """Random inputs of the tiny SD3 transformer: latents, text stream, pooled text, timesteps."""
    rng = np.random.default_rng(seed)
    latents = rng.standard_normal((batch, LATENT_CHANNELS, *latent_hw)).astype("float32")
    text = rng.standard_normal((batch, text_tokens, TEXT_CHANNELS)).astype("float32")
    pooled = rng.standard_normal((batch, POOLED_CHANNELS)).astype("float32")
    steps = np.full([batch], timestep, dtype="float32")
    return [paddle.to_tensor(a) for a in (latents, text, pooled, steps)]


def forward(model, inputs):
    with paddle.no_grad():
        return model(*inputs, return_dict=False)[0].numpy()


def record_rows(model):
    """Forward pre-hooks that record the input shape of, per block, the image stream's query projection
    (``attn.to_q``), the text stream's (``attn.add_q_proj``) and the image MLP's first layer (``ff.net[0]``: a hook
    on ``ff`` itself runs before ToMe's hook inside ``ff.forward`` and sees its unmerged input). Returns the record
    ``{(block, name): [shape, ...]}`` and the hook handles."""
    seen, handles = {}, []
    for i, block in enumerate(model.transformer_blocks):
        for name, layer in (("to_q", block.attn.to_q), ("add_q_proj", block.attn.add_q_proj), ("ff", block.ff.net[0])):
            def hook(layer, args, key=(i, name)):
                seen.setdefault(key, []).append(tuple(args[0].shape))
            handles.append(layer.register_forward_pre_hook(hook))
    return seen, handles


def remove_all(handles):
    for handle in handles:
        handle.remove()


# token counts -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("merge_mlp", [False, True], ids=["attention", "attention+mlp"])
@pytest.mark.parametrize("ratio", [0.5, 0.3])
def test_the_joint_attention_and_the_image_mlp_see_fewer_image_tokens_and_every_text_token(ratio, merge_mlp):
    model = tiny_sd3_transformer()
    inputs = transformer_inputs(batch=2, text_tokens=7)
    n, m = 64, 7
    seen, handles = record_rows(model)
    vanilla = forward(model, inputs)
    counted_vanilla = dict(seen)
    seen.clear()
    ppdiffusers_tome.apply_tome(model, ratio=ratio, merge_mlp=merge_mlp)
    merged = forward(model, inputs)
    remove_all(handles)
    # the hooks count what vanilla runs: every image token at every projection
    assert counted_vanilla == {(i, name): [(2, n if name != "add_q_proj" else m, WIDTH)]
                               for i in range(3) for name in ("to_q", "add_q_proj", "ff")}
    kept = n - int(n * ratio)  # 32 of 64 at 0.5, 45 at 0.3
    for i in range(3):  # every block, the last (context_pre_only) one included
        assert seen[i, "to_q"] == [(2, kept, WIDTH)]
        assert seen[i, "add_q_proj"] == [(2, m, WIDTH)]  # the text stream is unchanged
        assert seen[i, "ff"] == [(2, kept if merge_mlp else n, WIDTH)]
    stats = ppdiffusers_tome.tome_stats(model)[MODEL]
    assert stats["merges"] == 3 * (2 if merge_mlp else 1) and stats["plans_computed"] == 3
    assert merged.shape == vanilla.shape and 1e-4 < np.abs(merged - vanilla).max() < 1.0


# one merged block against float64 numpy -----------------------------------------------------------------------------
def silu64(x):
    return x / (1.0 + np.exp(-x))


def gelu_tanh64(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def layer_norm64(norm, x):
    """A Paddle ``LayerNorm`` in float64 (with its weight and bias when it has them)."""
    mean = x.mean(axis=-1, keepdims=True)
    y = (x - mean) / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + norm._epsilon)
    if norm.weight is not None:
        y = y * norm.weight.numpy().astype(np.float64)
    if norm.bias is not None:
        y = y + norm.bias.numpy().astype(np.float64)
    return y


def ada_norm_zero64(norm, x, temb):
    """``AdaLayerNormZero`` in float64: ``(x normed and modulated, gate_msa, shift_mlp, scale_mlp, gate_mlp)``."""
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = np.split(linear64(norm.linear, silu64(temb)), 6,
                                                                              axis=1)
    x = layer_norm64(norm.norm, x) * (1 + scale_msa[:, None]) + shift_msa[:, None]
    return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


def ada_norm_continuous64(norm, x, temb):
    """``AdaLayerNormContinuous`` (the last block's text norm) in float64: scale first, then shift."""
    scale, shift = np.split(linear64(norm.linear, silu64(temb)), 2, axis=1)
    return layer_norm64(norm.norm, x) * (1 + scale[:, None]) + shift[:, None]


def feed_forward64(ff, x):
    """SD3's ``FeedForward`` (tanh-approximated GELU projection, dropout 0, output projection) in float64."""
    return linear64(ff.net[2], gelu_tanh64(linear64(ff.net[0].proj, x)))


def owners_of(plan, batch, tokens):
    """``[B, N]``: the grid position of the token each image token ends in (the dst a merged src joined, else the
    token itself), from the plan's public attributes."""
    owner = np.tile(np.arange(tokens), (batch, 1))
    merged_pos, merged_into = plan.merged_pos.numpy(), plan.merged_into.numpy()
    for b in range(batch):
        owner[b, merged_pos[b]] = merged_into[b]
    return owner


def merge64(x, owner):
    """Each group (a dst and the src merged into it, or a token alone) becomes the average of its members."""
    return np.stack([np.stack([x[b, owner[b] == d].mean(axis=0) for d in np.unique(owner[b])])
                     for b in range(x.shape[0])])


def unmerge64(y, owner):
    """Every image token gets the row of the group it belongs to."""
    return np.stack([y[b, np.searchsorted(np.unique(owner[b]), owner[b])] for b in range(y.shape[0])])


def joint_block_reference(block, hidden, text, temb, owner=None, merge_mlp=False):
    """One ``JointTransformerBlock`` in float64, ``(text out or None, image out)``; with ``owner`` (see
    :func:`owners_of`) the joint attention runs on the merged image tokens (and the image MLP too with
    ``merge_mlp``), whose outputs are unmerged before the gates and residuals."""
    hidden, text, temb = (np.asarray(a, dtype=np.float64) for a in (hidden, text, temb))
    run_merged = lambda fn, x: unmerge64(fn(merge64(x, owner)), owner) if owner is not None else fn(x)  # noqa: E731
    norm_hidden, gate_msa, shift_mlp, scale_mlp, gate_mlp = ada_norm_zero64(block.norm1, hidden, temb)
    if block.context_pre_only:
        norm_text = ada_norm_continuous64(block.norm1_context, text, temb)
    else:
        norm_text, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = ada_norm_zero64(block.norm1_context, text, temb)
    texts = []

    def attention(image_tokens):
        image_out, text_out = joint_attention_reference(block.attn, image_tokens, norm_text)
        texts.append(text_out)
        return image_out

    hidden = hidden + gate_msa[:, None] * run_merged(attention, norm_hidden)
    norm_hidden = layer_norm64(block.norm2, hidden) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
    ff = lambda x: feed_forward64(block.ff, x)  # noqa: E731
    hidden = hidden + gate_mlp[:, None] * (run_merged(ff, norm_hidden) if merge_mlp else ff(norm_hidden))
    if block.context_pre_only:
        return None, hidden
    text = text + c_gate_msa[:, None] * texts[0]
    norm_text = layer_norm64(block.norm2_context, text) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
    return text + c_gate_mlp[:, None] * feed_forward64(block.ff_context, norm_text), hidden


@pytest.mark.parametrize("merge_mlp", [False, True], ids=["attention", "attention+mlp"])
@pytest.mark.parametrize("index", [0, 2], ids=["inner-block", "last-block"])
def test_one_merged_joint_block_matches_a_float64_numpy_forward(index, merge_mlp):
    model = tiny_sd3_transformer()
    block = model.transformer_blocks[index]
    grid_h, grid_w = 6, 8  # a non-square patch grid: 48 image tokens
    n, batch = grid_h * grid_w, 2
    rng = np.random.default_rng(index)
    hidden = rng.standard_normal((batch, n, WIDTH)).astype("float32")
    text = rng.standard_normal((batch, 5, WIDTH)).astype("float32")
    temb = rng.standard_normal((batch, WIDTH)).astype("float32")
    sample = paddle.to_tensor(rng.standard_normal((batch, LATENT_CHANNELS, 2 * grid_h, 2 * grid_w)).astype("float32"))
    with paddle.no_grad():
        plain_text, plain_image = block(paddle.to_tensor(hidden), paddle.to_tensor(text), paddle.to_tensor(temb))
    ppdiffusers_tome.apply_tome(model, ratio=0.5, merge_mlp=merge_mlp)
    patch = get_patch(model)
    plans = []
    handle = block.attn.to_q.register_forward_pre_hook(lambda layer, args: plans.append(patch.plan_in_flight(index)))
    with paddle.no_grad(), patch.in_call(sample, paddle.to_tensor([600.0, 600.0])):
        out_text, out_image = block(paddle.to_tensor(hidden), paddle.to_tensor(text), paddle.to_tensor(temb))
    handle.remove()

    # the plan: a partition with one dst per 2x2 cell, r = int(48 * 0.5) src merged, each into its most similar dst
    (plan,) = plans
    assert plan.r == n // 2 and plan.num_tokens == n
    src, dst = plan.src_pos.numpy(), plan.dst_pos.numpy()
    assert sorted(np.concatenate([src, dst]).tolist()) == list(range(n)) and len(dst) == (grid_h // 2) * (grid_w // 2)
    expected = reference_plan(hidden, src, dst, plan.r)  # the matching, in float64 numpy
    for b in range(batch):
        got = dict(zip(plan.merged_pos.numpy()[b].tolist(), plan.merged_into.numpy()[b].tolist()))
        assert got == {int(src[s]): int(dst[t]) for s, t in zip(expected.merged[b], expected.target[b])}

    owner = owners_of(plan, batch, n)
    ref_text, ref_image = joint_block_reference(block, hidden, text, temb, owner, merge_mlp)
    np.testing.assert_allclose(out_image.numpy(), ref_image, rtol=1e-4, atol=2e-5)
    if block.context_pre_only:
        assert out_text is None and ref_text is None
    else:
        np.testing.assert_allclose(out_text.numpy(), ref_text, rtol=1e-4, atol=2e-5)
    # the same numpy forward without merging is the plain block: the reference itself is right
    vanilla_text, vanilla_image = joint_block_reference(block, hidden, text, temb)
    np.testing.assert_allclose(plain_image.numpy(), vanilla_image, rtol=1e-4, atol=2e-5)
    assert np.abs(ref_image - vanilla_image).max() > 1e-3  # merging changes the block's output (the test can fail)
    if not block.context_pre_only:
        np.testing.assert_allclose(plain_text.numpy(), vanilla_text, rtol=1e-4, atol=2e-5)
        assert np.abs(ref_text - vanilla_text).max() > 1e-4  # the text attends to the merged image tokens


def test_in_call_keys_the_random_partition_by_its_timestep_as_a_model_call_does():
    """``patch.in_call(sample, timestep)`` reads the timestep by name: on SD3 it is the transformer's fourth
    argument, not the second (as on a UNet), and a block run on its own draws the partition of a model call."""
    model = tiny_sd3_transformer()
    ppdiffusers_tome.apply_tome(model, ratio=0.5)
    patch, block = get_patch(model), model.transformer_blocks[0]
    seen = []
    handle = block.attn.to_q.register_forward_pre_hook(
        lambda layer, args: seen.append(patch.plan_in_flight(0).dst_pos.numpy()))
    in_model = {}
    for t in (900.0, 100.0):
        inputs = transformer_inputs(batch=2, seed=5, timestep=t)
        forward(model, inputs)
        in_model[t] = seen.pop()
    rng = np.random.default_rng(6)
    hidden, text, temb = (paddle.to_tensor(rng.standard_normal(shape).astype("float32"))
                          for shape in ((2, 64, WIDTH), (2, 5, WIDTH), (2, WIDTH)))
    with paddle.no_grad():
        for t in (100.0, 900.0):
            with patch.in_call(inputs[0], paddle.to_tensor([t, t])):
                block(hidden, text, temb)
            np.testing.assert_array_equal(seen.pop(), in_model[t])
    handle.remove()
    assert not np.array_equal(in_model[900.0], in_model[100.0])  # the partition depends on the timestep


# odd and non-square grids, a dynamic batch -------------------------------------------------------------------------
@pytest.mark.parametrize("latent_hw", [(18, 26), (10, 6), (12, 20)], ids=["odd-9x13", "odd-5x3", "wide-6x10"])
def test_odd_and_non_square_patch_grids_merge(latent_hw):
    model = tiny_sd3_transformer()
    inputs = transformer_inputs(batch=2, latent_hw=latent_hw, seed=3)
    grid_h, grid_w = latent_hw[0] // 2, latent_hw[1] // 2
    n = grid_h * grid_w
    vanilla = forward(model, inputs)
    ppdiffusers_tome.apply_tome(model, ratio=0.5)
    patch, dst_counts = get_patch(model), []
    seen, handles = record_rows(model)
    handles.append(model.transformer_blocks[0].attn.to_q.register_forward_pre_hook(
        lambda layer, args: dst_counts.append(len(patch.plan_in_flight(0).dst_pos))))
    merged = forward(model, inputs)
    remove_all(handles)
    assert seen[0, "to_q"] == [(2, n - int(n * 0.5), WIDTH)]
    assert dst_counts == [(grid_h // 2) * (grid_w // 2)]  # one dst per full 2x2 cell of the grid
    assert merged.shape == (2, LATENT_CHANNELS, *latent_hw) and 1e-4 < np.abs(merged - vanilla).max() < 1.0


def test_a_non_square_pipeline_call_merges():
    pipe = tiny_sd3_pipeline()
    seen, handles = record_rows(pipe.transformer)
    vanilla = call(pipe, steps=2, height=48, width=80)  # latents 24 x 40: a 12 x 20 patch grid, 240 tokens
    pipe.apply_tome(ratio=0.5)
    seen.clear()
    merged = call(pipe, steps=2, height=48, width=80)
    remove_all(handles)
    assert seen[0, "to_q"] == [(2, 120, WIDTH)] * 2  # classifier-free guidance: a batch of 2 per step
    assert merged.shape == (1, 48, 80, 3) and 0 < np.abs(merged - vanilla).max() < 1.0


@pytest.mark.parametrize("options", [dict(ratio=0.5), dict(method="todo")], ids=["tome", "todo"])
def test_a_patched_transformer_exports_with_a_dynamic_batch_and_equals_eager(options, tmp_path):
    transformer = tiny_sd3_transformer(num_layers=2)  # an inner block and the last one
    model = NoisePredictor(transformer)
    model.eval()
    batches = {batch: transformer_inputs(batch, text_tokens=10, seed=batch, timestep=700.0) for batch in (1, 3)}
    with paddle.no_grad():
        vanilla = {batch: model(*inputs).numpy() for batch, inputs in batches.items()}
    ppdiffusers_tome.apply_tome(transformer, **options)
    with paddle.no_grad():
        eager = {batch: model(*inputs).numpy() for batch, inputs in batches.items()}
    spec = [InputSpec([None, LATENT_CHANNELS, 16, 16], "float32"), InputSpec([None, 10, TEXT_CHANNELS], "float32"),
            InputSpec([None, POOLED_CHANNELS], "float32"), InputSpec([None], "float32")]
    static = paddle.jit.to_static(model, input_spec=spec, full_graph=True)
    path = str(tmp_path / "sd3")
    paddle.jit.save(static, path)
    loaded = paddle.jit.load(path)
    for batch, inputs in batches.items():
        assert np.abs(eager[batch] - vanilla[batch]).max() > 1e-4  # ToMe (ToDo) is on in the eager model
        np.testing.assert_allclose(loaded(*inputs).numpy(), eager[batch], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options", [dict(ratio=0.5), dict(method="todo")], ids=["tome", "todo"])
def test_a_dynamic_latent_size_is_refused_by_name_at_export(options, tmp_path):
    """The patch grid is ``H/p x W/p``: with a dynamic height and width it is unknown while tracing (the program once
    ran unmerged, with no error)."""
    from ppdiffusers_tome.tome.patch import ToMeStaticGraphError

    transformer = tiny_sd3_transformer(num_layers=2)
    ppdiffusers_tome.apply_tome(transformer, **options)
    spec = [InputSpec([None, LATENT_CHANNELS, None, None], "float32"), InputSpec([None, 10, TEXT_CHANNELS], "float32"),
            InputSpec([None, POOLED_CHANNELS], "float32"), InputSpec([None], "float32")]
    static = paddle.jit.to_static(NoisePredictor(transformer), input_spec=spec, full_graph=True)
    with pytest.raises(ToMeStaticGraphError, match="on SD3Transformer2DModel cannot be converted with a dynamic latent "
                                                   "height and width"):
        paddle.jit.save(static, str(tmp_path / "sd3"))


# refusals --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, named", [(dict(merge_crossattn=True), "merge_crossattn")], ids=["merge_crossattn"])
def test_options_without_meaning_on_sd3_are_refused_by_name_before_anything_changes(options, named):
    """(``method="todo"`` works on SD3 since 0.13.0: tests/tome/test_sd3_todo.py.)"""
    pipe = tiny_sd3_pipeline()
    unpatched = hook_shape(pipe.transformer)
    with pytest.raises(ValueError, match=named):
        pipe.apply_tome(**options)
    assert get_patch(pipe.transformer) is None and hook_shape(pipe.transformer) == unpatched
    with pytest.raises(ValueError, match=named):
        ppdiffusers_tome.apply_tome(pipe.transformer, **options)  # the model alone too
    assert hooks_of(pipe.transformer) is None
    pipe.apply_tome(ratio=0.3)
    patch, patched = get_patch(pipe.transformer), hook_shape(pipe.transformer)
    with pytest.raises(ValueError, match=named):
        pipe.apply_tome(ratio=0.6, **options)
    assert get_patch(pipe.transformer) is patch and patch.installed and patch.config.ratio == 0.3
    assert hook_shape(pipe.transformer) == patched


def test_the_fused_inference_optimize_transformer_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("INFERENCE_OPTIMIZE", "True")
    model = tiny_sd3_transformer(math_attention=False)
    pipe = tiny_sd3_pipeline(math_attention=False)
    monkeypatch.delenv("INFERENCE_OPTIMIZE")
    assert not hasattr(model, "transformer_blocks")  # ppdiffusers put the fused SimplifiedSD3 in their place
    for target in (model, pipe):
        with pytest.raises(ValueError, match="INFERENCE_OPTIMIZE") as refused:
            ppdiffusers_tome.apply_tome(target, ratio=0.5)
        message = str(refused.value)
        assert "no blocks to hook" in message and "Unset INFERENCE_OPTIMIZE" in message
    assert hooks_of(model) is None and hooks_of(pipe.transformer) is None


# threads and copies ---------------------------------------------------------------------------------------------
def test_two_threads_calling_one_patched_transformer_each_get_the_single_thread_result():
    model = tiny_sd3_transformer()
    ppdiffusers_tome.apply_tome(model, ratio=0.5, merge_mlp=True)
    inputs = [transformer_inputs(batch=2, seed=0), transformer_inputs(batch=1, latent_hw=(12, 20), seed=1)]
    expected = [forward(model, x) for x in inputs]
    results, errors, barrier = {0: [], 1: []}, [], threading.Barrier(2)

    def work(k):
        try:
            barrier.wait()
            for _ in range(3):
                results[k].append(forward(model, inputs[k]))
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for k in (0, 1):
        assert len(results[k]) == 3
        for out in results[k]:
            np.testing.assert_array_equal(out, expected[k])
    assert ppdiffusers_tome.tome_stats(model)[MODEL]["calls"] == 2 + 6


# status ------------------------------------------------------------------------------------------------------------
def test_tome_status_and_tome_stats_report_sd3_like_a_unet():
    pipe, unet_pipe = tiny_sd3_pipeline(), tiny_sd_pipeline()
    assert ppdiffusers_tome.tome_status(pipe) == {"transformer": {"active": None, "settings": None, "blocks": 0,
                                                                   "cache": None}}
    assert ppdiffusers_tome.tome_stats(pipe) == {}
    pipe.apply_tome(ratio=0.5, merge_mlp=True)
    unet_pipe.apply_tome(ratio=0.5, merge_mlp=True)
    call(pipe, steps=2)
    status, unet_status = ppdiffusers_tome.tome_status(pipe), ppdiffusers_tome.tome_status(unet_pipe)
    assert list(status) == ["transformer"] and list(unet_status) == ["unet"]
    sd3 = status["transformer"]
    assert set(sd3) == set(unet_status["unet"])
    assert sd3["active"] == "ppdiffusers_tome" and sd3["blocks"] == 3 and sd3["cache"] is None
    assert sd3["settings"] == unet_status["unet"]["settings"]
    assert list(sd3["policy"]) == [64] and sd3["policy"][64]["action"] == "merge"  # the 8 x 8 patch grid
    stats = ppdiffusers_tome.tome_stats(pipe)
    assert list(stats) == ["transformer"]
    assert set(stats["transformer"]) == set(ppdiffusers_tome.tome_stats(unet_pipe)["unet"])
    assert stats["transformer"] == {"blocks": 3, "calls": 2, "merges": 12, "plans_computed": 6, "plans_reused": 0,
                                    "plans_shared": 0, "blocks_skipped": 0, "blocks_pooled": 0}
    pipe.apply_cache(interval=2)
    assert ppdiffusers_tome.tome_status(pipe)["transformer"]["cache"]["settings"]["interval"] == 2
    pipe.remove_cache()
    pipe.remove_tome()
    assert ppdiffusers_tome.tome_status(pipe)["transformer"]["active"] is None
    assert ppdiffusers_tome.tome_stats(pipe) == {}
