"""SD3's joint attention under ToMe and ToDo: which attention core a joint attention layer runs, and ToDo's joint
attention with the image keys and values downsampled on the patch grid."""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import paddle
from ppdiffusers.models.attention_processor import Attention, JointAttnProcessor2_5

from ..sd3_attention import JointMathAttnProcessor, joint_attention, math_attention, stock_attention

__all__ = ["attention_core", "downsampled_joint_attention"]


def attention_core(processor: Any) -> Optional[Callable[..., paddle.Tensor]]:
    """The attention core a joint attention processor runs: :func:`math_attention` for
    :class:`JointMathAttnProcessor`, :func:`stock_attention` for ppdiffusers' own ``JointAttnProcessor2_5``, None for
    any other processor (whose core this package does not know).

    >>> from ppdiffusers_tome.sd3_attention import JointMathAttnProcessor, math_attention
    >>> attention_core(JointMathAttnProcessor()) is math_attention, attention_core(object())
    (True, None)
    """
    if isinstance(processor, JointMathAttnProcessor):
        return math_attention
    if type(processor) is JointAttnProcessor2_5:
        return stock_attention
    return None


def downsampled_joint_attention(attn: Attention, hidden_states: paddle.Tensor, encoder_hidden_states: paddle.Tensor,
                                image_kv: paddle.Tensor) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """ToDo on a joint attention layer: :func:`joint_attention` with the image keys and values from ``image_kv``
    and the attention core of the layer's processor (:func:`attention_core`); refuses, by name, a processor whose
    core is unknown."""
    core = attention_core(attn.processor)
    if core is None:
        raise ValueError(f"method='todo' on SD3 runs the joint attention with the core of JointAttnProcessor2_5 or "
                         f"JointMathAttnProcessor; this layer has {type(attn.processor).__name__}")
    return joint_attention(attn, hidden_states, encoder_hidden_states, core, image_kv)
