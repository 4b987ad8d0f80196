"""What a technique's ``obj`` argument means: the one resolver of pipelines, models and lists into the models a
technique acts on, each with the name it is reported under.

A pipeline stands for its components (never the VAE, the text encoders, the tokenizers, the safety checker or the
feature extractor), a ``MultiControlNetModel`` for its nets, a list or tuple for its items; a layer for itself. Each
technique then keeps the models it can act on (:func:`resolve`'s ``accepts``).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import paddle

__all__ = ["SKIPPED_COMPONENTS", "Targets", "fused_sd3_reason", "is_fused_layer", "is_fused_sd3",
           "is_multi_controlnet", "keyword_call", "pipeline_candidates", "resolve"]

# components of a pipeline that no technique acts on, whatever they contain
SKIPPED_COMPONENTS = ("vae", "vqvae", "text_encoder", "tokenizer", "safety_checker", "feature_extractor",
                      "image_encoder")

Targets = List[Tuple[str, paddle.nn.Layer]]


def is_multi_controlnet(obj: Any) -> bool:
    return type(obj).__name__ == "MultiControlNetModel" and isinstance(getattr(obj, "nets", None), paddle.nn.LayerList)


def is_fused_layer(layer: Any) -> bool:
    """Whether ``layer`` is ppdiffusers' fused ``SimplifiedSD3`` or an ``SD3Transformer2DModel`` built with
    ``INFERENCE_OPTIMIZE=True`` (which holds one in place of its ``JointTransformerBlock``s); by class name, so that
    nothing here imports ppdiffusers."""
    names = {cls.__name__ for cls in type(layer).__mro__}
    return "SimplifiedSD3" in names or ("SD3Transformer2DModel" in names
                                        and bool(getattr(layer, "inference_optimize", False)))


def is_fused_sd3(model: Any) -> bool:
    """Whether ``model`` is, or holds, a fused SD3 transformer (:func:`is_fused_layer`)."""
    return isinstance(model, paddle.nn.Layer) and any(
        is_fused_layer(layer) for _, layer in model.named_sublayers(include_self=True))


def fused_sd3_reason(name: str, technique: str) -> str:
    """Why ``technique`` cannot act on the fused SD3 transformer ``name`` (see :func:`is_fused_sd3`)."""
    return (f"{name} was built with the environment variable INFERENCE_OPTIMIZE=True: ppdiffusers replaced its "
            f"JointTransformerBlocks by the fused SimplifiedSD3 transformer, which has no blocks to hook, so "
            f"{technique} could not act on it. Unset INFERENCE_OPTIMIZE (or set it to anything but True) before "
            "building or loading the model")


def _expand(obj: Any, name: str, strict: bool, what: str) -> Targets:
    if is_multi_controlnet(obj):
        return [(f"{name}.nets.{i}", net) for i, net in enumerate(obj.nets)]
    if isinstance(obj, (list, tuple)):
        return [item for i, sub in enumerate(obj) for item in _expand(sub, f"{name}[{i}]", strict, what)]
    if isinstance(obj, paddle.nn.Layer):
        return [(name, obj)]
    if strict:
        raise bad_input(obj, what)
    return []


def keyword_call(obj: Any, name: str, keyword: str, value: Any, method: bool) -> str:
    """The call ``name`` with ``value`` passed as the keyword ``keyword``, in the form the caller used: the method of
    ``obj`` (``pipe`` for a pipeline, ``model`` otherwise) or the function taking it first.

    >>> keyword_call(object(), "apply_tome", "ratio", 0.5, method=True)
    'model.apply_tome(ratio=0.5)'
    >>> keyword_call(object(), "apply_cache", "interval", 3, method=False)
    'apply_cache(model, interval=3)'
    """
    from ppdiffusers import DiffusionPipeline

    owner = "pipe" if isinstance(obj, DiffusionPipeline) else "model"
    return f"{owner}.{name}({keyword}={value!r})" if method else f"{name}({owner}, {keyword}={value!r})"


def bad_input(obj: Any, what: str) -> ValueError:
    return ValueError(
        f"{what} expects a ppdiffusers DiffusionPipeline, a model (UNet2DConditionModel, ControlNetModel, "
        "MultiControlNetModel, a DiT / PixArt-alpha Transformer2DModel, SD3Transformer2DModel) or a non-empty "
        f"list/tuple of models; got {type(obj).__module__}.{type(obj).__qualname__}"
    )


def resolve(obj: Any, what: str, accepts: Callable[[paddle.nn.Layer], bool] = lambda model: True
            ) -> Tuple[Optional[Any], Targets]:
    """``(pipeline or None, [(name, model)])``: the models inside ``obj`` that ``accepts`` keeps, in a stable order.
    A model given directly (not inside a pipeline) is always kept, so that the technique can say why it does not
    fit; anything that is neither a pipeline nor a layer nor a list of layers raises ``ValueError`` naming ``what``
    (the function called).

    >>> from ppdiffusers_tome.testing import tiny_controlnet_pipeline
    >>> _, found = resolve(tiny_controlnet_pipeline(num_controlnets=2), "f", lambda m: hasattr(m, "down_blocks"))
    >>> [name for name, _ in found]
    ['unet', 'controlnet.nets.0', 'controlnet.nets.1']
    """
    from ppdiffusers import DiffusionPipeline

    if isinstance(obj, DiffusionPipeline):
        return obj, [(name, model) for name, model in pipeline_candidates(obj) if accepts(model)]
    if not isinstance(obj, (paddle.nn.Layer, list, tuple)):
        raise bad_input(obj, what)
    found = _expand(obj, type(obj).__name__, True, what)
    if not found:
        raise bad_input(obj, what)
    return None, found


def pipeline_candidates(obj: Any) -> Targets:
    """Every model component of pipeline ``obj`` a technique could act on (for error messages)."""
    found: Targets = []
    for name, component in obj.components.items():
        if not name.startswith(SKIPPED_COMPONENTS):
            found.extend(_expand(component, name, False, ""))
    return found
