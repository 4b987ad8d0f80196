"""Which parts of a model the step cache keeps, and the hooks that keep them: one layout per kind of model.

**UNets and ControlNets** (:class:`UNetLayout`). The deep parts return, on a cached step, their output of the last
full step without computing anything. With ``depth=d``: ``down_blocks[d:]``, ``mid_block``, ``up_blocks[:-d]`` and
the downsampler of ``down_blocks[d - 1]`` (its output feeds only deep blocks). With ``depth=1, layers=k`` the cut
goes inside the first level, as DeepCache's finer branches do: of the last up block only its last ``k`` layers
(a layer is a resnet and the attention after it, or a resnet alone) run on a cached step, from the kept output of the
layer before them; of the first down block only the first ``k - 1`` layers run, the ones whose outputs those ``k``
layers read as skip connections (with ``conv_in``'s output, which always runs). DeepCache's ``cache_branch_id=b``
on SD-1.5 keeps what ``layers=b + 1`` keeps for ``b`` in 0 and 1; its ``b=2`` is ``depth=1, layers=None``.
``layers="auto"`` (the default) is ``1`` at ``depth=1`` and ``None`` at a deeper ``depth``.

**Transformer-only models** (:class:`TransformerLayout`: SD3's MMDiT, DiT, PixArt-alpha). With ``depth=d`` the
first and the last ``d`` transformer blocks run on every step; the blocks between form one segment whose
contribution (output minus input, per stream) is kept on a full step and added to the segment's input on a cached
step, the segment's other blocks passing their input through.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import paddle

from ..core.registry import Hook
from ..core.targets import fused_sd3_reason, is_fused_sd3

__all__ = ["AUTO", "CacheLayout", "Layout", "TransformerLayout", "UNetLayout", "layout_of", "too_few_blocks"]

AUTO = "auto"  # the default of ``layers``: DeepCache's finest branch on UNets and ControlNets at depth 1

Parts = List[Tuple[str, paddle.nn.Layer]]


def _first_tensor(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    return args[0] if args else kwargs.get("hidden_states", kwargs.get("sample"))


class CacheLayout:
    """The deep parts of one model (``deep``: ``(name, layer)`` in call order) and the hooks that keep them;
    ``layers``: the layers of the last up block a cached step runs (``None``: the whole first levels). (Named
    ``Layout`` until 0.14; that name stays an alias for one release. ``ppdiffusers_tome.ops.partition.Layout`` is
    the merge core's token grid, another thing.)"""

    deep: Parts
    layers: Optional[int] = None

    def hooks(self, cache: Any) -> List[Tuple[Hook, paddle.nn.Layer]]:
        raise NotImplementedError

    def hooked(self) -> Parts:
        """Every layer :meth:`hooks` puts a hook on."""
        return self.deep


Layout = CacheLayout  # 0.14's name, kept for one release


class _KeptOutput(Hook):
    """A deep part of a UNet: on a full step it runs and its output is kept; on a cached step it returns its kept
    output (with ``forecast="linear"``, the last deep part, the one the layers that run read, its forecast). The
    first deep part a call reaches settles the step's kind (:meth:`StepCache.arrive`: the input's shape, and the
    adaptive rule on its input)."""

    def __init__(self, cache: Any, name: str, first: bool, read: bool = False) -> None:
        self.cache, self.name, self.first, self.read = cache, name, first, read

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        step = self.cache.step
        mode = step.mode
        if mode is None:  # outside the model's forward, or with gradients on
            return self.next(*args, **kwargs)
        if self.first and step.program is None:
            hidden = _first_tensor(args, kwargs)
            if mode != "full" or self.cache.threshold is not None:
                mode = self.cache.arrive(step, step.state, tuple(hidden.shape), hidden, mode)
            elif step.pending is not None:  # a full step of the fixed interval: only the shape to note
                step.pending.shape = tuple(hidden.shape)
        if mode == "cached":
            site = step.state
            kept = site.kept.outputs if site is not None and site.kept is not None else {}
            if self.name in kept:
                value = kept[self.name]
                if step.program is not None:
                    return _structured(value, kwargs)
                if self.read and site.earlier is not None:
                    value = self.cache.work(site, step.index, value, site.earlier.outputs.get(self.name))
                return value
            return self._stand_in(args, kwargs)
        output = self.next(*args, **kwargs)
        if step.pending is not None:
            step.pending.outputs[self.name] = output
        return output

    def _stand_in(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """What a deep part whose output nothing reads returns on a cached step of a step program: its own input,
        in the structure of its output (a down block: hidden states and one residual per output), at no cost."""
        hidden = _first_tensor(args, kwargs)
        layer = self.layer
        if not self.name.startswith("down_blocks") or self.name.count(".") > 1:
            return _structured(hidden, kwargs)
        count = len(layer.resnets) + len(getattr(layer, "downsamplers", None) or ())
        return hidden, (hidden,) * count


def _structured(hidden: Any, kwargs: Dict[str, Any]) -> Any:
    """A step program's tensor as the layer returns it: a transformer called with ``return_dict=False`` (as every
    ppdiffusers block calls one) returns a 1-tuple."""
    return (hidden,) if kwargs.get("return_dict") is False and not isinstance(hidden, (tuple, list)) else hidden


def _pairs(block: paddle.nn.Layer, prefix: str) -> List[Parts]:
    """The layers of a UNet block, in call order: each resnet with the attention after it (when the block has
    attentions)."""
    attentions = getattr(block, "attentions", None) or []
    layers = []
    for i, resnet in enumerate(block.resnets):
        layer = [(f"{prefix}.resnets.{i}", resnet)]
        if i < len(attentions):
            layer.append((f"{prefix}.attentions.{i}", attentions[i]))
        layers.append(layer)
    return layers


class UNetLayout(CacheLayout):
    """The deep parts of a UNet or ControlNet (see the module docstring)."""

    def __init__(self, model: paddle.nn.Layer, depth: int, layers: Optional[int]):
        self.layers = layers
        down, up = model.down_blocks, getattr(model, "up_blocks", None)
        deep: Parts = []
        if layers is not None:
            # of the first down block, the layers from the k-th on (their outputs feed only skipped layers)
            deep += [part for pair in _pairs(down[0], "down_blocks.0")[layers - 1:] for part in pair]
        samplers = getattr(down[depth - 1], "downsamplers", None) or []
        deep += [(f"down_blocks.{depth - 1}.downsamplers.{i}", sampler) for i, sampler in enumerate(samplers)]
        deep += [(f"down_blocks.{i}", down[i]) for i in range(depth, len(down))]
        if getattr(model, "mid_block", None) is not None:
            deep.append(("mid_block", model.mid_block))
        if up is not None:
            deep += [(f"up_blocks.{i}", up[i]) for i in range(len(up) - depth)]
            if layers is not None:
                last = len(up) - 1
                pairs = _pairs(up[last], f"up_blocks.{last}")
                deep += [part for pair in pairs[: len(pairs) - layers] for part in pair]
        self.deep = deep
        self.reads_last = up is not None

    def hooks(self, cache: Any) -> List[Tuple[Hook, paddle.nn.Layer]]:
        last = len(self.deep) - 1
        read = self.reads_last  # the last deep part's output is read by the layers that run (not in a ControlNet)
        return [(_KeptOutput(cache, name, first=i == 0, read=read and i == last), layer)
                for i, (name, layer) in enumerate(self.deep)]


def _paired(block: paddle.nn.Layer) -> bool:
    """Whether ``block`` is a stack of layers (each resnet followed by its attention, or no attention at all), the
    structure the finer branches cut; skip blocks (one attention after all their resnets) are not."""
    attentions = getattr(block, "attentions", None) or []
    return len(attentions) in (0, len(block.resnets))


def _most_layers(model: paddle.nn.Layer) -> int:
    """The largest ``layers`` a UNet or ControlNet takes: at least one layer of the last up block must be cached
    (a UNet), and the skip connections of the layers that run come from the first down block's layers; 0 when its
    first level is not a stack of layers."""
    down, up = model.down_blocks, getattr(model, "up_blocks", None)
    first = len(down[0].resnets)
    if not _paired(down[0]) or (up is not None and not _paired(up[-1])):
        return 0
    return min(len(up[-1].resnets) - 1, first + 1) if up is not None else first + 1


def _check_unet(model: paddle.nn.Layer, depth: int, layers: Optional[int], most: int, name: str) -> None:
    """Refuse a ``depth`` or ``layers`` that ``model`` cannot take (``most``: its :func:`_most_layers`)."""
    down, up = model.down_blocks, getattr(model, "up_blocks", None)
    if not depth < len(down) or (up is not None and len(up) != len(down)):
        raise ValueError(f"depth must be in [1, {len(down) - 1}] for {name} ({len(down)} down blocks: at least one "
                         f"level must stay deep); got {depth}")
    if layers is None:
        return
    if most == 0:
        raise ValueError(f"layers={layers} cuts the first level into layers, and {name}'s first level is not a stack "
                         "of resnet + attention layers (a skip block, or one layer only): use layers=None")
    if not 1 <= layers <= most:
        first = len(down[0].resnets)
        where = (f"the last up block has {len(up[-1].resnets)} layers, the first down block {first}; at least one "
                 "layer of the last up block must be cached" if up is not None else
                 f"a ControlNet: the first down block has {first} layers")
        raise ValueError(f"layers must be in [1, {most}] for {name} ({where}); got {layers}")


class _Segment(Hook):
    """A block of a transformer's cached segment (see the module docstring)."""

    def __init__(self, cache: Any, first: bool, last: bool, joint: bool) -> None:
        self.cache, self.first, self.last, self.joint = cache, first, last, joint

    def _streams(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Any, ...]:
        """The block's input streams: ``(image,)``, or ``(image, text)`` for a joint (SD3) block."""
        image = args[0] if args else kwargs.get("hidden_states")
        if not self.joint:
            return (image,)
        text = args[1] if len(args) > 1 else kwargs.get("encoder_hidden_states")
        return image, text

    def _output(self, streams: Tuple[Any, ...]) -> Any:
        """``streams`` in the structure of the block's output (a joint block returns ``(text, image)``)."""
        return (streams[1], streams[0]) if self.joint else streams[0]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        step = self.cache.step
        mode = step.mode
        if mode is None:
            return self.next(*args, **kwargs)
        streams = self._streams(args, kwargs)
        if self.first and step.program is None:  # (both streams: the kept contribution has the kept step's shapes)
            shape = (tuple(streams[0].shape), tuple(streams[1].shape)) if self.joint else tuple(streams[0].shape)
            if mode != "full" or self.cache.threshold is not None:
                mode = self.cache.arrive(step, step.state, shape, streams[0], mode)
            elif step.pending is not None:  # a full step of the fixed interval: only the shape to note
                step.pending.shape = shape
        if mode == "cached":
            if not self.first:
                return self._output(streams)
            site = step.state
            earlier = site.earlier.delta if site.earlier is not None else None
            delta = self.cache.work(site, step.index, site.kept.delta, earlier)
            return self._output(tuple(x + d if d is not None else x for x, d in zip(streams, delta)))
        pending = step.pending
        if pending is None:  # nothing of this full step is kept
            return self.next(*args, **kwargs)
        if self.first:
            pending.streams = streams
        output = self.next(*args, **kwargs)
        if self.last:
            out = (output[1], output[0]) if self.joint else (output,)
            start, pending.streams = pending.streams, None
            pending.delta = tuple(None if o is None or s is None else o - s for o, s in zip(out, start))
        return output


class TransformerLayout(CacheLayout):
    """The cached segment of a transformer-only model (see the module docstring)."""

    def __init__(self, model: paddle.nn.Layer, depth: int):
        blocks = model.transformer_blocks
        self.blocks = [(f"transformer_blocks.{i}", block) for i, block in enumerate(blocks)]
        self.deep = self.blocks[depth: len(blocks) - depth]
        self.joint = type(blocks[0]).__name__ == "JointTransformerBlock"

    def hooks(self, cache: Any) -> List[Tuple[Hook, paddle.nn.Layer]]:
        last = len(self.deep) - 1
        return [(_Segment(cache, i == 0, i == last, self.joint), layer) for i, (_, layer) in enumerate(self.deep)]


def _is_unet(model: Any) -> bool:
    down = getattr(model, "down_blocks", None)
    return isinstance(down, paddle.nn.LayerList) and len(down) >= 2


def _is_transformer(model: Any) -> bool:
    blocks = getattr(model, "transformer_blocks", None)
    return isinstance(blocks, paddle.nn.LayerList) and len(blocks) >= 3 and getattr(model, "down_blocks", None) is None


def too_few_blocks(model: Any, name: str) -> Optional[str]:
    """Why ``model`` (reported as ``name``) takes no step cache when it is a transformer-only model with fewer than 3
    transformer blocks (PaddleMIX's DiT test pipeline has 2), else None."""
    blocks = getattr(model, "transformer_blocks", None)
    if not isinstance(blocks, paddle.nn.LayerList) or getattr(model, "down_blocks", None) is not None or len(blocks) >= 3:
        return None
    who = name if name == type(model).__name__ else f"{name} ({type(model).__name__})"
    return (f"{who} has {len(blocks)} transformer_blocks; the step cache needs at least 3 on a transformer-only model "
            "(at depth=1 the first and the last block run on every step and at least one between is cached)")


def layout_of(model: Any, config: Any, name: Optional[str] = None) -> Optional[CacheLayout]:
    """The layout of ``model`` for ``config`` (a :class:`~ppdiffusers_tome.cache.step_cache.CacheConfig`). With
    ``config=None``: whether a step cache can go on ``model`` at all (a layout at the defaults, or None). With a
    config, a model that has no such structure, or settings it cannot take, raise ``ValueError`` naming the
    argument and its range.

    >>> from ppdiffusers_tome.testing import tiny_unet
    >>> from ppdiffusers_tome.cache.step_cache import CacheConfig
    >>> [name for name, _ in layout_of(tiny_unet(), CacheConfig(depth=1, layers=None)).deep][:2]
    ['down_blocks.0.downsamplers.0', 'down_blocks.1']
    >>> layout_of(tiny_unet(), CacheConfig()).layers  # the default, layers="auto": DeepCache's finest branch
    1
    """
    name = name or type(model).__name__
    if _is_unet(model):
        depth, layers = (1, None) if config is None else (config.depth, config.layers)
        if config is not None:
            most = _most_layers(model) if layers is not None else 0  # (unread with layers=None)
            if layers == AUTO:
                layers = 1 if depth == 1 and most >= 1 else None
            _check_unet(model, depth, layers, most, name)
        return UNetLayout(model, depth, layers)
    if _is_transformer(model):
        count = len(model.transformer_blocks)
        if config is None:
            return TransformerLayout(model, 1)
        if config.layers not in (None, AUTO):
            raise ValueError(f"layers={config.layers} cuts inside a UNet's first level; {name} is a transformer-only "
                             "model: leave layers at \"auto\" (or None) and choose depth (blocks that run at each end)")
        if not 2 * config.depth < count:
            raise ValueError(f"depth must be in [1, {(count - 1) // 2}] for {name} ({count} transformer blocks: "
                             f"depth at each end run, at least one between is cached); got {config.depth}")
        return TransformerLayout(model, config.depth)
    if config is None:
        return None
    if is_fused_sd3(model):
        raise ValueError(fused_sd3_reason(name, "the step cache"))
    short = too_few_blocks(model, name)
    if short is not None:
        raise ValueError(short)
    raise ValueError(
        f"apply_cache needs a UNet2DConditionModel, a ControlNetModel (down_blocks, mid_block, up_blocks) or a "
        f"transformer-only model with at least 3 transformer_blocks (SD3, DiT, PixArt-alpha); {name} "
        f"({type(model).__name__}) is neither"
    )
