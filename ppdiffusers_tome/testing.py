"""Small ppdiffusers pipelines built from configs with random weights, for tests, examples and the offline demo.

Nothing here downloads anything: the CLIP tokenizer is built from a byte-level vocabulary written on the fly, and
every model is created from a config. The layouts keep what matters to ToMe: SD-style pipelines have transformer
blocks at the full latent resolution, the SDXL-style UNet (like the real one) has none at its first level.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from typing import Any, Dict, Optional, Sequence

import paddle

__all__ = [
    "tiny_tokenizer",
    "tiny_text_encoder",
    "tiny_unet",
    "tiny_vae",
    "tiny_controlnet",
    "random_controlnet",
    "tiny_sd_pipeline",
    "tiny_controlnet_pipeline",
    "tiny_sdxl_pipeline",
    "tiny_dit_transformer",
    "tiny_dit_pipeline",
]

TEXT_HIDDEN = 32


def _byte_symbols() -> list:
    """The 256 printable stand-ins that byte-level BPE uses for the bytes 0..255."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def write_tokenizer_files(folder: str) -> Dict[str, str]:
    """Write a minimal CLIP ``vocab.json`` and ``merges.txt`` (bytes, their word-final forms, two special
    tokens, no merges) into ``folder`` and return their paths."""
    symbols = _byte_symbols()
    vocab = {}
    for token in symbols + [s + "</w>" for s in symbols] + ["<|startoftext|>", "<|endoftext|>"]:
        vocab.setdefault(token, len(vocab))
    paths = {"vocab_file": os.path.join(folder, "vocab.json"), "merges_file": os.path.join(folder, "merges.txt")}
    with open(paths["vocab_file"], "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(paths["merges_file"], "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
    return paths


_tokenizer_files_written: Optional[Dict[str, str]] = None


def _tokenizer_files() -> Dict[str, str]:
    """The tokenizer files, written once per process (a tokenizer reads them again in ``save_pretrained``)."""
    global _tokenizer_files_written
    if _tokenizer_files_written is None:
        folder = tempfile.mkdtemp(prefix="ppdiffusers_tome_tokenizer_")
        atexit.register(shutil.rmtree, folder, True)
        _tokenizer_files_written = write_tokenizer_files(folder)
    return _tokenizer_files_written


def tiny_tokenizer(max_length: int = 16):
    """A working offline ``CLIPTokenizer`` (byte-level, 514 tokens) that pads prompts to ``max_length``."""
    from ppdiffusers.transformers import CLIPTokenizer

    return CLIPTokenizer(**_tokenizer_files(), max_len=max_length, model_max_length=max_length)


def tiny_text_encoder(vocab_size: int, max_length: int = 16, projection: bool = False, seed: int = 0, **overrides):
    """A 2-layer CLIP text encoder (optionally with projection, as SDXL's second encoder) with random weights;
    ``overrides`` replace ``CLIPTextConfig`` fields (e.g. ``hidden_size``)."""
    from ppdiffusers.transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    fields = dict(hidden_size=TEXT_HIDDEN, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4)
    fields.update(overrides)
    config = CLIPTextConfig(
        vocab_size=vocab_size,
        max_position_embeddings=max_length,
        projection_dim=fields["hidden_size"],
        bos_token_id=vocab_size - 2,
        eos_token_id=vocab_size - 1,
        pad_token_id=vocab_size - 1,
        **fields,
    )
    paddle.seed(seed)
    model = (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)
    model.eval()
    return model


def _preset_part(name: str, part: str) -> Dict[str, Any]:
    from .presets import load_preset  # (presets builds on this module's tokenizer and text encoders)

    return dict(load_preset(name)[part])


def tiny_unet(seed: int = 0, **overrides):
    """The ``tiny`` preset's SD-style ``UNet2DConditionModel`` with random weights: three levels; 3 transformer
    blocks at 1x, 3 at 2x and the mid block's at 4x (SD 1.x has them at 1x, 2x and 4x, and in its mid block at 8x).
    ``overrides`` replace config fields."""
    from ppdiffusers import UNet2DConditionModel

    paddle.seed(seed)
    unet = UNet2DConditionModel(**dict(_preset_part("tiny", "unet"), **overrides))
    unet.eval()
    return unet


def tiny_vae(seed: int = 0):
    """The ``tiny`` preset's ``AutoencoderKL`` (latent scale factor 2) with random weights."""
    from ppdiffusers import AutoencoderKL

    paddle.seed(seed)
    vae = AutoencoderKL(**_preset_part("tiny", "vae"))
    vae.eval()
    return vae


def random_controlnet(unet, seed: int = 1, conditioning_embedding_out_channels: Sequence[int] = (16, 32)):
    """A ``ControlNetModel`` shaped like ``unet`` with random weights. A trained ControlNet's output convolutions
    are not zero, so random ones are drawn for them too: the control signal then really changes the UNet's output."""
    from ppdiffusers import ControlNetModel

    paddle.seed(seed)
    controlnet = ControlNetModel.from_unet(
        unet,
        conditioning_embedding_out_channels=tuple(conditioning_embedding_out_channels),
        load_weights_from_unet=False,
    )
    for name, param in controlnet.named_parameters():
        if name.startswith(("controlnet_down_blocks", "controlnet_mid_block", "controlnet_cond_embedding.conv_out")):
            param.set_value(paddle.randn(param.shape, dtype=param.dtype) * 0.1)
    controlnet.eval()
    return controlnet


def tiny_controlnet(unet, seed: int = 1):
    """A ``ControlNetModel`` shaped like the tiny ``unet`` (conditioning embedding downsamples by 2, as the tiny VAE)."""
    return random_controlnet(unet, seed, (16, 32))


def make_scheduler(name: str):
    """A fresh scheduler of class ``name`` with Stable Diffusion's beta schedule."""
    import ppdiffusers

    kwargs = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000)
    if name == "DDIMScheduler":
        kwargs.update(clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    return getattr(ppdiffusers, name)(**kwargs)


def _sd_parts(unet, scheduler: str, seed: int) -> Dict[str, Any]:
    tokenizer = tiny_tokenizer()
    return dict(
        vae=tiny_vae(seed),
        text_encoder=tiny_text_encoder(len(tokenizer.get_vocab()), seed=seed),
        tokenizer=tokenizer,
        unet=unet,
        scheduler=make_scheduler(scheduler),
    )


def tiny_sd_pipeline(
    kind: str = "txt2img", scheduler: str = "DDIMScheduler", seed: int = 0, unet: Optional[Any] = None
):
    """A small Stable Diffusion pipeline with random weights; ``kind`` is ``txt2img``, ``img2img`` or ``inpaint``.

    >>> pipe = tiny_sd_pipeline()
    >>> type(pipe).__name__
    'StableDiffusionPipeline'
    """
    import ppdiffusers

    classes = {
        "txt2img": ppdiffusers.StableDiffusionPipeline,
        "img2img": ppdiffusers.StableDiffusionImg2ImgPipeline,
        "inpaint": ppdiffusers.StableDiffusionInpaintPipeline,
    }
    if kind not in classes:
        raise ValueError(f"kind must be one of {sorted(classes)}; got {kind!r}")
    if unet is None:
        unet = tiny_unet(seed, in_channels=9) if kind == "inpaint" else tiny_unet(seed)
    pipe = classes[kind](**_sd_parts(unet, scheduler, seed), safety_checker=None, feature_extractor=None,
                         requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_controlnet_pipeline(num_controlnets: int = 1, scheduler: str = "DDIMScheduler", seed: int = 0):
    """A small ``StableDiffusionControlNetPipeline``; with ``num_controlnets > 1`` it holds a MultiControlNet."""
    import ppdiffusers

    unet = tiny_unet(seed)
    nets = [tiny_controlnet(unet, seed=seed + 1 + i) for i in range(num_controlnets)]
    controlnet = nets[0] if num_controlnets == 1 else ppdiffusers.pipelines.controlnet.MultiControlNetModel(nets)
    pipe = ppdiffusers.StableDiffusionControlNetPipeline(
        **_sd_parts(unet, scheduler, seed),
        controlnet=controlnet,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_sdxl_unet(seed: int = 0):
    """The ``tiny-sdxl`` preset's SDXL-style UNet: no attention at the first level, text-time added conditioning,
    linear projections."""
    from ppdiffusers import UNet2DConditionModel

    paddle.seed(seed)
    unet = UNet2DConditionModel(**_preset_part("tiny-sdxl", "unet"))
    unet.eval()
    return unet


def tiny_sdxl_pipeline(scheduler: str = "EulerDiscreteScheduler", seed: int = 0):
    """A small ``StableDiffusionXLPipeline`` with random weights (two text encoders, SDXL-style UNet)."""
    import ppdiffusers

    tokenizer = tiny_tokenizer()
    vocab = len(tokenizer.get_vocab())
    pipe = ppdiffusers.StableDiffusionXLPipeline(
        vae=tiny_vae(seed),
        text_encoder=tiny_text_encoder(vocab, seed=seed),
        text_encoder_2=tiny_text_encoder(vocab, projection=True, seed=seed + 1),
        tokenizer=tokenizer,
        tokenizer_2=tiny_tokenizer(),
        unet=tiny_sdxl_unet(seed),
        scheduler=make_scheduler(scheduler),
        add_watermarker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_dit_transformer(norm_type: str = "ada_norm_zero", seed: int = 0, sample_size: int = 16):
    """A small patch ``Transformer2DModel`` (patch size 2, 3 blocks) with random weights: DiT-style
    (``norm_type="ada_norm_zero"``, class labels) or PixArt-alpha-style (``"ada_norm_single"``, cross-attention to
    text embeddings of width 32). The PixArt-style model has no caption projection: ppdiffusers 0.29's
    ``CaptionProjection`` calls ``paddle.randn(num_tokens, in_features)``, which Paddle 3.3 rejects, so it takes
    embeddings already projected to the model width."""
    from ppdiffusers import Transformer2DModel

    if norm_type not in ("ada_norm_zero", "ada_norm_single"):
        raise ValueError(f"norm_type must be 'ada_norm_zero' (DiT) or 'ada_norm_single' (PixArt-alpha); got {norm_type!r}")
    kwargs: Dict[str, Any] = dict(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=3,
        sample_size=sample_size, patch_size=2, activation_fn="gelu-approximate", norm_type=norm_type,
        norm_elementwise_affine=False, num_embeds_ada_norm=1000,
    )
    if norm_type == "ada_norm_single":
        kwargs.update(cross_attention_dim=32, norm_eps=1e-6)
    paddle.seed(seed)
    model = Transformer2DModel(**kwargs)
    for param in model.parameters():  # ada-norm-zero starts every block as the identity: draw non-zero gates
        if float(param.abs().max()) == 0.0:
            param.set_value(paddle.randn(param.shape, dtype=param.dtype) * 0.05)
    model.eval()
    return model


def tiny_dit_pipeline(scheduler: str = "DDIMScheduler", seed: int = 0):
    """A small ``DiTPipeline`` (class-conditional, transformer-only) with random weights.

    >>> pipe = tiny_dit_pipeline()
    >>> type(pipe.transformer).__name__
    'Transformer2DModel'
    """
    import ppdiffusers

    pipe = ppdiffusers.DiTPipeline(
        transformer=tiny_dit_transformer("ada_norm_zero", seed), vae=tiny_vae(seed), scheduler=make_scheduler(scheduler)
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
