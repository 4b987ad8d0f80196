"""What a block call does: the one set of action constants of ToMe and ToDo.

The policy (:class:`~ppdiffusers_tome.tome.policy.Policy`) chooses among :data:`Action.SKIP`, :data:`Action.POOL` and
:data:`Action.MERGE` for a block's size and kernels; the block decision
(:func:`~ppdiffusers_tome.tome.decision.decide_block`) answers with any of the five. The values are plain strings, as
``tome_status`` reports them.
"""

from __future__ import annotations

__all__ = ["Action"]


class Action:
    """The actions of a block call (a namespace of str constants, readable inside a traced forward).

    >>> Action.ALL
    ('off', 'skip', 'pool', 'todo', 'merge')
    """

    OFF = "off"  # not a merging block in this call (its level, its grid, a ratio that rounds to 0 tokens, ...)
    SKIP = "skip"  # it could merge, but min_tokens or the policy said the plan would cost more than it saves
    POOL = "pool"  # the policy's K/V pooling: ToDo's plan at its defaults
    TODO = "todo"  # ToDo's downsampling of keys and values, with the ToDoConfig's factor and mode
    MERGE = "merge"  # the settings' merge plan
    ALL = (OFF, SKIP, POOL, TODO, MERGE)
