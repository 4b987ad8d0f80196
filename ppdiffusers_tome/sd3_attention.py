"""A CPU path for Stable Diffusion 3's joint attention.

ppdiffusers 0.29's SD3 attention processor (``JointAttnProcessor2_5``) calls
``paddle.nn.functional.scaled_dot_product_attention_``, a function that ``ppdiffusers/patches/paddle_patch.py`` adds to
Paddle only where its GPU or NPU kernels exist: on a CPU an SD3 transformer stops with ``AttributeError``.
:class:`JointMathAttnProcessor` is that processor with the attention core written out as
``softmax(q k^T * scale) v``; :func:`use_math_attention` puts it on every joint attention layer of a pipeline or
model and :func:`remove_math_attention` puts the replaced processors back. Nothing is added to Paddle's modules: the
processor lives on the attention layers it is set on, like any other ppdiffusers processor.

:func:`joint_attention` is that processor's computation with the attention core as an argument and, optionally, the
image keys and values projected from other tokens: ToDo on SD3
(:func:`ppdiffusers_tome.tome.joint_attention.downsampled_joint_attention`) passes the image tokens downsampled on
the patch grid.

This does not reach the fused transformer that ppdiffusers builds when the environment variable
``INFERENCE_OPTIMIZE=True`` is set (``simplified_sd3.py``, which calls the GPU function directly and needs
PaddleMIX's Triton kernels); :func:`use_math_attention` refuses such a model by name.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

import paddle
from ppdiffusers.models.attention_processor import Attention, JointAttnProcessor2_5

from .core.targets import is_fused_layer

__all__ = ["JointMathAttnProcessor", "joint_attention", "joint_attention_layers", "math_attention",
           "remove_math_attention", "stock_attention", "use_math_attention"]

logger = logging.getLogger(__name__)

Model = TypeVar("Model")


def math_attention(query: paddle.Tensor, key: paddle.Tensor, value: paddle.Tensor,
                   scale: Optional[float] = None) -> paddle.Tensor:
    """``softmax(q k^T * scale) v`` per batch item and head, on ``[batch, seq, heads, head_dim]`` tensors (the
    layout of ppdiffusers' ``scaled_dot_product_attention_``), computed in the tensors' own dtype.

    ``scale`` defaults to ``1 / sqrt(head_dim)``. The operations are those of the "math" branch of ppdiffusers'
    GPU function with ``attn_mask=None``, ``dropout_p=0.0`` and ``is_causal=False`` (how the SD3 processor calls it):
    heads moved before the sequence, the queries multiplied by ``scale`` before the product with the keys, a softmax
    over the keys, the product with the values, heads moved back. Its other branches (cutlass, flash) compute the
    same function with other kernels. ``key`` and ``value`` may have another sequence length than ``query``.

    >>> import paddle
    >>> q = paddle.to_tensor([[[[1.0, 0.0]], [[0.0, 1.0]]]])  # batch 1, two tokens, one head of width 2
    >>> v = paddle.to_tensor([[[[2.0, 0.0]], [[0.0, 4.0]]]])
    >>> out = math_attention(q, q, v, scale=100.0)  # so sharp that each token attends to itself
    >>> list(out.shape), out.numpy().round(3).tolist()
    ([1, 2, 1, 2], [[[[2.0, 0.0]], [[0.0, 4.0]]]])
    """
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise ValueError(f"math_attention takes [batch, seq, heads, head_dim] tensors; got shapes {query.shape}, "
                         f"{key.shape}, {value.shape}")
    if scale is None:
        scale = 1 / math.sqrt(query.shape[-1])
    heads_first = [0, 2, 1, 3]
    q = paddle.transpose(query, heads_first)
    k = paddle.transpose(key, heads_first)
    v = paddle.transpose(value, heads_first)
    scores = paddle.matmul(q * scale, k, transpose_y=True)  # [batch, heads, queries, keys]
    weights = paddle.nn.functional.softmax(scores, axis=-1)
    return paddle.transpose(paddle.matmul(weights, v), heads_first)


class JointMathAttnProcessor(JointAttnProcessor2_5):
    """ppdiffusers' ``JointAttnProcessor2_5`` (SD3's joint attention) with its attention core computed by
    :func:`math_attention` instead of ``paddle.nn.functional.scaled_dot_product_attention_``, so it runs on any
    device; everything else is the same function with the same call signature.

    ``attn(hidden_states, encoder_hidden_states)`` takes the image stream ``[B, N, C]`` and the text stream
    ``[B, M, C]``. Both are projected by the layer's own ``to_q``/``to_k``/``to_v`` and ``add_q_proj``/
    ``add_k_proj``/``add_v_proj``, the image tokens come first in the concatenated sequence of ``N + M`` tokens,
    which is cut into ``attn.heads`` heads of ``inner_dim // attn.heads`` channels. The attention core matches the
    GPU function exactly as the stock processor calls it: layout ``[batch, seq, heads, head_dim]``, scale
    ``1 / sqrt(head_dim)`` (the function's default, not ``attn.scale``), no mask, no dropout (``dropout_p=0.0``),
    not causal, in the tokens' dtype. The output is cut back at ``N``: the image part goes through ``to_out``, the
    text part through ``to_add_out`` unless the layer is ``context_pre_only`` (the last SD3 block), where it is
    returned unprojected. Returns ``(image_output [B, N, C], text_output [B, M, C or inner_dim])``.

    As with the stock processor, ``attention_mask`` and any extra arguments are accepted and ignored. The stock
    processor's branch for 4-D ``[B, C, H, W]`` inputs cannot run in ppdiffusers 0.29 (it splits at the channel
    count); here such inputs are refused with a clear error. ``original`` is the processor this one replaced
    (:func:`remove_math_attention` puts it back).

    >>> import paddle
    >>> from ppdiffusers.models.attention_processor import Attention
    >>> paddle.seed(0)  # doctest: +ELLIPSIS
    <...>
    >>> attn = Attention(query_dim=8, added_kv_proj_dim=8, dim_head=4, heads=2, out_dim=8, context_pre_only=False,
    ...                  bias=True, processor=JointMathAttnProcessor())
    >>> image, text = attn(hidden_states=paddle.randn([1, 6, 8]), encoder_hidden_states=paddle.randn([1, 3, 8]))
    >>> list(image.shape), list(text.shape)
    ([1, 6, 8], [1, 3, 8])
    """

    def __init__(self, original: Any = None) -> None:
        super().__init__()
        self.original = original

    def __call__(
        self,
        attn: Attention,
        hidden_states: paddle.Tensor,
        encoder_hidden_states: Optional[paddle.Tensor] = None,
        attention_mask: Optional[paddle.Tensor] = None,
        *args: Any,
        **kwargs: Any,
    ) -> Tuple[paddle.Tensor, paddle.Tensor]:
        if encoder_hidden_states is None:
            raise ValueError("joint attention needs encoder_hidden_states (the text stream); got None")
        if hidden_states.ndim != 3 or encoder_hidden_states.ndim != 3:
            raise ValueError(f"joint attention takes [batch, tokens, channels] streams; got shapes "
                             f"{hidden_states.shape} (image) and {encoder_hidden_states.shape} (text)")
        return joint_attention(attn, hidden_states, encoder_hidden_states, math_attention)


def stock_attention(query: paddle.Tensor, key: paddle.Tensor, value: paddle.Tensor) -> paddle.Tensor:
    """The attention core of ppdiffusers' ``JointAttnProcessor2_5``: ``paddle.nn.functional.scaled_dot_product_attention_``
    called as that processor calls it. The function exists only where ppdiffusers found GPU or NPU kernels; elsewhere
    this raises ``AttributeError`` naming :func:`use_math_attention`."""
    function = getattr(paddle.nn.functional, "scaled_dot_product_attention_", None)
    if function is None:
        raise AttributeError("paddle.nn.functional.scaled_dot_product_attention_ does not exist here (ppdiffusers adds "
                             "it only where its GPU or NPU kernels exist): call use_math_attention(pipe) first")
    return function(query, key, value, dropout_p=0.0, is_causal=False)


def joint_attention(attn: Attention, hidden_states: paddle.Tensor, encoder_hidden_states: paddle.Tensor,
                    core: Callable[..., paddle.Tensor],
                    image_kv: Optional[paddle.Tensor] = None) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """SD3's joint attention of the layer ``attn`` (the computation of ``JointAttnProcessor2_5``) with ``core`` as
    its attention core, ``(image_output [B, N, C], text_output [B, M, C or inner_dim])``.

    With ``image_kv`` (``[B, N', C]``: ToDo's image tokens downsampled on the patch grid) the image stream's keys and
    values are projected from ``image_kv`` instead of ``hidden_states``; every image query stays, the text stream is
    unchanged, and the queries attend over ``[image keys (N'); text keys (M)]``, the stock processor's order. The
    outputs have the shapes of the call without ``image_kv``.

    >>> import paddle
    >>> from ppdiffusers.models.attention_processor import Attention
    >>> attn = Attention(query_dim=8, added_kv_proj_dim=8, dim_head=4, heads=2, out_dim=8, context_pre_only=False,
    ...                  bias=True, processor=JointMathAttnProcessor())
    >>> image, text = paddle.randn([1, 16, 8]), paddle.randn([1, 3, 8])
    >>> out = joint_attention(attn, image, text, math_attention, image_kv=image[:, ::4])
    >>> [list(t.shape) for t in out]
    [[1, 16, 8], [1, 3, 8]]
    """
    image_tokens = hidden_states.shape[1]
    image_kv = hidden_states if image_kv is None else image_kv

    # image stream first, text stream after it, in one sequence
    query = paddle.concat([attn.to_q(hidden_states), attn.add_q_proj(encoder_hidden_states)], axis=1)
    key = paddle.concat([attn.to_k(image_kv), attn.add_k_proj(encoder_hidden_states)], axis=1)
    value = paddle.concat([attn.to_v(image_kv), attn.add_v_proj(encoder_hidden_states)], axis=1)
    inner_dim = key.shape[-1]
    head_dim = inner_dim // attn.heads
    split_heads = [0, -1, attn.heads, head_dim]  # 0: the batch as it comes (a dynamic batch in a static graph)
    query, key, value = query.reshape(split_heads), key.reshape(split_heads), value.reshape(split_heads)

    joint = core(query, key, value)
    joint = joint.reshape([0, -1, attn.heads * head_dim]).astype(query.dtype)

    image, text = joint[:, :image_tokens], joint[:, image_tokens:]
    image = attn.to_out[1](attn.to_out[0](image))  # projection, then the layer's dropout
    if not attn.context_pre_only:
        text = attn.to_add_out(text)
    return image, text


def _layers_of(obj: Any) -> List[Tuple[str, paddle.nn.Layer]]:
    """``(name, layer)`` of the models of a pipeline (its ``components``), or of ``obj`` itself if it is a layer."""
    components = getattr(obj, "components", None)
    if isinstance(components, dict):
        return [(name, part) for name, part in components.items() if isinstance(part, paddle.nn.Layer)]
    if isinstance(obj, paddle.nn.Layer):
        return [("", obj)]
    raise TypeError(f"expected a ppdiffusers pipeline or a paddle.nn.Layer (an SD3Transformer2DModel, say); got "
                    f"{type(obj).__name__}")


def joint_attention_layers(obj: Any) -> Dict[str, Attention]:
    """The joint attention layers of a pipeline or model, by name (``"transformer.transformer_blocks.0.attn"`` in a
    pipeline, ``"transformer_blocks.0.attn"`` in the model itself): the ``Attention`` layers that project a second
    stream with a query of its own (``add_q_proj``), which is how an SD3 ``JointTransformerBlock`` builds its
    attention. Other attention layers (a UNet's, a CLIP encoder's) are not included.

    >>> from ppdiffusers_tome.testing import tiny_sd3_transformer, tiny_unet
    >>> sorted(joint_attention_layers(tiny_sd3_transformer()))
    ['transformer_blocks.0.attn', 'transformer_blocks.1.attn', 'transformer_blocks.2.attn']
    >>> joint_attention_layers(tiny_unet())
    {}
    """
    found = {}
    for prefix, model in _layers_of(obj):
        for name, layer in model.named_sublayers(include_self=True):
            if isinstance(layer, Attention) and getattr(layer, "add_q_proj", None) is not None:
                found[".".join(part for part in (prefix, name) if part)] = layer
    return found


def _check_not_fused(obj: Any) -> None:
    """Refuse, by name, an SD3 transformer built with ``INFERENCE_OPTIMIZE=True``: its blocks are replaced by a fused
    ``SimplifiedSD3`` that calls the GPU attention function itself."""
    for prefix, model in _layers_of(obj):
        for name, layer in model.named_sublayers(include_self=True):
            if is_fused_layer(layer):
                where = ".".join(part for part in (prefix, name) if part) or type(layer).__name__
                raise ValueError(
                    f"{where} was built with INFERENCE_OPTIMIZE=True: ppdiffusers replaced its transformer blocks by "
                    "the fused SimplifiedSD3, which calls paddle.nn.functional.scaled_dot_product_attention_ itself "
                    "and needs PaddleMIX's Triton kernels (a GPU); it has no attention processors to replace. Build "
                    "the model without INFERENCE_OPTIMIZE to run it on a CPU."
                )


def use_math_attention(obj: Model) -> Model:
    """Set a :class:`JointMathAttnProcessor` on every joint attention layer of ``obj`` (an SD3 pipeline, txt2img or
    img2img, its ``SD3Transformer2DModel`` or any layer holding ``JointTransformerBlock``s) and return ``obj``, so
    that SD3 runs where ``paddle.nn.functional.scaled_dot_product_attention_`` does not exist (a CPU).

    Only ppdiffusers' own ``JointAttnProcessor2_5`` is replaced; layers already on the math path are left as they
    are (calling this twice is harmless). Any other processor (a custom one, say) is refused with an error naming its
    layer before anything changes. A model built with ``INFERENCE_OPTIMIZE=True`` is refused too (see the module's
    docstring). :func:`remove_math_attention` puts the replaced processors back; so does
    ``transformer.set_attn_processor(saved)`` with ``saved = transformer.attn_processors`` taken before. The
    processors are not saved by ``save_pretrained``: a loaded pipeline has the stock ones again.

    >>> import paddle
    >>> from ppdiffusers_tome.testing import tiny_sd3_transformer
    >>> model = tiny_sd3_transformer(math_attention=False)  # ppdiffusers' own processors
    >>> model is use_math_attention(model)
    True
    >>> sorted({type(p).__name__ for p in model.attn_processors.values()})
    ['JointMathAttnProcessor']
    >>> paddle.seed(1)  # doctest: +ELLIPSIS
    <...>
    >>> out = model(paddle.randn([2, 16, 16, 16]), paddle.randn([2, 32, 96]), paddle.randn([2, 64]),
    ...             paddle.to_tensor([500.0, 500.0])).sample
    >>> list(out.shape)
    [2, 16, 16, 16]
    """
    _check_not_fused(obj)
    layers = joint_attention_layers(obj)
    if not layers:
        raise ValueError(f"{type(obj).__name__} has no joint attention layers (SD3's JointTransformerBlock); "
                         "use_math_attention is for Stable Diffusion 3 pipelines and SD3Transformer2DModel")
    foreign = {name: type(layer.processor).__name__ for name, layer in layers.items()
               if not isinstance(layer.processor, JointMathAttnProcessor)
               and type(layer.processor) is not JointAttnProcessor2_5}
    if foreign:
        raise ValueError(f"use_math_attention replaces only ppdiffusers' JointAttnProcessor2_5; these layers have "
                         f"other processors, left as they are: {foreign}")
    replaced = 0
    for layer in layers.values():
        if not isinstance(layer.processor, JointMathAttnProcessor):
            layer.set_processor(JointMathAttnProcessor(original=layer.processor))
            replaced += 1
    logger.debug("use_math_attention: %d of %d joint attention layers switched to the math path", replaced,
                 len(layers))
    return obj


def remove_math_attention(obj: Model) -> Model:
    """Undo :func:`use_math_attention` on ``obj`` and return it: every joint attention layer on the math path gets
    back the processor it had before (the same object), or a fresh ``JointAttnProcessor2_5`` if the math processor
    was set by hand without one. Layers on other processors are left alone; a model without joint attention is
    returned unchanged.

    >>> from ppdiffusers_tome.testing import tiny_sd3_transformer
    >>> model = tiny_sd3_transformer(math_attention=False)
    >>> before = model.attn_processors
    >>> after = remove_math_attention(use_math_attention(model)).attn_processors
    >>> all(after[name] is before[name] for name in before)
    True
    """
    restored = 0
    for layer in joint_attention_layers(obj).values():
        if isinstance(layer.processor, JointMathAttnProcessor):
            original = layer.processor.original
            layer.set_processor(original if original is not None else JointAttnProcessor2_5())
            restored += 1
    logger.debug("remove_math_attention: %d joint attention layers restored", restored)
    return obj
