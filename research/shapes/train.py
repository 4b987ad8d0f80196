"""Train the shapes pipeline (:mod:`research.shapes.model`) on the synthetic dataset, within a time budget.

    python -m research.shapes.train --minutes 45 --output shapes-model

Two phases, one clock:

1. **VAE** (``--vae-fraction`` of the budget, 15 % by default): the 2x ``AutoencoderKL`` learns to reconstruct the
   images (mean squared error plus a small KL term, as SD's VAE but without its adversarial and perceptual losses).
   The VAE is not kept random or fixed to an analytic map: a random decoder turns every latent into mush, and
   ppdiffusers' ``AutoencoderKL`` ends each half in GroupNorm + SiLU, so no weight setting makes it an identity. The
   images are flat colours and gradients, so a few minutes give sharp reconstructions; after that the VAE is frozen
   and its ``scaling_factor`` is set to ``1 / std`` of the latents of a fixed batch (as SD's 0.18215), so the UNet
   sees unit-variance latents.
2. **UNet and text encoder** (the rest of the budget), jointly: the standard diffusion loss on the VAE posterior's
   mean, with the target the scheduler names (v-prediction with zero terminal SNR for the shapes model:
   :data:`~research.shapes.model.SCHEDULER_CONFIG` says why; epsilon for SD's own schedule), uniform
   timesteps; ``--snr-gamma`` switches on Min-SNR weighting, which converges
   faster in the literature but is untested here at this scale). The text encoder costs almost nothing next to the
   UNet (20 tokens, two layers of width 64) and a random one would leave the words unseparated, so it is trained
   too. 10 % of the captions are replaced by the empty prompt, so that classifier-free guidance (the pipeline's
   default) has an unconditional prediction to push away from. The learning rate warms up over 100 steps and, when
   the number of steps is fixed (``--max-steps``), decays along a cosine to 10 % (:func:`learning_rate_factor`).
   An exponential moving average of the UNet's weights is what gets saved; its decay ramps up as
   ``(1 + k) / (10 + k)`` to at most 0.999, so after the ~1900 UNet steps of a 45-minute run it averages
   roughly the last 200 steps.

Everything is seeded (``--seed``): every step, VAE steps first, takes the next ``batch`` dataset indices (a fresh,
never repeated stream of images drawn from the same seed); the noise and timesteps come from Paddle's and numpy's
generators seeded once. A time budget makes the step count depend on the machine's speed: to reproduce shipped
weights, give ``--max-steps`` and ``--vae-steps`` (with a budget large enough to reach them) and ``--lr-decay none``
(a time-budgeted run keeps its learning rate constant); ``ppdiffusers_tome/shapes/weights/training.json`` has the
command. The same steps see the same images, noise and timesteps; the weights agree to float rounding, which
depends on the thread count.
A run stops at the first step that would end past the budget (the clock includes building the models, not saving).
The output folder gets the pipeline (``save_pretrained``, loadable offline by
``StableDiffusionPipeline.from_pretrained``) and ``train_log.json``: the settings, and the loss of every step with
its phase and elapsed seconds. The pipeline is also saved every ``--save-every`` minutes, so a killed run leaves
its latest weights.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from . import dataset
from .model import MAX_LENGTH, build_pipeline, count_parameters

logger = logging.getLogger(__name__)

__all__ = ["TrainConfig", "train", "diffusion_loss", "snr_weights", "vae_loss", "encode_prompts",
           "learning_rate_factor", "preview", "write_preview", "main"]

CAPTION_DROPOUT = 0.1
KL_WEIGHT = 1e-4
EMA_DECAY = 0.999
WARMUP_STEPS = 100


class TrainConfig:
    """The settings of a run (see :func:`train`); ``as_dict`` is written into the log."""

    def __init__(
        self,
        minutes: float = 45.0,
        seed: int = 0,
        batch_size: int = 8,
        unet_lr: float = 1e-3,
        vae_lr: float = 1e-3,
        vae_fraction: float = 0.15,
        max_steps: Optional[int] = None,
        vae_steps: Optional[int] = None,
        threads: Optional[int] = None,
        save_every_minutes: float = 5.0,
        snr_gamma: Optional[float] = None,
        lr_decay: str = "auto",
    ) -> None:
        if not minutes > 0:
            raise ValueError(f"minutes must be > 0; got {minutes}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1; got {batch_size}")
        if not 0.0 <= vae_fraction < 1.0:
            raise ValueError(f"vae_fraction must be in [0, 1); got {vae_fraction}")
        for name, value in (("max_steps", max_steps), ("vae_steps", vae_steps)):
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0; got {value}")
        for name, value in (("unet_lr", unet_lr), ("vae_lr", vae_lr)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0; got {value}")
        self.minutes = float(minutes)
        self.seed = int(seed)
        self.batch_size = int(batch_size)
        self.unet_lr = float(unet_lr)
        self.vae_lr = float(vae_lr)
        self.vae_fraction = float(vae_fraction)
        self.max_steps = max_steps
        self.vae_steps = vae_steps
        self.threads = threads
        self.save_every_minutes = float(save_every_minutes)
        if snr_gamma is not None and not snr_gamma > 0:
            raise ValueError(f"snr_gamma must be > 0 or None; got {snr_gamma}")
        self.snr_gamma = snr_gamma
        if lr_decay not in ("auto", "cosine", "none"):
            raise ValueError(f"lr_decay must be 'auto', 'cosine' or 'none'; got {lr_decay!r}")
        if lr_decay == "cosine" and max_steps is None:
            raise ValueError("lr_decay='cosine' needs max_steps (the decay ends there)")
        self.lr_decay = lr_decay  # auto: cosine with max_steps, constant with a time budget only

    def as_dict(self) -> Dict[str, Any]:
        return dict(vars(self))


# losses -----------------------------------------------------------------------------------------------------------
def encode_prompts(pipe, captions: Sequence[str]):
    """Token ids ``int64 [N, MAX_LENGTH]`` of ``captions`` with the pipeline's tokenizer (padded, truncated)."""
    import paddle

    ids = pipe.tokenizer(list(captions), padding="max_length", max_length=MAX_LENGTH, truncation=True).input_ids
    return paddle.to_tensor(np.asarray(ids, dtype=np.int64))


def vae_loss(vae, images):
    """Reconstruction MSE of ``images`` (float ``[N, 3, H, W]`` in [-1, 1]) through ``vae`` (a posterior sample)
    plus ``KL_WEIGHT`` x the KL divergence per latent element; returns ``(loss, mse)``."""
    posterior = vae.encode(images).latent_dist
    reconstruction = vae.decode(posterior.sample()).sample
    mse = ((reconstruction - images) ** 2).mean()
    kl = posterior.kl().mean() / float(np.prod(posterior.mean.shape[1:]))
    return mse + KL_WEIGHT * kl, mse


def snr_weights(scheduler, timesteps, gamma: Optional[float]) -> np.ndarray:
    """Per-sample loss weights ``min(SNR, gamma) / SNR`` of Min-SNR weighting (Hang et al. 2023) for ``timesteps``,
    with ``SNR = alpha_bar / (1 - alpha_bar)``; all ones when ``gamma`` is ``None`` (the standard loss)."""
    steps = np.asarray(timesteps.numpy() if hasattr(timesteps, "numpy") else timesteps, dtype=np.int64)
    if gamma is None:
        return np.ones(len(steps), dtype=np.float32)
    if not gamma > 0:
        raise ValueError(f"snr_gamma must be > 0 or None; got {gamma}")
    alpha_bar = np.asarray(scheduler.alphas_cumprod.numpy(), dtype=np.float64)[steps]
    snr = alpha_bar / np.maximum(1.0 - alpha_bar, 1e-12)
    if scheduler.config.prediction_type == "v_prediction":  # the v-loss is the eps-loss times SNR / (SNR + 1)...
        return (np.minimum(snr, gamma) / (snr + 1.0)).astype(np.float32)  # ...finite at zero terminal SNR too
    return (np.minimum(snr, gamma) / snr).astype(np.float32)


def diffusion_loss(unet, text_encoder, scheduler, latents, input_ids, noise, timesteps,
                   snr_gamma: Optional[float] = None):
    """The epsilon-prediction MSE of ``unet`` on ``latents`` noised with ``noise`` at ``timesteps`` (int64 ``[N]``),
    conditioned on ``text_encoder(input_ids)``; with ``snr_gamma``, each sample's error is weighted by
    :func:`snr_weights` (the mean over samples of the weighted per-sample mean)."""
    import paddle

    noisy = scheduler.add_noise(latents, noise, timesteps)
    context = text_encoder(input_ids)[0]
    prediction = unet(noisy, timesteps, encoder_hidden_states=context).sample
    if scheduler.config.prediction_type == "v_prediction":
        target = scheduler.get_velocity(latents, noise, timesteps)
    else:
        target = noise
    per_sample = ((prediction - target) ** 2).mean(axis=[1, 2, 3])
    if snr_gamma is None:
        return per_sample.mean()
    return (per_sample * paddle.to_tensor(snr_weights(scheduler, timesteps, snr_gamma))).mean()


def latent_scale(vae, images) -> float:
    """``1 / std`` of the latent means of ``images`` through ``vae`` (SD's ``scaling_factor`` recipe)."""
    import paddle

    with paddle.no_grad():
        std = float(np.std(vae.encode(images).latent_dist.mean.numpy().astype(np.float64)))
    if not std > 0 or not math.isfinite(std):
        raise RuntimeError(f"the VAE's latents have standard deviation {std}; cannot scale them")
    return 1.0 / std


# training loop ----------------------------------------------------------------------------------------------------
class _Ema:
    """Exponential moving average of a model's float parameters, decay ramping as ``min(EMA_DECAY, (1+k)/(10+k))``."""

    def __init__(self, model) -> None:
        self.params = [p for p in model.parameters() if not p.stop_gradient]
        self.shadow = [p.detach().clone() for p in self.params]
        self.updates = 0

    def update(self) -> None:
        import paddle

        self.updates += 1
        decay = min(EMA_DECAY, (1 + self.updates) / (10 + self.updates))
        with paddle.no_grad():
            for shadow, param in zip(self.shadow, self.params):
                shadow.set_value(shadow * decay + param.detach() * (1.0 - decay))

    def copy_to_model(self) -> List[Any]:
        """Put the averages into the model; returns the current weights (for :meth:`restore`)."""
        saved = [p.detach().clone() for p in self.params]
        for shadow, param in zip(self.shadow, self.params):
            param.set_value(shadow)
        return saved

    def restore(self, saved: List[Any]) -> None:
        for value, param in zip(saved, self.params):
            param.set_value(value)


def _short(value) -> float:
    """A loss for the log: 5 significant digits (the log stays small enough to ship beside the weights)."""
    return float(f"{float(value):.5g}")


def _save(pipe, output: str, log: Dict[str, Any], ema: Optional[_Ema]) -> None:
    saved = ema.copy_to_model() if ema is not None else None
    try:
        pipe.save_pretrained(output)
    finally:
        if saved is not None:
            ema.restore(saved)
    with open(os.path.join(output, "train_log.json"), "w", encoding="utf-8") as f:
        json.dump(log, f, separators=(",", ":"))  # one line: ~60 bytes per step


def train(output: str, config: Optional[TrainConfig] = None,
          clock: Callable[[], float] = time.monotonic) -> Dict[str, Any]:
    """Train the shapes pipeline with ``config`` (default :class:`TrainConfig`) and save it with its log into
    ``output``; returns the log (``settings``, ``parameters``, ``scaling_factor``, ``steps``: one
    ``{"phase", "step", "loss", "seconds"}`` per step, ``seconds``)."""
    import paddle

    from ppdiffusers_tome.tools.measure import set_threads

    config = config or TrainConfig()
    start = clock()
    budget = config.minutes * 60.0
    threads = set_threads(config.threads)
    paddle.seed(config.seed)
    rng = np.random.default_rng(config.seed)
    os.makedirs(output, exist_ok=True)
    pipe = build_pipeline(seed=config.seed)
    log: Dict[str, Any] = {
        "settings": dict(config.as_dict(), threads=threads),
        "parameters": count_parameters(pipe),
        "steps": [],
    }
    batch_size = config.batch_size
    next_index = 0

    def next_batch():
        nonlocal next_index
        images, captions, _ = dataset.batch(range(next_index, next_index + batch_size), seed=config.seed)
        next_index += batch_size
        return paddle.to_tensor(images), captions

    def out_of_steps(seconds_per_step: float, phase_end: float) -> bool:
        """Whether the run must stop: ``max_steps`` reached, or the next step would end after ``phase_end``."""
        if config.max_steps is not None and len(log["steps"]) >= config.max_steps:
            return True
        return clock() + seconds_per_step > phase_end

    # phase 1: the VAE
    vae, unet, text_encoder = pipe.vae, pipe.unet, pipe.text_encoder
    vae.train()
    optimizer = paddle.optimizer.AdamW(learning_rate=config.vae_lr, parameters=vae.parameters(), weight_decay=0.0,
                                       grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    # its share of the budget, or (with vae_steps) a number of steps within the whole budget
    vae_end = start + (budget if config.vae_steps is not None else budget * config.vae_fraction)
    vae_steps = config.vae_steps if config.vae_steps is not None else math.inf
    step, step_seconds = 0, 0.0
    while step < vae_steps and not out_of_steps(step_seconds, vae_end):
        began = clock()
        images, _ = next_batch()
        loss, mse = vae_loss(vae, images)
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        step_seconds = clock() - began
        log["steps"].append({"phase": "vae", "step": step, "loss": _short(loss), "mse": _short(mse),
                             "seconds": round(clock() - start, 2)})
        step += 1
    vae.eval()
    for param in vae.parameters():
        param.stop_gradient = True
    probe, _, _ = dataset.batch(range(10**6, 10**6 + 32), seed=config.seed)  # a fixed batch outside the stream
    scaling = latent_scale(vae, paddle.to_tensor(probe))
    vae.register_to_config(scaling_factor=scaling)
    log["scaling_factor"] = scaling
    logger.info("VAE: %d steps, scaling factor %.4f", step, scaling)

    # phase 2: UNet and text encoder
    unet.train()
    text_encoder.train()
    parameters = list(unet.parameters()) + list(text_encoder.parameters())
    unet_steps = None if config.max_steps is None else max(config.max_steps - len(log["steps"]), 1)
    decay_total = None if config.lr_decay == "none" else unet_steps  # (unet_steps is None without max_steps)
    schedule = paddle.optimizer.lr.LambdaDecay(config.unet_lr, lambda k: learning_rate_factor(k, decay_total))
    optimizer = paddle.optimizer.AdamW(learning_rate=schedule, parameters=parameters, weight_decay=1e-2,
                                       grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    ema = _Ema(unet)
    scheduler = _noise_scheduler(pipe)
    end = start + budget
    last_save = clock()
    step, step_seconds = 0, 0.0
    while not out_of_steps(step_seconds, end):
        began = clock()
        images, captions = next_batch()
        captions = ["" if rng.random() < CAPTION_DROPOUT else c for c in captions]
        with paddle.no_grad():  # the posterior's mean: its sampling noise is not something a caption can predict
            latents = vae.encode(images).latent_dist.mean * scaling
        noise = paddle.randn(latents.shape, dtype=latents.dtype)
        timesteps = paddle.to_tensor(rng.integers(0, scheduler.config.num_train_timesteps, len(captions)),
                                     dtype="int64")
        loss = diffusion_loss(unet, text_encoder, scheduler, latents, encode_prompts(pipe, captions), noise,
                              timesteps, config.snr_gamma)
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        schedule.step()
        ema.update()
        step_seconds = clock() - began
        log["steps"].append({"phase": "unet", "step": step, "loss": _short(loss), "seconds": round(clock() - start, 2)})
        if step % 50 == 0:
            logger.info("step %d: loss %.4f (%.2f s/step)", step, float(loss), step_seconds)
        step += 1
        if clock() - last_save > config.save_every_minutes * 60.0:
            _finish_models(pipe)
            _save(pipe, output, log, ema)
            unet.train()
            text_encoder.train()
            last_save = clock()
    _finish_models(pipe)
    log["seconds"] = round(clock() - start, 3)
    _save(pipe, output, log, ema)
    return log


def preview(pipe, count: int = 8, steps: int = 20, seed: int = 999, guidance_scale: float = 4.0):
    """A picture to judge a trained ``pipe`` by: ``count`` held-out dataset images (dataset seed ``seed``) in the top
    row and, below each, the image ``pipe`` generates from its caption (``steps`` DDIM steps, generator seed = the
    column). Returns ``(PIL image, captions)``."""
    import paddle

    if count < 1 or steps < 1:
        raise ValueError(f"count and steps must be >= 1; got count={count}, steps={steps}")
    real, captions = [], []
    for index in range(count):
        image, caption, _ = dataset.sample(index, seed=seed)
        real.append(image)
        captions.append(caption)
    generated = []
    for column, caption in enumerate(captions):
        array = pipe(caption, num_inference_steps=steps, guidance_scale=guidance_scale, height=real[0].size[1],
                     width=real[0].size[0], generator=paddle.Generator().manual_seed(column),
                     output_type="np").images[0]
        generated.append(dataset.to_image(array * 2.0 - 1.0))
    return dataset.grid(real + generated, columns=count), captions


def write_preview(pipe, path: str) -> None:
    """Save :func:`preview`'s picture of ``pipe``, at twice its size, as a PNG at ``path``; log its captions."""
    picture, captions = preview(pipe)
    picture.resize((picture.width * 2, picture.height * 2), 0).save(path)
    logger.info("preview %s: %s", path, " | ".join(captions))


def learning_rate_factor(step: int, total: Optional[int]) -> float:
    """The UNet's learning rate at ``step`` as a fraction of ``unet_lr``: a linear warm-up over the first
    :data:`WARMUP_STEPS` steps, then constant when the number of steps is not known in advance (a time budget), or a
    cosine decay to 10 % at step ``total`` when it is (``max_steps``: the reproducible way to ship weights).

    >>> [round(learning_rate_factor(k, 1000), 3) for k in (0, 99, 100, 1000)]
    [0.01, 1.0, 1.0, 0.1]
    """
    warm = min(1.0, (step + 1) / WARMUP_STEPS)
    if total is None or total <= WARMUP_STEPS:
        return warm
    progress = min(1.0, max(0.0, (step - WARMUP_STEPS) / (total - WARMUP_STEPS)))
    return warm * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _noise_scheduler(pipe):
    """A ``DDPMScheduler`` with the pipeline scheduler's betas, for ``add_noise`` during training."""
    from ppdiffusers import DDPMScheduler

    return DDPMScheduler.from_config(pipe.scheduler.config)


def _finish_models(pipe) -> None:
    for model in (pipe.unet, pipe.vae, pipe.text_encoder):
        model.eval()


# command line -----------------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m research.shapes.train",
        description="Train the tiny shapes text-to-image pipeline within a time budget and save it to a folder.",
    )
    parser.add_argument("--minutes", type=float, default=45.0, help="time budget in minutes (default 45)")
    parser.add_argument("--output", required=True, help="folder for the pipeline and train_log.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8, help="images per step (default 8)")
    parser.add_argument("--unet-lr", type=float, default=1e-3)
    parser.add_argument("--vae-lr", type=float, default=1e-3)
    parser.add_argument("--vae-fraction", type=float, default=0.15, help="share of the budget for the VAE")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps in all (smoke runs)")
    parser.add_argument("--vae-steps", type=int, default=None, help="VAE steps (default: its share of the budget)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    parser.add_argument("--save-every", type=float, default=5.0, help="minutes between checkpoints (default 5)")
    parser.add_argument("--snr-gamma", type=float, default=None,
                        help="Min-SNR loss weighting with this gamma (e.g. 5); default: the standard unweighted loss")
    parser.add_argument("--lr-decay", choices=["auto", "cosine", "none"], default="auto",
                        help="UNet learning rate after warm-up: cosine to 10%% at --max-steps, or constant (none); "
                             "auto: cosine when --max-steps is given (default auto). The shipped weights come from a "
                             "time budget, so their reproduction gives --lr-decay none with the step counts")
    parser.add_argument("--preview", default=None,
                        help="after training, write a PNG here: held-out images above what the model draws from "
                             "their captions (20 DDIM steps)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m research.shapes.train``."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        config = TrainConfig(
            minutes=args.minutes, seed=args.seed, batch_size=args.batch_size, unet_lr=args.unet_lr,
            vae_lr=args.vae_lr, vae_fraction=args.vae_fraction, max_steps=args.max_steps, vae_steps=args.vae_steps,
            threads=args.threads, save_every_minutes=args.save_every, snr_gamma=args.snr_gamma,
            lr_decay=args.lr_decay,
        )
    except ValueError as error:
        _parser().error(str(error))
    log = train(args.output, config)
    if args.preview:
        from ppdiffusers_tome.presets import load_local_pipeline

        write_preview(load_local_pipeline(args.output), args.preview)
    unet_steps = [s for s in log["steps"] if s["phase"] == "unet"]
    logger.info("saved %s: %d steps in %.0f s, last loss %s", args.output, len(log["steps"]), log["seconds"],
                f"{unet_steps[-1]['loss']:.4f}" if unet_steps else "n/a")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
