"""The merge core's public names in one place, as releases up to 0.8 had them in this module.

The code lives in :mod:`ppdiffusers_tome.ops`, one job per module; import from here or from there.

>>> from ppdiffusers_tome.merge import bipartite_soft_matching_random2d, MergePlan
>>> MergePlan.__module__
'ppdiffusers_tome.ops.global_plan'
"""

from .ops.cache import DEFAULT_CACHE_BYTES, cache_info, clear_cache, clear_table_cache, table_cache_info
from .ops.downsample import DOWNSAMPLE_MODES, DownsamplePlan, downsample_tokens
from .ops.feature_order import feature_partition_table
from .ops.global_plan import GroupMergePlan, MergePlan, bipartite_soft_matching_random2d
from .ops.local_plan import DenseFeaturePlan, DenseLocalPlan, LocalMergePlan
from .ops.partition import find_downsample, grid_partition, max_ratio, partition_table, step_key
from .ops.runtime import compute_dtype, converting, device_kind, force_kernels, tracing
from .ops.similarity import similarity_dtype
from .ops.windows import window_partition_table, window_sides

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
