"""The shapes task on SD3's MMDiT: the trainer (research/shapes/sd3.py) fits and writes a pipeline that
``StableDiffusion3Pipeline.from_pretrained`` loads; the shipped weights (ppdiffusers_tome/tools/shapes_sd3_model/)
load offline, run on the CPU's math attention, and draw the background a caption names, where random weights do not;
ToMe on them merges and still does."""

import json
import os

import numpy as np
import paddle
import pytest
from ppdiffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

from ppdiffusers_tome.sd3_attention import JointMathAttnProcessor, use_math_attention
from ppdiffusers_tome.tools import shapes as shipped
from research.shapes import dataset, sd3

from .shapes_scores import generate, held_out, mean_accuracy

# Classifier accuracy on FIXED_PROMPTS held-out captions at STEPS steps (chance: 1/6 for the background, 0.15 for the
# mean of the four heads). BACKGROUND_THRESHOLD and ACCURACY_THRESHOLD sit below what the shipped weights scored when
# they shipped (training.json's scores: background 1.0, mean 0.51 over 4 x 32 captions at 20 steps; here 1.0 and 0.48)
# and above what random weights score (background 0, mean 0.08-0.17 for seeds 1-3).
FIXED_PROMPTS = 12
STEPS = 12
BACKGROUND_THRESHOLD = 0.8
ACCURACY_THRESHOLD = 0.35


def test_flow_loss_falls_on_a_fixed_batch():
    paddle.seed(0)
    pipe = sd3.build_sd3_pipeline(seed=0)
    images, captions, _ = dataset.batch(range(2), seed=0)
    with paddle.no_grad():
        latents = pipe.vae.encode(paddle.to_tensor(images)).latent_dist.mean * pipe.vae.config.scaling_factor
    noise = paddle.randn(latents.shape)
    sigmas = np.array([0.3, 0.8], dtype=np.float32)
    parameters = [p for m in (pipe.transformer, pipe.text_encoder, pipe.text_encoder_2) for p in m.parameters()]
    optimizer = paddle.optimizer.AdamW(learning_rate=2e-3, parameters=parameters, weight_decay=0.0)
    pipe.transformer.train()
    losses = []
    for _ in range(8):
        loss = sd3.flow_loss(pipe, latents, captions, noise, sigmas)
        losses.append(float(loss))
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
    assert all(np.isfinite(losses)) and losses[-1] < 0.7 * losses[0], losses


def test_flow_loss_is_the_velocity_error_written_out():
    """The loss against a float64 numpy reference of rectified flow: x_t = (1 - s) x0 + s n, target n - x0."""
    pipe = sd3.build_sd3_pipeline(seed=1)
    rng = np.random.default_rng(0)
    latents, noise = (rng.standard_normal((2, 4, 32, 32)).astype(np.float32) for _ in range(2))
    sigmas = np.array([0.25, 0.9], dtype=np.float32)
    captions = ["a small red star at the top left on a blue background", ""]
    with paddle.no_grad():
        loss = float(sd3.flow_loss(pipe, paddle.to_tensor(latents), captions, paddle.to_tensor(noise), sigmas))
        embeds, _, pooled, _ = pipe.encode_prompt(captions, captions, captions, do_classifier_free_guidance=False)
        s = sigmas.astype(np.float64)[:, None, None, None]
        noisy = (1 - s) * latents + s * noise
        prediction = pipe.transformer(hidden_states=paddle.to_tensor(noisy.astype(np.float32)),
                                      timestep=paddle.to_tensor(sigmas * 1000.0), encoder_hidden_states=embeds,
                                      pooled_projections=pooled).sample.numpy().astype(np.float64)
    expected = np.mean((prediction - (noise.astype(np.float64) - latents)) ** 2)
    assert loss == pytest.approx(expected, rel=1e-5)


def test_training_noise_levels_are_the_schedulers_shift_of_a_logit_normal():
    """sample_sigmas shifts as FlowMatchEulerDiscreteScheduler(shift=3) shifts its own sigmas."""
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=sd3.SHIFT)
    unshifted = np.linspace(1.0, 1 / 1000, 1000)  # the scheduler's sigmas before its shift
    np.testing.assert_allclose(scheduler.sigmas.numpy()[:1000],
                               sd3.SHIFT * unshifted / (1 + (sd3.SHIFT - 1) * unshifted), rtol=1e-5)
    levels = sd3.sample_sigmas(np.random.default_rng(0), 20000)
    # the median of sigmoid(N(0, 1)) is 0.5, shifted: 3 * 0.5 / (1 + 2 * 0.5) = 0.75
    assert np.median(levels) == pytest.approx(0.75, abs=0.01)
    assert sd3.sample_sigmas(np.random.default_rng(0), 5, shift=1.0) == pytest.approx(
        1 / (1 + np.exp(-np.random.default_rng(0).standard_normal(5))))


def test_smoke_run_writes_a_pipeline_that_from_pretrained_loads(tmp_path):
    out = tmp_path / "model"
    assert sd3.main(["--minutes", "1", "--output", str(out), "--max-steps", "2", "--batch-size", "2",
                     "--threads", "1"]) == 0
    with open(out / "train_log.json", encoding="utf-8") as f:
        log = json.load(f)
    assert [s["step"] for s in log["steps"]] == [0, 1] and all(np.isfinite(s["loss"]) for s in log["steps"])
    with open(out / "vae" / "config.json", encoding="utf-8") as f:
        vae = json.load(f)
    assert vae["shift_factor"] == 0.0 and vae["scaling_factor"] == pytest.approx(log["scaling_factor"])
    pipe = StableDiffusion3Pipeline.from_pretrained(str(out), text_encoder_3=None, tokenizer_3=None)
    use_math_attention(pipe).set_progress_bar_config(disable=True)
    image = pipe("a small red star at the top left on a blue background", num_inference_steps=1, height=64,
                 width=64, generator=paddle.Generator().manual_seed(0), output_type="np").images
    assert image.shape == (1, 64, 64, 3) and np.isfinite(image).all()
    # --init-from continues from those weights, on the dataset's images after the ones the first run saw
    more = tmp_path / "more"
    assert sd3.main(["--minutes", "1", "--output", str(more), "--max-steps", "1", "--batch-size", "2",
                     "--threads", "1", "--init-from", str(out)]) == 0
    with open(more / "train_log.json", encoding="utf-8") as f:
        continued = json.load(f)
    assert continued["first_index"] == 2 * 2 and continued["settings"]["init_from"] == str(out)


class _CountingVae:
    """Stands in for the VAE: a latent whose every value is its image's mean (checkable), encodes counted."""

    class config:  # noqa: N801 (read as pipe.vae.config.scaling_factor)
        scaling_factor = 2.0

    def __init__(self):
        self.encoded = []

    def encode(self, images):
        self.encoded.append(int(images.shape[0]))
        means = images.mean(axis=[1, 2, 3], keepdim=True).expand([images.shape[0], 4, 32, 32])

        class _Dist:
            latent_dist = type("_Posterior", (), {"mean": means})

        return _Dist


class _Pipe:
    def __init__(self):
        self.vae = _CountingVae()


def _expected_latent(index, seed=0):
    images, captions, _ = dataset.batch([index], seed=seed)
    return 2.0 * images.astype(np.float64).mean(), captions[0]


def test_a_stream_draws_consecutive_images_each_encoded_when_drawn():
    pipe = _Pipe()
    stream = sd3._Latents(pipe, first=5, count=0, seed=0, rng=np.random.default_rng(0))
    for first in (5, 8):
        latents, captions = stream.batch(3)
        for k, index in enumerate(range(first, first + 3)):
            value, caption = _expected_latent(index)
            assert float(latents[k].mean()) == pytest.approx(value, rel=1e-4) and captions[k] == caption
    assert pipe.vae.encoded == [3, 3]


def test_kept_images_are_encoded_once_and_every_epoch_draws_each_once():
    pipe = _Pipe()
    stream = sd3._Latents(pipe, first=10, count=6, seed=0, rng=np.random.default_rng(1))
    drawn = []
    for _ in range(6):  # 4 epochs of 6 images in batches of 4: batches straddle epochs
        latents, captions = stream.batch(4)
        for latent, caption in zip(latents, captions):
            matches = [k for k in range(10, 16) if _expected_latent(k)[1] == caption
                       and float(latent.mean()) == pytest.approx(_expected_latent(k)[0], rel=1e-4)]
            assert matches, caption
            drawn.append(matches[0])
    assert sum(pipe.vae.encoded) == 6  # each image through the encoder once
    epochs = [drawn[k:k + 6] for k in range(0, 24, 6)]
    assert epochs[0] == list(range(10, 16))  # the first epoch in order
    assert all(sorted(e) == list(range(10, 16)) for e in epochs[1:])
    assert epochs[1:] != [epochs[0]] * 3  # later epochs are shuffled


@pytest.mark.parametrize("field, value, message", [
    ("minutes", 0, "minutes must be > 0"),
    ("batch_size", 0, "batch_size must be >= 1"),
    ("lr", 0.0, "lr must be > 0"),
    ("max_steps", 0, "max_steps must be >= 1"),
    ("lr_decay", "linear", "lr_decay must be 'auto', 'cosine' or 'none'"),
    ("init_from", "no-such-folder", "init_from must be a folder this trainer wrote"),
    ("images", -1, "images must be an int >= 0"),
    ("images", 2.5, "images must be an int >= 0"),
    ("images", True, "images must be an int >= 0"),
])
def test_bad_settings_are_refused_by_name(field, value, message):
    with pytest.raises(ValueError, match=message):
        sd3.SD3TrainConfig(**{field: value})


# the shipped weights ------------------------------------------------------------------------------------------------
def test_shipped_sd3_weights_exist_and_record_their_command():
    assert shipped.has_sd3_weights()
    total = sum(os.path.getsize(os.path.join(root, name))
                for root, _, files in os.walk(shipped.SD3_MODEL_DIR) for name in files)
    assert 1_000_000 < total <= 12_000_000, total
    info = shipped.training_info("sd3")
    assert "research.shapes.sd3" in info["pipeline"]["command"] and "--max-steps" in info["pipeline"]["command"]
    assert info["pipeline"]["minutes"] <= 75  # the training budget on this machine class
    with pytest.raises(ValueError, match="model must be 'unet' or 'sd3'"):
        shipped.training_info("sdxl")


def test_shipped_sd3_loads_offline_and_runs_on_the_math_attention():
    pipe = StableDiffusion3Pipeline.from_pretrained(shipped.sd3_pipeline_folder(), text_encoder_3=None,
                                                    tokenizer_3=None)
    assert pipe.transformer.config.num_layers == 6 and pipe.vae_scale_factor == 2
    assert type(pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    loaded = shipped.load_sd3_pipeline()
    if not hasattr(paddle.nn.functional, "scaled_dot_product_attention_"):  # a CPU: the math path is put on
        assert all(type(p) is JointMathAttnProcessor for p in loaded.transformer.attn_processors.values())


def _generate(pipe, prompts):
    return generate(pipe, prompts, STEPS, shipped.SD3_DEMO_GUIDANCE)


@pytest.fixture(scope="module")
def fixed():
    return held_out(FIXED_PROMPTS)


def test_trained_sd3_draws_the_background_the_caption_names(fixed):
    prompts, targets, model = fixed
    mean, scores = mean_accuracy(model, _generate(shipped.load_sd3_pipeline(), prompts), targets)
    assert scores["background"] >= BACKGROUND_THRESHOLD and mean >= ACCURACY_THRESHOLD, scores


def test_random_sd3_weights_do_not_reach_the_thresholds(fixed):
    prompts, targets, model = fixed
    half = FIXED_PROMPTS // 2
    pipe = sd3.build_sd3_pipeline(seed=1)
    mean, scores = mean_accuracy(model, _generate(pipe, prompts[:half]), {h: t[:half] for h, t in targets.items()})
    assert scores["background"] < BACKGROUND_THRESHOLD and mean < ACCURACY_THRESHOLD, scores


def test_tome_on_the_trained_sd3_merges_and_still_draws_the_background(fixed):
    import ppdiffusers_tome

    prompts, targets, model = fixed
    pipe = shipped.load_sd3_pipeline()
    pipe.apply_tome(ratio=0.5)
    mean, scores = mean_accuracy(model, _generate(pipe, prompts), targets)
    assert ppdiffusers_tome.tome_stats(pipe)["transformer"]["merges"] > 0
    assert scores["background"] >= BACKGROUND_THRESHOLD, scores
