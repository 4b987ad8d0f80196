"""ToDo: token downsampling of keys and values (Smith et al. 2024), the alternative to merging.

Every query stays; self-attention reads its keys and values from the tokens downsampled on their 2D grid. Nothing is
matched, so there is nothing to unmerge.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import paddle

from .runtime import compute_dtype, dtype_name

__all__ = ["DOWNSAMPLE_MODES", "DownsamplePlan", "downsample_tokens"]

DOWNSAMPLE_MODES = ("nearest", "average")


def downsample_tokens(x: paddle.Tensor, h: int, w: int, factor: int, mode: str = "nearest") -> paddle.Tensor:
    """Downsample ``[B, h*w, C]`` tokens on their 2D grid by ``factor`` to ``[B, ceil(h/f)*ceil(w/f), C]``.

    ``"nearest"`` keeps the top-left token of every ``factor x factor`` cell; ``"average"`` takes the mean of each
    cell (cells cut by the grid's edge average the tokens they hold). Arithmetic runs in
    :func:`~ppdiffusers_tome.ops.runtime.compute_dtype`; the result has ``x``'s dtype. ``factor == 1`` returns ``x``.

    >>> import paddle
    >>> x = paddle.arange(16, dtype="float32").reshape([1, 16, 1])
    >>> downsample_tokens(x, 4, 4, 2, "nearest").flatten().tolist()
    [0.0, 2.0, 8.0, 10.0]
    >>> downsample_tokens(x, 4, 4, 2, "average").flatten().tolist()
    [2.5, 4.5, 10.5, 12.5]
    """
    if mode not in DOWNSAMPLE_MODES:
        raise ValueError(f"mode must be one of {DOWNSAMPLE_MODES}, got {mode!r}")
    if x.ndim != 3 or x.shape[1] != h * w:
        raise ValueError(f"x must be [batch, h*w={h * w}, channels], got shape {list(x.shape)}")
    if factor == 1:
        return x
    channels = x.shape[2]
    grid = x.reshape([-1, h, w, channels])  # one -1 only: the batch may be dynamic under to_static
    if mode == "nearest":
        out = grid[:, ::factor, ::factor, :]
    else:
        work = compute_dtype(x.dtype)
        grid = grid if dtype_name(x.dtype) == work else grid.astype(work)
        out = paddle.nn.functional.avg_pool2d(
            grid, kernel_size=factor, stride=factor, ceil_mode=True, exclusive=True, data_format="NHWC"
        ).astype(x.dtype)
    return out.reshape([-1, -(-h // factor) * -(-w // factor), channels])


class DownsamplePlan:
    """What ToDo does to one self-attention call: every query stays, keys and values come from the tokens
    downsampled on their ``grid_h x grid_w`` grid (see :func:`downsample_tokens`). There is nothing to unmerge.

    >>> import paddle
    >>> plan = DownsamplePlan(num_tokens=64, batch_size=2, grid_h=8, grid_w=8, factor=2)
    >>> list(plan.keys_values(paddle.randn([2, 64, 4])).shape)
    [2, 16, 4]
    """

    def __init__(self, num_tokens: int, batch_size: int, grid_h: int, grid_w: int, factor: int, mode: str = "nearest"):
        if mode not in DOWNSAMPLE_MODES:
            raise ValueError(f"mode must be one of {DOWNSAMPLE_MODES}, got {mode!r}")
        self.num_tokens, self.batch_size = int(num_tokens), int(batch_size)
        self.grid_h, self.grid_w, self.factor, self.mode = int(grid_h), int(grid_w), int(factor), mode
        # plain attributes: every block call reads them
        self.is_identity = self.factor <= 1
        self.kv_tokens = -(-self.grid_h // self.factor) * -(-self.grid_w // self.factor)  # keys/values per item

    def __repr__(self) -> str:
        return (
            f"DownsamplePlan(batch_size={self.batch_size}, grid={self.grid_h}x{self.grid_w}, "
            f"factor={self.factor}, mode={self.mode!r})"
        )

    def keys_values(self, x: paddle.Tensor) -> paddle.Tensor:
        """The keys and values of self-attention: ``x`` downsampled on its grid."""
        return downsample_tokens(x, self.grid_h, self.grid_w, self.factor, self.mode)

    def run_sublayer(self, sublayer: Any, x: paddle.Tensor, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """Run a self-attention ``sublayer`` (a sub-layer hook: ``sublayer.next`` runs the layer) on its input ``x``
        with every query and the keys and values from ``x`` downsampled; on a joint attention layer
        (``sublayer.joint``: SD3) the text stream stays and the image keys and values are downsampled
        (``sublayer.joint_attention``). ``NotImplemented`` for a layer that is not self-attention (its keys and
        values are not ``x``'s): nothing ran."""
        if sublayer.joint:
            text = args[1] if len(args) > 1 else kwargs.get("encoder_hidden_states")
            return sublayer.joint_attention(x, text, self.keys_values(x))
        if not sublayer.self_attention or kwargs.get("encoder_hidden_states") is not None:
            return NotImplemented  # not self-attention after all (only_cross_attention blocks)
        return sublayer.next(*args, **dict(kwargs, encoder_hidden_states=self.keys_values(x)))
