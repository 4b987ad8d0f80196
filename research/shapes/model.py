"""The tiny text-to-image pipeline for the shapes dataset, built from ppdiffusers' own classes with random weights.

Layout (why it trains fastest on two CPU cores while keeping what matters to ToMe):

* **64x64 images, an ``AutoencoderKL`` with one downsampling (scale factor 2) and 4 latent channels** → 32x32
  latents, so the UNet's finest transformer level holds 32 x 32 = 1024 tokens (the issue's minimum). A pixel-space
  "identity-ish" VAE would need 32x32 images for the same token count (too small for a person to judge) or 4096
  tokens at 64x64 (4x the attention cost and 16x its memory). The 2x VAE is cheap (two levels of 16/32 channels)
  and learns to reconstruct flat shapes within minutes; its latents also compress the image 3x.
* **UNet2DConditionModel** with three levels (32, 64, 64 channels): transformer blocks at 32x32 (1024 tokens) and
  16x16, a plain ResNet level at 8x8, a cross-attention mid block; heads of 32 channels (1 head at 32x32, 2 below);
  one ResNet per level. This mirrors SD 1.x (attention at the full latent resolution, where ToMe merges) at 1/10
  of its width (32 channels against 320) and 1/580 of its parameters.
* **A 2-layer CLIP text encoder** (width 64) and a **CLIP tokenizer with a word-level vocabulary**: the byte-level
  vocabulary of :mod:`ppdiffusers_tome.presets` plus BPE merges that make every dataset word one token (any other
  text still tokenizes, byte by byte). Whole-word tokens spare the tiny encoder from learning spelling, and a
  caption fits in :data:`MAX_LENGTH` = 20 tokens (the longest caption has 16 with its two special tokens).
* **DDIM** for sampling, with SD's scaled-linear betas rescaled to zero terminal SNR, v-prediction and trailing
  timesteps (:data:`SCHEDULER_CONFIG` says why); training adds noise with the same betas.

Parameters: 1.77 M in all (UNet 1.49 M, VAE 0.17 M, text encoder 0.11 M), 7.1 MB in float32; a saved folder takes
6.9 MB on disk (:func:`count_parameters`).

Everything is offline: the tokenizer files are written on the fly, and :func:`build_pipeline` + ``save_pretrained``
make a folder that ``StableDiffusionPipeline.from_pretrained`` and :func:`ppdiffusers_tome.presets.load_local_pipeline`
load without a network.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from typing import Any, Dict, Iterable, List, Tuple

from ppdiffusers_tome.tools.pipelines import _NO_SAFETY_CHECKER
from ppdiffusers_tome.tools.tiny import _byte_symbols, _libs, tiny_text_encoder
from .dataset import VOCABULARY

__all__ = [
    "MAX_LENGTH",
    "IMAGE_SIZE",
    "UNET_CONFIG",
    "VAE_CONFIG",
    "TEXT_CONFIG",
    "word_merges",
    "write_word_tokenizer_files",
    "build_tokenizer",
    "build_text_encoder",
    "build_unet",
    "build_vae",
    "SCHEDULER_CONFIG",
    "build_scheduler",
    "build_pipeline",
    "count_parameters",
]

MAX_LENGTH = 20
IMAGE_SIZE = 64

UNET_CONFIG: Dict[str, Any] = {
    "sample_size": IMAGE_SIZE // 2,
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    "block_out_channels": [32, 64, 64],
    "layers_per_block": 1,
    # ppdiffusers (like diffusers) reads this as the number of heads per level for SD-style UNets: 1 head of 32
    # channels at the 1024-token level (its attention matrices are most of a training step: 2 heads there cost
    # 1.66 s per step of 8 images instead of 1.01 s on one core), 2 heads of 32 below
    "attention_head_dim": [1, 2, 2],
    "cross_attention_dim": 64,
    "norm_num_groups": 8,
}

VAE_CONFIG: Dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D"],
    "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D"],
    "block_out_channels": [16, 32],
    "layers_per_block": 1,
    "latent_channels": 4,
    "norm_num_groups": 8,
    "sample_size": IMAGE_SIZE,
}

TEXT_CONFIG: Dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}

_SPECIAL = ["<|startoftext|>", "<|endoftext|>"]


def _apply_bpe(word: Tuple[str, ...], ranks: Dict[Tuple[str, str], int]) -> Tuple[str, ...]:
    """CLIP's BPE loop (as ``CLIPTokenizer.bpe``) on the symbols ``word`` with merge ``ranks``."""
    while len(word) > 1:
        pairs = {(word[i], word[i + 1]) for i in range(len(word) - 1)}
        best = min(pairs, key=lambda pair: ranks.get(pair, float("inf")))
        if best not in ranks:
            break
        merged, i = [], 0
        while i < len(word):
            if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                merged.append(word[i] + word[i + 1])
                i += 2
            else:
                merged.append(word[i])
                i += 1
        word = tuple(merged)
    return word


def word_merges(words: Iterable[str]) -> List[Tuple[str, str]]:
    """BPE merges under which every one of ``words`` (lowercase ASCII) becomes a single token ``word</w>``.

    Each word is run through the merges so far; while it is in several pieces, its first two pieces become a new
    merge and it is run again (the piece count drops each time). A new merge ranks after all earlier ones, so it
    acts only where no earlier merge applies: the words made single tokens before reach that token by earlier merges
    alone, and every word ends as one token."""
    merges: List[Tuple[str, str]] = []
    ranks: Dict[Tuple[str, str], int] = {}
    for word in words:
        if not word or not word.isascii() or word != word.lower() or " " in word:
            raise ValueError(f"words must be non-empty lowercase ASCII without spaces; got {word!r}")
        symbols = tuple(word[:-1]) + (word[-1] + "</w>",)
        pieces = _apply_bpe(symbols, ranks)
        while len(pieces) > 1:  # no known pair is left: the first two pieces become a new, last-ranked merge
            pair = (pieces[0], pieces[1])
            ranks[pair] = len(merges)
            merges.append(pair)
            pieces = _apply_bpe(symbols, ranks)  # (the new merge may also join a repeat of the pair further on)
    return merges


def write_word_tokenizer_files(folder: str, words: Iterable[str] = VOCABULARY) -> Dict[str, str]:
    """Write a CLIP ``vocab.json`` and ``merges.txt`` into ``folder``: the byte-level vocabulary of the presets
    plus one token per word of ``words`` (and the tokens on the way to it), specials last. Returns the paths."""
    symbols = _byte_symbols()
    merges = word_merges(words)
    vocab: Dict[str, int] = {}
    for token in symbols + [s + "</w>" for s in symbols] + [a + b for a, b in merges] + _SPECIAL:
        vocab.setdefault(token, len(vocab))
    paths = {"vocab_file": os.path.join(folder, "vocab.json"), "merges_file": os.path.join(folder, "merges.txt")}
    with open(paths["vocab_file"], "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(paths["merges_file"], "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return paths


_tokenizer_files_written: Dict[str, str] = {}


def _tokenizer_files() -> Dict[str, str]:
    """The word tokenizer's files, written once per process into a temporary folder removed at exit (as the
    presets' tokenizer does: a tokenizer copies its files again in ``save_pretrained``)."""
    if not _tokenizer_files_written:
        folder = tempfile.mkdtemp(prefix="ppdiffusers_tome_shapes_tokenizer_")
        atexit.register(shutil.rmtree, folder, True)
        _tokenizer_files_written.update(write_word_tokenizer_files(folder))
    return dict(_tokenizer_files_written)


def build_tokenizer(max_length: int = MAX_LENGTH):
    """An offline ``CLIPTokenizer`` whose vocabulary holds every dataset word as one token; pads to ``max_length``."""
    _, _, transformers = _libs()
    return transformers.CLIPTokenizer(**_tokenizer_files(), max_len=max_length, model_max_length=max_length)


def build_text_encoder(vocab_size: int, seed: int = 0, projection: bool = False):
    """A 2-layer ``CLIPTextModel`` (:data:`TEXT_CONFIG`; ``CLIPTextModelWithProjection`` with ``projection``, as
    SD3's encoders) with random weights drawn from ``seed``."""
    return tiny_text_encoder(vocab_size, max_length=MAX_LENGTH, projection=projection, seed=seed, **TEXT_CONFIG)


def build_unet(seed: int = 0):
    """The ``UNet2DConditionModel`` of :data:`UNET_CONFIG` with random weights drawn from ``seed``."""
    paddle, ppdiffusers, _ = _libs()
    paddle.seed(seed)
    return ppdiffusers.UNet2DConditionModel(**UNET_CONFIG)


def build_vae(seed: int = 0):
    """The ``AutoencoderKL`` of :data:`VAE_CONFIG` (scale factor 2) with random weights drawn from ``seed``."""
    paddle, ppdiffusers, _ = _libs()
    paddle.seed(seed)
    return ppdiffusers.AutoencoderKL(**VAE_CONFIG)


# SD's scaled-linear betas, rescaled to zero terminal SNR, with v-prediction and "trailing" timesteps (Lin et al.,
# "Common Diffusion Noise Schedules and Sample Steps are Flawed", 2023). Why not SD's own schedule: at t = 999 it
# keeps 6.8% of the image, and on these flat-coloured images the noisy latent's per-channel mean (the background's
# colour, averaged over 1,024 positions) survives that noise. A model trained on it reads the background from the
# noisy input instead of the caption, and sampling from pure noise, where that signal is random, gave wrong
# backgrounds and noisy images (a 400-step run with SD's schedule). With zero terminal SNR the last step holds no
# image at all, so the caption is the only source; eps-prediction is undefined there, hence v-prediction.
SCHEDULER_CONFIG: Dict[str, Any] = {
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "num_train_timesteps": 1000,
    "clip_sample": False,
    "set_alpha_to_one": False,
    "steps_offset": 1,  # (used by "leading" spacing only; 1 keeps the pipeline from warning about an old config)
    "prediction_type": "v_prediction",
    "rescale_betas_zero_snr": True,
    "timestep_spacing": "trailing",
}


def build_scheduler():
    """The ``DDIMScheduler`` of :data:`SCHEDULER_CONFIG` (training noises with the same betas)."""
    _, ppdiffusers, _ = _libs()
    return ppdiffusers.DDIMScheduler(**SCHEDULER_CONFIG)


def build_pipeline(seed: int = 0):
    """A ``StableDiffusionPipeline`` of the shapes layout with random weights (UNet from ``seed``, VAE from
    ``seed + 1``, text encoder from ``seed + 2``), models in eval mode, progress bar off, no safety checker.

    >>> pipe = build_pipeline()
    >>> pipe.vae_scale_factor, pipe.unet.config.sample_size
    (2, 32)
    """
    _, ppdiffusers, _ = _libs()
    tokenizer = build_tokenizer()
    pipe = ppdiffusers.StableDiffusionPipeline(
        vae=build_vae(seed + 1),
        text_encoder=build_text_encoder(len(tokenizer.get_vocab()), seed + 2),
        tokenizer=tokenizer,
        unet=build_unet(seed),
        scheduler=build_scheduler(),
        **_NO_SAFETY_CHECKER,
    )
    for model in (pipe.unet, pipe.vae, pipe.text_encoder):
        model.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def count_parameters(pipe) -> Dict[str, int]:
    """Parameters per model of ``pipe`` (``unet``, ``vae``, ``text_encoder``) and their ``total``."""
    counts = {name: int(sum(int(p.numel()) for p in getattr(pipe, name).parameters()))
              for name in ("unet", "vae", "text_encoder")}
    counts["total"] = sum(counts.values())
    return counts
