"""Gradient checkpointing with ToMe: the plan of every checkpointed block call, kept for its recomputation.

ppdiffusers checkpoints each transformer block with Paddle's non-re-entrant recompute: during backward it runs the
block's forward again, on the very input tensor of the first run, and expects it to save exactly what the first run
saved. That second run comes after the model's call has ended, so without help it would not merge at all (Paddle then
fails with "Not supported to retrieve a tensor saved by autograd multiple times", or computes other gradients). So
the plan of each checkpointed block call is kept, keyed by the block and its input tensor, for as long as that tensor
lives (which is as long as a graph can still recompute it), and the recomputation merges with it again: the same
operations, hence the same gradients as without checkpointing, for any number of forwards before a backward, for
repeated backwards (``retain_graph=True``) and with forwards under ``paddle.no_grad()`` in between.

Re-entrant recompute (``FLAG_RECOMPUTE_USE_REENTRANT=True`` or ``FLAG_USE_OLD_RECOMPUTE=True`` in ppdiffusers)
recomputes from detached copies of the inputs, to which no kept plan can be matched; it is refused at the model's
call, before any work, with an error that names the flags.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, List, Optional, Tuple

import paddle

__all__ = ["RecomputePlans", "ReentrantRecomputeError", "reentrant_recompute"]


class ReentrantRecomputeError(RuntimeError):
    """Raised when a model with ToMe is called for training with ppdiffusers' re-entrant recompute."""


def reentrant_recompute() -> bool:
    """Whether ppdiffusers checkpoints with Paddle's re-entrant recompute (read from its flags at each call, as
    ppdiffusers itself reads them).

    >>> reentrant_recompute()
    False
    """
    try:
        from ppdiffusers.utils.import_utils import recompute_use_reentrant
    except ImportError:  # pragma: no cover - a ppdiffusers without the switch
        return False
    return bool(recompute_use_reentrant())


class RecomputePlans:
    """The plans of the checkpointed block calls of one patched model, by ``(block index, id(input))``, each held
    while its input tensor lives. ``owners[i]`` is the layer whose ``gradient_checkpointing`` covers block ``i``
    (its ``Transformer2DModel``), or None.

    >>> from ppdiffusers_tome.testing import tiny_unet
    >>> from ppdiffusers_tome.tome.patch import find_blocks
    >>> unet = tiny_unet()
    >>> plans = RecomputePlans(unet, find_blocks(unet))
    >>> plans.possible, len(plans)
    (True, 0)
    """

    def __init__(self, model: Any, blocks: List[Tuple[str, Any]]):
        self.model = model
        layers = dict(model.named_sublayers(include_self=True))
        self.owners: List[Any] = []
        for name, _ in blocks:
            # the Transformer2DModel that holds the block: "down_blocks.1.attentions.0" for a UNet's block, the model
            # itself ("") when it is one (DiT, PixArt-alpha: "transformer_blocks.0")
            owner = None
            if ".transformer_blocks." in name:
                owner = name.rsplit(".transformer_blocks.", 1)[0]
            elif name.startswith("transformer_blocks."):
                owner = ""
            self.owners.append(layers.get(owner) if owner is not None else None)
        self.possible = any(owner is not None for owner in self.owners)  # a block that can be checkpointed
        self._plans: Dict[Tuple[int, int], Tuple[Any, Any]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._plans)

    # copies and pickles start with no kept plan: those belong to this process's autograd graphs
    def __getstate__(self) -> Dict[str, Any]:
        return {"model": self.model, "owners": self.owners, "possible": self.possible}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._plans = {}
        self._lock = threading.Lock()

    def check_call(self) -> None:
        """Refuse a call that would checkpoint with re-entrant recompute (before the model computes anything)."""
        if not self.possible or not paddle.is_grad_enabled():
            return
        if not any(getattr(owner, "gradient_checkpointing", False) for owner in self.owners if owner is not None):
            return
        if reentrant_recompute():
            raise ReentrantRecomputeError(
                f"ToMe cannot train {type(self.model).__name__} with gradient checkpointing in ppdiffusers' "
                "re-entrant recompute (FLAG_RECOMPUTE_USE_REENTRANT=True or FLAG_USE_OLD_RECOMPUTE=True): it "
                "recomputes each block from detached copies of its input, so the merge plan of the first run cannot "
                "be found and the gradients would be wrong. Unset both flags (the default recompute works with ToMe), "
                "or remove_tome() while training, or disable_gradient_checkpointing()."
            )

    def keep(self, block_index: int, hidden: Any, plan: Any) -> None:
        """Keep ``plan`` for the recomputation of this block call when gradient checkpointing covers it."""
        owner = self.owners[block_index] if block_index < len(self.owners) else None
        if owner is None or not getattr(owner, "gradient_checkpointing", False):
            return
        if not isinstance(hidden, paddle.Tensor) or hidden.stop_gradient or not paddle.is_grad_enabled():
            return
        key = (block_index, id(hidden))
        ref = weakref.ref(hidden, self._forgetter(key))
        with self._lock:
            self._plans[key] = (ref, plan)

    def _forgetter(self, key: Tuple[int, int]):
        """The callback that drops ``key``'s plan when its input tensor is freed (only if it is still that entry:
        the id may have been taken by a newer tensor meanwhile)."""
        plans = weakref.ref(self)

        def forget(ref: Any) -> None:
            owner = plans()
            if owner is None:
                return
            with owner._lock:
                entry = owner._plans.get(key)
                if entry is not None and entry[0] is ref:
                    del owner._plans[key]

        return forget

    def replayed(self, block_index: int, hidden: Any) -> Optional[Any]:
        """The plan a checkpointed block call used, when this is its recomputation in backward (else None). It stays
        kept: a graph retained for a second backward recomputes the block again."""
        entry = self._plans.get((block_index, id(hidden)))
        if entry is None or entry[0]() is not hidden:
            return None
        return entry[1]
