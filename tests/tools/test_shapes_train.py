"""The shapes training script (ppdiffusers_tome/shapes/train.py): its losses fall when fitted on a fixed batch, a
smoke run through the command line writes a loadable pipeline folder and its log, the time budget stops a run, and
bad settings are refused by name."""

import json
import os

import numpy as np
import paddle
import pytest
from ppdiffusers import StableDiffusionPipeline

from research.shapes import dataset, train
from research.shapes.model import build_pipeline
from research.shapes.train import TrainConfig, diffusion_loss, encode_prompts, vae_loss


def fit(loss_fn, parameters, steps, lr):
    optimizer = paddle.optimizer.AdamW(learning_rate=lr, parameters=parameters, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        loss = loss_fn()
        losses.append(float(loss))
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
    return losses


def test_diffusion_loss_falls_on_a_fixed_batch():
    paddle.seed(0)
    pipe = build_pipeline(seed=0)
    images, captions, _ = dataset.batch(range(2), seed=0)
    with paddle.no_grad():
        latents = pipe.vae.encode(paddle.to_tensor(images)).latent_dist.mean
    noise = paddle.randn(latents.shape)
    timesteps = paddle.to_tensor([100, 700], dtype="int64")
    ids = encode_prompts(pipe, captions)
    assert ids.shape == [2, 20]
    scheduler = train._noise_scheduler(pipe)
    pipe.unet.train()
    losses = fit(lambda: diffusion_loss(pipe.unet, pipe.text_encoder, scheduler, latents, ids, noise, timesteps),
                 list(pipe.unet.parameters()) + list(pipe.text_encoder.parameters()), steps=8, lr=2e-3)
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.7 * losses[0], losses


def test_vae_loss_falls_on_a_fixed_batch():
    paddle.seed(0)
    vae = build_pipeline(seed=0).vae
    vae.train()
    images = paddle.to_tensor(dataset.batch(range(2), seed=0)[0])
    losses = fit(lambda: vae_loss(vae, images)[0], vae.parameters(), steps=8, lr=2e-3)
    assert losses[-1] < 0.7 * losses[0], losses


def test_smoke_run_writes_a_loadable_pipeline_and_its_log(tmp_path):
    out = tmp_path / "model"
    code = train.main(["--minutes", "1", "--output", str(out), "--max-steps", "4", "--vae-steps", "2",
                       "--batch-size", "2", "--threads", "1"])
    assert code == 0
    with open(out / "train_log.json", encoding="utf-8") as f:
        log = json.load(f)
    assert [(s["phase"], s["step"]) for s in log["steps"]] == [("vae", 0), ("vae", 1), ("unet", 0), ("unet", 1)]
    assert all(np.isfinite(s["loss"]) for s in log["steps"])
    assert log["settings"]["batch_size"] == 2 and log["settings"]["threads"] == 1
    assert log["parameters"]["total"] * 4 <= 10 * 1024**2
    with open(out / "vae" / "config.json", encoding="utf-8") as f:
        assert json.load(f)["scaling_factor"] == pytest.approx(log["scaling_factor"])
    size = sum(path.stat().st_size for path in out.rglob("*") if path.is_file())
    assert size <= 10 * 1024**2, size  # the folder as it would ship, log included
    pipe = StableDiffusionPipeline.from_pretrained(str(out))
    pipe.set_progress_bar_config(disable=True)
    image = pipe("a small red star at the top left on a blue background", num_inference_steps=1, height=64,
                 width=64, generator=paddle.Generator().manual_seed(0), output_type="np").images
    assert image.shape == (1, 64, 64, 3) and np.isfinite(image).all()


def test_the_reproduction_command_gives_the_same_weights_twice(tmp_path):
    """What training.json promises: fixed step counts (and --lr-decay none, as a time-budgeted run has) make a run
    repeatable on the same thread count."""
    from safetensors.numpy import load_file

    weights = []
    for name in ("a", "b"):
        out = tmp_path / name
        assert train.main(["--minutes", "2", "--output", str(out), "--max-steps", "4", "--vae-steps", "2",
                           "--batch-size", "2", "--threads", "1", "--lr-decay", "none"]) == 0
        weights.append(load_file(str(out / "unet" / "diffusion_paddle_model.safetensors")))
        with open(out / "train_log.json", encoding="utf-8") as f:
            assert json.load(f)["settings"]["lr_decay"] == "none"
    assert weights[0].keys() == weights[1].keys()
    for key in weights[0]:
        np.testing.assert_array_equal(weights[0][key], weights[1][key], err_msg=key)


def test_lr_decay_option_is_validated_by_name():
    with pytest.raises(ValueError, match="lr_decay must be 'auto', 'cosine' or 'none'"):
        TrainConfig(lr_decay="linear")
    with pytest.raises(ValueError, match="lr_decay='cosine' needs max_steps"):
        TrainConfig(lr_decay="cosine")


def test_the_time_budget_stops_the_run(tmp_path):
    ticks = iter(np.arange(0.0, 10**6, 7.0))  # every look at the clock moves it 7 s on
    log = train.train(str(tmp_path), TrainConfig(minutes=1.0, batch_size=1, threads=1, vae_fraction=0.25),
                      clock=lambda: float(next(ticks)))
    phases = [s["phase"] for s in log["steps"]]
    assert 0 < phases.count("vae") and 0 < phases.count("unet")
    assert len(phases) < 10  # 60 s of a clock that moves 7 s per look
    assert os.path.isfile(tmp_path / "model_index.json")


@pytest.mark.parametrize("field, value, message", [
    ("minutes", 0, "minutes must be > 0"),
    ("batch_size", 0, "batch_size must be >= 1"),
    ("vae_fraction", 1.0, r"vae_fraction must be in \[0, 1\)"),
    ("max_steps", -1, "max_steps must be >= 0"),
    ("unet_lr", 0.0, "unet_lr must be > 0"),
])
def test_bad_settings_are_refused_by_name(field, value, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{field: value})


def test_command_line_names_a_bad_setting(capsys):
    with pytest.raises(SystemExit):
        train.main(["--output", "x", "--minutes", "-1"])
    assert "minutes must be > 0" in capsys.readouterr().err


def test_learning_rate_warms_up_then_decays_only_with_a_known_step_count():
    factors = [train.learning_rate_factor(k, 1000) for k in range(1000)]
    assert factors[0] == pytest.approx(0.01) and factors[99] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[100:], factors[101:]))  # non-increasing after warm-up
    assert train.learning_rate_factor(999, 1000) == pytest.approx(0.1, abs=1e-3)
    assert train.learning_rate_factor(5000, None) == 1.0  # a time budget: constant


def test_preview_shows_real_images_above_generated_ones():
    pipe = build_pipeline(seed=0)
    picture, captions = train.preview(pipe, count=2, steps=1)
    assert captions == [dataset.sample(i, seed=999)[1] for i in range(2)]
    assert picture.size == (2 * 66 + 2, 2 * 66 + 2)
    top_left = np.asarray(picture)[2:66, 2:66].astype(np.float64)
    np.testing.assert_array_equal(top_left, np.asarray(dataset.sample(0, seed=999)[0], dtype=np.float64))


def _epsilon_scheduler():
    """SD's own schedule (epsilon prediction, non-zero terminal SNR), as a training scheduler."""
    from ppdiffusers import DDPMScheduler

    from ppdiffusers_tome.presets import make_scheduler

    return DDPMScheduler.from_config(make_scheduler("DDIMScheduler").config)


@pytest.mark.parametrize("kind", ["epsilon", "v_prediction"])
def test_min_snr_weights_cap_the_signal_to_noise_ratio_and_weight_the_loss(kind):
    pipe = build_pipeline(seed=0)
    scheduler = train._noise_scheduler(pipe) if kind == "v_prediction" else _epsilon_scheduler()
    assert scheduler.config.prediction_type == kind
    timesteps = paddle.to_tensor([0, 50, 400, 999], dtype="int64")
    assert np.array_equal(train.snr_weights(scheduler, timesteps, None), np.ones(4, np.float32))
    alpha_bar = scheduler.alphas_cumprod.numpy().astype(np.float64)[[0, 50, 400, 999]]
    snr = alpha_bar / np.maximum(1 - alpha_bar, 1e-12)
    weights = train.snr_weights(scheduler, timesteps, 5.0)
    expected = np.minimum(snr, 5.0) / (snr + 1.0 if kind == "v_prediction" else snr)
    np.testing.assert_allclose(weights, expected, rtol=1e-6)
    assert np.all(np.isfinite(weights)) and weights[0] < 0.01  # early (clean) steps are down-weighted
    latents, noise = paddle.randn([4, 4, 32, 32]), paddle.randn([4, 4, 32, 32])
    ids = encode_prompts(pipe, ["a red star"] * 4)
    paddle.seed(1)
    plain = float(diffusion_loss(pipe.unet, pipe.text_encoder, scheduler, latents, ids, noise, timesteps))
    weighted = float(diffusion_loss(pipe.unet, pipe.text_encoder, scheduler, latents, ids, noise, timesteps, 5.0))
    with paddle.no_grad():
        noisy = scheduler.add_noise(latents, noise, timesteps)
        prediction = pipe.unet(noisy, timesteps, encoder_hidden_states=pipe.text_encoder(ids)[0]).sample
    # the target, from the closed form: v = sqrt(alpha_bar) * noise - sqrt(1 - alpha_bar) * x0
    a = paddle.to_tensor(alpha_bar.astype(np.float32)).reshape([4, 1, 1, 1])
    target = a.sqrt() * noise - (1 - a).sqrt() * latents if kind == "v_prediction" else noise
    per_sample = ((prediction - target) ** 2).mean(axis=[1, 2, 3]).numpy()
    assert plain == pytest.approx(float(per_sample.mean()), rel=1e-4)
    assert weighted == pytest.approx(float((per_sample * weights).mean()), rel=1e-4)
    with pytest.raises(ValueError, match="snr_gamma must be > 0"):
        TrainConfig(snr_gamma=0.0)


def test_shapes_scheduler_has_zero_terminal_snr_and_samples_from_the_last_step():
    from research.shapes.model import SCHEDULER_CONFIG, build_scheduler

    scheduler = build_scheduler()
    alpha_bar = scheduler.alphas_cumprod.numpy().astype(np.float64)
    assert alpha_bar[-1] < 1e-6 and alpha_bar[0] > 0.99  # no image left at t = 999; nearly clean at t = 0
    scheduler.set_timesteps(20)
    steps = [int(t) for t in scheduler.timesteps]
    assert steps[0] == 999 and steps == sorted(steps, reverse=True) and len(steps) == 20  # trailing spacing
    assert SCHEDULER_CONFIG["prediction_type"] == "v_prediction"


def test_latent_scale_gives_unit_variance_latents():
    vae = build_pipeline(seed=0).vae
    images = paddle.to_tensor(dataset.batch(range(8), seed=0)[0])
    scale = train.latent_scale(vae, images)
    with paddle.no_grad():
        means = vae.encode(images).latent_dist.mean.numpy().astype(np.float64)
    assert scale > 0 and np.std(means * scale) == pytest.approx(1.0, rel=1e-6)
