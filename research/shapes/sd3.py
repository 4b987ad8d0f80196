"""The shapes task on Stable Diffusion 3's MMDiT: a tiny ``StableDiffusion3Pipeline`` and its flow-matching trainer.

    python -m research.shapes.sd3 --minutes 75 --threads 2 --max-steps 5400 --images 8192 --output shapes-sd3

Parts, all ppdiffusers' own classes:

* **The VAE of the shipped shapes UNet pipeline**, frozen (same latents: 4 channels at 32 x 32 for a 64 x 64 image,
  the same ``scaling_factor``; SD3's pipeline also reads a ``shift_factor``, set to 0).
* **An ``SD3Transformer2DModel``** (:data:`TRANSFORMER_CONFIG`): 6 joint blocks (the last ``context_pre_only``, as
  SD3), width 96 (2 heads of 48), patch 2, so a 64 x 64 image is 16 x 16 = 256 image tokens; 2.0 M parameters.
  Sized for the CPU: a training step of 8 images takes about 0.7 s on 2 cores on kept latents, 1.2 s when each
  image also goes through the VAE's encoder.
* **Two CLIP text encoders with projection** (the UNet model's encoder, :data:`research.shapes.model.TEXT_CONFIG`: 2
  layers, width 64, here with its projection) sharing the UNet model's
  word-level tokenizer (:func:`research.shapes.model.build_tokenizer`), and no T5 (``text_encoder_3=None``: the
  pipeline puts zero tokens in its place). The text stream is 20 CLIP tokens (both encoders' penultimate states side
  by side, 128 channels = ``joint_attention_dim``) plus 20 zero tokens; the pooled input is the two projections.
* **``FlowMatchEulerDiscreteScheduler(shift=3.0)``**, SD3's sampler and shift.

Training is SD3's rectified flow: ``x_t = (1 - s) x_0 + s noise`` with ``s`` drawn logit-normal (``sigmoid`` of a
standard normal) and then shifted as the scheduler shifts its sigmas (``3 s / (1 + 2 s)``), so training sees the
noise levels sampling visits; the transformer, given ``t = 1000 s``, predicts ``noise - x_0`` (mean squared error).
The transformer and both text encoders are trained jointly (10 % of the captions replaced by the empty prompt, for
classifier-free guidance); an exponential moving average of the transformer is what is saved. Seeding, the time
budget, ``--max-steps``, ``--lr-decay`` and the periodic saves follow :mod:`research.shapes.train` (its docstring
says how to reproduce shipped weights); the output folder gets the pipeline and ``train_log.json``. ``--images N``
trains on the dataset's first ``N`` images, each encoded once and its latent kept (the first epoch in order, later
ones shuffled): the encoder is a third of a step, so 73 minutes buy 5,400 steps where a stream of fresh images
gets about 3,600. ``--init-from`` continues from a folder this trainer wrote (its saved weights, a fresh optimizer
and average; a stream goes on with the images after the ones that run saw, kept images stay the same). The shipped
weights are the command above: one run of 5,400 steps in 73 minutes, 8,192 images, the rate decayed along a cosine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from typing import Any, Callable, Dict, Optional, Sequence

import numpy as np

from . import dataset
from .model import build_text_encoder, build_tokenizer
from .train import CAPTION_DROPOUT, _Ema, _save, _short, learning_rate_factor, write_preview

logger = logging.getLogger(__name__)

__all__ = ["TRANSFORMER_CONFIG", "SHIFT", "build_sd3_pipeline", "load_shapes_vae", "sample_sigmas",
           "flow_loss", "SD3TrainConfig", "train_sd3", "main"]

TRANSFORMER_CONFIG: Dict[str, Any] = {
    "sample_size": 32,
    "patch_size": 2,
    "in_channels": 4,
    "out_channels": 4,
    "num_layers": 6,
    "num_attention_heads": 2,
    "attention_head_dim": 48,
    "joint_attention_dim": 128,  # the two encoders' 64 channels side by side (no padding, as no T5 is wider)
    "caption_projection_dim": 96,
    "pooled_projection_dim": 128,
    "pos_embed_max_size": 16,
}
SHIFT = 3.0


def load_shapes_vae(folder: str = ""):
    """The trained VAE of the shipped shapes pipeline (or of ``folder``), frozen, with ``shift_factor=0``."""
    from ppdiffusers import AutoencoderKL

    from ppdiffusers_tome.tools.shapes import pipeline_folder

    vae = AutoencoderKL.from_pretrained(folder or pipeline_folder(), subfolder="vae")
    vae.register_to_config(shift_factor=0.0)
    vae.eval()
    for param in vae.parameters():
        param.stop_gradient = True
    return vae


def build_sd3_pipeline(vae=None, seed: int = 0):
    """A ``StableDiffusion3Pipeline`` of this layout with random weights (transformer from ``seed``, text encoders
    from ``seed + 2`` and ``seed + 3``) on ``vae`` (default :func:`load_shapes_vae`), models in eval mode, the
    joint attention on :func:`ppdiffusers_tome.sd3_attention.use_math_attention` (CPUs run it), progress bar off.

    >>> pipe = build_sd3_pipeline()
    >>> len(pipe.transformer.transformer_blocks), pipe.text_encoder_3 is None
    (6, True)
    """
    import paddle
    from ppdiffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    from ppdiffusers_tome.sd3_attention import use_math_attention

    tokenizer = build_tokenizer()
    vocab = len(tokenizer.get_vocab())
    paddle.seed(seed)
    transformer = SD3Transformer2DModel(**TRANSFORMER_CONFIG)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, vae=vae if vae is not None else load_shapes_vae(),
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SHIFT),
        text_encoder=build_text_encoder(vocab, seed + 2, projection=True), tokenizer=tokenizer,
        text_encoder_2=build_text_encoder(vocab, seed + 3, projection=True), tokenizer_2=tokenizer,
        text_encoder_3=None, tokenizer_3=None)
    use_math_attention(pipe)
    for model in (pipe.transformer, pipe.text_encoder, pipe.text_encoder_2):
        model.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def sample_sigmas(rng: np.random.Generator, count: int, shift: float = SHIFT) -> np.ndarray:
    """``count`` noise levels: ``sigmoid`` of a standard normal (SD3's logit-normal), shifted as the scheduler
    shifts its sigmas, ``shift s / (1 + (shift - 1) s)``.

    >>> levels = sample_sigmas(np.random.default_rng(0), 1000)
    >>> bool(levels.min() > 0 and levels.max() < 1), round(float(np.median(levels)), 2)  # the shifted median: 0.75
    (True, 0.74)
    """
    s = 1.0 / (1.0 + np.exp(-rng.standard_normal(count)))
    return (shift * s / (1.0 + (shift - 1.0) * s)).astype(np.float32)


def flow_loss(pipe, latents, captions: Sequence[str], noise, sigmas):
    """The rectified-flow loss: the transformer's prediction at ``(1 - s) latents + s noise`` (timestep ``1000 s``)
    against ``noise - latents``, mean squared error; the prompts go through the pipeline's own ``encode_prompt``."""
    import paddle

    embeds, _, pooled, _ = pipe.encode_prompt(prompt=list(captions), prompt_2=list(captions),
                                              prompt_3=list(captions), do_classifier_free_guidance=False)
    sigma = paddle.to_tensor(sigmas)
    s = sigma.reshape([-1, 1, 1, 1])
    noisy = (1.0 - s) * latents + s * noise
    prediction = pipe.transformer(hidden_states=noisy, timestep=sigma * 1000.0, encoder_hidden_states=embeds,
                                  pooled_projections=pooled).sample
    return ((prediction - (noise - latents)) ** 2).mean()


class SD3TrainConfig:
    """The settings of a run (see :func:`train_sd3`); ``as_dict`` is written into the log."""

    def __init__(self, minutes: float = 60.0, seed: int = 0, batch_size: int = 8, lr: float = 5e-4,
                 max_steps: Optional[int] = None, threads: Optional[int] = None, save_every_minutes: float = 5.0,
                 lr_decay: str = "auto", init_from: str = "", images: int = 0) -> None:
        if not minutes > 0:
            raise ValueError(f"minutes must be > 0; got {minutes}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1; got {batch_size}")
        if not lr > 0:
            raise ValueError(f"lr must be > 0; got {lr}")
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be >= 1; got {max_steps}")
        if isinstance(images, bool) or not isinstance(images, int) or images < 0:
            raise ValueError(f"images must be an int >= 0 (0: a fresh image every draw); got {images!r}")
        if lr_decay not in ("auto", "cosine", "none"):
            raise ValueError(f"lr_decay must be 'auto', 'cosine' or 'none'; got {lr_decay!r}")
        self.minutes, self.seed, self.batch_size, self.lr = float(minutes), int(seed), int(batch_size), float(lr)
        self.max_steps, self.threads, self.save_every_minutes = max_steps, threads, float(save_every_minutes)
        self.lr_decay, self.images = lr_decay, images
        if init_from and not os.path.isfile(os.path.join(init_from, "train_log.json")):
            raise ValueError(f"init_from must be a folder this trainer wrote (with train_log.json); got {init_from!r}")
        self.init_from = init_from

    def as_dict(self) -> Dict[str, Any]:
        return dict(vars(self))


class _Latents:
    """The training stream: with ``count == 0`` dataset images ``first, first + 1, ...`` each encoded when drawn;
    with ``count > 0`` the images ``[first, first + count)``, each encoded once (the VAE's encoder is a third of a
    step) and its latent kept: the first epoch in order, later epochs in a random order drawn from ``rng``."""

    def __init__(self, pipe, first: int, count: int, seed: int, rng: np.random.Generator) -> None:
        self.pipe, self.first, self.count, self.seed, self.rng = pipe, first, count, seed, rng
        self.scaling = float(pipe.vae.config.scaling_factor)
        self.drawn = 0
        self.order: list = []
        self.kept: Dict[int, Any] = {}

    def _encode(self, indices: Sequence[int]):
        import paddle

        images, captions, _ = dataset.batch(indices, seed=self.seed)
        with paddle.no_grad():
            return self.pipe.vae.encode(paddle.to_tensor(images)).latent_dist.mean * self.scaling, captions

    def _next_indices(self, size: int) -> list:
        if not self.count:
            start = self.first + self.drawn
            self.drawn += size
            return list(range(start, start + size))
        while len(self.order) < size:
            epoch = (self.drawn + len(self.order)) // self.count
            positions = np.arange(self.count) if epoch == 0 else self.rng.permutation(self.count)
            self.order.extend(int(self.first + k) for k in positions)
        self.drawn += size
        taken, self.order = self.order[:size], self.order[size:]
        return taken

    def batch(self, size: int):
        """``size`` latents ``[size, 4, 32, 32]`` (scaled) and their captions."""
        import paddle

        indices = self._next_indices(size)
        if not self.count:
            return self._encode(indices)
        missing = [k for k in dict.fromkeys(indices) if k not in self.kept]
        if missing:
            latents, captions = self._encode(missing)
            for k, latent, caption in zip(missing, latents, captions):
                self.kept[k] = (latent, caption)
        return paddle.stack([self.kept[k][0] for k in indices]), [self.kept[k][1] for k in indices]


def _set_mode(pipe, training: bool) -> None:
    for model in (pipe.transformer, pipe.text_encoder, pipe.text_encoder_2):
        model.train() if training else model.eval()


def train_sd3(output: str, config: Optional[SD3TrainConfig] = None,
              clock: Callable[[], float] = time.monotonic) -> Dict[str, Any]:
    """Train the SD3 shapes pipeline with ``config`` and save it with its log into ``output``; returns the log
    (``settings``, ``parameters``, ``scaling_factor``, ``steps``: one ``{"step", "loss", "seconds"}`` per step)."""
    import paddle

    from ppdiffusers_tome.tools.measure import set_threads

    config = config or SD3TrainConfig()
    start = clock()
    threads = set_threads(config.threads)
    paddle.seed(config.seed)
    rng = np.random.default_rng(config.seed)
    os.makedirs(output, exist_ok=True)
    pipe = build_sd3_pipeline(seed=config.seed)
    models = {"transformer": pipe.transformer, "text_encoder": pipe.text_encoder,
              "text_encoder_2": pipe.text_encoder_2}
    first_index = 0  # the dataset index of the first image: a continued run goes on where its start stopped
    if config.init_from:
        from ppdiffusers_tome.presets import load_local_pipeline

        start_pipe = load_local_pipeline(config.init_from)
        for name, model in models.items():
            model.set_state_dict(getattr(start_pipe, name).state_dict())
        with open(os.path.join(config.init_from, "train_log.json"), encoding="utf-8") as f:
            start_log = json.load(f)
        first_index = start_log.get("first_index", 0)
        if not start_log["settings"].get("images"):  # a stream goes on after the images its start saw
            first_index += len(start_log["steps"]) * start_log["settings"]["batch_size"]
    stream = _Latents(pipe, first_index, config.images, config.seed, rng)
    log: Dict[str, Any] = {"settings": dict(config.as_dict(), threads=threads), "scaling_factor": stream.scaling,
                           "first_index": first_index,
                           "parameters": {k: int(sum(int(p.numel()) for p in m.parameters()))
                                          for k, m in models.items()}, "steps": []}
    parameters = [p for m in models.values() for p in m.parameters()]
    decay_total = config.max_steps if config.lr_decay != "none" else None
    schedule = paddle.optimizer.lr.LambdaDecay(config.lr, lambda k: learning_rate_factor(k, decay_total))
    optimizer = paddle.optimizer.AdamW(learning_rate=schedule, parameters=parameters, weight_decay=1e-2,
                                       grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    ema = _Ema(pipe.transformer)
    _set_mode(pipe, True)
    end, last_save, step, step_seconds = start + config.minutes * 60.0, clock(), 0, 0.0
    while (config.max_steps is None or step < config.max_steps) and clock() + step_seconds <= end:
        began = clock()
        latents, captions = stream.batch(config.batch_size)
        captions = ["" if rng.random() < CAPTION_DROPOUT else c for c in captions]
        noise = paddle.randn(latents.shape, dtype=latents.dtype)
        loss = flow_loss(pipe, latents, captions, noise, sample_sigmas(rng, len(captions)))
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        schedule.step()
        ema.update()
        step_seconds = clock() - began
        log["steps"].append({"step": step, "loss": _short(loss), "seconds": round(clock() - start, 2)})
        if step % 50 == 0:
            logger.info("step %d: loss %.4f (%.2f s/step)", step, float(loss), step_seconds)
        step += 1
        if clock() - last_save > config.save_every_minutes * 60.0:
            _set_mode(pipe, False)
            _save(pipe, output, log, ema)
            _set_mode(pipe, True)
            last_save = clock()
    _set_mode(pipe, False)
    log["seconds"] = round(clock() - start, 3)
    _save(pipe, output, log, ema)
    return log


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m research.shapes.sd3",
                                     description="Train the tiny SD3 shapes pipeline within a time budget.")
    parser.add_argument("--minutes", type=float, default=60.0, help="time budget in minutes (default 60)")
    parser.add_argument("--output", required=True, help="folder for the pipeline and train_log.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-4, help="peak learning rate (default 5e-4)")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--lr-decay", choices=("auto", "cosine", "none"), default="auto",
                        help="auto: cosine to 10%% with --max-steps, constant with a time budget only")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    parser.add_argument("--save-every", type=float, default=5.0, help="minutes between saves (default 5)")
    parser.add_argument("--init-from", default="",
                        help="start from the weights of a folder this trainer wrote (its EMA), on the images after its")
    parser.add_argument("--images", type=int, default=0,
                        help="train on this many dataset images, each encoded once and reused every epoch "
                             "(default 0: a fresh image every draw)")
    parser.add_argument("--preview", default="", help="also write a preview picture (PNG) here")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m research.shapes.sd3``."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        config = SD3TrainConfig(minutes=args.minutes, seed=args.seed, batch_size=args.batch_size, lr=args.lr,
                                max_steps=args.max_steps, threads=args.threads, save_every_minutes=args.save_every,
                                lr_decay=args.lr_decay, init_from=args.init_from, images=args.images)
    except ValueError as error:
        _parser().error(str(error))
    log = train_sd3(args.output, config)
    if args.preview:
        from ppdiffusers_tome.presets import load_local_pipeline

        write_preview(load_local_pipeline(args.output), args.preview)
    logger.info("saved %s: %d steps in %.0f s, last loss %s", args.output, len(log["steps"]), log["seconds"],
                log["steps"][-1]["loss"] if log["steps"] else "n/a")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
