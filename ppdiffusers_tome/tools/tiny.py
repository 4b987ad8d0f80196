"""The tiny models: small pipelines and models with random weights, built offline in seconds (no downloads), for
the tests, the examples, the offline demo and the doctests. ``tiny_sd_pipeline(seed=s)`` builds exactly what
``preset_pipeline("tiny", seed=s)`` builds (same weights), as do ``tiny_controlnet_pipeline`` and
``tiny_sdxl_pipeline`` for ``tiny-controlnet`` and ``tiny-sdxl``: those go through the one assembly of
:mod:`~ppdiffusers_tome.tools.presets`. The tiny layouts keep what matters to ToMe: SD-style pipelines have
transformer blocks at the full latent resolution, the SDXL-style UNet (like the real one) has none at its first level.
The tiny Stable Diffusion 3 pipeline (:func:`tiny_sd3_pipeline`, an MMDiT transformer, two CLIP encoders with
projection, no T5) and the tiny DiT are built from keyword arguments here, not from a preset. Nothing is downloaded:
the CLIP tokenizer is built from a byte-level vocabulary written on the fly.

The parts every preset pipeline is assembled from (tokenizer, text encoders, seeded models, ControlNets,
schedulers) live here too. :mod:`~ppdiffusers_tome.tools.presets` imports this module and re-exports its builders
(so every ``from ppdiffusers_tome.tools.presets import tiny_...`` keeps working), as does
:mod:`ppdiffusers_tome.testing`. Paddle and ppdiffusers are imported only by the functions that build (through
:func:`_libs`): importing this module is instant.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

from .preset_configs import load_preset

__all__ = [
    "TEXT_HIDDEN",
    "make_scheduler",
    "random_controlnet",
    "tiny_controlnet",
    "tiny_dit_pipeline",
    "tiny_dit_transformer",
    "tiny_sd3_pipeline",
    "tiny_sd3_transformer",
    "tiny_sdxl_unet",
    "tiny_text_encoder",
    "tiny_tokenizer",
    "tiny_unet",
    "tiny_vae",
    "write_tokenizer_files",
]


def _preset(name: str) -> dict[str, Any]:
    """The config of preset ``name`` (see :func:`ppdiffusers_tome.tools.presets.load_preset`)."""
    return load_preset(name)


def _libs():
    """``(paddle, ppdiffusers, ppdiffusers.transformers)``, imported on first use. This is the only place this module
    and :mod:`~ppdiffusers_tome.tools.presets` import them: the presets' config and memory functions serve the
    command line's ``--help``, which must not wait seconds for Paddle. (The CLIP tokenizer and text encoders live in
    ``ppdiffusers.transformers``, which the lazy ``ppdiffusers`` module does not expose as an attribute.)"""
    import paddle
    import ppdiffusers
    from ppdiffusers import transformers

    return paddle, ppdiffusers, transformers


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


def write_tokenizer_files(folder: str) -> dict[str, str]:
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


_tokenizer_files_written: dict[str, str] | None = None


def _tokenizer_files() -> dict[str, str]:
    """The tokenizer files, written once per process (a tokenizer reads them again in ``save_pretrained``)."""
    global _tokenizer_files_written
    if _tokenizer_files_written is None:
        folder = tempfile.mkdtemp(prefix="ppdiffusers_tome_tokenizer_")
        atexit.register(shutil.rmtree, folder, True)
        _tokenizer_files_written = write_tokenizer_files(folder)
    return _tokenizer_files_written


def tiny_tokenizer(max_length: int = 16):
    """A working offline ``CLIPTokenizer`` (byte-level, 514 tokens) that pads prompts to ``max_length``."""
    _, _, transformers = _libs()
    return transformers.CLIPTokenizer(**_tokenizer_files(), max_len=max_length, model_max_length=max_length)


def tiny_text_encoder(vocab_size: int, max_length: int = 16, projection: bool = False, seed: int = 0, **overrides):
    """A 2-layer CLIP text encoder (optionally with projection, as SDXL's second encoder) with random weights;
    ``overrides`` replace ``CLIPTextConfig`` fields (e.g. ``hidden_size``)."""
    paddle, _, transformers = _libs()
    fields = dict(hidden_size=TEXT_HIDDEN, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4)
    fields.update(overrides)
    config = transformers.CLIPTextConfig(
        vocab_size=vocab_size,
        max_position_embeddings=max_length,
        projection_dim=fields["hidden_size"],
        bos_token_id=vocab_size - 2,
        eos_token_id=vocab_size - 1,
        pad_token_id=vocab_size - 1,
        **fields,
    )
    paddle.seed(seed)
    class_name = "CLIPTextModelWithProjection" if projection else "CLIPTextModel"
    model = getattr(transformers, class_name)(config)
    model.eval()
    return model


def _seeded_model(class_name: str, config: dict[str, Any], seed: int):
    """The ppdiffusers model ``class_name`` built from ``config`` after ``paddle.seed(seed)``, in eval mode."""
    paddle, ppdiffusers, _ = _libs()
    paddle.seed(seed)
    model = getattr(ppdiffusers, class_name)(**config)
    model.eval()
    return model


def tiny_unet(seed: int = 0, **overrides):
    """The ``tiny`` preset's SD-style ``UNet2DConditionModel`` with random weights: three levels; 3 transformer
    blocks at 1x, 3 at 2x and the mid block's at 4x (SD 1.x has them at 1x, 2x and 4x, and in its mid block at 8x).
    ``overrides`` replace config fields."""
    return _seeded_model("UNet2DConditionModel", dict(_preset("tiny")["unet"], **overrides), seed)


def tiny_vae(seed: int = 0):
    """The ``tiny`` preset's ``AutoencoderKL`` (latent scale factor 2) with random weights."""
    return _seeded_model("AutoencoderKL", _preset("tiny")["vae"], seed)


def tiny_sdxl_unet(seed: int = 0):
    """The ``tiny-sdxl`` preset's SDXL-style UNet: no attention at the first level, text-time added conditioning,
    linear projections."""
    return _seeded_model("UNet2DConditionModel", _preset("tiny-sdxl")["unet"], seed)


def random_controlnet(unet, seed: int = 1, conditioning_embedding_out_channels: Sequence[int] = (16, 32)):
    """A ``ControlNetModel`` shaped like ``unet`` with random weights. A trained ControlNet's output convolutions
    are not zero, so random ones are drawn for them too: the control signal then really changes the UNet's output."""
    paddle, ppdiffusers, _ = _libs()
    paddle.seed(seed)
    controlnet = ppdiffusers.ControlNetModel.from_unet(
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
    _, ppdiffusers, _ = _libs()
    kwargs = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000)
    if name == "DDIMScheduler":
        kwargs.update(clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    return getattr(ppdiffusers, name)(**kwargs)
def _finish(pipe, dtype: str = "float32"):
    """Every model of ``pipe`` in eval mode, cast to ``dtype``, progress bar off."""
    paddle, _, _ = _libs()
    for component in pipe.components.values():
        if isinstance(component, paddle.nn.Layer):
            component.eval()
    if dtype != "float32":
        pipe.to(dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe
def tiny_dit_transformer(norm_type: str = "ada_norm_zero", seed: int = 0, sample_size: int = 16, num_layers: int = 3):
    """A small patch ``Transformer2DModel`` (patch size 2, ``num_layers`` blocks, 3 by default) with random weights:
    DiT-style (``norm_type="ada_norm_zero"``, class labels) or PixArt-alpha-style (``"ada_norm_single"``,
    cross-attention to text embeddings of width 32). The PixArt-style model has no caption projection: ppdiffusers 0.29's
    ``CaptionProjection`` calls ``paddle.randn(num_tokens, in_features)``, which Paddle 3.3 rejects, so it takes
    embeddings already projected to the model width."""
    paddle, _, _ = _libs()
    if norm_type not in ("ada_norm_zero", "ada_norm_single"):
        raise ValueError(f"norm_type must be 'ada_norm_zero' (DiT) or 'ada_norm_single' (PixArt-alpha); got {norm_type!r}")
    kwargs: dict[str, Any] = dict(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=num_layers,
        sample_size=sample_size, patch_size=2, activation_fn="gelu-approximate", norm_type=norm_type,
        norm_elementwise_affine=False, num_embeds_ada_norm=1000,
    )
    if norm_type == "ada_norm_single":
        kwargs.update(cross_attention_dim=32, norm_eps=1e-6)
    model = _seeded_model("Transformer2DModel", kwargs, seed)
    for param in model.parameters():  # ada-norm-zero starts every block as the identity: draw non-zero gates
        if float(param.abs().max()) == 0.0:
            param.set_value(paddle.randn(param.shape, dtype=param.dtype) * 0.05)
    return model


def tiny_dit_pipeline(scheduler: str = "DDIMScheduler", seed: int = 0):
    """A small ``DiTPipeline`` (class-conditional, transformer-only) with random weights.

    >>> pipe = tiny_dit_pipeline()
    >>> type(pipe.transformer).__name__
    'Transformer2DModel'
    """
    _, ppdiffusers, _ = _libs()
    pipe = ppdiffusers.DiTPipeline(
        transformer=tiny_dit_transformer("ada_norm_zero", seed), vae=tiny_vae(seed), scheduler=make_scheduler(scheduler)
    )
    return _finish(pipe)


# Stable Diffusion 3 (MMDiT): every width here is narrow, the structure is SD3's. The transformer's text input is the
# pipeline's prompt embeddings: the two CLIP encoders' penultimate hidden states side by side (2 x TEXT_HIDDEN
# channels) padded to ``joint_attention_dim`` and followed by as many zero tokens (no T5 encoder), so the text stream
# has 2 x ``max_length`` tokens; the pooled input is the two encoders' projections side by side.
_SD3_JOINT_DIM = 3 * TEXT_HIDDEN  # wider than the CLIP part, as SD3's 4096 T5 channels exceed its 2048 CLIP ones
_SD3_TRANSFORMER = dict(
    sample_size=16, patch_size=2, in_channels=16, out_channels=16, num_layers=3, num_attention_heads=2,
    attention_head_dim=16, joint_attention_dim=_SD3_JOINT_DIM, pooled_projection_dim=2 * TEXT_HIDDEN,
    pos_embed_max_size=48,
)
# SD3's VAE: 16 latent channels, no quant convolutions, its scaling and shift factors (on the tiny preset's VAE)
_SD3_VAE = dict(latent_channels=16, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
                use_post_quant_conv=False)
_SD3_PIPELINES = {"txt2img": "StableDiffusion3Pipeline", "img2img": "StableDiffusion3Img2ImgPipeline"}


def tiny_sd3_transformer(seed: int = 0, math_attention: bool = True, **overrides: Any):
    """A small ``SD3Transformer2DModel`` (MMDiT) with random weights: 3 ``JointTransformerBlock``s (the last one
    ``context_pre_only``, as in SD3), width 32 (2 heads of 16), patch size 2, 16 latent channels, positional
    embeddings cropped from a 48 x 48 grid (latents up to 96 x 96), text input of 96 channels, pooled input of 64.
    ``overrides`` replace config fields (``caption_projection_dim`` follows the width unless given).

    Every parameter that ppdiffusers initialises to zero (the biases) is drawn non-zero, so that every term of the
    block's math shows in a test. With ``math_attention`` (the default) the joint attention runs through
    :func:`ppdiffusers_tome.sd3_attention.use_math_attention`, which any device can run; ``False`` keeps
    ppdiffusers' processor, which needs its GPU attention function.

    >>> model = tiny_sd3_transformer()
    >>> [type(block).__name__ for block in model.transformer_blocks], model.config.patch_size
    (['JointTransformerBlock', 'JointTransformerBlock', 'JointTransformerBlock'], 2)
    >>> [block.context_pre_only for block in model.transformer_blocks]
    [False, False, True]
    """
    paddle, _, _ = _libs()
    config = dict(_SD3_TRANSFORMER, **overrides)
    config.setdefault("caption_projection_dim", config["num_attention_heads"] * config["attention_head_dim"])
    model = _seeded_model("SD3Transformer2DModel", config, seed)
    for param in model.parameters():
        if float(param.abs().max()) == 0.0:
            param.set_value(paddle.randn(param.shape, dtype=param.dtype) * 0.05)
    if math_attention:
        from ..sd3_attention import use_math_attention

        use_math_attention(model)
    return model


def _tiny_sd3_vae(seed: int):
    """SD3's kind of ``AutoencoderKL`` (16 latent channels, scaling and shift factors) on the ``tiny`` preset's
    two levels (scale factor 2)."""
    return _seeded_model("AutoencoderKL", dict(_preset("tiny")["vae"], **_SD3_VAE), seed)


def tiny_sd3_pipeline(kind: str = "txt2img", seed: int = 0, transformer: Any | None = None, max_length: int = 77,
                      math_attention: bool = True):
    """A small Stable Diffusion 3 pipeline with random weights (offline, seeded): ``StableDiffusion3Pipeline`` for
    ``kind="txt2img"``, ``StableDiffusion3Img2ImgPipeline`` for ``"img2img"``. Parts: :func:`tiny_sd3_transformer`
    (seed ``seed``; ``transformer`` replaces it), an SD3-style VAE with 16 latent channels and scale factor 2 (seed
    ``seed + 1``), two 2-layer CLIP text encoders with projection (seeds ``seed + 2`` and ``seed + 3``) and their
    tokenizers padding to ``max_length``, ``FlowMatchEulerDiscreteScheduler(shift=3.0)`` as SD3 uses, and no T5
    (``text_encoder_3=None``: the pipeline puts zeros in its place). The text stream has ``2 * max_length`` tokens
    (154 by default, as ppdiffusers' SD3 with its 77-token tokenizers); a 32 x 32 px image has 8 x 8 = 64 image
    tokens, 64 x 64 px 256. ``math_attention`` as in :func:`tiny_sd3_transformer` (it applies to the given
    ``transformer`` too).

    A prompt must tokenize to fewer than ``max_length`` tokens (the tiny tokenizer gives one per character, plus
    two): ppdiffusers 0.29's SD3 pipelines fail on longer prompts (their truncation warning compares tensors of two
    lengths), with any tokenizer.

    The other task shares every model: ``StableDiffusion3Img2ImgPipeline(**pipe.components)``. Loading a folder
    written by ``save_pretrained`` gives ppdiffusers' own attention processors back; call
    :func:`ppdiffusers_tome.sd3_attention.use_math_attention` on it to run it on a CPU.

    >>> pipe = tiny_sd3_pipeline()
    >>> type(pipe).__name__, pipe.text_encoder_3 is None, pipe.vae.config.latent_channels
    ('StableDiffusion3Pipeline', True, 16)
    >>> pipe("a red cube", height=32, width=32, num_inference_steps=2, output_type="np").images.shape
    (1, 32, 32, 3)
    """
    _, ppdiffusers, _ = _libs()
    if kind not in _SD3_PIPELINES:
        raise ValueError(f"kind must be one of {sorted(_SD3_PIPELINES)}; got {kind!r}")
    if transformer is None:
        transformer = tiny_sd3_transformer(seed, math_attention=False)
    vae = _tiny_sd3_vae(seed + 1)
    parts: dict[str, Any] = {}
    for suffix, encoder_seed in (("", seed + 2), ("_2", seed + 3)):
        tokenizer = tiny_tokenizer(max_length=max_length)
        parts["tokenizer" + suffix] = tokenizer
        parts["text_encoder" + suffix] = tiny_text_encoder(len(tokenizer.get_vocab()), max_length=max_length,
                                                           projection=True, seed=encoder_seed)
    scheduler = ppdiffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    pipe = getattr(ppdiffusers, _SD3_PIPELINES[kind])(transformer=transformer, vae=vae, scheduler=scheduler,
                                                      text_encoder_3=None, tokenizer_3=None, **parts)
    if math_attention:
        from ..sd3_attention import use_math_attention

        use_math_attention(pipe)
    return _finish(pipe)
