"""The merge core: tensors in, tensors out; nothing here knows about UNets, pipelines or hooks.

One job per module, in the order a plan is made: :mod:`.runtime` (the kernel family object, tracing),
:mod:`.cache` (device tables), :mod:`.partition` (the one layout type and the random src/dst partition over it),
:mod:`.similarity` (best dst per src), :mod:`.global_plan` (ToMe's plan over the whole grid), :mod:`.windows` and
:mod:`.local_plan` (matching inside windows), :mod:`.feature_order` (windows cut along the features) and
:mod:`.downsample` (ToDo).

Everything a forward runs stays on the device and no Python decision depends on a tensor's value or the batch size,
so the same code runs eagerly and under ``paddle.jit.to_static``, also with a dynamic batch (see ``docs/design.md``
for the rules the traced code follows). The package exports the public names of its modules.
"""

from .cache import DEFAULT_CACHE_BYTES, cache_info, clear_cache, clear_table_cache, table_cache_info
from .downsample import DOWNSAMPLE_MODES, DownsamplePlan, downsample_tokens
from .feature_order import feature_partition_table
from .global_plan import GroupMergePlan, MergePlan, bipartite_soft_matching_random2d
from .local_plan import DenseFeaturePlan, DenseLocalPlan, LocalMergePlan
from .partition import find_downsample, grid_partition, max_ratio, partition_table, step_key
from .runtime import compute_dtype, converting, device_kind, force_kernels, tracing
from .similarity import similarity_dtype
from .windows import window_partition_table, window_sides

__all__ = [
    "DEFAULT_CACHE_BYTES",
    "DOWNSAMPLE_MODES",
    "DenseFeaturePlan",
    "DenseLocalPlan",
    "DownsamplePlan",
    "GroupMergePlan",
    "LocalMergePlan",
    "MergePlan",
    "bipartite_soft_matching_random2d",
    "cache_info",
    "clear_cache",
    "clear_table_cache",
    "compute_dtype",
    "converting",
    "device_kind",
    "downsample_tokens",
    "feature_partition_table",
    "find_downsample",
    "force_kernels",
    "grid_partition",
    "max_ratio",
    "partition_table",
    "similarity_dtype",
    "step_key",
    "table_cache_info",
    "tracing",
    "window_partition_table",
    "window_sides",
]
